"""Every attention path against the explicit one, and the fused self-attention projection
against the three separate projections: outputs and gradients, causal and padding masks."""

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


@pytest.mark.parametrize("masking", ["none", "causal", "padding"])
def test_fused_matches_explicit(rng, masking):
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


@pytest.mark.parametrize("causal", [False, True])
def test_layer_paths_agree_outputs_and_gradients(rng, causal):
    """explicit / fused / chunked through the layer, with a padding mask: loss (a function
    of every output) and gradients, fully-masked rows included (finite gradients)."""
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


def test_auto_picks_chunked_for_long_sequences_and_keeps_results(rng, monkeypatch):
    monkeypatch.setattr(kernels, "CHUNK_THRESHOLD", 16)
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
    long = kernels.choose_implementation(None, need_weights=False, dropout_active=False, **common)
    assert long == ("fused" if keras.backend.backend() == "torch" else "chunked")
    unknown = dict(common, key_length=None)
    assert (
        kernels.choose_implementation(
            "chunked", need_weights=False, dropout_active=False, **unknown
        )
        == "explicit"
    )


# ------------------------------------------------------------------- fused projection
def test_fused_projection_matches_three_projections(rng):
    (layer,) = _layers(["explicit"])
    x = ops.convert_to_tensor(rng.standard_normal((B, T, 8)).astype("float32"))
    denses = (layer.query_dense, layer.key_dense, layer.value_dense)
    for d in denses:  # non-zero biases, so a dropped or misplaced bias shows
        d.bias.assign(rng.standard_normal(tuple(d.bias.shape)).astype("float32"))
    assert projections.can_fuse(denses)
    assert projections.fusable(denses) == (keras.backend.backend() == "jax")
    fused = projections.fused_self_projection(denses, x)
    for got, dense in zip(fused, denses):
        assert tuple(got.shape) == (B, T, N, H)
        np.testing.assert_allclose(to_numpy(got), to_numpy(dense(x)), atol=1e-5)


def test_self_attention_runs_the_fused_projection_with_the_same_results(rng, monkeypatch):
    # Where it does not pay off by default (TensorFlow, torch), the hook is still tested.
    monkeypatch.setattr(projections, "pays_off", lambda training=None: True)
    calls = []
    original = projections.fused_self_projection
    monkeypatch.setattr(
        projections, "fused_self_projection", lambda *a: calls.append(1) or original(*a)
    )
    (layer,) = _layers(["explicit"], value_dim=5)
    x = rng.standard_normal((B, T, 8)).astype("float32")
    same = ops.convert_to_tensor(x)
    fused = to_numpy(layer(same, same))
    assert calls, "self-attention did not take the fused projection"
    calls.clear()
    separate = to_numpy(layer(same, ops.convert_to_tensor(x)))  # equal values, other tensor
    assert not calls
    np.testing.assert_allclose(fused, separate, atol=1e-5)


def test_lora_disables_the_fused_projection(rng):
    (layer,) = _layers(["explicit"])
    layer.query_dense.enable_lora(2)
    assert not projections.can_fuse((layer.query_dense, layer.key_dense, layer.value_dense))


def test_fusion_runs_where_it_measured_faster():
    backend = keras.backend.backend()
    assert projections.pays_off(training=False) == (backend == "jax")
    assert not projections.pays_off(training=True)
