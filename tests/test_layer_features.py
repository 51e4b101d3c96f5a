"""Attention bias, logit soft-capping, attention sinks and rotary embeddings: against
the float64 reference on every kernel, with GQA, QK-norm, masks and windows, through
the backward pass, cached decoding, jit, saving, and their argument checks."""

import keras
import numpy as np
import pytest
from helpers import BACKEND, compiled, gradients, to_numpy
from keras import ops
from reference import reference_mha

import keras_mha

B, T, DIM, HEADS, KEY_DIM = 2, 9, 16, 4, 4
ATOL = 2e-5
FEATURES = {
    "bias": {},
    "soft_cap": {"logit_soft_cap": 1.5},
    "sinks": {"use_sinks": True},
    "rope": {"rope_max_wavelength": 50.0, "rope_scaling_factor": 2.0},
    "all+gqa+qk_norm": {
        "logit_soft_cap": 1.5,
        "use_sinks": True,
        "rope_max_wavelength": 50.0,
        "num_key_value_heads": 2,
        "normalize_qk": True,
    },
}
MASKING = {
    "causal+padding": dict(use_causal_mask=True),
    "window": dict(sliding_window=3),
}


def _layer(features, implementation=None, sliding_window=None, seed=0, **extra):
    keras.utils.set_random_seed(seed)
    layer = keras_mha.MultiHeadAttention(
        HEADS,
        KEY_DIM,
        implementation=implementation,
        chunk_size=4,
        sliding_window=sliding_window,
        **FEATURES[features],
        **extra,
    )
    layer.build((B, T, DIM), (B, T, DIM))
    if layer._use_sinks:  # non-zero sink logits, so they matter
        layer._sinks.sinks.assign(np.linspace(-1.0, 1.5, HEADS).astype("float32"))
    return layer


def _inputs(rng, features):
    x = rng.standard_normal((B, T, DIM)).astype("float32")
    padding = np.ones((B, T), bool)
    padding[1, 6:] = False
    bias = None
    if features in ("bias", "all+gqa+qk_norm"):
        bias = rng.standard_normal((1, HEADS, T, T)).astype("float32")
    return x, padding, bias


def _reference(layer, x, padding, bias, causal, window):
    mask = padding[:, None, :] & np.ones((1, T, 1), bool)
    return reference_mha(
        layer,
        x,
        x,
        mask=mask,
        use_causal_mask=causal,
        sliding_window=window,
        attention_bias=bias,
    )


@pytest.mark.parametrize("masking", list(MASKING))
@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked", None])
@pytest.mark.parametrize("features", list(FEATURES))
def test_matches_float64_reference(rng, features, implementation, masking):
    options = MASKING[masking]
    window = options.get("sliding_window")
    layer = _layer(features, implementation, sliding_window=window)
    x, padding, bias = _inputs(rng, features)
    causal = options.get("use_causal_mask", False)
    out = layer(x, x, value_mask=padding, use_causal_mask=causal, attention_bias=bias)
    expected, _ = _reference(layer, x, padding, bias, causal, window)
    np.testing.assert_allclose(to_numpy(out), expected, atol=ATOL)


@pytest.mark.parametrize("features", ["sinks", "all+gqa+qk_norm"])
def test_scores_are_the_weights_with_sinks(rng, features):
    layer = _layer(features)
    x, padding, bias = _inputs(rng, features)
    _, scores = layer(x, x, value_mask=padding, attention_bias=bias, return_attention_scores=True)
    _, expected = _reference(layer, x, padding, bias, False, None)
    np.testing.assert_allclose(to_numpy(scores), expected, atol=ATOL)
    assert (to_numpy(scores).sum(-1) < 1.0 - 1e-3).all()  # the sinks take a share


@pytest.mark.parametrize("features", list(FEATURES))
def test_chunked_gradients_equal_explicit(rng, features):
    """Inputs, every weight (the sinks included) and a learned bias."""
    x, padding, bias = _inputs(rng, features)
    results = []
    for implementation in ("explicit", "chunked"):
        layer = _layer(features, implementation)
        inputs = {"query": x, "value": x}
        if bias is not None:
            inputs["attention_bias"] = bias
        results.append(gradients(layer, inputs, value_mask=padding, use_causal_mask=True))
    (loss_a, in_a, w_a), (loss_b, in_b, w_b) = results
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
    for name in in_a:
        assert np.abs(in_a[name]).max() > 0
        np.testing.assert_allclose(in_b[name], in_a[name], atol=1e-4)
    for a, b in zip(w_a, w_b):
        np.testing.assert_allclose(b, a, atol=1e-4)
    if FEATURES[features].get("use_sinks"):
        assert np.abs(w_a[-1]).max() > 0  # the sinks learn


