"""PyTorch interop: `torch.nn.MultiheadAttention` <-> `keras_mha.MultiHeadAttention`.

Weights travel through NumPy, so both functions work under any Keras backend; torch
is imported inside them only. The layout mapping, with `E = embed_dim`, `N` heads and
`h = E // N` (PyTorch applies its weights as `x @ W.T`):

    torch                                  keras_mha
    in_proj_weight[:E] or q_proj_weight    query/kernel  = Wq.T.reshape(E, N, h)
    in_proj_weight[E:2E] or k_proj_weight  key/kernel    = Wk.T.reshape(kdim, N, h)
    in_proj_weight[2E:] or v_proj_weight   value/kernel  = Wv.T.reshape(vdim, N, h)
    in_proj_bias (3E,)                     query/key/value biases, each (N, h)
    out_proj.weight (E, E), out_proj.bias  attention_output/kernel = Wo.T.reshape(N, h, E)

Masks use opposite conventions: torch's `key_padding_mask` and boolean `attn_mask`
mark with `True` what may NOT be attended, ours mark what may; see `masks_from_torch`.
"""

import numpy as np

from keras_mha import checks
from keras_mha.layer import MultiHeadAttention


def from_torch(module):
    """A built `MultiHeadAttention` holding the weights of a `torch.nn.MultiheadAttention`.

    The returned layer takes batch-first inputs `(B, T, E)`, `(B, S, vdim)` and
    optionally `key` `(B, S, kdim)`, whatever the module's `batch_first`.

    Args:
        module: a `torch.nn.MultiheadAttention`.

    Returns:
        `MultiHeadAttention(num_heads, key_dim=E // N, use_bias=..., dropout=...)`.

    Raises:
        ValueError: for what our layer cannot express (`add_bias_kv`, `add_zero_attn`).
    """
    import torch

    if not isinstance(module, torch.nn.MultiheadAttention):
        raise checks.invalid("module", "a `torch.nn.MultiheadAttention`", type(module).__name__)
    if module.bias_k is not None:
        raise checks.invalid("add_bias_kv", "False (keras_mha has no learned bias keys)", True)
    if module.add_zero_attn:
        raise checks.invalid("add_zero_attn", "False (keras_mha has no zero-attention slot)", True)
    embed_dim, num_heads = module.embed_dim, module.num_heads
    head_dim = embed_dim // num_heads
    use_bias = module.in_proj_bias is not None
    layer = MultiHeadAttention(
        num_heads=num_heads,
        key_dim=head_dim,
        use_bias=use_bias,
        dropout=float(module.dropout),
    )
    layer.build((None, None, embed_dim), (None, None, module.vdim), (None, None, module.kdim))

    def numpy(tensor):
        return tensor.detach().cpu().to(torch.float32).numpy()

    if module._qkv_same_embed_dim:
        wq, wk, wv = np.split(numpy(module.in_proj_weight), 3, axis=0)
    else:
        wq, wk, wv = (
            numpy(w) for w in (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        )
    heads = (num_heads, head_dim)
    weights = []
    biases = np.split(numpy(module.in_proj_bias), 3) if use_bias else (None,) * 3
    for w, b in zip((wq, wk, wv), biases):
        weights.append(w.T.reshape((w.shape[1],) + heads))
        if use_bias:
            weights.append(b.reshape(heads))
    weights.append(numpy(module.out_proj.weight).T.reshape(heads + (embed_dim,)))
    if use_bias:
        weights.append(numpy(module.out_proj.bias))
    layer.set_weights(weights)
    return layer


def to_torch(layer):
    """A `torch.nn.MultiheadAttention(batch_first=True)` holding a built layer's weights.

    Args:
        layer: a built `MultiHeadAttention` on `(B, T, E)` inputs whose heads tile
            the query width (`num_heads * key_dim == E`).

    Returns:
        The torch module, float32, in the layer's `dropout`, training mode off.

    Raises:
        ValueError: naming what torch's module cannot express (an unbuilt layer,
            N-d attention, `value_dim != key_dim`, another `output_shape`,
            `use_gate`, `num_key_value_heads`, `normalize_qk`, `sliding_window`,
            `scale`, `use_output_bias` unlike `use_bias`, `normalize_value`,
            `dropout_on="output"` with dropout,
            `num_heads * key_dim != E`).
    """
    import torch

    if not isinstance(layer, MultiHeadAttention):
        raise checks.invalid("layer", "a `keras_mha.MultiHeadAttention`", type(layer).__name__)
    if not layer.built:
        raise checks.invalid(
            "layer", "a built layer (call it once, or `build` it)", "unbuilt layer"
        )
    query_shape, value_shape, key_shape = layer._built_shapes
    embed_dim = query_shape[-1]
    _require(len(query_shape) == 3, "attention_axes", "(B, T, E) inputs", query_shape)
    _require(
        layer.value_dim == layer.key_dim, "value_dim", f"key_dim={layer.key_dim}", layer.value_dim
    )
    _require(
        layer._output_shape in (None, (embed_dim,)),
        "output_shape",
        f"`None` or ({embed_dim},), the query width",
        layer._output_shape,
    )
    _require(not layer._use_gate, "use_gate", "False", layer._use_gate)
    _require(
        layer.num_key_value_heads == layer.num_heads,
        "num_key_value_heads",
        f"num_heads={layer.num_heads}",
        layer.num_key_value_heads,
    )
    _require(not layer._normalize_qk, "normalize_qk", "False", layer._normalize_qk)
    _require(layer._sliding_window is None, "sliding_window", "`None`", layer._sliding_window)
    _require(layer._scale is None, "scale", "`None`", layer._scale)
    _require(
        layer._output_bias == layer.use_bias,
        "use_output_bias",
        f"`None` or use_bias={layer.use_bias}",
        layer._use_output_bias,
    )
    _require(not layer._normalize_value, "normalize_value", "False", layer._normalize_value)
    _require(
        layer._dropout_on == "weights" or not layer.dropout,
        "dropout_on",
        '"weights" (torch\'s module drops the weights)',
        layer._dropout_on,
    )
    _require(
        layer.num_heads * layer.key_dim == embed_dim,
        "key_dim",
        f"embed_dim / num_heads = {embed_dim} / {layer.num_heads}",
        layer.key_dim,
    )

    kdim, vdim = key_shape[-1], value_shape[-1]
    module = torch.nn.MultiheadAttention(
        embed_dim,
        layer.num_heads,
        dropout=layer.dropout,
        bias=layer.use_bias,
        kdim=kdim,
        vdim=vdim,
        batch_first=True,
    )
    module.eval()
    weights = [np.asarray(w, dtype=np.float32) for w in layer.get_weights()]
    step = 2 if layer.use_bias else 1
    wq, wk, wv, wo = (weights[i * step] for i in range(4))

    def tensor(array):
        return torch.from_numpy(np.ascontiguousarray(array))

    projections = [w.reshape(w.shape[0], embed_dim).T for w in (wq, wk, wv)]
    with torch.no_grad():
        if module._qkv_same_embed_dim:
            module.in_proj_weight.copy_(tensor(np.concatenate(projections, axis=0)))
        else:
            module.q_proj_weight.copy_(tensor(projections[0]))
            module.k_proj_weight.copy_(tensor(projections[1]))
            module.v_proj_weight.copy_(tensor(projections[2]))
        module.out_proj.weight.copy_(tensor(wo.reshape(embed_dim, embed_dim).T))
        if layer.use_bias:
            biases = [weights[i * 2 + 1].reshape(-1) for i in range(3)]
            module.in_proj_bias.copy_(tensor(np.concatenate(biases)))
            module.out_proj.bias.copy_(tensor(weights[7]))
    return module


def masks_from_torch(key_padding_mask=None, attn_mask=None):
    """Torch's masks (`True` = masked) as our `attention_mask` (`True` = may attend).

    Args:
        key_padding_mask: `(B, S)` boolean, `True` = padding to ignore, or `None`.
        attn_mask: `(T, S)` or `(B, T, S)` boolean, `True` = not allowed, or `None`.
            (Per-head `(B * N, T, S)` masks have no counterpart here.)

    Returns:
        A NumPy boolean mask broadcastable to `(B, T, S)`, or `None`.
    """
    merged = None
    if key_padding_mask is not None:
        merged = ~_to_numpy(key_padding_mask, "key_padding_mask")[:, None, :]
    if attn_mask is not None:
        allowed = ~_to_numpy(attn_mask, "attn_mask")
        merged = allowed if merged is None else merged & allowed
    return merged


def _to_numpy(mask, name):
    array = mask.detach().cpu().numpy() if hasattr(mask, "detach") else np.asarray(mask)
    if array.dtype != np.bool_:
        raise checks.invalid(
            name, "a boolean mask (float masks are additive in torch)", array.dtype
        )
    return array


def _require(ok, name, expected, received):
    if not ok:
        raise checks.invalid(
            name, f"{expected} to convert to torch.nn.MultiheadAttention", received
        )
