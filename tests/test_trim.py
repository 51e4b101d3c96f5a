"""Padded tails cut off before a kernel runs (`kernels/trim.py`): where a call is cut,
which mask factors go, and that a cut call gives every kernel's uncut results, forward
and backward, against the float64 reference."""

import numpy as np
import pytest
from helpers import BACKEND, leaf, to_numpy
from keras import ops
from reference import reference_attention

from keras_mha import equations, kernels, masks
from keras_mha.kernels import fused, trim

N, H = 2, 4
EQUATIONS = equations.attention_equations(4, (1,))[:2] + (1,)


def _valid(lengths, length):
    """`(B, length)` right padding: row `b` keeps its first `lengths[b]` positions."""
    return np.arange(length)[None, :] < np.asarray(lengths)[:, None]


def _inputs(rng, batch, t, s):
    shapes = ((batch, t, N, H), (batch, s, N, H), (batch, s, N, H))
    return [rng.standard_normal(shape).astype("float32") for shape in shapes]


def _cut(mask, batch, t, s, dropout=False):
    q, k, _ = (ops.convert_to_tensor(x) for x in _inputs(np.random.default_rng(0), batch, t, s))
    return trim.cut(q, k, mask, dropout=dropout)


# (name, mask, (B, T, S), expected (queries, keys, query padding kept, key padding kept))
CUTS = [
    (
        "one row, padded + causal: a plain causal call",
        masks.AttentionMask(query_valid=_valid([9], 12), key_valid=_valid([9], 12), causal=True),
        (1, 12, 12),
        (9, 9, False, False),
    ),
    (
        "two rows: cut to the longer, the shorter's padding kept",
        masks.AttentionMask(query_valid=_valid([9, 6], 12), key_valid=_valid([9, 6], 12)),
        (2, 12, 12),
        (9, 9, True, True),
    ),
    (
        "rows of two lengths, padded + causal: causality hides the key padding",
        masks.AttentionMask(
            query_valid=_valid([9, 6], 12), key_valid=_valid([9, 6], 12), causal=True
        ),
        (2, 12, 12),
        (9, 9, True, False),
    ),
    (
        "causal, keys padded alone: a padded query would see padded keys, kept",
        masks.AttentionMask(key_valid=_valid([9, 6], 12), causal=True),
        (2, 12, 12),
        (12, 9, False, True),
    ),
    (
        "cross-attention, keys padded only",
        masks.AttentionMask(key_valid=_valid([5, 3], 10)),
        (2, 7, 10),
        (7, 5, False, True),
    ),
    (
        "causal: keys after the last kept query are cut",
        masks.AttentionMask(query_valid=_valid([4, 4], 12), causal=True),
        (2, 12, 12),
        (4, 4, False, False),
    ),
    (
        "a window bounds the keys too",
        masks.AttentionMask(query_valid=_valid([4], 12), window=3),
        (1, 12, 12),
        (4, 6, False, False),
    ),
    (
        "an asymmetric window bounds the keys by its right side",
        masks.AttentionMask(query_valid=_valid([4], 12), window=(5, 3)),
        (1, 12, 12),
        (4, 7, False, False),
    ),
    (
        "packed rows: trailing id 0 is padding",
        masks.AttentionMask(
            query_segments=np.array([[1, 1, 2, 2, 2, 0, 0, 0]], "int32"),
            key_segments=np.array([[1, 1, 2, 2, 2, 0, 0, 0]], "int32"),
        ),
        (1, 8, 8),
        (5, 5, False, False),
    ),
    (
        "a broadcast (B, 1) key padding of True goes",
        masks.AttentionMask(query_valid=_valid([3], 6), key_valid=np.ones((1, 1), bool)),
        (1, 6, 6),
        (3, 6, False, False),
    ),
]


