"""The one float64 NumPy reference of multi-head attention every test compares with.

`reference_mha` runs a built layer (ours or the built-in) from its weights: the
projections, QK-norm (either parametrisation, its epsilon), the value norm, rotary
embeddings, grouped key/value heads, the logits' scale, soft-cap, bias, masks (causal,
symmetric or `(left, right)` window, dense with or without free axes), sinks, the gate,
dropout on the attention output (a given keep mask) and the output projection. A query
row with no key to attend to gets zero weights. NumPy in, NumPy out, the same on every
backend. `numeric_gradient` differentiates any of it by central differences.
"""

import keras
import numpy as np


def softmax_with_mask(logits, mask=None, axes=(-1,), sinks=None):
    """Float64 softmax over `axes`; masked entries get 0, fully-masked rows all 0.

    Args:
        logits: any shape.
        mask: boolean, broadcastable to `logits`, `True` = may attend; or `None`.
        axes: the axes normalised over.
        sinks: `None` or logits broadcastable to `logits` with `axes` as 1s, each
            joining its row's denominator with no value of its own.
    """
    logits = np.asarray(logits, np.float64)
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
        logits = np.where(mask, logits, -np.inf)
    peak = np.max(logits, axis=axes, keepdims=True)
    if sinks is not None:
        peak = np.maximum(peak, sinks)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    exp = np.exp(logits - peak)
    total = np.sum(exp, axis=axes, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks - peak)
    return np.where(total > 0, exp / np.where(total > 0, total, 1.0), 0.0)


