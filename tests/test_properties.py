"""Property-based tests: the layer against the float64 NumPy reference (`reference.py`).

Hypothesis draws batch sizes, lengths, head counts, key/value dims, output shapes,
attention axes (rank-3 and rank-4 inputs), kernels, masks (with fully masked rows
and whole batches) and causal flags. The default budget keeps the file fast; set
`KERAS_MHA_HYPOTHESIS_PROFILE=thorough` for a larger one.
"""

import math
import os

import keras
import numpy as np
from helpers import call, output_and_gradients
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from keras import ops
from reference import reference_mha

from keras_mha import MultiHeadAttention

settings.register_profile(
    "keras_mha_default",
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = settings.get_profile(os.environ.get("KERAS_MHA_HYPOTHESIS_PROFILE", "keras_mha_default"))
RTOL, ATOL = 1e-4, 2e-5


# ------------------------------------------------- layouts (to scramble masked keys)
def _to_attention_layout(x, axes):
    """`(B, X1..Xk, N, H)` -> `(B, F, N, prod(attention dims), H)`, F the free dims."""
    k = x.ndim - 3
    free = [a for a in range(1, k + 1) if a not in axes]
    moved = np.transpose(x, [0, *free, k + 1, *axes, k + 2])
    batch, heads, size = x.shape[0], x.shape[k + 1], x.shape[-1]
    free_size = math.prod(x.shape[a] for a in free)
    return moved.reshape(batch, free_size, heads, -1, size)


def _from_attention_layout(y, shape, axes):
    """Inverse of `_to_attention_layout` for an output of shape `shape[:-1] + (Hv,)`."""
    k = len(shape) - 3
    free = [a for a in range(1, k + 1) if a not in axes]
    order = [0, *free, k + 1, *axes, k + 2]
    moved_shape = [shape[a] for a in order[:-1]] + [y.shape[-1]]
    return np.transpose(y.reshape(moved_shape), np.argsort(order))


# ------------------------------------------------------------------------ examples
@st.composite
def examples(draw, allow_causal=True):
    """One configuration plus a seed for its inputs, weights and masks."""
    rank = draw(st.sampled_from([3, 3, 4]))
    if rank == 3:
        query_dims = (draw(st.integers(1, 6)),)
        key_dims = (draw(st.integers(1, 6)),)
        axes_arg = draw(st.sampled_from([None, (1,), -2, (-2,)]))
        implementation = draw(st.sampled_from([None, "explicit", "fused", "chunked"]))
        causal = allow_causal and draw(st.booleans())
        padding_masks = draw(st.booleans())
    else:
        query_dims = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
        axes_arg = draw(st.sampled_from([None, (1,), (2,), (1, 2), (2, 1), -2, (-3, -2)]))
        axes = _normalized(axes_arg, 4)
        # Key dims may differ from the query's only along attention axes.
        key_dims = tuple(
            draw(st.integers(1, 3)) if a + 1 in axes else query_dims[a] for a in range(2)
        )
        implementation, causal, padding_masks = None, False, False
    return dict(
        rank=rank,
        batch=draw(st.integers(1, 3)),
        query_dims=query_dims,
        key_dims=key_dims,
        dims=(draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 5))),
        separate_key=draw(st.booleans()),
        num_heads=draw(st.integers(1, 3)),
        key_dim=draw(st.integers(1, 4)),
        value_dim=draw(st.sampled_from([None, 1, 3])),
        output_shape=draw(st.sampled_from([None, 2, (3,), (2, 2)])),
        use_bias=draw(st.booleans()),
        attention_axes=axes_arg,
        implementation=implementation,
        chunk_size=draw(st.sampled_from([1, 2, 512])),
        causal=causal,
        mask_kind=draw(st.sampled_from(["none", "random", "masked_row", "masked_batch"])),
        mask_dtype=draw(st.sampled_from(["bool", "int32", "float32"])),
        padding_masks=padding_masks,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _normalized(axes_arg, rank):
    if axes_arg is None:
        return tuple(range(1, rank - 1))
    axes = (axes_arg,) if isinstance(axes_arg, int) else axes_arg
    return tuple(a if a >= 0 else rank + a for a in axes)


_LAYERS = {}


