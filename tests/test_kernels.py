"""Every attention path against the explicit one (outputs and gradients, causal and
padding masks), the kernel choice, and the projection sublayer against `EinsumDense`."""

import contextlib

import keras
import numpy as np
import pytest
from helpers import gradients, to_numpy
from keras import ops

import keras_mha
from keras_mha import kernels, projections

B, T, S, N, H = 2, 13, 11, 3, 4
ATOL = 2e-5


def _qkv(rng, query_length=T, key_length=S):
    q = rng.standard_normal((B, query_length, N, H)).astype("float32")
    k = rng.standard_normal((B, key_length, N, H)).astype("float32")
    v = rng.standard_normal((B, key_length, N, H)).astype("float32")
    return q, k, v


def _padding_mask(key_length=S):
    """`(B, 1, T, S)`: batch 0 sees its first 7 keys; batch 1 row 2 sees no key at all."""
    mask = np.ones((B, 1, T, key_length), bool)
    mask[0, :, :, 7:] = False
    mask[1, :, 2, :] = False
    return mask


def _explicit(q, k, v, mask=None, causal=False, offset=0):
    if causal:
        c = to_numpy(
            ops.expand_dims(keras_mha.masks.causal_mask(q.shape[1], k.shape[1], offset), 1)
        )
        mask = c if mask is None else np.logical_and(mask, c)
    out, _ = kernels.explicit_attention(
        q,
        k,
        v,
        scale=H**-0.5,
        dot_product_equation="aecd,abcd->acbe",
        combine_equation="acbe,aecd->abcd",
        num_attention_axes=1,
        mask=None if mask is None else ops.convert_to_tensor(mask),
    )
    return to_numpy(out)


@pytest.mark.parametrize("over", ["keys", "queries"])
@pytest.mark.parametrize("chunk_size", [4, 64])
@pytest.mark.parametrize("masking", ["none", "causal", "padding", "causal+padding"])
def test_chunked_matches_explicit(rng, over, chunk_size, masking):
    q, k, v = _qkv(rng)
    mask = _padding_mask() if "padding" in masking else None
    causal = "causal" in masking
    out = kernels.chunked_attention(
        q,
        k,
        v,
        scale=H**-0.5,
        mask=None if mask is None else ops.convert_to_tensor(mask),
        is_causal=causal,
        chunk_size=chunk_size,
        over=over,
    )
    np.testing.assert_allclose(to_numpy(out), _explicit(q, k, v, mask, causal), atol=ATOL)
    if mask is not None:  # the row with no key: zero context
        np.testing.assert_array_equal(to_numpy(out)[1, 2], 0.0)


@pytest.mark.parametrize("over", ["keys", "queries"])
def test_chunked_causal_offset_matches_explicit(rng, over):
    q, k, v = _qkv(rng, query_length=7, key_length=S)
    out = kernels.chunked_attention(
        q, k, v, scale=H**-0.5, is_causal=True, causal_offset=4, chunk_size=3, over=over
    )
    np.testing.assert_allclose(to_numpy(out), _explicit(q, k, v, causal=True, offset=4), atol=ATOL)


def _compiled(fn, dynamic_shapes):
    """`fn` under the backend's compiler; TensorFlow traces with unknown `B` and `T`."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        query = (None, None, N, H) if dynamic_shapes else (B, T, N, H)
        keys = tf.TensorSpec((B, S, N, H), "float32")
        return tf.function(fn, input_signature=[tf.TensorSpec(query, "float32"), keys, keys])
    if backend == "jax":
        import jax

        return jax.jit(fn)
    return fn


@pytest.mark.parametrize("dynamic_shapes", [False, True])
def test_query_chunks_compiled_match_explicit(rng, dynamic_shapes):
    """Query chunks under the backend's compiler; an unknown `T` is one chunk."""
    q, k, v = _qkv(rng)
    mask = ops.convert_to_tensor(_padding_mask())

    def fn(q, k, v):
        return kernels.chunked_attention(
            q, k, v, scale=H**-0.5, mask=mask, is_causal=True, chunk_size=4, over="queries"
        )

    out = _compiled(fn, dynamic_shapes)(*(ops.convert_to_tensor(x) for x in (q, k, v)))
    expected = _explicit(q, k, v, _padding_mask(), causal=True)
    np.testing.assert_allclose(to_numpy(out), expected, atol=ATOL)