def rope(
    x,
    start,
    max_wavelength,
    scaling_factor=1.0,
    positions=None,
    scaling=None,
    rope_dim=None,
    layout="prefix",
    interleaved=False,
):
    """Float64 rotary embedding of `x` `(B, T, N, H)` at positions `start + t`, in
    keras-hub's rotate-half convention (`keras_hub.layers.RotaryEmbedding`), with the
    variants of `keras_mha.rope` written from their papers' and keras-hub's formulas.

    Args:
        x: `(B, T, N, H)`.
        start: the first position (and, for LongRoPE, `start + T` picks the factors).
        max_wavelength, scaling_factor: the base and the positions' divisor.
        positions: `None`, `(B, T)` per-token positions, or `(B, 3, T)` M-RoPE streams.
        scaling: `None` or a `rope_scaling` dict with every key (the layer's).
        rope_dim, layout, interleaved: partial rotary and the pairing.
    """
    x = np.asarray(x, np.float64)
    head_dim = x.shape[-1]
    dim = head_dim if rope_dim is None else rope_dim
    if dim < head_dim and layout == "prefix":
        rotated = rope(
            x[..., :dim], start, max_wavelength, scaling_factor, positions, scaling,
            interleaved=interleaved,
        )  # fmt: skip
        return np.concatenate([rotated, x[..., dim:]], axis=-1)
    denominator = head_dim if dim < head_dim else dim
    index = np.arange(dim // 2)
    inverse = max_wavelength ** (-2.0 * index / denominator)
    gain = 1.0
    kind = None if scaling is None else scaling["type"]
    if kind == "llama3":
        inverse = _llama3(inverse, scaling)
    elif kind == "yarn":
        inverse, gain = _yarn(inverse, index, denominator, max_wavelength, scaling)
    elif kind == "longrope":
        inverse, gain = _longrope(inverse, start + x.shape[1], scaling)
    inverse = np.concatenate([inverse, np.zeros((head_dim - dim) // 2)])  # proportional
    if positions is None:
        positions = (start + np.arange(x.shape[1]))[None, :]
    positions = np.asarray(positions, np.float64) / scaling_factor
    if positions.ndim == 3:  # M-RoPE: each frequency follows one of 3 streams
        sections = scaling["sections"]
        stream = np.zeros(head_dim // 2, int)
        for i in range(head_dim // 2):
            if i % 3 == 1 and i < 3 * sections[1]:
                stream[i] = 1
            elif i % 3 == 2 and i < 3 * sections[2]:
                stream[i] = 2
        angles = np.stack(  # (B, T, H/2)
            [positions[:, stream[i], :] * inverse[i] for i in range(head_dim // 2)], axis=-1
        )
    else:
        angles = positions[:, :, None] * inverse  # (B or 1, T, H/2)
    cos, sin = gain * np.cos(angles)[:, :, None, :], gain * np.sin(angles)[:, :, None, :]
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = odd * cos + even * sin
        return out
    half = head_dim // 2
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _llama3(inverse, scaling):
    """Llama 3.1's smoothing: long wavelengths (above `original / low_freq_factor`)
    interpolated by `factor`, short ones (below `original / high_freq_factor`) kept,
    those between blended linearly in `original / wavelength`."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * np.pi / inverse
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inverse / factor + smooth * inverse
    return np.where(
        wavelength > original / low,
        inverse / factor,
        np.where(wavelength < original / high, inverse, blended),
    )


def _yarn(inverse, index, dim, max_wavelength, scaling):
    """YaRN: frequency `i` interpolated by `factor` in proportion to a ramp that is 0
    below the dimension where `beta_fast` rotations fit the original length and 1
    above the one where `beta_slow` do; `cos`/`sin` times `0.1 ln(factor) + 1`."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dimension(rotations):
        return dim * np.log(original / (rotations * 2 * np.pi)) / (2 * np.log(max_wavelength))

    low, high = dimension(scaling["beta_fast"]), dimension(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0.0), min(high, dim - 1.0)
    ramp = np.clip((index - low) / max(high - low, 0.001), 0.0, 1.0)
    gain = scaling["attention_factor"] or 0.1 * np.log(factor) + 1.0
    return inverse / factor * ramp + inverse * (1.0 - ramp), gain


def _longrope(inverse, last, scaling):
    """LongRoPE: frequencies divided by the long factors when the call's last position
    `last` passes the original length, else by the short ones; `cos`/`sin` times
    `sqrt(1 + ln(max / original) / ln(original))`."""
    original = scaling["original_max_position_embeddings"]
    factors = scaling["long_factor"] if last > original else scaling["short_factor"]
    ratio = (scaling["max_position_embeddings"] or original) / original
    gain = scaling["attention_factor"] or (
        np.sqrt(1 + np.log(ratio) / np.log(original)) if ratio > 1 else 1.0
    )
    return inverse / np.asarray(factors, np.float64), gain


def reference_attention(
    query,
    key,
    value,
    mask=None,
    attention_axes=None,
    bias=None,
    soft_cap=None,
    sinks=None,
    scale=None,
    score_mod=None,
    query_offset=0,
):
    """Float64 `softmax(q k^T * scale, masked) v` on projected heads.

    Args:
        query: `(B, <dims>, N, H)`; key: `(B, <dims'>, N, H)`; value: `(B, <dims'>, N, Hv)`.
        mask: boolean `(B or 1, <query attention dims>, <key attention dims>)`, or
            `(B or 1, <free dims>, <query att dims>, <key att dims>)`, or `None`.
        attention_axes: non-negative projected axes attention runs over; `None` means
            every axis between batch and heads.
        bias: one attention axis only: added to the logits, broadcastable to
            `(B, N, T, S)`.
        soft_cap: logits become `cap * tanh(logits / cap)` (before the bias).
        sinks: `(N,)` sink logits joining each row's denominator.
        scale: the logits' scale; `None` means `1 / sqrt(H)`.
        score_mod: one attention axis only: a NumPy `fn(score, b, h, q_idx, kv_idx)`
            over the float64 logits `(B, N, T, S)` after the bias, before the mask,
            with broadcast int index arrays `(B,1,1,1)`, `(1,N,1,1)`, `(1,1,T,1)`,
            `(1,1,1,S)`.
        query_offset: the score function's `q_idx` of query 0 (KV-cache decoding).

    Returns:
        `(output, weights)`: output like the query with `Hv` channels, and weights in
        the built-in layer's layout `(<other axes>, N, <query att dims>, <key att dims>)`.
    """
    query, key, value = (np.asarray(x, np.float64) for x in (query, key, value))
    rank = query.ndim
    axes = tuple(range(1, rank - 2)) if attention_axes is None else tuple(attention_axes)
    others = tuple(i for i in range(rank - 1) if i not in axes)  # batch, free axes, heads

    def flatten(x):  # -> (<others>, prod(att dims), channels)
        moved = np.transpose(x, others + axes + (rank - 1,))
        lead = moved.shape[: len(others)]
        return moved.reshape(lead + (-1, x.shape[-1])), moved.shape[len(others) : -1]

    q, q_dims = flatten(query)
    k, k_dims = flatten(key)
    v, _ = flatten(value)
    scale = 1.0 / np.sqrt(query.shape[-1]) if scale is None else scale
    logits = np.einsum("...th,...sh->...ts", q, k) * scale
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    if score_mod is not None:
        b, n, t, s = logits.shape
        logits = np.broadcast_to(
            score_mod(
                logits,
                np.arange(b).reshape(-1, 1, 1, 1),
                np.arange(n).reshape(1, -1, 1, 1),
                np.arange(t).reshape(1, 1, -1, 1) + query_offset,
                np.arange(s).reshape(1, 1, 1, -1),
            ),
            logits.shape,
        )
    if sinks is not None:  # heads are the last of the "other" axes
        sinks = np.asarray(sinks, np.float64).reshape((-1, 1, 1))
    flat_mask = None
    if mask is not None:
        mask = np.asarray(mask, bool)
        lead = mask.shape[: mask.ndim - 2 * len(axes)]  # (B,) or (B, <free dims>)
        mask = mask.reshape(lead + (int(np.prod(q_dims)), int(np.prod(k_dims))))
        # Broadcast over the "other" axes the mask lacks: heads, and free axes if absent.
        flat_mask = mask.reshape(lead + (1,) * (len(others) - len(lead)) + mask.shape[-2:])
    weights = softmax_with_mask(logits, flat_mask, sinks=sinks)
    out = np.einsum("...ts,...sh->...th", weights, v)
    lead = out.shape[: len(others)]
    out = out.reshape(lead + q_dims + (v.shape[-1],))
    # Back from (<others>, <att dims>, Hv) to the query's layout.
    order = others + axes + (rank - 1,)
    out = np.transpose(out, np.argsort(order))
    weights = weights.reshape(lead + q_dims + k_dims)
    return out, weights


def layer_weights(layer):
    """The layer's projection weights as float64 NumPy arrays, keyed by sublayer."""
    names = ["query", "key", "value", "output"] + (["gate"] if _has_gate(layer) else [])
    result = {}
    for name in names:
        dense = getattr(layer, f"_{name}_dense", None)
        if dense is None:  # `key_value_projection` "tied" or "none"
            continue
        kernel = np.asarray(keras.ops.convert_to_numpy(dense.kernel), np.float64)
        bias = None if dense.bias is None else keras.ops.convert_to_numpy(dense.bias)
        result[name] = (kernel, None if bias is None else np.asarray(bias, np.float64))
    return result


def _has_gate(layer):
    return getattr(layer, "_use_gate", False)


def _project(x, kernel, bias, input_axes):
    # Contract the trailing `input_axes` axes of x with the leading axes of kernel.
    out = np.tensordot(x, kernel, axes=input_axes)
    return out if bias is None else out + bias


def reference_mha(
    layer,
    query,
    value,
    key=None,
    mask=None,
    use_causal_mask=False,
    sliding_window=None,
    attention_bias=None,
    output_keep=None,
    positions=None,
    key_positions=None,
    shared_key_value=None,
    query_offset=0,
):
    """Float64 NumPy forward pass of a built `MultiHeadAttention` (ours or built-in).

    Reads the layer's weights, `num_heads`, `attention_axes` and gate, and for ours
    also QK-norm, the value norm, rotary embeddings, grouped key/value heads, the
    scale, the soft cap and sinks.

    Args:
        layer: a built layer.
        query: `(B, ..., dim)`; value, key: `(B, ..., dim_v)` of the same rank.
        mask: boolean `(B or 1, <query att dims>, <key att dims>)` or `None`.
        use_causal_mask, sliding_window: masks of 1-d attention, ANDed into `mask`;
            the window an int `w` (`|t - s| < w`) or a pair `(left, right)`
            (`t - left <= s <= t + right`).
        attention_bias: added to the logits, broadcastable to `(B, N, T, S)`.
        output_keep: dropout on the attention output: `None`, or a `(B, T, N, Hv)`
            0/1 keep mask with the rate, `(keep, rate)`: the context becomes
            `context * keep / (1 - rate)` before the output projection.
        positions: RoPE positions of the queries and keys (self-attention): `None`
            (`t`), `(B, T)`, or M-RoPE's `(B, 3, T)`.
        key_positions: the keys' own RoPE positions, when not `positions`.
        shared_key_value: `(B, 2, S, Nkv, H)` keys and values another layer computed
            (ours' `shared_key_value`): used as they are, not projected.
        query_offset: the queries' position among the keys (RoPE, causal, window).

    With `key_value_projection="tied"`, the values are the key projection's output
    (before the key norm and RoPE).

    Returns:
        `(output, scores)` as float64 arrays; fully-masked rows have zero scores.
    """
    query, value = np.asarray(query, np.float64), np.asarray(value, np.float64)
    key = value if key is None else np.asarray(key, np.float64)
    w = layer_weights(layer)
    q = _project(query, *w["query"], 1)
    own = shared_key_value is None
    if own:
        k = _project(key, *w["key"], 1)
        v = _project(value, *w["value"], 1) if "value" in w else k  # tied: the key's
    else:
        shared = np.asarray(shared_key_value, np.float64)
        k, v = shared[:, 0], shared[:, 1]
    if getattr(layer, "_normalize_qk", False):
        q = _rms_norm(q, layer._query_norm)
        if own:
            k = _rms_norm(k, layer._key_norm)
    if getattr(layer, "_normalize_value", False) and own:
        v = rms_norm(v, 1.0, layer._value_norm.epsilon)
    wavelength = getattr(layer, "_rope_max_wavelength", None)
    if wavelength is not None:
        options = dict(
            positions=positions,
            scaling=getattr(layer, "_rope_scaling", None),
            rope_dim=getattr(layer, "_rope_dim", None),
            layout=getattr(layer, "_rope_dim_layout", "prefix"),
            interleaved=getattr(layer, "_rope_interleaved", False),
        )
        q = rope(q, query_offset, wavelength, layer._rope_scaling_factor, **options)
        if key_positions is not None:
            options["positions"] = key_positions
        if own:
            k = rope(k, 0, wavelength, layer._rope_scaling_factor, **options)
    repeats = layer.num_heads // getattr(layer, "num_key_value_heads", layer.num_heads)
    k, v = np.repeat(k, repeats, axis=-2), np.repeat(v, repeats, axis=-2)
    sinks = None
    if getattr(layer, "_use_sinks", False):
        sinks = keras.ops.convert_to_numpy(layer._sinks.sinks)
    soft_cap = getattr(layer, "_logit_soft_cap", None)
    axes = layer.attention_axes
    if use_causal_mask or sliding_window is not None:
        t, s = query.shape[1], k.shape[1]
        rows, cols = query_offset + np.arange(t)[:, None], np.arange(s)[None, :]
        band = np.ones((1, t, s), bool)
        if use_causal_mask:
            band &= rows >= cols
        if sliding_window is not None:
            band &= in_window(rows - cols, sliding_window)
        mask = band if mask is None else np.asarray(mask, bool) & band
    context, scores = reference_attention(
        q,
        k,
        v,
        mask,
        axes,
        bias=attention_bias,
        soft_cap=soft_cap,
        sinks=sinks,
        scale=getattr(layer, "_scale", None),
    )
    if _has_gate(layer):
        gate_kernel, gate_bias = w["gate"]
        context = context / (1.0 + np.exp(-_project(query, gate_kernel, gate_bias, 1)))
    if output_keep is not None:
        keep, rate = output_keep
        context = context * np.asarray(keep, np.float64) / (1.0 - rate)
    out_kernel, out_bias = w["output"]
    return _project(context, out_kernel, out_bias, 2), scores


def _rms_norm(x, norm):
    scale = np.asarray(keras.ops.convert_to_numpy(norm.scale), np.float64)
    if getattr(norm, "unit_offset", False):
        scale = 1.0 + scale  # `x_hat * (1 + w)`
    return rms_norm(x, scale, norm.epsilon)


def rms_norm(x, scale, epsilon):
    """Float64 RMS normalisation over the last axis, times `scale`."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + epsilon) * scale


def in_window(distance, window):
    """Boolean: `distance = t - s` lies in the window, an int `w` (`|t - s| < w`) or a
    pair `(left, right)` (`-right <= t - s <= left`)."""
    if isinstance(window, (tuple, list)):
        left, right = window
        return (distance <= left) & (distance >= -right)
    return np.abs(distance) < window


def numeric_gradient(fn, array, step=1e-6):
    """Float64 central-difference gradient of the scalar `fn(array)` w.r.t. `array`."""
    array = np.asarray(array, np.float64)
    grad = np.zeros_like(array)
    flat, out = array.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        saved = flat[i]
        flat[i] = saved + step
        up = fn(array)
        flat[i] = saved - step
        down = fn(array)
        flat[i] = saved
        out[i] = (up - down) / (2 * step)
    return grad