def _layer(ex):
    """A built layer for the example's structure (cached), with fresh weights."""
    structure = (
        ex["rank"],
        ex["dims"],
        ex["num_heads"],
        ex["key_dim"],
        ex["value_dim"],
        ex["output_shape"],
        ex["use_bias"],
        ex["attention_axes"],
        ex["implementation"],
        ex["chunk_size"],
        ex["separate_key"],
    )
    if structure not in _LAYERS:
        if len(_LAYERS) > 32:
            _LAYERS.clear()
        layer = MultiHeadAttention(
            num_heads=ex["num_heads"],
            key_dim=ex["key_dim"],
            value_dim=ex["value_dim"],
            output_shape=ex["output_shape"],
            use_bias=ex["use_bias"],
            attention_axes=ex["attention_axes"],
            implementation=ex["implementation"],
            chunk_size=ex["chunk_size"],
            kernel_initializer="zeros",
        )
        pad = (None,) * (ex["rank"] - 1)
        dim_q, dim_v, dim_k = ex["dims"]
        dim_k = dim_k if ex["separate_key"] else dim_v
        layer.build(pad + (dim_q,), pad + (dim_v,), pad + (dim_k,))
        _LAYERS[structure] = layer
    layer = _LAYERS[structure]
    rng = np.random.default_rng(ex["seed"])
    layer.set_weights(
        [rng.normal(0.0, 0.6, w.shape).astype("float32") for w in layer.get_weights()]
    )
    return layer


def _inputs(ex):
    """Query/value/key arrays and masks: call kwargs plus the merged reference mask."""
    rng = np.random.default_rng(ex["seed"] + 1)
    b, axes = ex["batch"], _normalized(ex["attention_axes"], ex["rank"])
    dim_q, dim_v, dim_k = ex["dims"]
    query = rng.normal(size=(b, *ex["query_dims"], dim_q)).astype("float32")
    value = rng.normal(size=(b, *ex["key_dims"], dim_v)).astype("float32")
    key = rng.normal(size=(b, *ex["key_dims"], dim_k)).astype("float32")
    if not ex["separate_key"]:
        key = None
    free = [ex["query_dims"][a - 1] for a in range(1, ex["rank"] - 1) if a not in axes]
    q_att = [ex["query_dims"][a - 1] for a in axes]
    k_att = [ex["key_dims"][a - 1] for a in axes]
    kwargs = {}
    merged = None
    if ex["mask_kind"] != "none":
        merged = rng.random((b, *free, *q_att, *k_att)) < 0.7
        flat = merged.reshape(b, -1, math.prod(k_att))
        if ex["mask_kind"] == "masked_row":
            flat[rng.integers(b), rng.integers(flat.shape[1])] = False
        if ex["mask_kind"] == "masked_batch":
            flat[rng.integers(b)] = False
        kwargs["attention_mask"] = merged.astype(ex["mask_dtype"])
    if ex["padding_masks"]:
        t_len, s_len = ex["query_dims"][0], ex["key_dims"][0]
        pads = {
            "query_mask": rng.random((b, t_len)) < 0.8,
            "value_mask": rng.random((b, s_len)) < 0.8,
        }
        if key is not None:
            pads["key_mask"] = rng.random((b, s_len)) < 0.8
        pad_merged = pads["query_mask"][:, :, None] & pads["value_mask"][:, None, :]
        if "key_mask" in pads:
            pad_merged = pad_merged & pads["key_mask"][:, None, :]
        merged = pad_merged if merged is None else merged & pad_merged
        kwargs.update({k: v.astype(ex["mask_dtype"]) for k, v in pads.items()})
    if ex["causal"]:
        t_len, s_len = ex["query_dims"][0], ex["key_dims"][0]
        causal = np.arange(t_len)[:, None] >= np.arange(s_len)[None, :]
        merged = causal[None] if merged is None else merged & causal
        merged = np.broadcast_to(merged, (b, t_len, s_len))
        kwargs["use_causal_mask"] = True
    return query, value, key, kwargs, merged, axes


# --------------------------------------------------------------------------- tests
# Found by this test: on TensorFlow, Keras's `ops.add` added a `(N, 1)` bias along
# the sequence axis when T == N (see `projections.add_bias`).
_BIAS_ON_SEQUENCE_AXIS = dict(
    rank=3,
    batch=1,
    query_dims=(2,),
    key_dims=(2,),
    dims=(1, 1, 1),
    separate_key=False,
    num_heads=2,
    key_dim=1,
    value_dim=None,
    output_shape=None,
    use_bias=True,
    attention_axes=None,
    implementation=None,
    chunk_size=1,
    causal=False,
    mask_kind="none",
    mask_dtype="bool",
    padding_masks=False,
    seed=0,
)