def test_query_chunks_are_ordered_in_tensorflow_graphs(rng):
    """TensorFlow's executor would start every query chunk at once (peak memory of the
    whole score matrix): chunk `i` waits for chunk `i - IN_FLIGHT`. Elsewhere ops run in
    program order (torch) or XLA schedules them, and no ordering is added."""
    q, k, v = (ops.convert_to_tensor(x) for x in _qkv(rng, query_length=16))
    chunks = 16 // 4

    def fn(q, k, v):
        return kernels.chunked_attention(q, k, v, scale=H**-0.5, chunk_size=4, over="queries")

    if keras.backend.backend() != "tensorflow":
        assert isinstance(kernels._after([q]), contextlib.nullcontext)
        return
    import tensorflow as tf

    graph = tf.function(fn).get_concrete_function(q, k, v).graph
    waited_on = {c.name for op in graph.get_operations() for c in op.control_inputs}
    assert len(waited_on) == chunks - kernels.IN_FLIGHT


@pytest.mark.parametrize("over", ["keys", "queries"])
def test_chunked_empty_batch(over):
    q = np.zeros((0, T, N, H), "float32")
    kv = np.zeros((0, S, N, H), "float32")
    out = kernels.chunked_attention(q, kv, kv, scale=H**-0.5, chunk_size=4, over=over)
    assert tuple(out.shape) == (0, T, N, H)


@pytest.mark.parametrize("copies", [False, True], ids=["views", "copies"])
@pytest.mark.parametrize("masking", ["none", "causal", "padding"])
def test_fused_matches_explicit(rng, masking, copies, monkeypatch):
    """Torch takes heads-first views of short keys and copies of long ones (every
    backend runs both cases; only torch tells them apart)."""
    monkeypatch.setattr(kernels, "CONTIGUOUS_KEYS_FROM", 1 if copies else 10**9)
    q, k, v = _qkv(rng)
    mask = _padding_mask() if masking == "padding" else None
    if masking == "causal":
        mask = to_numpy(ops.expand_dims(keras_mha.masks.causal_mask(T, S), 1))
    out = kernels.fused_attention(
        q, k, v, scale=H**-0.5, mask=None if mask is None else ops.convert_to_tensor(mask)
    )
    np.testing.assert_allclose(to_numpy(out), _explicit(q, k, v, mask), atol=ATOL)


# --------------------------------------------------------------------------- layer level
class _SelfAttention(keras.layers.Layer):
    """`inner(x, x, **kwargs)`: self-attention with query and value the same tensor."""

    def __init__(self, inner, **kwargs):
        super().__init__()
        self.inner, self.kwargs = inner, kwargs
        self.built = inner.built

    def call(self, x, key_mask=None):
        return self.inner(x, x, key_mask=key_mask, **self.kwargs)


def _layers(implementations, **config):
    layers = [
        keras_mha.MultiHeadAttention(
            num_heads=N, key_dim=H, implementation=i, chunk_size=4, **config
        )
        for i in implementations
    ]
    x = np.zeros((B, T, 8), "float32")
    for layer in layers:
        layer(x, x)
    for layer in layers[1:]:
        layer.set_weights(layers[0].get_weights())
    return layers


@pytest.mark.parametrize(
    "causal, copies",
    [(False, False), (True, False), (True, True)],
    ids=["plain", "causal", "copies"],
)
def test_layer_paths_agree_outputs_and_gradients(rng, causal, copies, monkeypatch):
    """explicit / fused / chunked through the layer, with a padding mask: loss (a function
    of every output) and gradients, fully-masked rows included (finite gradients); on
    torch the fused path also with heads-first copies of the keys and values."""
    monkeypatch.setattr(kernels, "CONTIGUOUS_KEYS_FROM", 1 if copies else 10**9)
    x = rng.standard_normal((B, T, 8)).astype("float32")
    key_mask = np.ones((B, T), bool)
    key_mask[0, 5:] = False
    key_mask[1, :] = False  # batch 1 attends to nothing
    results = []
    for layer in _layers(["explicit", "fused", "chunked"]):
        wrapper = _SelfAttention(layer, use_causal_mask=causal)
        loss, grad_in, grad_w = gradients(wrapper, {"x": x}, key_mask=key_mask)
        results.append((loss, grad_in["x"], grad_w))
    reference = results[0]
    assert np.isfinite(reference[1]).all()
    for loss, grad_x, grad_w in results[1:]:
        np.testing.assert_allclose(loss, reference[0], rtol=1e-5)
        np.testing.assert_allclose(grad_x, reference[1], atol=1e-4)
        for g, ref in zip(grad_w, reference[2]):
            np.testing.assert_allclose(g, ref, atol=1e-4)


