"""Head-parallel sharding of `MultiHeadAttention` on `keras.distribution` (JAX).

Attention parallelises over heads with no communication until the output
projection (Megatron-style tensor parallelism): each device along `model_axis`
holds a slice of the heads of every projection,

    query/key/value/gate kernel  (dim, N, H)  -> (None, model, None)
    query/key/value/gate bias    (N, H)       -> (model, None)
    output kernel                (N, Hv, out) -> (model, None, None)
    output bias                  (out,)       -> replicated
    query_norm/key_norm scale    (H,)         -> replicated
    sinks/sinks                  (N,)         -> (model,)

computes its heads' attention locally, and the output projection's contraction over
heads ends in one all-reduce, which GSPMD inserts. The patterns match the variable
paths of this layer and of `keras.layers.MultiHeadAttention` /
`keras.layers.GroupQueryAttention` (same sublayer names), at any nesting depth.

`keras.distribution` shards variables on the JAX backend only; the guide's "Scaling
out" page shows what tensorflow and torch do with it, and their own engines
(`tf.distribute.MirroredStrategy`, torch `DistributedDataParallel`) training the layer.
"""

from keras import distribution as keras_distribution

from keras_mha import checks

# A sublayer name at any depth: "query/kernel", "model/block_0/mha/query/kernel", ...
_ANY_PARENT = "(?:.*/)?"


def layout_map(device_mesh, model_axis="model", *, num_heads=None, num_key_value_heads=None):
    """A `keras.distribution.LayoutMap` sharding attention weights by heads.

    Use it with `keras.distribution.ModelParallel(layout_map=..., batch_dim_name=...)`.
    It is an ordinary `LayoutMap`: add entries for the rest of the model with
    `layout_map["regex"] = (axis names...)`. Keys are regexes matched in full against
    `variable.path`; a path must match at most one key.

    Args:
        device_mesh: A `keras.distribution.DeviceMesh`, e.g. shape `(2, 4)` with axis
            names `("batch", "model")`.
        model_axis: Name of the mesh axis the heads are split over.
        num_heads: Optional number of query heads `N` of the attention layers. When
            given, it must be divisible by the size of `model_axis`, or a `ValueError`
            says so here (without it, JAX rejects the uneven split when the
            variables are created).
        num_key_value_heads: Optional number `Nkv` of key/value heads (grouped-query
            attention); `None` means `num_heads`. Key and value kernels and biases
            are sharded when `Nkv` is divisible by the size of `model_axis`, and
            replicated on every device otherwise (each device then computes all
            `Nkv` key/value heads and uses the ones its query heads need).

    Returns:
        A `keras.distribution.LayoutMap` over `device_mesh`.
    """
    if not isinstance(device_mesh, keras_distribution.DeviceMesh):
        raise checks.invalid("device_mesh", "a `keras.distribution.DeviceMesh`", device_mesh)
    axis_names = tuple(device_mesh.axis_names)
    if model_axis not in axis_names:
        raise checks.invalid("model_axis", f"one of the mesh's axis names {axis_names}", model_axis)
    shards = device_mesh.shape[axis_names.index(model_axis)]
    num_heads = checks.positive_int("num_heads", num_heads, allow_none=True)
    num_key_value_heads = checks.positive_int(
        "num_key_value_heads", num_key_value_heads, allow_none=True
    )
    if num_heads is not None and num_heads % shards:
        raise checks.invalid(
            "num_heads",
            f"a multiple of the size {shards} of mesh axis {model_axis!r}",
            num_heads,
            "Pick a mesh whose model axis divides the number of heads.",
        )
    kv_heads = num_key_value_heads or num_heads
    shard_key_value = kv_heads is None or kv_heads % shards == 0

    heads = (None, model_axis, None)
    heads_bias = (model_axis, None)
    replicated_kernel = (None, None, None)
    replicated_bias = (None, None)
    layouts = keras_distribution.LayoutMap(device_mesh)
    for name in ("query", "gate"):
        layouts[f"{_ANY_PARENT}{name}/kernel"] = heads
        layouts[f"{_ANY_PARENT}{name}/bias"] = heads_bias
    for name in ("key", "value"):
        layouts[f"{_ANY_PARENT}{name}/kernel"] = heads if shard_key_value else replicated_kernel
        layouts[f"{_ANY_PARENT}{name}/bias"] = heads_bias if shard_key_value else replicated_bias
    # Trailing dimensions left out of a layout are replicated, so these two also fit
    # a tuple `output_shape`: kernel (N, Hv, *out), bias (*out,).
    layouts[f"{_ANY_PARENT}attention_output/kernel"] = (model_axis,)
    layouts[f"{_ANY_PARENT}attention_output/bias"] = ()
    for name in ("query_norm", "key_norm"):
        layouts[f"{_ANY_PARENT}{name}/scale"] = (None,)
    layouts[f"{_ANY_PARENT}sinks/sinks"] = (model_axis,)  # one per query head
    return layouts