@pytest.mark.parametrize("mask, sizes, expected", [c[1:] for c in CUTS], ids=[c[0] for c in CUTS])
def test_where_a_call_is_cut(mask, sizes, expected):
    cut = _cut(mask, *sizes)
    queries, keys, query_padding, key_padding = expected
    assert (cut.queries, cut.keys) == (queries, keys)
    assert (cut.mask.query_valid is not None) == query_padding
    assert (cut.mask.key_valid is not None) == key_padding


def test_nothing_is_cut_where_nothing_can_be():
    full = masks.AttentionMask(query_valid=_valid([12, 5], 12), key_valid=_valid([12, 5], 12))
    assert _cut(full, 2, 12, 12) is None
    assert _cut(masks.AttentionMask(causal=True), 1, 12, 12) is None
    assert _cut(None, 1, 12, 12) is None
    # Attention dropout numbers its weights over the whole (T, S): never cut.
    padded = masks.AttentionMask(query_valid=_valid([4], 12), key_valid=_valid([4], 12))
    assert _cut(padded, 1, 12, 12, dropout=True) is None
    # A decoding offset given as a tensor: not cut.
    offset = ops.convert_to_tensor(np.int32(0))
    assert _cut(masks.AttentionMask(query_valid=_valid([4], 12), offset=offset), 1, 12, 12) is None
    # Left padding: causality hides no padded key, and nothing trails.
    left = np.arange(12)[None, :] >= np.array([[3]])
    assert (
        _cut(masks.AttentionMask(query_valid=left, key_valid=left, causal=True), 1, 12, 12) is None
    )
    # No query sees a key: left to the kernels' own empty rows.
    assert _cut(masks.AttentionMask(key_valid=_valid([0], 12)), 1, 12, 12) is None


def test_a_call_left_whole_costs_no_device_op(monkeypatch):
    """Where nothing is cut (a small model's padded batch, one row whole), the cut is
    found on the host: no mask is sliced on the device (a fixed cost per call)."""
    full = masks.AttentionMask(query_valid=_valid([12, 5], 12), key_valid=_valid([12, 5], 12))
    q, k, _ = (ops.convert_to_tensor(x) for x in _inputs(np.random.default_rng(0), 2, 12, 12))
    sliced = []
    original = masks.slice_along
    monkeypatch.setattr(masks, "slice_along", lambda *a: sliced.append(a) or original(*a))
    assert trim.cut(q, k, full, dropout=False) is None
    assert sliced == []
    assert trim.cut(q, k, masks.AttentionMask(query_valid=_valid([9, 5], 12)), dropout=False)
    assert sliced  # the check sees a cut's slices


@pytest.mark.skipif(BACKEND != "torch", reason="torch.jit.trace is torch's")
def test_a_torch_trace_is_never_cut():
    """`torch.jit.trace` (OpenVINO's export of a torch model) would keep a cut's sizes
    as constants: traced calls are not cut."""
    import torch

    mask, sizes, _ = CUTS[0][1:]
    assert _cut(mask, *sizes) is not None
    seen = []

    def traced(query, key):
        seen.append(trim.cut(query, key, mask, dropout=False))
        return query

    q, k, _ = _inputs(np.random.default_rng(0), *sizes)
    torch.jit.trace(traced, (torch.tensor(q), torch.tensor(k)))
    assert seen[0] is None  # the tracing call (the trace's check then runs it eagerly)


@pytest.mark.parametrize("case", [0, 2], ids=["one row", "rows of two lengths"])
def test_a_padded_causal_call_reaches_the_fused_kernel_whole(case):
    """The cut leaves causality alone (and the query padding, which only zeroes rows),
    which the fused kernel takes with `is_causal`."""
    mask, sizes, _ = CUTS[case][1:]
    cut = _cut(mask, *sizes)
    assert not fused._takes_whole(mask, None)
    assert fused._takes_whole(cut.mask, None)


def _dense(mask, t, s):
    block = to_numpy(mask.block(0, t, 0, s))[:, 0]
    return np.broadcast_to(block, (block.shape[0], t, s))


