"""Rotary position embedding (RoPE) of projected queries and keys.

The rotate-half convention of `keras_hub.layers.RotaryEmbedding(max_wavelength,
scaling_factor)` applied to `(B, T, N, H)`, so attention written for keras-hub
checkpoints (Llama, Mistral, Gemma) carries over:

    inverse_frequency[i] = max_wavelength ** (-2i / H)            i < H / 2
    angle[t, i]          = (start + t) / scaling_factor * inverse_frequency[i]
    rotate(x)[t]         = x[t] * cos([angle, angle]) + [-x2, x1][t] * sin([angle, angle])

with `x1, x2` the two halves of the head dimension.
"""

from keras import ops


def rotate(x, start, max_wavelength, scaling_factor=1.0):
    """RoPE of `x` `(B, T, N, H)` at positions `start ... start + T - 1`.

    Args:
        x: projected queries or keys; `H` even.
        start: position of `x[:, 0]`: a Python int or an integer scalar tensor.
        max_wavelength: the longest wavelength of the rotations.
        scaling_factor: positions are divided by it (position interpolation).

    Returns:
        A tensor like `x`.
    """
    x = ops.convert_to_tensor(x)
    head_dim = x.shape[-1]
    exponents = ops.arange(0, head_dim, 2, dtype="float32") / float(head_dim)
    inverse_frequency = 1.0 / ops.power(float(max_wavelength), exponents)
    positions = ops.arange(ops.shape(x)[1], dtype="float32") + ops.cast(start, "float32")
    angles = ops.einsum("t,i->ti", positions / float(scaling_factor), inverse_frequency)
    angles = ops.concatenate([angles, angles], axis=-1)[None, :, None, :]  # (1, T, 1, H)
    cos = ops.cast(ops.cos(angles), x.dtype)
    sin = ops.cast(ops.sin(angles), x.dtype)
    first, second = ops.split(x, 2, axis=-1)
    rotated = ops.concatenate([ops.negative(second), first], axis=-1)
    return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin))
