"""Keras features that act through the projection sublayers and dtype policies: LoRA
(beside the built-in), mixed precision (softmax in float32; `mixed_float16` compiled on
every backend) and `DTypePolicyMap`. Quantization is in `test_quantization.py`.
"""

import keras
import numpy as np
import pytest
from helpers import BACKEND, make_pair, random_inputs, to_numpy
from reference import reference_mha

import keras_mha

B, T, S, DIM = 2, 5, 7, 8
PROJECTIONS = ("query_dense", "key_dense", "value_dense", "output_dense")


def _functional(layer, scores=False):
    query, value = keras.Input((T, DIM)), keras.Input((S, DIM))
    return keras.Model([query, value], layer(query, value, return_attention_scores=scores))


def _data(rng):
    return random_inputs(rng, (B, T, DIM), (B, S, DIM))


# ------------------------------------------------------------------------------ LoRA
@pytest.mark.parametrize("which", [("query_dense",), PROJECTIONS], ids=["query", "all"])
def test_lora_on_projections_trains_as_the_builtin(which, rng):
    ours, builtin = make_pair(dict(num_heads=2, key_dim=4, name="mha"), (B, T, DIM), (B, S, DIM))
    models = {layer: _functional(layer) for layer in (ours, builtin)}
    q, v = _data(rng)
    before = to_numpy(models[ours]([q, v]))
    frozen = {name: to_numpy(getattr(ours, name).kernel) for name in which}
    for layer in (ours, builtin):
        for name in which:
            getattr(layer, name).enable_lora(4)
            assert getattr(layer, name).lora_enabled
    # Same trainable weights, in the same order; then the same values.
    assert [(w.path, w.shape) for w in ours.trainable_weights] == [
        (w.path, w.shape) for w in builtin.trainable_weights
    ]
    for name in which:
        path = f"mha/{getattr(ours, name).name}"
        trainable = [w.path for w in ours.trainable_weights]
        assert f"{path}/lora_kernel_a" in trainable and f"{path}/kernel" not in trainable
    builtin.set_weights(ours.get_weights())
    # LoRA starts as the identity update: same outputs.
    for model in models.values():
        np.testing.assert_allclose(to_numpy(model([q, v])), before, atol=1e-6)

    target = rng.standard_normal((B, T, DIM)).astype("float32")
    losses = {}
    for layer, model in models.items():
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        history = model.fit([q, v], target, epochs=4, batch_size=B, shuffle=False, verbose=0)
        losses[layer] = history.history["loss"]
    assert losses[ours][-1] < losses[ours][0]
    np.testing.assert_allclose(losses[ours], losses[builtin], rtol=1e-5)
    for got, want in zip(ours.get_weights(), builtin.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
    expected = to_numpy(models[builtin]([q, v]))
    np.testing.assert_allclose(to_numpy(models[ours]([q, v])), expected, atol=1e-5)
    for name in which:
        dense = getattr(ours, name)
        np.testing.assert_array_equal(to_numpy(dense._kernel), frozen[name])
        assert np.abs(to_numpy(dense.kernel) - frozen[name]).max() > 0
    # The layer's own forward pass uses the merged (LoRA) kernels.
    expected, _ = reference_mha(ours, q, v)
    np.testing.assert_allclose(to_numpy(models[ours]([q, v])), expected, atol=1e-5)


# ------------------------------------------------------------------- mixed precision
@pytest.mark.parametrize(
    "policy, atol", [("mixed_float16", 1e-2), ("mixed_bfloat16", 5e-2)], ids=str
)
def test_mixed_precision_close_to_float32(policy, atol, rng):
    q, v = _data(rng)
    mask = keras.ops.convert_to_tensor(rng.random((B, T, S)) > 0.3)
    keras.utils.set_random_seed(0)
    full = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
    mixed = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, dtype=policy)
    for layer in (full, mixed):
        layer.build(q.shape, v.shape)
    mixed.set_weights(full.get_weights())
    assert mixed.compute_dtype == policy.split("_")[1]
    assert all(w.dtype == "float32" for w in mixed.weights)

    for implementation in ("explicit", "fused", "chunked"):
        mixed._implementation = full._implementation = implementation
        expected = to_numpy(full(q, v, attention_mask=mask))
        output = mixed(q, v, attention_mask=mask)
        assert keras.backend.standardize_dtype(output.dtype) == mixed.compute_dtype
        output = to_numpy(output).astype("float32")
        np.testing.assert_allclose(output, expected, atol=atol, err_msg=implementation)

    expected, expected_scores = to_numpy(
        full(q, v, attention_mask=mask, return_attention_scores=True)
    )
    output, scores = mixed(q, v, attention_mask=mask, return_attention_scores=True)
    assert keras.backend.standardize_dtype(scores.dtype) == mixed.compute_dtype
    scores = to_numpy(scores).astype("float32")
    np.testing.assert_allclose(scores, expected_scores, atol=atol)
    np.testing.assert_allclose(scores.sum(-1), np.ones_like(scores.sum(-1)), atol=atol)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_large_logits_stay_finite(policy, rng):
    """Logits beyond float16's range: the float32 softmax keeps the result finite."""
    q, v = _data(rng)
    q, v = q * 100.0, v * 100.0
    keras.utils.set_random_seed(0)
    layer = keras_mha.MultiHeadAttention(
        num_heads=2, key_dim=4, dtype=policy, kernel_initializer="ones"
    )
    full = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, kernel_initializer="ones")
    for implementation in ("explicit", "chunked"):
        layer._implementation = full._implementation = implementation
        output, scores = to_numpy(layer(q, v, return_attention_scores=True))
        assert np.isfinite(output.astype("float32")).all(), implementation
        assert np.isfinite(scores.astype("float32")).all(), implementation
        _, expected_scores = to_numpy(full(q, v, return_attention_scores=True))
        np.testing.assert_allclose(scores.astype("float32"), expected_scores, atol=5e-2)


