"""The layer inside each backend's step compiler, traced whole, forward and backward:
`jax.jit`, `tf.function(jit_compile=True)` (XLA: one program, or an error) and
`torch.compile(fullgraph=True)` (any graph break is an error; AOTAutograd traces the
backward too, without inductor's code generation). The compiled outputs and input
gradients are the eager ones.

Not covered on torch: attention dropout (Keras's `SeedGenerator.next` breaks the graph,
the built-in's too)."""

import contextlib

import keras
import numpy as np
import pytest
from helpers import BACKEND, to_numpy

import keras_mha

B, T, DIM = 2, 8, 16
ATOL = 1e-5

# Each with key padding (`value_mask`): the scores' path (the explicit kernel), and
# every logit feature (the backend's default kernel).
FEATURES = {
    "causal+scores": (dict(num_heads=2, key_dim=8), dict(use_causal_mask=True, scores=True)),
    "modern+bias": (
        dict(
            num_heads=4,
            key_dim=4,
            num_key_value_heads=2,
            normalize_qk=True,
            rope_max_wavelength=10_000,
            sliding_window=3,
            logit_soft_cap=30.0,
            use_sinks=True,
        ),
        dict(use_causal_mask=True, bias=True),
    ),
}


def _step(layer, options, mask, bias, weights):
    """`loss(x) -> (sum(output * weights) [+ sum(scores)], output)`; the other
    tensors made before, outside the compiled function."""
    scores = options.get("scores", False)
    kwargs = {"use_causal_mask": options.get("use_causal_mask", False)}
    kwargs["value_mask"] = keras.ops.convert_to_tensor(mask)
    if options.get("bias"):
        kwargs["attention_bias"] = keras.ops.convert_to_tensor(bias)
    weights = keras.ops.convert_to_tensor(weights)

    def loss(x):
        out = layer(x, x, return_attention_scores=scores, **kwargs)
        output = out[0] if scores else out
        total = keras.ops.sum(output * weights)
        if scores:
            total = total + keras.ops.sum(out[1] * out[1])
        return total, output

    return loss


def _value_and_grad(loss, x, compile_it):
    """`(output, d loss / d x)` as NumPy, eagerly or through the backend's compiler."""
    if BACKEND == "jax":
        import jax

        step = jax.value_and_grad(loss, has_aux=True)
        (_, out), grad = (jax.jit(step) if compile_it else step)(jax.numpy.asarray(x))
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                value, out = loss(x)
            return out, tape.gradient(value, x)

        step = tf.function(step, jit_compile=True) if compile_it else step
        out, grad = step(tf.constant(x))
    else:
        import torch

        step = torch.compile(loss, fullgraph=True, backend="aot_eager") if compile_it else loss
        tensor = torch.tensor(x, requires_grad=True)
        value, out = step(tensor)
        value.backward()
        grad = tensor.grad
    return to_numpy(out), to_numpy(grad)


@pytest.mark.parametrize("features", list(FEATURES))
def test_compiled_whole_gives_the_eager_outputs_and_gradients(rng, features):
    config, options = FEATURES[features]
    layer = keras_mha.MultiHeadAttention(**config)
    x = rng.standard_normal((B, T, DIM)).astype("float32")
    mask = np.arange(T)[None, :] < np.array([[5], [T]])  # batch 0: 3 padded keys
    bias = rng.standard_normal((B, 1, T, T)).astype("float32")
    weights = rng.standard_normal((B, T, DIM)).astype("float32")
    loss = _step(layer, options, mask, bias, weights)
    eager_out, eager_grad = _value_and_grad(loss, x, compile_it=False)
    out, grad = _value_and_grad(loss, x, compile_it=True)
    np.testing.assert_allclose(out, eager_out, atol=ATOL)
    np.testing.assert_allclose(grad, eager_grad, atol=ATOL)
    assert np.abs(eager_grad).max() > 0


def test_compiled_decoding_step_gives_the_causal_call(rng):
    """A decoding step with a cache, compiled whole: the tokens one by one give the
    causal call on the whole sequence; torch, without gradients as a generation loop
    runs (keras-hub's `generate`), compiles it once, not once per index."""
    config, _ = FEATURES["modern+bias"]
    layer = keras_mha.MultiHeadAttention(**config)
    x = rng.standard_normal((B, T, DIM)).astype("float32")
    full = to_numpy(layer(x, x, use_causal_mask=True))

    def step(token, cache, index):
        return layer(token, token, cache=cache, cache_update_index=index, use_causal_mask=True)

    if BACKEND == "jax":
        import jax

        step = jax.jit(step)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        step = tf.function(step, jit_compile=True)
    else:
        import torch
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        graphs_before = counters["stats"]["unique_graphs"]  # counted across the process
        step = torch.compile(step, fullgraph=True, backend="aot_eager")
    cache = layer.init_cache(B, T)
    outputs = []
    with _no_gradients():
        for t in range(T):
            token = keras.ops.convert_to_tensor(x[:, t : t + 1])
            out, cache = step(token, cache, keras.ops.convert_to_tensor(t, dtype="int32"))
            outputs.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), full, atol=ATOL)
    if BACKEND == "torch":
        assert counters["stats"]["unique_graphs"] - graphs_before == 1


def _no_gradients():
    if BACKEND == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()