@PROFILE
@given(examples())
@example(_BIAS_ON_SEQUENCE_AXIS)
def test_outputs_and_scores_match_float64_reference(ex):
    layer = _layer(ex)
    query, value, key, kwargs, merged, axes = _inputs(ex)
    expected, expected_scores = reference_mha(layer, query, value, key, mask=merged)
    output = call(layer, query, value, key=key, **kwargs)
    np.testing.assert_allclose(output, expected, rtol=RTOL, atol=ATOL)
    output, scores = call(layer, query, value, key=key, return_attention_scores=True, **kwargs)
    np.testing.assert_allclose(output, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(scores, expected_scores, rtol=RTOL, atol=ATOL)

    # Scores: non-negative, zero on masked keys, summing to 1 over the unmasked
    # keys of every row that has one and to 0 on fully masked rows.
    assert scores.shape == expected_scores.shape
    assert np.all(scores >= 0.0)
    num_key_axes = len(axes)
    key_axes = tuple(range(-num_key_axes, 0))
    sums = scores.sum(axis=key_axes)
    if merged is None:
        np.testing.assert_allclose(sums, 1.0, rtol=0, atol=1e-5)
        return
    allowed = _mask_like_scores(merged, scores.shape, ex["rank"], num_key_axes)
    assert np.all(scores[~allowed] == 0.0)
    has_keys = allowed.any(axis=key_axes)
    np.testing.assert_allclose(sums, np.where(has_keys, 1.0, 0.0), rtol=0, atol=1e-5)


def _mask_like_scores(merged, scores_shape, rank, num_key_axes):
    """The merged `(B, <free>, <q attn>, <k attn>)` mask with the heads axis inserted."""
    free = rank - 2 - num_key_axes
    expanded = np.expand_dims(merged, 1 + free)
    return np.broadcast_to(expanded, scores_shape)


@PROFILE
@given(examples())
def test_outputs_ignore_the_values_of_masked_keys(ex):
    layer = _layer(ex)
    query, value, key, kwargs, merged, axes = _inputs(ex)
    before = call(layer, query, value, key=key, **kwargs)
    if merged is None:
        return
    rng = np.random.default_rng(ex["seed"] + 2)
    # Key positions (per batch and free position) that no query may attend to.
    k_att = [ex["key_dims"][a - 1] for a in axes]
    flat = np.broadcast_to(merged, merged.shape).reshape(
        merged.shape[0], -1, math.prod(merged.shape[-2 * len(axes) : -len(axes)]), math.prod(k_att)
    )
    unused = ~flat.any(axis=2)  # (B, F, S)

    def scramble(x):
        with_heads = x[..., None, :]  # (B, ..., 1, dim), the layout helpers' shape
        layout = _to_attention_layout(with_heads, axes)  # (B, F, 1, S, dim)
        noise = rng.normal(10.0, 50.0, layout.shape).astype(x.dtype)
        layout = np.where(unused[:, :, None, :, None], noise, layout)
        return _from_attention_layout(layout, with_heads.shape, axes)[..., 0, :]

    after = call(
        layer, query, scramble(value), key=None if key is None else scramble(key), **kwargs
    )
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


@PROFILE
@given(examples(allow_causal=False))
def test_permuting_keys_and_values_together_changes_nothing(ex):
    layer = _layer(ex)
    query, value, key, kwargs, merged, axes = _inputs(ex)
    before = call(layer, query, value, key=key, **kwargs)
    k_att = [ex["key_dims"][a - 1] for a in axes]
    permutation = np.random.default_rng(ex["seed"] + 3).permutation(math.prod(k_att))

    def permute_keys(x, key_axes):
        """Permutes the flattened key attention positions, at `key_axes` of `x`."""
        others = [a for a in range(x.ndim) if a not in key_axes]
        moved = np.transpose(x, others + list(key_axes))
        flat = moved.reshape(moved.shape[: len(others)] + (-1,))[..., permutation]
        return np.transpose(flat.reshape(moved.shape), np.argsort(others + list(key_axes)))

    def permute_input(x):
        return permute_keys(x, axes)

    permuted = dict(kwargs)
    if "attention_mask" in kwargs:
        mask = kwargs["attention_mask"]
        permuted["attention_mask"] = permute_keys(
            mask, tuple(range(mask.ndim - len(axes), mask.ndim))
        )
    for name in ("value_mask", "key_mask"):
        if name in kwargs:
            permuted[name] = permute_keys(kwargs[name], (1,))
    after = call(
        layer,
        query,
        permute_input(value),
        key=None if key is None else permute_input(key),
        **permuted,
    )
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-5)


