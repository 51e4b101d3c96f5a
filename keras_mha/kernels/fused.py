"""The backend's fused kernel (`keras.ops.dot_product_attention`; torch's
`scaled_dot_product_attention` directly).

It takes what `policy.fusable` lets through: no mask, causality alone (`is_causal`),
key padding or the user's dense mask (broadcast as they are), or a bias. Padded
queries, and rows left with no key, are zeroed after the kernel, which never sees an
all-masked row (some kernels turn one into NaN).
"""

from keras import backend, ops

from keras_mha import masks as masks_lib
from keras_mha.kernels import policy


def attention(query, key, value, *, scale, mask=None, bias=None, flash=None):
    """Returns the output `(B, T, N, Hv)`.

    Args:
        query: `(B, T, N, H)`; key: `(B, S, N, H)`; value: `(B, S, N, Hv)`.
        mask: an `AttentionMask` that `policy.fusable` accepted, or `None`.
        bias: float, broadcastable to `(B, N, T, S)`, or `None`.
        flash: the layer's `flash_attention` (`None` lets the backend decide).
    """
    kernel_mask, valid, is_causal = _kernel_mask(mask)
    dtype = query.dtype
    if backend.standardize_dtype(dtype) == "float16" and not policy.current().fused_float16:
        query, key, value = (ops.cast(x, "float32") for x in (query, key, value))
    if backend.backend() == "torch" and not flash:
        output = _torch_attention(
            query, key, value, mask=kernel_mask, bias=bias, scale=scale, is_causal=is_causal
        )
    else:
        output = ops.dot_product_attention(
            query,
            key,
            value,
            bias=bias,
            mask=kernel_mask,
            scale=scale,
            is_causal=is_causal,
            flash_attention=flash,
        )
    output = ops.cast(output, dtype)
    if valid is not None:
        output = ops.where(ops.transpose(valid, (0, 2, 1, 3)), output, 0.0)
    return output


def _kernel_mask(mask):
    """`(kernel_mask, valid_rows, is_causal)` for the kernel.

    `valid_rows` `(B or 1, N or 1, T or 1, 1)` marks queries that attend to
    something; the others are unmasked in `kernel_mask` and zeroed after.
    """
    if mask is None:
        return None, None, False
    keys = None
    if mask.key_valid is not None:
        keys = mask.key_valid[:, None, None, :]
    kernel_mask = masks_lib.logical_and(keys, mask.dense)
    valid = None
    if kernel_mask is not None:
        valid = ops.any(kernel_mask, axis=-1, keepdims=True)
        kernel_mask = ops.logical_or(kernel_mask, ops.logical_not(valid))
    if mask.query_valid is not None:
        valid = masks_lib.logical_and(valid, mask.query_valid[:, None, :, None])
    return kernel_mask, valid, mask.causal


def _torch_attention(query, key, value, *, mask, bias, scale, is_causal):
    """torch's `scaled_dot_product_attention` on heads-first views of `(B, T, N, H)`.

    What Keras's torch `dot_product_attention` runs, minus its copies: it makes the
    transposed query, key and value contiguous (and the output projection then
    copies the transposed result back), while torch's kernels take strided views.
    """
    import torch

    dtype = backend.result_type(query.dtype, key.dtype, value.dtype)
    query, key, value = (ops.cast(x, dtype).transpose(1, 2) for x in (query, key, value))
    attn_mask = mask if bias is None else ops.cast(bias, dtype)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale
    )
    return output.transpose(1, 2)