def _on_jax_cpu():
    if BACKEND != "jax":
        return False
    import jax

    return jax.default_backend() == "cpu"


def test_mixed_float16_predicts_and_trains_compiled(rng):
    """`mixed_float16` in a compiled model (XLA on TensorFlow and JAX): ours predicts and
    trains on every backend. The built-in fails on JAX's CPU: its fused attention
    (`jax.nn.dot_product_attention`) asks for float16 products accumulated in float32,
    which XLA's CPU `dot_general` lacks. Asserted, so this test notices when that changes.
    """
    q, v = _data(rng)
    target = rng.standard_normal((B, T, DIM)).astype("float32")
    jit_compile = BACKEND != "torch"  # torch's would be `torch.compile`
    for base in (keras_mha.MultiHeadAttention, keras.layers.MultiHeadAttention):
        keras.utils.set_random_seed(0)
        layer = base(num_heads=2, key_dim=4, dtype="mixed_float16")
        model = _functional(layer)
        model.compile(keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
        if base is keras.layers.MultiHeadAttention and _on_jax_cpu():
            with pytest.raises(ValueError, match="F16_F16_F32' is not supported by dot_general"):
                model.predict([q, v], verbose=0)
            continue
        output = model.predict([q, v], verbose=0)
        assert output.dtype == np.float16 and np.isfinite(output).all(), base
        kernel = to_numpy(layer.query_dense.kernel)
        history = model.fit([q, v], target, epochs=2, batch_size=B, verbose=0)
        assert np.isfinite(history.history["loss"]).all(), base
        assert history.history["loss"][-1] < history.history["loss"][0], base
        assert np.abs(to_numpy(layer.query_dense.kernel) - kernel).max() > 0, base


# ------------------------------------------------------------------- DTypePolicyMap
def test_dtype_policy_map(rng):
    q, v = _data(rng)
    outputs = {}
    for base in (keras_mha.MultiHeadAttention, keras.layers.MultiHeadAttention):
        policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
        policy_map["mha/query"] = "bfloat16"
        policy_map["mha/attention_output"] = "mixed_bfloat16"
        keras.utils.set_random_seed(0)
        layer = base(num_heads=2, key_dim=4, dtype=policy_map, name="mha")
        layer.build(q.shape, v.shape)
        assert layer.query_dense.compute_dtype == "bfloat16"
        assert layer.query_dense.kernel.dtype == "bfloat16"
        assert layer.key_dense.compute_dtype == "float32"
        assert layer.output_dense.compute_dtype == "bfloat16"
        assert layer.output_dense.kernel.dtype == "float32"
        outputs[base] = (layer, to_numpy(layer(q, v)).astype("float32"))
    (ours, out), (builtin, expected) = outputs.values()
    assert [w.dtype for w in ours.weights] == [w.dtype for w in builtin.weights]
    np.testing.assert_allclose(out, expected, atol=5e-2)
    config = ours.get_config()
    clone = keras_mha.MultiHeadAttention.from_config(config)
    clone.build(q.shape, v.shape)
    assert clone.query_dense.compute_dtype == "bfloat16"