def test_reference_agrees_with_the_builtin_layer():
    """The reference itself, checked once against `keras.layers.MultiHeadAttention`."""
    rng = np.random.default_rng(0)
    query = rng.normal(size=(2, 3, 2, 4)).astype("float32")
    value = rng.normal(size=(2, 3, 5, 3)).astype("float32")
    builtin = keras.layers.MultiHeadAttention(
        num_heads=2, key_dim=3, value_dim=2, output_shape=(2, 2), attention_axes=(2,)
    )
    builtin(query, value)
    mask = rng.random((2, 3, 2, 5)) < 0.6
    output, scores = builtin(query, value, attention_mask=mask, return_attention_scores=True)
    expected, expected_scores = reference_mha(builtin, query, value, mask=mask)
    valid_rows = mask.any(-1)  # the built-in gives masked rows uniform weights
    score_rows = np.broadcast_to(valid_rows[:, :, None, :, None], expected_scores.shape)
    np.testing.assert_allclose(
        ops.convert_to_numpy(scores)[score_rows],
        expected_scores[score_rows],
        rtol=RTOL,
        atol=ATOL,
    )
    rows = np.broadcast_to(valid_rows[..., None, None], (2, 3, 2, 2, 2))
    np.testing.assert_allclose(
        ops.convert_to_numpy(output)[rows], expected[rows], rtol=RTOL, atol=ATOL
    )


# -------------------------------------------------------------------- packed rows
PACKED_DIM = 8


@settings(PROFILE, max_examples=min(PROFILE.max_examples, 5))
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    padding=st.integers(0, 3),
    implementation=st.sampled_from(["explicit", "fused", "chunked"]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_documents_get_their_own_row_outputs_and_gradients(
    lengths, padding, implementation, causal, seed
):
    """Random document lengths packed into one row (then padding, id 0): each
    document's outputs and input gradients are those it gets alone; the weights'
    gradients are the sum over the documents alone."""
    rng = np.random.default_rng(seed)
    keras.utils.set_random_seed(seed)
    layer = MultiHeadAttention(
        4,
        4,
        implementation=implementation,
        chunk_size=3,
        rope_max_wavelength=30.0,
        num_key_value_heads=2,
        normalize_qk=True,
    )
    total = sum(lengths) + padding
    layer.build((1, total, PACKED_DIM), (1, total, PACKED_DIM))
    x = rng.standard_normal((1, total, PACKED_DIM)).astype("float32")
    w = rng.standard_normal((1, total, PACKED_DIM)).astype("float32")
    w[:, sum(lengths) :] = 0.0
    ids = np.zeros((1, total), "int32")
    spans = np.cumsum([0] + lengths)
    for i, (start, end) in enumerate(zip(spans[:-1], spans[1:])):
        ids[0, start:end] = i + 1

    def run(inputs, weights, **kwargs):
        loss = lambda y: ops.sum(y * ops.convert_to_tensor(weights))  # noqa: E731
        out, _, grads, weight_grads = output_and_gradients(
            layer, {"query": inputs, "value": inputs}, loss, use_causal_mask=causal, **kwargs
        )
        return out, grads["query"] + grads["value"], weight_grads

    packed, packed_grads, packed_weight_grads = run(x, w, segment_ids=ids)
    summed = [np.zeros_like(g) for g in packed_weight_grads]
    for start, end in zip(spans[:-1], spans[1:]):
        alone, grads, weight_grads = run(x[:, start:end], w[:, start:end])
        np.testing.assert_allclose(packed[:, start:end], alone, rtol=RTOL, atol=3e-5)
        np.testing.assert_allclose(packed_grads[:, start:end], grads, rtol=RTOL, atol=3e-5)
        summed = [a + b for a, b in zip(summed, weight_grads)]
    for got, want in zip(packed_weight_grads, summed):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-4)
