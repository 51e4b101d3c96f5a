"""KV-cache for decoding: one tensor holding the projected keys and values.

Layout, that of keras-hub's `CachedMultiHeadAttention`:

    cache[:, 0] = keys     (B, max_length, num_key_value_heads, key_dim)
    cache[:, 1] = values   (B, max_length, num_key_value_heads, key_dim)

so the whole cache is `(B, 2, max_length, num_key_value_heads, key_dim)`, which is why
it needs `value_dim == key_dim`. Updates are `ops.slice_update` at a position that may
be a Python int or a scalar integer tensor: no Python control flow on tensor values,
so decoding loops trace under `jax.jit`, `tf.function(jit_compile=True)` and torch.
"""

from keras import ops

from keras_mha import checks


def init(batch_size, max_length, num_key_value_heads, key_dim, dtype):
    """An all-zeros cache `(batch_size, 2, max_length, num_key_value_heads, key_dim)`."""
    batch_size = checks.positive_int("batch_size", batch_size)
    max_length = checks.positive_int("max_length", max_length)
    return ops.zeros((batch_size, 2, max_length, num_key_value_heads, key_dim), dtype=dtype)


def check_layout(value_dim, key_dim):
    """A cache stores keys and values in one tensor: their head sizes must agree."""
    if value_dim != key_dim:
        raise checks.invalid(
            "value_dim",
            f"value_dim == key_dim ({key_dim}) to use a KV cache, whose keys and values "
            "share one (B, 2, max_length, num_key_value_heads, key_dim) tensor",
            value_dim,
        )


def validate(cache, *, query_shape, num_key_value_heads, key_dim, index_given, name="cache"):
    """Checks the cache (or keys and values in its layout, the argument `name`) and
    the query it is used with; raises `ValueError`.

    Args:
        cache: the cache tensor, expected `(B, 2, max_length, num_key_value_heads,
            key_dim)`.
        query_shape: the query's shape, expected `(B, T, dim)`.
        index_given: whether `cache_update_index` was passed, in which case the `T`
            new positions must fit in the cache.
    """
    shape = tuple(cache.shape)
    expected = f"(batch, 2, max_length, {num_key_value_heads}, {key_dim})"
    if len(shape) != 5:
        raise checks.invalid(name, f"a rank-5 tensor of shape {expected}", f"shape {shape}")
    if any(
        checks.dims_differ(have, want)
        for have, want in zip(shape[3:], (num_key_value_heads, key_dim))
    ) or checks.dims_differ(shape[1], 2):
        raise checks.invalid(name, f"a tensor of shape {expected}", f"shape {shape}")
    if len(query_shape) != 3:
        raise checks.invalid(
            "query",
            "a rank-3 (B, T, dim) tensor when a cache is given",
            f"shape {tuple(query_shape)}",
        )
    batch = query_shape[0]
    if checks.dims_differ(batch, shape[0]):
        raise checks.invalid(
            name,
            f"the query's batch size ({batch}) as its first dimension",
            f"shape {shape}",
        )
    length, max_length = query_shape[1], shape[2]
    known = checks.is_known(length) and checks.is_known(max_length)
    if index_given and known and length > max_length:
        raise checks.invalid(
            name,
            f"room for the query's {length} new positions",
            f"shape {shape}",
        )


def as_index(index):
    """`cache_update_index` as a Python int or an int32 scalar tensor."""
    if isinstance(index, bool):
        raise checks.invalid("cache_update_index", "an integer or a scalar integer tensor", index)
    if isinstance(index, int):
        if index < 0:
            raise checks.invalid("cache_update_index", "a non-negative integer", index)
        return index
    shape = tuple(getattr(index, "shape", (None,)))
    dtype = str(getattr(index, "dtype", type(index).__name__))
    if shape != () or "int" not in dtype:
        raise checks.invalid(
            "cache_update_index",
            "an integer or a scalar integer tensor",
            f"{type(index).__name__} of shape {shape} and dtype {dtype}",
        )
    return ops.cast(index, "int32")


def update(cache, key, value, index, update_mask=None):
    """Writes `key`, `value` `(B, T, Nkv, H)` at positions `index ... index + T - 1`.

    With `update_mask` (`(B, T)`, true: write), a position whose flag is false keeps
    what the cache holds there (Gemma 3's `cache_update_mask`).

    Returns the updated cache; the input tensor is not modified.
    """
    update = ops.stack([key, value], axis=1)
    update = ops.cast(update, cache.dtype)
    if isinstance(index, int):
        start = [0, 0, index, 0, 0]
    else:  # One int32 vector: every backend's dynamic update takes it, traced or not.
        start = ops.convert_to_tensor([0, 0, 1, 0, 0], dtype="int32") * index
    if update_mask is not None:
        current = ops.slice(cache, start, ops.shape(update))
        write = ops.cast(update_mask, "bool")[:, None, :, None, None]
        update = ops.where(write, update, current)
    return ops.slice_update(cache, start, update)


def split(cache):
    """`(keys, values)`, each `(B, max_length, Nkv, H)`."""
    return cache[:, 0, ...], cache[:, 1, ...]