def test_auto_picks_chunked_and_keeps_results(rng, monkeypatch):
    calls = []
    original = kernels.chunked_attention
    monkeypatch.setattr(
        kernels, "chunked_attention", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    auto, explicit = _layers([None, "explicit"])
    x = rng.standard_normal((B, T, 8)).astype("float32")
    np.testing.assert_allclose(
        to_numpy(auto(x, x, use_causal_mask=True)),
        to_numpy(explicit(x, x, use_causal_mask=True)),
        atol=ATOL,
    )
    # Torch's fused kernel already keeps O(T) memory: auto keeps it there.
    assert bool(calls) == (keras.backend.backend() != "torch")


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_chunk_size_none_takes_the_backend_default(rng, monkeypatch, chunk_size):
    """`chunk_size=None` reaches the chunked kernel as this backend's default, chosen
    at call time; it stays `None` in the config, so a reloaded layer re-chooses."""
    seen = []
    for name in ("_chunked_over_queries", "_chunked_over_keys"):
        original = getattr(kernels, name)

        def spy(*a, _original=original, **k):
            seen.append(k["chunk_size"])
            return _original(*a, **k)

        monkeypatch.setattr(kernels, name, spy)
    layer = keras_mha.MultiHeadAttention(
        num_heads=N, key_dim=H, implementation="chunked", chunk_size=chunk_size
    )
    x = rng.standard_normal((B, T, 8)).astype("float32")
    layer(x, x)
    expected = chunk_size or kernels.DEFAULT_CHUNK_SIZE[keras.backend.backend()]
    assert seen == [expected]
    config = layer.get_config()
    assert config["chunk_size"] == chunk_size
    assert keras_mha.MultiHeadAttention.from_config(config).get_config() == config


def test_choose_implementation_rules():
    common = dict(projected_rank=4, same_head_dims=True, query_length=8192, key_length=8192)
    assert (
        kernels.choose_implementation(None, need_weights=True, dropout_active=False, **common)
        == "explicit"
    )
    assert (
        kernels.choose_implementation(None, need_weights=False, dropout_active=True, **common)
        == "explicit"
    )
    expected = "fused" if keras.backend.backend() == "torch" else "chunked"
    long = kernels.choose_implementation(None, need_weights=False, dropout_active=False, **common)
    assert long == expected
    short = dict(common, query_length=16, key_length=16)
    assert (
        kernels.choose_implementation(None, need_weights=False, dropout_active=False, **short)
        == expected
    )
    for requested in kernels.IMPLEMENTATIONS:
        assert (
            kernels.choose_implementation(
                requested, need_weights=False, dropout_active=False, **short
            )
            == requested
        )
    # Chunks over keys need a static `S`; chunks over queries do not.
    unknown = dict(common, query_length=None, key_length=None)
    over = kernels.CHUNK_OVER[keras.backend.backend()]
    assert kernels.choose_implementation(
        "chunked", need_weights=False, dropout_active=False, **unknown
    ) == ("chunked" if over == "queries" else "explicit")


# ------------------------------------------------------------------- projections
@pytest.mark.parametrize("key_dim", [1, 4])
def test_projection_matches_einsum_dense(rng, key_dim):
    """`projections.Projection` is `EinsumDense` with the same weights, bias included,
    also where TensorFlow's `ops.add` would put a `(N, 1)` bias on the sequence axis."""
    x = rng.standard_normal((2, 3, 8)).astype("float32")
    ours = projections.Projection("abc,cde->abde", output_shape=(None, 3, key_dim), bias_axes="de")
    reference = keras.layers.EinsumDense(
        "abc,cde->abde", output_shape=(None, 3, key_dim), bias_axes="de"
    )
    ours.build(x.shape)
    reference.build(x.shape)
    bias = rng.standard_normal((3, key_dim)).astype("float32")
    ours.set_weights([reference.get_weights()[0], bias])
    expected = x @ reference.get_weights()[0].reshape(8, -1)
    expected = expected.reshape(2, 3, 3, key_dim) + bias
    np.testing.assert_allclose(to_numpy(ours(x)), expected, atol=1e-5)


def test_projection_gradients_match_einsum_dense(rng):
    """The bias add (in place on torch) leaves the input alone and gives `EinsumDense`'s
    gradients for the input, the kernel and the bias."""
    x = rng.standard_normal((2, 5, 8)).astype("float32")
    before = x.copy()
    layers = [
        cls("abc,cde->abde", output_shape=(None, 3, 4), bias_axes="de")
        for cls in (projections.Projection, keras.layers.EinsumDense)
    ]
    for layer in layers:
        layer.build(x.shape)
    layers[0].set_weights([w + 0.5 for w in layers[1].get_weights()])
    layers[1].set_weights(layers[0].get_weights())
    (ours_loss, ours_inputs, ours_weights), (loss, inputs, weights) = (
        gradients(layer, {"inputs": x}) for layer in layers
    )
    np.testing.assert_allclose(ours_loss, loss, rtol=1e-6)
    np.testing.assert_allclose(ours_inputs["inputs"], inputs["inputs"], atol=1e-5)
    for ours_grad, grad in zip(ours_weights, weights):
        np.testing.assert_allclose(ours_grad, grad, atol=1e-5)
    np.testing.assert_array_equal(x, before)
