"""On a GPU: placement, device scopes, numerics, fused-kernel selection, training (issue 8).

Every test is marked `gpu`; `tests/conftest.py` skips them, saying why, where this
session's backend sees no GPU. Run per backend, e.g.
`KERAS_BACKEND=torch pytest -m gpu tests/test_gpu.py`; `make gpu` runs them on every
installed backend, then `benchmarks/gpu_bench.py`, and writes a report.

Which kernel ran is read from the backend, not assumed: torch's profiler lists the
`aten::_scaled_dot_product_{flash,efficient,cudnn}_attention` ops and their CUDA
kernels; on JAX the compiled HLO holds a `__cudnn$fmha*` custom call. Keras's
TensorFlow backend has no fused attention kernel, so those two tests skip there.
"""

import re

import keras
import numpy as np
import pytest

from keras_mha import MultiHeadAttention, kernels

pytestmark = pytest.mark.gpu

BACKEND = keras.backend.backend()
ACCELERATOR = "gpu"
# TF32 keeps 10 mantissa bits (torch leaves it off for matmuls, JAX and TF use it).
TF32 = dict(rtol=5e-3, atol=5e-3)
# bfloat16 keeps 8: measured |mixed_bfloat16 - float32| <= 0.015 on outputs up to 2.9.
BF16 = dict(rtol=2e-2, atol=2e-2)
# Sizes the fused kernels accept: bfloat16, head size 64, lengths multiple of 64.
FUSED_SHAPE, FUSED_HEADS, FUSED_KEY_DIM = (2, 256, 256), 4, 64

TORCH_FUSED_OPS = (
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
)
TORCH_FUSED_KERNEL = re.compile(r"flash|fmha|sdpa", re.IGNORECASE)
JAX_FUSED_CALL = re.compile(r"__cudnn\$fmha\w*")


def _numpy(x):
    return keras.ops.convert_to_numpy(keras.ops.cast(x, "float32"))


