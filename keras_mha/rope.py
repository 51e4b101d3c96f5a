"""Rotary position embedding (RoPE) of projected queries and keys.

The rotate-half convention of `keras_hub.layers.RotaryEmbedding(max_wavelength,
scaling_factor)` applied to `(B, T, N, H)`, so attention written for keras-hub
checkpoints (Llama, Mistral, Gemma) carries over:

    inverse_frequency[i] = max_wavelength ** (-2i / H)            i < H / 2
    angle[t, i]          = (start + t) / scaling_factor * inverse_frequency[i]
    rotate(x)[t]         = x[t] * cos([angle, angle]) + [-x2, x1][t] * sin([angle, angle])

with `x1, x2` the two halves of the head dimension. Packed rows give each token its
own position instead of `start + t` (`positions`, `(B, T)`), restarting at each
document (`segment_positions`).
"""

from keras import ops


def rotate(x, start, max_wavelength, scaling_factor=1.0, positions=None):
    """RoPE of `x` `(B, T, N, H)` at positions `start ... start + T - 1`.

    Args:
        x: projected queries or keys; `H` even.
        start: position of `x[:, 0]`: a Python int or an integer scalar tensor.
        max_wavelength: the longest wavelength of the rotations.
        scaling_factor: positions are divided by it (position interpolation).
        positions: `None`, or `(B, T)` per-token positions (packed rows), which
            replace `start + t` (`start` is then not used).

    Returns:
        A tensor like `x`.
    """
    x = ops.convert_to_tensor(x)
    head_dim = x.shape[-1]
    exponents = ops.arange(0, head_dim, 2, dtype="float32") / float(head_dim)
    inverse_frequency = 1.0 / ops.power(float(max_wavelength), exponents)
    if positions is None:
        positions = ops.arange(ops.shape(x)[1], dtype="float32") + ops.cast(start, "float32")
        positions = positions[None, :]  # (1, T)
    positions = ops.cast(positions, "float32") / float(scaling_factor)
    angles = ops.einsum("bt,i->bti", positions, inverse_frequency)
    angles = ops.concatenate([angles, angles], axis=-1)[:, :, None, :]  # (B or 1, T, 1, H)
    cos = ops.cast(ops.cos(angles), x.dtype)
    sin = ops.cast(ops.sin(angles), x.dtype)
    first, second = ops.split(x, 2, axis=-1)
    rotated = ops.concatenate([ops.negative(second), first], axis=-1)
    return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin))


def segment_positions(segment_ids):
    """Each token's position within its document: `(B, T)` int32, restarting at 0
    wherever the id changes from the previous token's.

    Args:
        segment_ids: `(B, T)` integer document ids of packed rows.
    """
    ids = ops.convert_to_tensor(segment_ids)
    steps = ops.arange(ops.shape(ids)[1], dtype="int32")[None, :]
    changed = ops.not_equal(ids[:, 1:], ids[:, :-1])
    starts_here = ops.concatenate([ops.ones_like(ids[:, :1], "bool"), changed], axis=1)
    # The start of each token's document: the last start at or before it, a running
    # maximum taken in log2(T) doubling steps (shapes stay fixed, T may be unknown).
    starts = ops.where(starts_here, steps, ops.zeros_like(steps))
    length = ids.shape[1]
    shift = 1
    while shift < (length if isinstance(length, int) else 2**30):
        before = ops.where(steps >= shift, ops.roll(starts, shift, axis=1), 0)
        starts = ops.maximum(starts, before)
        shift *= 2
    return ops.cast(steps - starts, "int32")
