"""`keras_mha.interop`: torch.nn.MultiheadAttention <-> MultiHeadAttention, both ways."""

import keras
import numpy as np
import pytest
import torch
from keras import ops

import keras_mha
from keras_mha import interop

E, N, B, T, S = 8, 2, 2, 5, 4


def _torch_out(module, q, k, v, **masks):
    module.eval()
    with torch.no_grad():
        out, _ = module(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), **masks)
    return out.numpy()


def _ours(layer, q, k, v, attention_mask=None):
    out = layer(q, v, key=k, attention_mask=attention_mask)
    return ops.convert_to_numpy(out)


def _inputs(rng, kdim=E, vdim=E):
    q = rng.normal(size=(B, T, E)).astype("float32")
    k = rng.normal(size=(B, S, kdim)).astype("float32")
    v = rng.normal(size=(B, S, vdim)).astype("float32")
    return q, k, v


def _randomise(module, seed=0):
    # Non-zero biases, so a misplaced bias cannot go unnoticed.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


@pytest.mark.parametrize(
    "bias,kdim,vdim",
    [
        pytest.param(True, E, E, id="bias_packed"),
        pytest.param(False, E, E, id="no_bias_packed"),
        pytest.param(True, 3, 6, id="bias_kdim_vdim"),
        pytest.param(False, 5, 5, id="no_bias_kdim_vdim"),
    ],
)
def test_from_torch_matches_torch_outputs(rng, bias, kdim, vdim):
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, N, bias=bias, kdim=kdim, vdim=vdim, batch_first=True)
    _randomise(module)
    layer = interop.from_torch(module)
    assert isinstance(layer, keras_mha.MultiHeadAttention) and layer.built
    assert len(layer.weights) == (8 if bias else 4)
    q, k, v = _inputs(rng, kdim, vdim)
    np.testing.assert_allclose(_ours(layer, q, k, v), _torch_out(module, q, k, v), atol=1e-5)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dims", [(E, E), (3, 6)], ids=["packed", "kdim_vdim"])
def test_to_torch_matches_our_outputs(rng, bias, dims):
    kdim, vdim = dims
    layer = keras_mha.MultiHeadAttention(N, E // N, use_bias=bias, bias_initializer="random_normal")
    q, k, v = _inputs(rng, kdim, vdim)
    ours = _ours(layer, q, k, v)
    module = interop.to_torch(layer)
    assert module.batch_first and (module.in_proj_bias is not None) == bias
    assert module._qkv_same_embed_dim == (dims == (E, E))
    np.testing.assert_allclose(_torch_out(module, q, k, v), ours, atol=1e-5)


def test_round_trip_gives_back_the_weights(rng):
    module = torch.nn.MultiheadAttention(E, N, kdim=3, vdim=6, batch_first=True)
    _randomise(module)
    back = interop.to_torch(interop.from_torch(module))
    for (name, p), (name2, p2) in zip(module.named_parameters(), back.named_parameters()):
        assert name == name2
        np.testing.assert_array_equal(p.detach().numpy(), p2.detach().numpy())


def test_masks_agree_with_torch_conventions(rng):
    module = torch.nn.MultiheadAttention(E, N, batch_first=True)
    _randomise(module)
    layer = interop.from_torch(module)
    q, k, v = _inputs(rng)
    # torch: True = ignore. Every query row keeps at least one key (torch gives NaN
    # for rows with none, we give zeros).
    key_padding_mask = torch.tensor([[False, False, True, True], [False, True, False, False]])
    attn_mask = torch.from_numpy(rng.random((T, S)) > 0.6)
    attn_mask[:, 0] = False
    expected = _torch_out(module, q, k, v, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
    mask = interop.masks_from_torch(key_padding_mask=key_padding_mask, attn_mask=attn_mask)
    assert mask.shape == (B, T, S) and mask.dtype == np.bool_
    np.testing.assert_allclose(_ours(layer, q, k, v, mask), expected, atol=1e-5)
    # The same through our padding mask argument.
    ours = layer(
        q, v, key=k, value_mask=~key_padding_mask.numpy(), attention_mask=~attn_mask.numpy()
    )
    np.testing.assert_allclose(ops.convert_to_numpy(ours), expected, atol=1e-5)
    # The masks did change the result (the test would catch an inverted convention).
    assert np.abs(_torch_out(module, q, k, v) - expected).max() > 1e-3


def test_masks_from_torch_rejects_float_masks():
    with pytest.raises(ValueError, match="attn_mask"):
        interop.masks_from_torch(attn_mask=torch.zeros(T, S))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        pytest.param({"add_bias_kv": True}, "add_bias_kv", id="add_bias_kv"),
        pytest.param({"add_zero_attn": True}, "add_zero_attn", id="add_zero_attn"),
    ],
)
def test_from_torch_rejects_what_we_cannot_express(kwargs, name):
    module = torch.nn.MultiheadAttention(E, N, batch_first=True, **kwargs)
    with pytest.raises(ValueError, match=f"`{name}`"):
        interop.from_torch(module)


def test_from_torch_rejects_other_modules():
    with pytest.raises(ValueError, match="`module`"):
        interop.from_torch(torch.nn.Linear(E, E))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        pytest.param({"value_dim": 3}, "value_dim", id="value_dim"),
        pytest.param({"output_shape": 5}, "output_shape", id="output_shape"),
        pytest.param({"use_gate": True}, "use_gate", id="use_gate"),
        pytest.param({"num_key_value_heads": 1}, "num_key_value_heads", id="gqa"),
        pytest.param({"normalize_qk": True}, "normalize_qk", id="normalize_qk"),
        pytest.param({"sliding_window": 2}, "sliding_window", id="sliding_window"),
        pytest.param({"scale": 1.0}, "scale", id="scale"),
        pytest.param({"use_output_bias": False}, "use_output_bias", id="use_output_bias"),
        pytest.param({"normalize_value": True}, "normalize_value", id="normalize_value"),
        pytest.param({"dropout": 0.1, "dropout_on": "output"}, "dropout_on", id="dropout_on"),
        pytest.param({"key_dim": 3}, "key_dim", id="heads_do_not_tile"),
    ],
)
def test_to_torch_rejects_what_torch_cannot_express(kwargs, name):
    config = {"num_heads": N, "key_dim": E // N, **kwargs}
    layer = keras_mha.MultiHeadAttention(**config)
    layer.build((None, T, E), (None, S, E))
    with pytest.raises(ValueError, match=f"`{name}`"):
        interop.to_torch(layer)


def test_to_torch_rejects_nd_attention_and_unbuilt_layers():
    layer = keras_mha.MultiHeadAttention(N, E // N, attention_axes=(1, 2))
    layer.build((None, 3, T, E), (None, 3, S, E))
    with pytest.raises(ValueError, match="`attention_axes`"):
        interop.to_torch(layer)
    with pytest.raises(ValueError, match="built"):
        interop.to_torch(keras_mha.MultiHeadAttention(N, E // N))
    with pytest.raises(ValueError, match="`layer`"):
        interop.to_torch(keras.layers.Dense(3))


def test_importing_keras_mha_does_not_import_torch():
    import os
    import subprocess
    import sys

    code = "import sys, keras_mha; keras_mha.interop; print('torch' in sys.modules)"
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