def _inputs(shape=(2, 16, 32), seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def device_type(x):
    """`"gpu"` or `"cpu"`: where a backend tensor or variable lives."""
    if BACKEND == "jax":
        platforms = {d.platform for d in x.devices()}
        return platforms.pop() if len(platforms) == 1 else str(sorted(platforms))
    if BACKEND == "torch":
        return "gpu" if x.device.type == "cuda" else x.device.type
    name = x.device.upper()
    return "gpu" if ":GPU:" in name else "cpu" if ":CPU:" in name else name


def _copy(layer, x, **kwargs):
    """A new layer with `layer`'s config and weights (under the current device scope)."""
    config = {**layer.get_config(), **kwargs}
    config.pop("name")
    clone = MultiHeadAttention.from_config(config)
    clone.build(x.shape, x.shape)
    clone.set_weights(layer.get_weights())
    return clone


def _masks(kind, batch, length):
    """Call arguments for a mask `kind`: none, causal, padding or both."""
    lengths = np.array([length, length // 2 + 3])[:batch]
    padding = np.arange(length)[None, :] < lengths[:, None]
    return {
        "none": {},
        "causal": {"use_causal_mask": True},
        "padding": {"query_mask": padding, "value_mask": padding},
        "causal_padding": {"use_causal_mask": True, "value_mask": padding},
        "causal_keras_padding": {
            "use_causal_mask": True,
            "query_mask": padding,
            "value_mask": padding,
        },
    }[kind]


# --------------------------------------------------------------------- placement
def test_variables_and_outputs_live_on_the_gpu():
    x = _inputs()
    layer = MultiHeadAttention(num_heads=4, key_dim=8, use_gate=True, normalize_qk=True)
    output = layer(x, x)
    assert {device_type(v.value) for v in layer.weights} == {ACCELERATOR}
    assert device_type(output) == ACCELERATOR


@pytest.mark.parametrize("device", ["cpu:0", "gpu:0"])
def test_device_scopes_are_honoured(device):
    x = _inputs()
    with keras.device(device):
        layer = MultiHeadAttention(num_heads=4, key_dim=8)
        output = layer(x, x, use_causal_mask=True)
        scores = layer(x, x, return_attention_scores=True)[1]
    want = device.split(":")[0]
    assert {device_type(v.value) for v in layer.weights} == {want}
    assert device_type(output) == want
    assert device_type(scores) == want


# ---------------------------------------------------------------------- numerics
@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_float32_on_gpu_matches_cpu(implementation, mask):
    x = _inputs((2, 32, 32))
    kwargs = _masks(mask, 2, 32)
    with keras.device("cpu:0"):
        cpu_layer = MultiHeadAttention(
            num_heads=4, key_dim=8, implementation=implementation, chunk_size=8
        )
        expected = _numpy(cpu_layer(x, x, **kwargs))
    with keras.device("gpu:0"):
        gpu_layer = _copy(cpu_layer, x)
        output = gpu_layer(x, x, **kwargs)
    assert device_type(output) == ACCELERATOR
    np.testing.assert_allclose(_numpy(output), expected, **TF32)


@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
def test_mixed_bfloat16_matches_float32(implementation):
    x = _inputs((2, 64, 128))
    reference = MultiHeadAttention(
        num_heads=4, key_dim=32, implementation=implementation, chunk_size=16
    )
    expected = _numpy(reference(x, x, use_causal_mask=True))
    layer = _copy(reference, x, dtype="mixed_bfloat16")
    output = layer(x, x, use_causal_mask=True)
    assert keras.backend.standardize_dtype(output.dtype) == "bfloat16"
    assert {keras.backend.standardize_dtype(v.dtype) for v in layer.weights} == {"float32"}
    np.testing.assert_allclose(_numpy(output), expected, **BF16)


def test_mixed_bfloat16_softmax_runs_in_float32(monkeypatch):
    seen = []

    def recording_softmax(logits, mask, axes, sinks=None):
        weights = softmax(logits, mask, axes, sinks)
        seen.append((keras.backend.standardize_dtype(logits.dtype), device_type(weights)))
        return weights

    softmax = kernels.logits.softmax
    monkeypatch.setattr(kernels.logits, "softmax", recording_softmax)
    x = _inputs((2, 64, 128))
    layer = MultiHeadAttention(num_heads=4, key_dim=32, dtype="mixed_bfloat16")
    output, scores = layer(x, x, return_attention_scores=True)
    assert seen and all(entry == ("float32", ACCELERATOR) for entry in seen)
    assert keras.backend.standardize_dtype(scores.dtype) == "bfloat16"
    np.testing.assert_allclose(_numpy(scores).sum(-1), 1.0, atol=2e-2)


# ------------------------------------------------------------ fused kernel selection
def _fused_layer(**kwargs):
    x = _inputs(FUSED_SHAPE)
    layer = MultiHeadAttention(
        num_heads=FUSED_HEADS, key_dim=FUSED_KEY_DIM, dtype="mixed_bfloat16", **kwargs
    )
    layer.build(x.shape, x.shape)
    return layer, x


def _kernels_that_ran(layer, x, **call_kwargs):
    """What the backend ran for `layer(x, x, **call_kwargs)`; returns (output, evidence).

    torch: (aten op names, CUDA kernel names) from the profiler. JAX: the custom-call
    targets named in the compiled HLO of a jitted stateless call.
    """
    if BACKEND == "torch":
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities, record_shapes=True) as prof:
            output = layer(x, x, **call_kwargs)
            torch.cuda.synchronize()
        events = prof.events()
        ops_ran = {e.name for e in events if e.name.startswith("aten::")}
        gpu_kernels = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA}
        # The shape of each `scaled_dot_product_attention` call's `attn_mask` ([] if none).
        masks = [
            list(e.input_shapes[3])
            for e in events
            if e.name == "aten::scaled_dot_product_attention" and len(e.input_shapes) > 3
        ]
        return output, (ops_ran, gpu_kernels, masks)
    if BACKEND == "jax":
        import jax

        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]

        def call(trainable, non_trainable, x):
            return layer.stateless_call(trainable, non_trainable, x, x, **call_kwargs)[0]

        compiled = jax.jit(call).lower(trainable, non_trainable, x).compile()
        output = compiled(trainable, non_trainable, x)
        return output, set(JAX_FUSED_CALL.findall(compiled.as_text()))
    pytest.skip(
        "Keras's TensorFlow backend has no fused attention kernel: "
        "ops.dot_product_attention is plain XLA math there"
    )


def _assert_fused(evidence):
    if BACKEND == "torch":
        ops_ran, gpu_kernels, _ = evidence
        assert ops_ran & set(TORCH_FUSED_OPS), sorted(ops_ran)
        assert any(TORCH_FUSED_KERNEL.search(name) for name in gpu_kernels), sorted(gpu_kernels)
    else:
        assert evidence, "no __cudnn$fmha custom call in the compiled HLO"


def _assert_not_fused(evidence):
    if BACKEND == "torch":
        ops_ran, gpu_kernels, _ = evidence
        assert not ops_ran & set(TORCH_FUSED_OPS), sorted(ops_ran)
        assert not any(TORCH_FUSED_KERNEL.search(name) for name in gpu_kernels)
    else:
        assert not evidence, sorted(evidence)


@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
@pytest.mark.parametrize("implementation", [None, "fused"])
def test_fused_kernel_runs_where_eligible(implementation, mask):
    layer, x = _fused_layer(implementation=implementation)
    kwargs = _masks(mask, FUSED_SHAPE[0], FUSED_SHAPE[1])
    output, evidence = _kernels_that_ran(layer, x, **kwargs)
    _assert_fused(evidence)
    explicit = _copy(layer, x, implementation="explicit")
    np.testing.assert_allclose(_numpy(output), _numpy(explicit(x, x, **kwargs)), **BF16)