@pytest.mark.parametrize("implementation", ["explicit", "chunked", None])
def test_cached_decoding_equals_one_causal_call(rng, implementation):
    layer = _layer("all+gqa+qk_norm", implementation, sliding_window=5)
    x, _, bias = _inputs(rng, "all+gqa+qk_norm")
    full = to_numpy(layer(x, x, use_causal_mask=True, attention_bias=bias))
    cache = layer.init_cache(B, T)
    steps = []
    for t in range(T):
        token = x[:, t : t + 1]
        out, cache = layer(
            token,
            token,
            cache=cache,
            cache_update_index=t,
            use_causal_mask=True,
            attention_bias=bias[:, :, t : t + 1],
        )
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=ATOL)


def test_decoding_step_compiles_once(rng):
    """A compiled decoding step: the index is data, RoPE and the masks follow it."""
    layer = _layer("all+gqa+qk_norm")
    x, _, _ = _inputs(rng, "all+gqa+qk_norm")
    full = to_numpy(layer(x, x, use_causal_mask=True))
    traces = []

    def step(token, cache, index):
        traces.append(1)
        return layer(token, token, cache=cache, cache_update_index=index, use_causal_mask=True)

    step = compiled(step)
    cache = layer.init_cache(B, T)
    outputs = []
    for t in range(T):
        token = ops.convert_to_tensor(x[:, t : t + 1])
        out, cache = step(token, cache, ops.convert_to_tensor(t, dtype="int32"))
        outputs.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), full, atol=ATOL)
    if BACKEND in ("jax", "tensorflow"):
        assert len(traces) == 1


@pytest.mark.parametrize("features", ["all+gqa+qk_norm"])
def test_saved_and_reloaded(tmp_path, rng, features):
    inputs = keras.Input((T, DIM))
    bias_input = keras.Input((HEADS, T, T))
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, **FEATURES[features])
    model = keras.Model(
        [inputs, bias_input], layer(inputs, inputs, use_causal_mask=True, attention_bias=bias_input)
    )
    layer._sinks.sinks.assign(np.linspace(-1.0, 1.0, HEADS).astype("float32"))
    x = rng.standard_normal((B, T, DIM)).astype("float32")
    bias = rng.standard_normal((B, HEADS, T, T)).astype("float32")
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    config = loaded.layers[2].get_config()
    for name, value in FEATURES[features].items():
        assert config[name] == value
    np.testing.assert_allclose(to_numpy(loaded([x, bias])), to_numpy(model([x, bias])), atol=1e-6)
    assert loaded.layers[2].weights[-1].path.endswith("sinks/sinks")


def test_all_off_keeps_todays_weights():
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM)
    layer.build((B, T, DIM), (B, T, DIM))
    assert len(layer.weights) == 8
    config = layer.get_config()
    assert config["logit_soft_cap"] is None and config["use_sinks"] is False
    assert config["rope_max_wavelength"] is None and config["rope_scaling_factor"] == 1.0


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"logit_soft_cap": 0.0}, "logit_soft_cap"),
        ({"logit_soft_cap": -1}, "logit_soft_cap"),
        ({"logit_soft_cap": "2"}, "logit_soft_cap"),
        ({"rope_max_wavelength": 0}, "rope_max_wavelength"),
        ({"rope_max_wavelength": float("inf")}, "rope_max_wavelength"),
        ({"rope_scaling_factor": 0.0, "rope_max_wavelength": 10}, "rope_scaling_factor"),
        ({"rope_max_wavelength": 10, "key_dim": 3}, "key_dim"),
        ({"use_sinks": "yes"}, "use_sinks"),
    ],
)
def test_bad_constructor_values_name_the_argument(kwargs, argument):
    kwargs = {"num_heads": 2, "key_dim": 4, **kwargs}
    with pytest.raises(ValueError, match=f"argument `{argument}`"):
        keras_mha.MultiHeadAttention(**kwargs)


def test_rope_needs_rank3_inputs():
    layer = keras_mha.MultiHeadAttention(2, 4, rope_max_wavelength=10)
    with pytest.raises(ValueError, match="rank-3"):
        layer.build((2, 3, 4, 8), (2, 3, 4, 8))
    assert not layer.built and not layer.weights


@pytest.mark.parametrize(
    "bias, message",
    [
        (np.zeros((B, HEADS, T, T + 1), "float32"), "broadcastable to the scores"),
        (np.zeros((3, 1, 1, T), "float32"), "broadcastable to the scores"),
        (np.zeros((1, HEADS + 1, 1, 1), "float32"), "broadcastable to the scores"),
        (np.zeros((1, 1, B, HEADS, T, T), "float32"), "broadcastable to the scores"),
        (np.zeros((1, HEADS, T, T), "int32"), "a float tensor"),
    ],
)
def test_bad_bias_is_rejected_and_changes_nothing(bias, message):
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM)
    x = np.zeros((B, T, DIM), "float32")
    layer(x, x)
    before = [w.copy() for w in layer.get_weights()]
    with pytest.raises(ValueError, match=f"`attention_bias`.*{message}"):
        layer(x, x, attention_bias=ops.convert_to_tensor(bias))
    for a, b in zip(before, layer.get_weights()):
        np.testing.assert_array_equal(a, b)