def _eager_value_and_grads(fn, arrays):
    """`fn(*tensors)` and the gradients of `sum(output * w)`, eagerly (where the masks
    hold data; JAX's autodiff traces, so there only the forward is cut, and only by
    overriding its row, which cuts nothing: `Policy.sizes_from_data`)."""
    weights = np.random.default_rng(7).standard_normal(
        (arrays[0].shape[0], arrays[0].shape[1], N, H)
    )
    weights = weights.astype("float32")
    if BACKEND == "tensorflow":
        import tensorflow as tf

        tensors = [tf.constant(a) for a in arrays]
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            out = fn(*tensors)
            loss = tf.reduce_sum(out * weights)
        return to_numpy(out), [to_numpy(g) for g in tape.gradient(loss, tensors)]
    if BACKEND == "torch":
        tensors = [leaf(a) for a in arrays]
        out = fn(*tensors)
        (out * ops.convert_to_tensor(weights)).sum().backward()
        return to_numpy(out), [to_numpy(t.grad) for t in tensors]
    import jax

    with kernels.policy.overriding(sizes_from_data=True):
        out = fn(*arrays)  # eager: cut
    grads = jax.jit(jax.grad(lambda *x: (fn(*x) * weights).sum(), argnums=(0, 1, 2)))(*arrays)
    return to_numpy(out), [to_numpy(g) for g in grads]


def _reference_value_and_grads(arrays, dense, bias=None):
    """The float64 reference's output and its gradients, by central differences."""
    weights = np.random.default_rng(7).standard_normal(arrays[0].shape[:2] + (N, H))

    def loss(q, k, v):
        return float((reference_attention(q, k, v, dense, bias=bias)[0] * weights).sum())

    out = reference_attention(*arrays, dense, bias=bias)[0]
    grads = []
    for i, a in enumerate(arrays):
        grad = np.zeros(a.shape)
        flat, step = a.astype(np.float64).reshape(-1), 1e-4
        for j in range(flat.size):
            hi, lo = flat.copy(), flat.copy()
            hi[j] += step
            lo[j] -= step
            args = [x.astype(np.float64) for x in arrays]
            args[i] = hi.reshape(a.shape)
            up = loss(*args)
            args[i] = lo.reshape(a.shape)
            grad.reshape(-1)[j] = (up - loss(*args)) / (2 * step)
        grads.append(grad)
    return out, grads


CALLS = {
    "one row, padded + causal": (
        masks.AttentionMask(query_valid=_valid([5], 7), key_valid=_valid([5], 7), causal=True),
        (1, 7, 7),
    ),
    "two rows, padded + causal": (
        masks.AttentionMask(
            query_valid=_valid([5, 3], 7), key_valid=_valid([5, 3], 7), causal=True
        ),
        (2, 7, 7),
    ),
    "two rows, padded + window": (
        masks.AttentionMask(query_valid=_valid([5, 3], 7), key_valid=_valid([5, 3], 7), window=2),
        (2, 7, 7),
    ),
    "cross-attention, padded keys": (masks.AttentionMask(key_valid=_valid([4, 2], 6)), (2, 5, 6)),
}


@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
@pytest.mark.parametrize("case", list(CALLS))
def test_a_cut_call_gives_the_uncut_results(rng, implementation, case):
    """Outputs and the query, key and value gradients equal the reference's on the
    whole call: the cut rows are zero, their gradients too."""
    mask, (batch, t, s) = CALLS[case]
    assert _cut(mask, batch, t, s) is not None
    arrays = _inputs(rng, batch, t, s)
    bias = rng.standard_normal((1, N, t, s)).astype("float32")

    def fn(q, k, v):
        out, _ = kernels.attention(
            q,
            k,
            v,
            scale=H**-0.5,
            equations=EQUATIONS,
            mask=mask,
            bias=ops.convert_to_tensor(bias),
            implementation=implementation,
            chunk_size=2,
        )
        return out

    out, grads = _eager_value_and_grads(fn, arrays)
    expected, expected_grads = _reference_value_and_grads(arrays, _dense(mask, t, s), bias)
    np.testing.assert_allclose(out, expected, atol=2e-5)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, atol=1e-3)