@pytest.mark.parametrize("mask", ["causal_padding", "causal_keras_padding"])
def test_causal_padding_runs_the_fused_kernel_without_a_dense_mask(mask):
    """Causality with key padding: the fused kernel runs on chunks of queries, each
    with its own mask block, or on JAX (bfloat16) once, whole, with the padding folded
    into a head channel. Right-padded, with the padded queries masked too (a Keras
    mask), causality alone hides the padded keys: a torch call (eager) takes the
    kernel whole with `is_causal` and no mask at all."""
    layer, x = _fused_layer()
    kwargs = _masks(mask, FUSED_SHAPE[0], FUSED_SHAPE[1])
    output, evidence = _kernels_that_ran(layer, x, **kwargs)
    _assert_fused(evidence)
    if BACKEND == "torch":
        masks = evidence[2]
        assert masks and all(len(m) == 0 for m in masks) == (mask == "causal_keras_padding")
    explicit = _copy(layer, x, implementation="explicit")
    np.testing.assert_allclose(_numpy(output), _numpy(explicit(x, x, **kwargs)), **BF16)


# Packed rows of T=2048: two documents each (the second row ends in padding, id 0),
# lengths multiples of 64 (what cuDNN takes alone).
PACKED_DOCUMENTS = ((1216, 832), (896, 1024))
PACKED_LENGTH = 2048


@pytest.mark.parametrize("causal", [False, True])
def test_packed_rows_run_the_fused_kernel_and_give_each_document_its_own_row(causal):
    """`segment_ids` on the GPU's fused kernels (issue 31): every document of a packed
    row gets what it gets alone in a row of its own, padding gets zeros. On torch (an
    eager call) each document runs whole, alone, with no mask; under `jax.jit` cuDNN
    takes chunks of queries with their block-diagonal masks."""
    x = _inputs((len(PACKED_DOCUMENTS), PACKED_LENGTH, FUSED_SHAPE[2]), seed=3)
    ids = np.zeros(x.shape[:2], "int32")
    for row, lengths in enumerate(PACKED_DOCUMENTS):
        ends = np.cumsum(lengths)
        for i, (start, end) in enumerate(zip(ends - lengths, ends)):
            ids[row, start:end] = i + 1
    layer, _ = _fused_layer()
    output, evidence = _kernels_that_ran(layer, x, segment_ids=ids, use_causal_mask=causal)
    _assert_fused(evidence)
    if BACKEND == "torch":
        masks = evidence[2]
        assert masks and all(len(m) == 0 for m in masks), masks
    output = _numpy(output)
    for row, lengths in enumerate(PACKED_DOCUMENTS):
        ends = np.cumsum(lengths)
        for start, end in zip(ends - lengths, ends):
            document = x[row : row + 1, start:end]
            alone = _numpy(layer(document, document, use_causal_mask=causal))
            np.testing.assert_allclose(output[row : row + 1, start:end], alone, **BF16)
        np.testing.assert_array_equal(output[row, ends[-1] :], 0.0)


@pytest.mark.parametrize("reason", ["dropout_in_training", "scores_requested"])
def test_falls_back_where_not_eligible(reason):
    """Dropout takes the lean chunked kernel (the fused ones would need their own
    RNG); scores the explicit one."""
    if reason == "dropout_in_training":
        layer, x = _fused_layer(implementation="fused", dropout=0.5, seed=1)
        kwargs = {"training": True}
    else:
        layer, x = _fused_layer(implementation="fused")
        kwargs = {"return_attention_scores": True}
    output, evidence = _kernels_that_ran(layer, x, **kwargs)
    _assert_not_fused(evidence)
    output = _numpy(output[0] if isinstance(output, (tuple, list)) else output)
    assert output.shape == FUSED_SHAPE and np.isfinite(output).all()
    if reason == "scores_requested":
        fused = _copy(layer, x)
        np.testing.assert_allclose(output, _numpy(fused(x, x)), **BF16)


# ---------------------------------------------------------------------- training
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_fit_save_and_reload_on_the_gpu(tmp_path, policy):
    x = _inputs((32, 16, 32), seed=1)
    y = np.random.default_rng(2).normal(size=(32, 1)).astype("float32")
    inputs = keras.Input((16, 32))
    attended = MultiHeadAttention(num_heads=4, key_dim=8, dtype=policy)(
        inputs, inputs, use_causal_mask=True
    )
    pooled = keras.layers.GlobalAveragePooling1D()(attended)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(pooled))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0).history["loss"]
    assert np.isfinite(history).all() and history[-1] < history[0]
    assert {device_type(v.value) for v in model.weights} == {ACCELERATOR}

    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert {device_type(v.value) for v in loaded.weights} == {ACCELERATOR}
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    loaded.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    assert np.isfinite(loaded.fit(x, y, batch_size=8, epochs=1, verbose=0).history["loss"]).all()
