"""Every kernel against the explicit one, forward and backward, with every mask kind
and every logit feature; the dropout hash; the chunked kernel's key ranges."""

import dataclasses
import threading

import keras
import numpy as np
import pytest
from helpers import BACKEND, fingerprint, to_numpy, value_and_grads
from keras import ops
from reference import reference_attention

from keras_mha import block_mask, equations, kernels, masks
from keras_mha.kernels import chunked, explicit, fused, logits

B, T, N, H = 2, 13, 3, 4
ATOL = 3e-5
EQUATIONS = equations.attention_equations(4, (1,))[:2] + (1,)


# ------------------------------------------------------------------------ fixtures
def _padding(length, cut, rng=None):
    """`(B, length)`: batch 0 keeps its first `cut` positions, batch 1 all but one."""
    valid = np.ones((B, length), bool)
    valid[0, cut:] = False
    valid[1, length // 2] = False
    return valid


MASKS = {
    "none": lambda t, s: None,
    "causal": lambda t, s: masks.AttentionMask(causal=True),
    "keys": lambda t, s: masks.AttentionMask(key_valid=_padding(s, 7)),
    "queries": lambda t, s: masks.AttentionMask(query_valid=_padding(t, 9)),
    "causal+padding": lambda t, s: masks.AttentionMask(
        causal=True, key_valid=_padding(s, 7), query_valid=_padding(t, 9)
    ),
    "window": lambda t, s: masks.AttentionMask(window=3),
    "causal+window": lambda t, s: masks.AttentionMask(causal=True, window=4),
    "offset": lambda t, s: masks.AttentionMask(causal=True, offset=s - t, window=5),
    # Asymmetric windows (left, right), with padding and a decoding offset.
    "window-pair": lambda t, s: masks.AttentionMask(window=(2, 1)),
    "window-pair+offset+padding": lambda t, s: masks.AttentionMask(
        window=(4, 2), offset=s - t, key_valid=_padding(s, 8), query_valid=_padding(t, 9)
    ),
    "dense": lambda t, s: masks.AttentionMask(dense=_dense(t, s, heads=1)),
    "dense-heads+causal": lambda t, s: masks.AttentionMask(
        dense=_dense(t, s, heads=N), causal=True, key_valid=_padding(s, 8)
    ),
    # Batch 0 has no key at all; batch 1's padding leaves every row a key.
    "no-keys": lambda t, s: masks.AttentionMask(key_valid=np.arange(B)[:, None] * np.ones(s) > 0),
    # Packed rows: document ids per position, 0 = padding.
    "segments": lambda t, s: masks.AttentionMask(
        query_segments=_segment_ids(t), key_segments=_segment_ids(s)
    ),
    "segments+causal+window+padding": lambda t, s: masks.AttentionMask(
        causal=True,
        window=5,
        key_valid=_padding(s, 11),
        query_valid=_padding(t, 10),
        query_segments=_segment_ids(t),
        key_segments=_segment_ids(s),
    ),
}


def _segment_ids(length):
    """`(B, length)` int32 document ids: batch 0 documents of 4, 5 and the rest (ids 1,
    2, 3); batch 1 ids 7 (6 positions), 2 (4), then padding (0)."""
    ids = np.zeros((B, length), "int32")
    ids[0, :4], ids[0, 4:9], ids[0, 9:] = 1, 2, 3
    ids[1, :6], ids[1, 6:10] = 7, 2
    return ids


def _block_diagonal(t, s):
    """The dense `(B, 1, t, s)` mask `_segment_ids` describes."""
    rows, cols = _segment_ids(t)[:, :, None], _segment_ids(s)[:, None, :]
    return ((rows == cols) & (rows != 0))[:, None]


def _dense(t, s, heads):
    """A random dense mask with one all-False row per batch."""
    mask = np.random.default_rng(1).random((B, heads, t, s)) > 0.3
    mask[:, :, 2, :] = False
    return mask


def _inputs(rng, t=T, s=T, hv=H):
    q = rng.standard_normal((B, t, N, H)).astype("float32")
    k = rng.standard_normal((B, s, N, H)).astype("float32")
    v = rng.standard_normal((B, s, N, hv)).astype("float32")
    return q, k, v


def folding():
    """Key padding folded into a head channel and not taken whole, as on JAX's GPU
    (there in half precision)."""
    return kernels.policy.overriding(fold_key_padding=("float32",), fused_key_padding=False)


def _map_arrays(mask, fn):
    """`mask` with `fn` applied to each of its NumPy arrays; `None` stays `None`."""
    if mask is None:
        return None
    fields = {
        f.name: fn(getattr(mask, f.name))
        for f in dataclasses.fields(mask)
        if isinstance(getattr(mask, f.name), np.ndarray)
    }
    return dataclasses.replace(mask, **fields)


def _tensorize(mask):
    return _map_arrays(mask, ops.convert_to_tensor)


def _run(kernel, mask, extras=None, **options):
    """`fn(q, k, v, *extras)` running `kernel` with `options`."""
    extras = extras or ()

    options = dict(options)
    # The static loop's chunks by blocks of 4 keys unless told: several per chunk,
    # the last one moved back where S is no multiple of 4.
    key_block = options.pop("key_block", 4)
    forward_chunk_size = options.pop("forward_chunk_size", None)  # the chunked kernel's

    def fn(q, k, v, *rest):
        named = dict(zip(extras, rest))
        scale = options.pop("scale", H**-0.5)
        kwargs = dict(scale=scale, mask=_tensorize(mask), **options, **named)
        if kernel == "explicit":
            out, _ = explicit.attention(q, k, v, equations=EQUATIONS, **kwargs)
            return out
        if kernel == "fused":
            return fused.attention(q, k, v, chunk_size=4, **kwargs)
        if kernel == "folded":  # key padding as a head channel (JAX's GPU row)
            with folding():
                return fused.attention(q, k, v, chunk_size=4, **kwargs)
        loop, dynamic = kernel in ("looped", "dynamic", "widened"), kernel in ("dynamic", "widened")
        if kernel == "widened":  # key ranges out to multiples of 3 keys: extra keys masked
            kwargs["key_multiple"] = 3
        return chunked.attention(
            q,
            k,
            v,
            chunk_size=4,
            forward_chunk_size=forward_chunk_size,
            key_block=key_block,
            loop=loop,
            dynamic=dynamic,
            in_place_sums=kernel == "in-place",
            **kwargs,
        )

    return fn


# The explicit kernel's outputs and gradients, by their inputs: the kernels compared
# with it on the same inputs (within a test and across tests) share one run of it.
_EXPLICIT = {}


def _explicit(mask, arrays, extras=None, **options):
    key = fingerprint((mask, tuple(arrays), extras, options))
    if key not in _EXPLICIT:
        _EXPLICIT[key] = value_and_grads(_run("explicit", mask, extras, **options), arrays)
    return _EXPLICIT[key]


def _assert_same(kernel, mask, arrays, extras=None, **options):
    expected, expected_grads = _explicit(mask, arrays, extras, **options)
    out, grads = value_and_grads(_run(kernel, mask, extras, **options), arrays)
    np.testing.assert_allclose(out, expected, atol=ATOL)
    assert np.isfinite(out).all()
    for got, want in zip(grads, expected_grads):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=ATOL)


# --------------------------------------------------------------------------- tests
# Chunks unrolled (each sees its key range), in a loop (each sees every key), or in a
# dynamic loop (each sees its key range; not on JAX, whose shapes are static).
CHUNKED = ["chunked", "looped"] + (["dynamic"] if BACKEND != "jax" else [])


@pytest.mark.parametrize("kernel", CHUNKED)
@pytest.mark.parametrize("masking", list(MASKS))
@pytest.mark.parametrize("lengths", [(T, T), (T, T + 4), (9, T)])
def test_chunked_matches_explicit_forward_and_backward(rng, kernel, masking, lengths):
    t, s = lengths
    _assert_same(kernel, MASKS[masking](t, s), _inputs(rng, t, s))


@pytest.mark.parametrize("masking", list(MASKS))
def test_key_gradients_summed_in_one_buffer_change_nothing(rng, masking):
    """Unrolled chunks' key and value gradients added into one zeroed buffer at each
    chunk's keys (`Policy.in_place_sums`: in place on torch), against the explicit
    kernel: chunks whose key ranges start and end at different keys."""
    _assert_same("in-place", MASKS[masking](9, T + 4), _inputs(rng, 9, T + 4))


@pytest.mark.skipif(BACKEND == "jax", reason="a dynamic loop needs dynamic shapes; JAX has none")
@pytest.mark.parametrize("masking", [m for m in MASKS if m not in ("none", "dense")])
@pytest.mark.parametrize("lengths", [(T, T), (9, T + 4)])
def test_widened_key_ranges_change_nothing(rng, masking, lengths):
    """A dynamic loop's key ranges widened out to multiples of 3 keys (within `S`): the
    keys added, before and after the visible range, are masked."""
    t, s = lengths
    _assert_same("widened", MASKS[masking](t, s), _inputs(rng, t, s))


@pytest.mark.parametrize("kernel", CHUNKED)
@pytest.mark.parametrize(
    "masking",
    ["none", "causal+padding", "dense-heads+causal", "offset", "segments+causal+window+padding"],
)
def test_chunked_logit_features_match_explicit(rng, kernel, masking):
    q, k, v = _inputs(rng, T, T + 2)
    bias = rng.standard_normal((1, N, T, T + 2)).astype("float32")
    sinks = rng.standard_normal((N,)).astype("float32")
    mask = MASKS[masking](T, T + 2)
    _assert_same(kernel, mask, (q, k, v, bias, sinks), ("bias", "sinks"), soft_cap=2.0)


@pytest.mark.parametrize("kernel", CHUNKED)
@pytest.mark.parametrize(
    "masking",
    ["none", "keys", "offset", "no-keys", "causal+padding", "segments+causal+window+padding"],
)
def test_one_query_matches_explicit_forward_and_backward(rng, kernel, masking):
    """A decode step's single query: the chunked kernel takes its logits from the keys
    in rows (`keys @ query^T`), not from the keys-last layout of longer calls."""
    q, k, v = _inputs(rng, 1, T + 2)
    bias = rng.standard_normal((B, N, 1, T + 2)).astype("float32")
    sinks = rng.standard_normal((N,)).astype("float32")
    mask = MASKS[masking](1, T + 2)
    _assert_same(kernel, mask, (q, k, v))
    _assert_same(kernel, mask, (q, k, v, bias, sinks), ("bias", "sinks"), soft_cap=2.0)


@pytest.mark.parametrize("kernel", CHUNKED)
@pytest.mark.parametrize("shape", [(B, 1, 1, T), (1, 1, T, 1), (B, N, T, T)])
def test_bias_gradient_of_every_broadcast_shape(rng, kernel, shape):
    q, k, v = _inputs(rng)
    bias = rng.standard_normal(shape).astype("float32")
    _assert_same(kernel, MASKS["causal"](T, T), (q, k, v, bias), ("bias",))


_CHUNKED_OUTPUTS = {}


def _chunked_output(mask, arrays, **options):
    """The chunked kernel's output (forward and backward run), once per inputs."""
    key = fingerprint((mask, tuple(arrays), options))
    if key not in _CHUNKED_OUTPUTS:
        _CHUNKED_OUTPUTS[key] = value_and_grads(_run("chunked", mask, **options), arrays)[0]
    return _CHUNKED_OUTPUTS[key]


@pytest.mark.parametrize("kernel", CHUNKED)
def test_chunked_dropout_equals_explicit_dropout(rng, kernel):
    """The dropout mask is a hash of positions: chunking does not change it."""
    seed = ops.convert_to_tensor(np.array([3, 11]), "int32")
    mask = MASKS["causal+padding"](T, T)
    _assert_same(kernel, mask, _inputs(rng), dropout=0.4, seed=seed)
    packed = MASKS["segments+causal+window+padding"](T, T)
    _assert_same(kernel, packed, _inputs(rng), dropout=0.4, seed=seed)
    # Dropout acted, and another seed drops other weights (the chunked kernel's runs, the
    # same for every `kernel`: once per module).
    plain = _chunked_output(mask, _inputs(rng))
    first = _chunked_output(mask, _inputs(rng), dropout=0.4, seed=seed)
    other = ops.convert_to_tensor(np.array([4, 11]), "int32")
    second = _chunked_output(mask, _inputs(rng), dropout=0.4, seed=other)
    assert np.abs(first - plain).max() > 1e-2
    assert np.abs(first - second).max() > 1e-2


@pytest.mark.parametrize("kernel", CHUNKED)
@pytest.mark.parametrize("masking", ["none", "causal+padding", "segments+causal+window+padding"])
def test_forward_chunks_other_than_the_backwards_change_nothing(rng, kernel, masking):
    """`forward_chunk_size` (`Policy.chunk_bytes`): the forward's chunks of 3 rows,
    the backward's of 4, dropout and a bias included, give the explicit kernel's
    outputs and gradients."""
    seed = ops.convert_to_tensor(np.array([3, 11]), "int32")
    arrays = (*_inputs(rng), rng.standard_normal((1, N, T, T)).astype("float32"))
    options = dict(dropout=0.4, seed=seed, forward_chunk_size=3)
    _assert_same(kernel, MASKS[masking](T, T), arrays, ("bias",), **options)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_keep_rate_and_independence(rate):
    """The hash drops a fraction `rate` (within 5 binomial sigmas), independently of
    the row and of the column, and differently for another seed."""
    seed = ops.convert_to_tensor(np.array([12345, 678]), "int32")
    rows = logits.row_ids(4, 8, 64, 0, 64)  # (4, 8, 64, 1)
    cols = ops.arange(256, dtype="int32")[None, None, None, :]
    keep = to_numpy(logits.dropout_keep(seed, rows, cols, rate))
    n = keep.size
    sigma = np.sqrt(n * rate * (1 - rate))
    assert abs((~keep).sum() - n * rate) < 5 * sigma
    # Per-row and per-column drop fractions scatter like independent draws.
    for axis, count in ((-1, 256), ((0, 1, 2), 4 * 8 * 64)):
        fractions = 1.0 - keep.mean(axis=axis)
        spread = np.sqrt(rate * (1 - rate) / count)
        assert abs(fractions.std() - spread) < 0.25 * spread
    # Neighbouring positions are not correlated.
    flat = keep.reshape(-1, 256).astype(float)
    corr = np.corrcoef(flat[:, :-1].ravel(), flat[:, 1:].ravel())[0, 1]
    assert abs(corr) < 0.02
    other = ops.convert_to_tensor(np.array([12346, 678]), "int32")
    assert (to_numpy(logits.dropout_keep(other, rows, cols, rate)) != keep).mean() > 0.1


# "folded": key padding as one more head channel (JAX's GPU row), where the mask is
# padding and causality; the others go as "fused" (one of them checked).
FOLDED = ["keys", "causal+padding", "no-keys", "segments+causal+window+padding"]


@pytest.mark.parametrize(
    "kernel, masking", [("fused", m) for m in MASKS] + [("folded", m) for m in FOLDED]
)
@pytest.mark.parametrize("lengths", [(T, T), (T, T + 4)])
def test_fused_matches_explicit(rng, kernel, masking, lengths):
    """Masks the kernel cannot take whole are built one chunk of queries at a time."""
    t, s = lengths
    mask = MASKS[masking](t, s)
    assert kernels.policy.fusable(kernels.policy.Call(mask=mask))
    _assert_same(kernel, mask, _inputs(rng, t, s))


@pytest.mark.parametrize(
    "masking", ["keys", "causal+padding", "no-keys", "left-padded+causal", "queries+keys"]
)
# JAX's kernel takes no value heads of another size (`policy.fusable`).
@pytest.mark.parametrize("hv", [H] + ([3] if BACKEND != "jax" else []))
def test_folded_key_padding_is_one_whole_call_without_a_mask(rng, monkeypatch, masking, hv):
    """Key padding (with causality, query padding, rows left with no key) folded into
    the head channels: one kernel call over every query and key, `is_causal` where
    causal, no mask tensor, 8 channels; outputs and gradients as the explicit kernel's,
    value heads of another size too."""
    calls = []
    original = fused._Kernel.__call__

    def spy(self, query, key, value, mask, valid, is_causal, bias):
        calls.append((tuple(query.shape), tuple(key.shape), mask, is_causal, bias))
        return original(self, query, key, value, mask, valid, is_causal, bias)

    monkeypatch.setattr(fused._Kernel, "__call__", spy)
    left = np.ones((B, T), bool)
    left[0, :5] = False  # batch 0's first 5 keys padded: its causal rows 0-4 see none
    mask = {
        "left-padded+causal": masks.AttentionMask(causal=True, key_valid=left),
        "queries+keys": masks.AttentionMask(key_valid=left, query_valid=_padding(T, 9)),
    }.get(masking) or MASKS[masking](T, T)
    arrays = _inputs(rng, hv=hv)
    _assert_same("folded", mask, arrays)
    out, _ = value_and_grads(_run("folded", mask), arrays)
    assert out.shape == (B, T, N, hv)
    assert calls and all(c == calls[0] for c in calls)  # one call per run
    query_shape, key_shape, kernel_mask, is_causal, bias = calls[0]
    assert query_shape == (B, T, N, 8) and key_shape == (B, T, N, 8)
    assert kernel_mask is None and bias is None and is_causal == mask.causal
    if masking in ("no-keys", "left-padded+causal"):
        assert np.all(out[0, : 5 if mask.causal else T] == 0.0)


def test_key_padding_is_folded_only_in_the_policys_dtypes(rng, monkeypatch):
    """JAX's GPU row folds in half precision only: float32 calls go by chunks there."""
    calls = []
    original = fused._Kernel.__call__

    def spy(self, query, key, value, mask, *rest):
        calls.append(query.shape[-1])
        return original(self, query, key, value, mask, *rest)

    monkeypatch.setattr(fused._Kernel, "__call__", spy)
    mask = _tensorize(MASKS["causal+padding"](T, T))
    q, k, v = _inputs(rng)
    half = ("bfloat16", "float16")
    with kernels.policy.overriding(fold_key_padding=half, fused_key_padding=False):
        fused.attention(q, k, v, scale=0.5, mask=mask, chunk_size=4)
    assert len(calls) > 1 and set(calls) == {H}


def test_folded_key_padding_holds_with_large_logits(rng):
    """Logits up to +-50 (query and key norms of 10): a hidden key still gets no
    weight, a visible one its own."""
    q, k, v = (10 * x / np.linalg.norm(x, axis=-1, keepdims=True) for x in _inputs(rng))
    mask = MASKS["causal+padding"](T, T)
    dense = to_numpy(_tensorize(mask).block(0, T, 0, T))[:, 0]
    expected, _ = reference_attention(q, k, v, mask=dense)
    out, _ = value_and_grads(_run("folded", mask), (q, k, v))
    np.testing.assert_allclose(out, expected, atol=1e-4)


@pytest.mark.parametrize(
    "masking", ["none", "keys", "causal+padding", "dense-heads+causal", "segments"]
)
def test_fused_takes_a_bias(rng, masking):
    q, k, v = _inputs(rng)
    bias = rng.standard_normal((1, N, T, T)).astype("float32")
    _assert_same("fused", MASKS[masking](T, T), (q, k, v, bias), ("bias",))


@pytest.mark.parametrize("kernel", ["fused"] + CHUNKED)
def test_bias_row_with_no_key_has_the_explicit_kernels_gradients(rng, kernel):
    """An additive mask, a constant, with a row left with no key (keras-hub's T5Gemma:
    `(1 - mask) * -1e9` on a padded query): every kernel's gradients are the explicit
    kernel's. A logsumexp kept in float32 near -1e9 loses the row's `log(S)`, and its
    gradients come out wrong: torch's CPU flash kernel's (`fused._exact_backward`) and
    the chunked kernel's before `logits.no_key_offset`."""
    q, k, v = _inputs(rng)
    visible = np.ones((B, 1, T, T), bool)
    visible[1, :, 3:5, :] = False  # rows 3 and 4 of the second sequence: no key
    visible[0, :, :, T - 2 :] = False
    bias = np.where(visible, 0.0, -1e9).astype("float32")

    def run(kernel):
        return lambda *qkv: _run(kernel, None, ("bias",))(*qkv, ops.convert_to_tensor(bias))

    expected, expected_grads = value_and_grads(run("explicit"), (q, k, v))
    out, grads = value_and_grads(run(kernel), (q, k, v))
    np.testing.assert_allclose(out, expected, atol=ATOL)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, atol=ATOL)
    # The rows with no key reach the gradients: they are not zero there.
    assert np.abs(grads[0][1, 3:5]).max() > 1e-3


@pytest.mark.parametrize("kernel", ["explicit", "fused"] + CHUNKED)
@pytest.mark.parametrize("masking", ["segments", "segments+causal+window+padding"])
@pytest.mark.parametrize("lengths", [(9, T)])
def test_segments_match_the_reference_with_a_dense_block_diagonal_mask(
    rng, kernel, masking, lengths
):
    """Forward against the float64 reference given the dense block-diagonal mask;
    backward against the explicit kernel given that dense mask (no document ids)."""
    t, s = lengths
    mask = MASKS[masking](t, s)
    dense = dataclasses.replace(
        mask, query_segments=None, key_segments=None, dense=_block_diagonal(t, s)
    )
    arrays = _inputs(rng, t, s)
    out, grads = value_and_grads(_run(kernel, mask), arrays)
    dense_mask = to_numpy(_tensorize(dense).block(0, t, 0, s))
    expected, _ = reference_attention(*arrays, mask=dense_mask[:, 0])
    np.testing.assert_allclose(out, expected, atol=ATOL)
    _, expected_grads = _explicit(dense, arrays)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, atol=ATOL)
    # Across documents nothing flows: the key gradient of batch 0's first document
    # comes from its own queries only.
    assert np.abs(grads[1][0, :4]).max() > 0


def test_fused_builds_no_whole_mask_for_segments(rng, monkeypatch):
    """Document ids are built into a mask one chunk of queries at a time, and where
    they hold data (an eager call) each chunk takes only its documents' keys."""
    shapes = []
    original = fused._Kernel.__call__

    def spy(self, query, key, value, mask, *rest):
        shapes.append(tuple(mask.shape))
        return original(self, query, key, value, mask, *rest)

    monkeypatch.setattr(fused._Kernel, "__call__", spy)
    q, k, v = _inputs(rng)
    fused.attention(q, k, v, scale=1.0, mask=_tensorize(MASKS["segments"](T, T)), chunk_size=4)
    # Chunks from the last: query 12 (batch 0's document 3: keys 9-12; batch 1's
    # padding), queries 8-11 (documents 2 and 3; batch 1's 2: keys 4-12), 4-7 (batch 1's
    # documents 7 and 2: keys 0-9), 0-3 (documents 1 and 7: keys 0-5).
    assert shapes == [(B, 1, 1, 4), (B, 1, 4, 9), (B, 1, 4, 10), (B, 1, 4, 6)]


def test_fused_skips_a_chunk_whose_queries_are_all_padding(rng, monkeypatch):
    """Queries 4-7 are padding in every batch row: eagerly, no kernel call for their
    chunk, and the results still equal the explicit kernel's, gradients too."""
    calls = []
    original = fused._Kernel.__call__

    def spy(self, query, *rest):
        calls.append(query.shape[1])
        return original(self, query, *rest)

    monkeypatch.setattr(fused._Kernel, "__call__", spy)
    valid = np.ones((B, 12), bool)
    valid[:, 4:8] = False
    mask = masks.AttentionMask(query_valid=valid, causal=True, window=6)
    q, k, v = _inputs(rng, 12, 12)
    fused.attention(q, k, v, scale=0.5, mask=_tensorize(mask), chunk_size=4)
    assert calls == [4, 4]
    _assert_same("fused", mask, (q, k, v))


@pytest.mark.parametrize("masking", ["causal+window", "block-mask", "documents"])
def test_fused_chunks_take_views_with_one_gradient_per_tensor(rng, monkeypatch, masking):
    """On torch, the fused kernel's chunks (each with its own key range, or runs of
    key blocks) and packed rows' documents take their queries, keys and values as
    views of the whole tensors (no copy kept for the backward) from one autograd node
    per tensor, whose gradient is one tensor of the whole size: a slice's gradient is
    a zero tensor of the whole input, one per slice (a sliding-window train step spent
    a quarter of its time filling them). Results and gradients stay the explicit
    kernel's, on every backend."""
    if masking == "block-mask":

        def global_sliding(b, h, q, k):  # keys near the query, and the first two
            return ops.logical_or(ops.less(ops.abs(q - k), 2), ops.less(k, 2))

        mask = masks.AttentionMask(
            block_mask=block_mask.create_block_mask(global_sliding, None, None, T, T, 3)
        )
    elif masking == "documents":
        mask = _tensorize(_packed_mask((6, 5), T, True))
    else:
        mask = masks.AttentionMask(causal=True, window=4)
    arrays = _inputs(rng)
    if BACKEND == "torch":
        import torch

        q, k, v = (torch.tensor(x, requires_grad=True) for x in arrays)
        shared = []
        original = fused._Kernel.__call__

        def spy(self, query, key, *rest):
            shared.append(key.untyped_storage().data_ptr() == k.untyped_storage().data_ptr())
            return original(self, query, key, *rest)

        monkeypatch.setattr(fused._Kernel, "__call__", spy)
        output = fused.attention(q, k, v, scale=0.5, mask=mask, chunk_size=4)
        nodes, seen, todo = [], set(), [output.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            nodes.append(type(node).__name__)
            todo += [parent for parent, _ in node.next_functions]
        assert "SliceBackward0" not in nodes, nodes
        assert nodes.count("OneGradientViewsBackward") == 3, nodes
        if masking != "block-mask":  # (a chunk's several runs of blocks are joined)
            assert len(shared) > 1 and all(shared), shared
        monkeypatch.undo()
    _assert_same("fused", mask, arrays)


@pytest.mark.parametrize("tail_gradient", ["zero", "nonzero"])
def test_fused_causal_tail_skips_its_backward_where_its_gradient_is_zero(
    rng, monkeypatch, tail_gradient
):
    """A causal call with more queries than keys (what a cut leaves of right-padded
    rows whose padded queries attend, as in keras-hub's models): its queries from `S`
    on see every key. On torch (`Policy.skip_zero_gradient_tail`) they run apart, and
    their backward runs only where their output's gradient is not zero: a loss that
    ignores them runs no kernel for them backward. Results and gradients are the
    explicit kernel's either way, on every backend."""
    t, s = 13, 9
    mask = masks.AttentionMask(causal=True)
    kept = np.ones((1, t, 1, 1), "float32")
    if tail_gradient == "zero":
        kept[:, s:] = 0.0
    calls = []
    original = fused._Kernel.__call__

    def spy(self, *args):
        calls.append(args[0].shape[1])
        return original(self, *args)

    monkeypatch.setattr(fused._Kernel, "__call__", spy)

    def fn(q, k, v):
        return fused.attention(q, k, v, scale=0.5, mask=mask) * ops.convert_to_tensor(kept)

    def reference(q, k, v):
        out = explicit.attention(q, k, v, scale=0.5, equations=EQUATIONS, mask=mask)[0]
        return out * ops.convert_to_tensor(kept)

    arrays = _inputs(rng, t, s)
    out, grads = value_and_grads(fn, arrays)
    if BACKEND == "torch":  # the square, the tail, and the tail again where it has a gradient
        assert calls == ([s, t - s] if tail_gradient == "zero" else [s, t - s, t - s]), calls
    else:
        assert calls == [t], calls
    expected, expected_grads = value_and_grads(reference, arrays)
    np.testing.assert_allclose(out, expected, atol=ATOL)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, atol=ATOL)
    if BACKEND == "torch":  # `torch.func` transforms differentiate the whole call themselves
        import torch

        def loss(*tensors):
            return (fn(*tensors) * torch.as_tensor(weights)).sum()

        weights = np.random.default_rng(7).standard_normal(out.shape).astype("float32")
        tensors = [torch.as_tensor(a) for a in arrays]
        transformed = torch.func.grad(loss, argnums=(0, 1, 2))(*tensors)
        expected = torch.func.grad(
            lambda *t: (reference(*t) * torch.as_tensor(weights)).sum(), argnums=(0, 1, 2)
        )(*tensors)
        for got, want in zip(transformed, expected):
            np.testing.assert_allclose(to_numpy(got), to_numpy(want), atol=ATOL)


@pytest.mark.parametrize("loop", ["static", "dynamic"])
@pytest.mark.parametrize("how", ["eager", "graph"])
def test_chunked_loop_skips_chunks_whose_gradient_is_zero(rng, monkeypatch, loop, how):
    """The chunked kernel's loop (`Policy.skip_zero_gradient_chunks`) skips at run time
    the backward of a chunk whose output's gradient is all zero (padded queries a loss
    ignores, as in keras-hub's models): the gradients are the explicit kernel's, with
    chunks wholly zero (skipped), one partly zero (not skipped) and live ones, in the
    chunks' order of the static loop (the leftover chunk unrolled) and of the dynamic
    one (its query gradients a growing buffer: zero rows where it skips). Where the
    loop runs eagerly (TensorFlow, torch), the live chunks alone visit keys backward."""
    if loop == "dynamic" and BACKEND != "tensorflow":
        pytest.skip("the dynamic loop is TensorFlow's (dynamic shapes)")
    visited = set()  # the chunks whose backward ran, by their first query
    original = chunked._backward_chunk

    def spy(block, rows, sink=True):
        # JAX traces its loop's body; a skipped chunk of the dynamic loop visits 0 keys.
        if how == "eager" and BACKEND != "jax" and int(block.keys) > 0:
            visited.add(int(block.start))
        return original(block, rows, sink)

    monkeypatch.setattr(chunked, "_backward_chunk", spy)
    mask = masks.AttentionMask(causal=True, key_valid=_padding(T, 9))
    kept = np.ones((B, T, 1, 1), "float32")
    kept[:, 6:] = 0.0  # queries 8-12 wholly zero; 4-7 partly; 0-3 live

    def fn(q, k, v):
        out = chunked.attention(
            q,
            k,
            v,
            scale=0.5,
            mask=_tensorize(mask),
            chunk_size=4,
            key_block=4,
            loop=True,
            dynamic=loop == "dynamic",
            skip_zero_gradients=True,
        )
        return out * ops.convert_to_tensor(kept)

    def reference(q, k, v):
        out = explicit.attention(q, k, v, scale=0.5, equations=EQUATIONS, mask=mask)[0]
        return out * ops.convert_to_tensor(kept)

    arrays = _inputs(rng)
    if how == "eager":
        out, grads = value_and_grads(fn, arrays)
        if BACKEND != "jax":  # the dynamic loop's chunks end at T: [9, 13), [5, 9), ...
            assert visited == ({0, 4} if loop == "static" else {0, 1, 5}), visited
        expected, expected_grads = value_and_grads(reference, arrays)
    else:
        out, grads = _compiled_value_and_grads(fn, arrays, "graph")
        expected, expected_grads = _compiled_value_and_grads(reference, arrays, "graph")
    np.testing.assert_allclose(out, expected, atol=ATOL)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, atol=ATOL)
    assert np.abs(grads[0][:, 8:]).max() == 0.0 and np.abs(grads[0][:, 4:6]).min() > 0.0


def test_fused_builds_no_whole_mask_for_padding_with_causality(rng, monkeypatch):
    """Each chunk's kernel call sees that chunk's rows and the keys up to its last one."""
    shapes = []
    original = fused._Kernel.__call__

    def spy(self, query, key, value, mask, *rest):
        shapes.append((query.shape[1], key.shape[1], tuple(mask.shape)))
        return original(self, query, key, value, mask, *rest)

    monkeypatch.setattr(fused._Kernel, "__call__", spy)
    q, k, v = _inputs(rng, 12, 12)
    mask = _tensorize(masks.AttentionMask(causal=True, key_valid=_padding(12, 7)))
    with kernels.policy.overriding(fold_key_padding=()):  # as on every row but JAX's GPU
        fused.attention(q, k, v, scale=0.5, mask=mask, chunk_size=4)
    assert sorted(shapes) == [(4, 4, (B, 1, 4, 4)), (4, 8, (B, 1, 4, 8)), (4, 12, (B, 1, 4, 12))]
    assert shapes[0][1] == 12  # the chunk with the most keys first: its buffers get reused


def test_rows_without_keys_are_zero_and_finite(rng):
    """Batch 0 has no key: zero output everywhere, zero gradients, no NaN."""
    mask = MASKS["no-keys"](T, T)
    for kernel in ("explicit", "chunked", "looped", "fused"):
        out, grads = value_and_grads(_run(kernel, mask), _inputs(rng))
        assert np.all(out[0] == 0.0), kernel
        assert all(np.isfinite(g).all() for g in grads), kernel
        assert np.all(grads[0][0] == 0.0), kernel


def _layout_copies(fn, arrays, shapes):
    """The ops of `fn(*arrays)`'s forward and backward pass, as the backend traces or
    dispatches them, that put a tensor of one of `shapes` into another layout:
    TensorFlow's `Transpose`, JAX's `transpose`; in torch, a `clone` / `copy_` or a
    strided view (its consumers read it out of order)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def run(*tensors):
            with tf.GradientTape() as tape:
                tape.watch(tensors)
                total = tf.reduce_sum(fn(*tensors))
            return tape.gradient(total, tensors)

        specs = [tf.TensorSpec(a.shape, a.dtype) for a in arrays]
        graph = tf.function(run).get_concrete_function(*specs).graph
        found = [(op.type, tuple(op.outputs[0].shape)) for op in graph.get_operations()]
        return [(kind, shape) for kind, shape in found if kind == "Transpose" and shape in shapes]
    if BACKEND == "jax":
        import jax

        def total(*tensors):
            return jax.numpy.sum(fn(*tensors))

        grad = jax.grad(total, argnums=tuple(range(len(arrays))))
        found = []

        def visit(jaxpr):
            for eqn in jaxpr.eqns:
                found.extend((eqn.primitive.name, tuple(v.aval.shape)) for v in eqn.outvars)
                for param in eqn.params.values():
                    for sub in param if isinstance(param, (list, tuple)) else [param]:
                        inner = getattr(sub, "jaxpr", sub)
                        if hasattr(inner, "eqns"):
                            visit(inner)

        visit(jax.make_jaxpr(grad)(*arrays).jaxpr)
        return [(kind, shape) for kind, shape in found if kind == "transpose" and shape in shapes]
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    found = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                found.append((str(func), tuple(out.shape), out.is_contiguous()))
            return out

    tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
    with Recorder():
        fn(*tensors).sum().backward()
    return [
        (kind, shape)
        for kind, shape, contiguous in found
        if shape in shapes and (not contiguous or "clone" in kind or "copy_" in kind)
    ]


def test_explicit_scores_come_out_in_their_layout(rng):
    """The explicit kernel's query-key product puts out the scores `(B, N, T, S)` as
    they are used: no op copies the whole scores (or their gradient) from another
    layout, forward or backward. Keras's TensorFlow einsum takes the built-in's
    `key, query` order as a product of keys by queries and transposes its
    `(B, N, S, T)` result: a pass over every score (the Benchmarks page, "Decisions")."""
    t, s = 5, 7
    q, k, v = _inputs(rng, t, s)

    def run(q, k, v):
        return explicit.attention(q, k, v, scale=0.5, equations=EQUATIONS)[0]

    scores = {(B, N, t, s), (B, N, s, t)}
    assert _layout_copies(run, (q, k, v), scores) == []


def _assert_variants_agree(run, arrays):
    """`run(True)` gives `run(False)`'s output and gradients."""
    expected, expected_grads = value_and_grads(run(False), arrays)
    got, grads = value_and_grads(run(True), arrays)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    for g, e in zip(grads, expected_grads):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_explicit_kernel_as_one_einsum_op_each_is_the_same_attention(rng):
    """`one_op_einsum` (the policy's small calls) gives the same output and gradients
    as Keras's `ops.einsum`, padded rows included; on TensorFlow each product is then
    one `Einsum` op with no `Transpose` around it, which Keras's rewrite adds."""
    q, k, v = _inputs(rng, 5, 7)
    mask = MASKS["causal+padding"](5, 7)

    def run(one_op):
        def fn(q, k, v):
            kwargs = dict(scale=0.5, equations=EQUATIONS, mask=_tensorize(mask))
            return explicit.attention(q, k, v, **kwargs, empty_rows="mean", one_op_einsum=one_op)[0]

        return fn

    _assert_variants_agree(run, (q, k, v))
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def op_types(one_op):
            specs = [tf.TensorSpec(a.shape, a.dtype) for a in (q, k, v)]
            graph = tf.function(run(one_op)).get_concrete_function(*specs).graph
            return [op.type for op in graph.get_operations()]

        assert op_types(True).count("Einsum") == 2 and "Transpose" not in op_types(True)
        assert "Einsum" not in op_types(False) and "Transpose" in op_types(False)


def test_explicit_products_with_a_unit_axis_are_the_same_attention(rng):
    """`unit_axis` (JAX's CPU policy for small calls) gives the same output and
    gradients as the plain products, a padded row included, and copies no scores from
    another layout. On JAX the point of it: compiled for the CPU, every product of the
    backward runs in YNNPACK, where without the axis the key's or the value's
    gradient takes XLA's Eigen dot (a `dot` outside any YNNPACK fusion)."""
    t, s = 5, 7
    q, k, v = _inputs(rng, t, s)
    mask = MASKS["causal+padding"](t, s)

    def run(unit_axis, masked=True):
        def fn(q, k, v):
            kwargs = dict(scale=0.5, equations=EQUATIONS, unit_axis=unit_axis)
            kwargs["mask"] = _tensorize(mask) if masked else None
            return explicit.attention(q, k, v, **kwargs)[0]

        return fn

    _assert_variants_agree(run, (q, k, v))
    scores = {(B, N, t, s), (B, N, s, t)}
    assert _layout_copies(run(True, masked=False), (q, k, v), scores) == []
    if BACKEND == "jax":
        assert _eigen_dots(run(True, masked=False)) == 0
        assert _eigen_dots(run(False, masked=False)) > 0  # what the axis is for


def _eigen_dots(fn):
    """The `dot`s outside YNNPACK fusions in JAX's CPU program for the gradients of
    `fn`'s sum, over `(B, 12, N, 32)` inputs (a small model's)."""
    import re

    import jax

    x = jax.numpy.ones((B, 12, N, 32))
    grad = jax.jit(jax.grad(lambda *a: jax.numpy.sum(fn(*a)), argnums=(0, 1, 2)))
    text = grad.lower(x, x, x).compile().as_text()
    ynn = set(re.findall(r"calls=%([\w.\-]+)[^\n]*__ynn_fusion", text))
    computation, dots = None, 0
    for line in text.splitlines():
        name = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
        computation = name.group(1) if name else computation
        dots += " dot(" in line and computation not in ynn
    return dots


def test_policy_looks_for_a_cut_where_it_can_pay():
    rules = kernels.policy.Policy("fused", cut_from=100)
    looks = kernels.policy.looks_for_cut
    padded = masks.AttentionMask(key_valid=np.ones((1, 3), bool))
    assert not looks(100, padded, rules)  # small: the look costs more than a cut saves
    assert looks(101, padded, rules)
    assert looks(None, padded, rules)  # unknown while tracing
    assert looks(4, dataclasses.replace(padded, causal=True), rules)  # may become is_causal
    assert not looks(101, None, rules)  # nothing to cut
    assert not looks(101, padded, dataclasses.replace(rules, sizes_from_data=False))


def test_policy_runs_one_einsum_op_only_for_small_known_calls():
    rules = kernels.policy.Policy("chunked", one_op_einsum_up_to=100)
    one_op, call = kernels.policy.one_op_einsum, kernels.policy.Call
    assert one_op(call(score_entries=100), rules)
    assert not one_op(call(score_entries=101), rules)
    assert not one_op(call(score_entries=None), rules)  # unknown while tracing
    assert not one_op(call(score_entries=4), kernels.policy.Policy("chunked"))


def test_explicit_product_of_any_equation_gives_the_builtins_scores(rng):
    """The query-first product equals the built-in's `einsum(equation, key, query)`,
    for the layer's equations and for an equation without `->` (a subclass may
    write one), which keeps its order."""
    q, k, _ = _inputs(rng, 5, 7)
    for equation in (EQUATIONS[0], "aecd,abcd", "...ecd,...bcd->...cbe"):
        expected = to_numpy(ops.einsum(equation, k, q))
        got = to_numpy(ops.einsum(*explicit._query_first(equation, k, q)))
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_chunked_skips_keys_no_query_sees(rng, monkeypatch):
    """A causal chunk computes logits only against the keys up to its last query."""
    widths = []
    original = logits.logits

    def spy(query, key_t):
        widths.append(key_t.shape[-1])
        return original(query, key_t)

    monkeypatch.setattr(logits, "logits", spy)
    q, k, v = _inputs(rng, 12, 12)
    chunked.attention(q, k, v, scale=0.5, mask=masks.AttentionMask(causal=True), chunk_size=4)
    assert widths == [12, 8, 4]  # the chunk with the most keys goes first


def _skipping_mask(t, s):
    """Causal, a window of 6, key padding, document ids, and queries from 8 on
    padding in both batch rows: the chunks from query 8 see no key."""
    query_valid = np.ones((B, t), bool)
    query_valid[:, 8:] = False
    return masks.AttentionMask(
        causal=True,
        window=6,
        key_valid=_padding(s, s - 2),
        query_valid=query_valid,
        query_segments=_segment_ids(t),
        key_segments=_segment_ids(s),
    )


@pytest.mark.parametrize(
    "t, s, key_block",
    [(13, 15, 4), (9, 6, 8)],  # S no multiple of the block; S below it
)
def test_static_loop_by_key_blocks_matches_explicit(rng, t, s, key_block):
    """The static loop's chunks visit their visible key blocks only, with an online
    softmax, every logit feature and dropout; chunks that see no key included."""
    q, k, v = _inputs(rng, t, s)
    bias = rng.standard_normal((B, 1, t, s)).astype("float32")
    sinks = rng.standard_normal((N,)).astype("float32")
    seed = ops.convert_to_tensor(np.array([5, 9]), "int32")
    _assert_same(
        "looped",
        _skipping_mask(t, s),
        (q, k, v, bias, sinks),
        ("bias", "sinks"),
        soft_cap=2.0,
        dropout=0.3,
        seed=seed,
        key_block=key_block,
    )


@pytest.mark.parametrize("t, s, key_block", [(13, 16, 4), (9, 8, 8)])
def test_static_loop_without_a_mask_runs_whole_blocks(rng, t, s, key_block):
    """With no mask and `S` a multiple of the block, no block moves and none is
    masked (`_Plan.key_block_of`); outputs and gradients are still the explicit
    kernel's, with every logit feature and dropout."""
    q, k, v = _inputs(rng, t, s)
    plan = chunked._Plan.make(q, k, None, 4, None, True, False, key_block=key_block)
    inputs = chunked._Inputs(chunked._Options(1.0, None, None, 0.0, None), q, k, v, None, None)
    lo = ops.zeros((), "int32")
    assert [plan.key_block_of(inputs, 0, 4, lo, j).since for j in range(2)] == [None, None]
    bias = rng.standard_normal((B, 1, t, s)).astype("float32")
    sinks = rng.standard_normal((N,)).astype("float32")
    seed = ops.convert_to_tensor(np.array([5, 9]), "int32")
    arrays = (q, k, v, bias, sinks)
    options = dict(soft_cap=2.0, dropout=0.3, seed=seed, key_block=key_block)
    _assert_same("looped", None, arrays, ("bias", "sinks"), **options)
    _assert_same("looped", None, (q, k, v), key_block=key_block)


def test_static_loop_schedules_only_the_blocks_a_chunk_sees(rng):
    """Each chunk's key blocks (`_Plan.key_blocks`, computed at run time) start at
    the first key one of its queries sees, cover the last, and are no more than
    that; a chunk of padding has none, and the causal chunks skip the later keys."""
    t, s, size = 13, 15, 4
    mask = _tensorize(_skipping_mask(t, s))
    q, k, _ = _inputs(rng, t, s)
    plan = chunked._Plan.make(q, k, mask, 4, None, True, False, key_block=size)
    assert plan.loop and plan.key_block == size
    seen = np.broadcast_to(to_numpy(mask.block(0, t, 0, s)), (B, 1, t, s)).any(axis=(0, 1))
    counts = []
    for start in range(0, t, 4):
        rows = min(4, t - start)
        lo, count = (int(to_numpy(x)) for x in plan.key_blocks(start, rows))
        keys = np.flatnonzero(seen[start : start + rows].any(axis=0))
        if keys.size == 0:
            assert count == 0
        else:
            assert lo == keys[0] and count == -(-(keys[-1] + 1 - lo) // size)
        counts.append(count)
    assert counts == [1, 2, 0, 0]  # every key: 4 blocks per chunk


def test_static_loop_never_touches_a_skipped_block(rng):
    """Keys no query sees (padding in every batch row) hold NaN, and so do the
    queries of a chunk of padding: compiled (`jax.jit`, TensorFlow with XLA), the
    static loop never visits them, so outputs and gradients stay finite and equal
    the explicit kernel's with zeros there, every logit feature and dropout on. A
    loop over every key gives NaN."""
    t, s = 16, 16
    q, k, v = _inputs(rng, t, s)
    bias = rng.standard_normal((1, N, t, s)).astype("float32")
    sinks = rng.standard_normal((N,)).astype("float32")
    valid = np.ones((B, s), bool)
    valid[:, 8:] = False
    mask = masks.AttentionMask(causal=True, key_valid=valid, query_valid=valid)
    seed = ops.convert_to_tensor(np.array([5, 9]), "int32")
    options = dict(soft_cap=2.0, dropout=0.3, seed=seed)
    explicit_run = _run("explicit", mask, ("bias", "sinks"), **options)
    expected, expected_grads = value_and_grads(explicit_run, (q, k, v, bias, sinks))
    q[:, 12:], k[:, 8:], v[:, 8:] = np.nan, np.nan, np.nan

    def fn(q, k, v):
        return chunked.attention(
            q,
            k,
            v,
            scale=H**-0.5,
            mask=_tensorize(mask),
            bias=bias,
            sinks=sinks,
            chunk_size=4,
            key_block=4,
            loop=True,
            **options,
        )

    out, grads = _compiled_value_and_grads(fn, (q, k, v), "xla")
    np.testing.assert_allclose(out, expected, atol=ATOL)
    for got, want in zip(grads, expected_grads[:3]):
        np.testing.assert_allclose(got, want, atol=ATOL)


def _packed_mask(lengths, total, causal=False):
    """Rows of documents of `lengths` (ids 1, 2, ...) and padding, for both batch rows."""
    ids = np.zeros((B, total), "int32")
    starts = np.cumsum([0] + list(lengths))
    for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        ids[:, a:b] = i + 1
    ids = ops.convert_to_tensor(ids)
    return masks.AttentionMask(causal=causal, query_segments=ids, key_segments=ids)


def _kernel_calls(monkeypatch):
    """The fused kernel's calls: `(queries, keys, mask shape or None, is_causal)`."""
    calls = []
    original = fused._Kernel.__call__

    def spy(self, query, key, value, mask, valid, is_causal, bias):
        shape = None if mask is None else tuple(mask.shape)
        calls.append((query.shape[1], key.shape[1], shape, is_causal))
        return original(self, query, key, value, mask, valid, is_causal, bias)

    monkeypatch.setattr(fused._Kernel, "__call__", spy)
    return calls


@pytest.mark.parametrize("causal", [False, True])
def test_fused_runs_each_document_alone(rng, monkeypatch, causal):
    """Eagerly, contiguous documents of a packed self-attention each run whole, alone,
    with no mask (`is_causal` where causal), as FlashAttention's variable-length kernels
    do; padding gets zero rows. Outputs and gradients are the explicit kernel's."""
    mask = _packed_mask((6, 5), T, causal)  # then 2 of padding, in both batch rows
    _assert_same("fused", mask, _inputs(rng))
    calls = _kernel_calls(monkeypatch)
    q, k, v = _inputs(rng)
    fused.attention(q, k, v, scale=1.0, mask=mask, chunk_size=4)
    assert calls == [(6, 6, None, causal), (5, 5, None, causal)] * B


def test_fused_goes_by_chunks_where_documents_would_not_pay(rng, monkeypatch):
    """Chunks of queries, with their masks, where a document id comes back after
    another (no contiguous run per document), where the keys' ids are not the
    queries', and where rows hold more documents than the call has chunks of
    queries. Outputs and gradients stay the explicit kernel's."""
    calls = _kernel_calls(monkeypatch)
    arrays = _inputs(rng)
    ids = np.ones((B, T), "int32")
    ids[:, 4:8] = 2  # document 1 on both sides of document 2: 6 runs, 7 chunks of 2
    queries, keys = np.ones((B, T), "int32"), np.ones((B, T), "int32")
    queries[:, 6:], keys[:, 5:] = 2, 2  # contiguous documents, the keys' one key apart
    cases = [
        (masks.AttentionMask(query_segments=ids, key_segments=ids), 2),
        (masks.AttentionMask(query_segments=queries, key_segments=keys), 2),
        (_packed_mask((2, 2, 2, 2, 2, 3), T), 4),  # 12 runs, 4 chunks of 4 queries
    ]
    for mask, chunk_size in cases:
        calls.clear()
        mask = _tensorize(mask)

        def run(q, k, v, mask=mask, chunk_size=chunk_size):
            return fused.attention(q, k, v, scale=0.5, mask=mask, chunk_size=chunk_size)

        def want(q, k, v, mask=mask):
            return explicit.attention(q, k, v, scale=0.5, equations=EQUATIONS, mask=mask)[0]

        out, grads = value_and_grads(run, arrays)
        assert calls and all(shape is not None for _, _, shape, _ in calls)
        expected, expected_grads = value_and_grads(want, arrays)
        np.testing.assert_allclose(out, expected, atol=ATOL)
        for got, wanted in zip(grads, expected_grads):
            np.testing.assert_allclose(got, wanted, atol=ATOL)


def test_a_cut_packed_row_runs_its_documents_alone(rng, monkeypatch):
    """Through the kernels' entry point: the trailing padding is cut off first, then
    each document runs alone (4 documents, 6 chunks of 2 queries in the 11 kept);
    the results are the explicit kernel's."""
    calls = _kernel_calls(monkeypatch)
    mask = _packed_mask((7, 4), T, causal=True)
    q, k, v = _inputs(rng)
    out, _ = kernels.attention(
        q, k, v, scale=0.5, equations=EQUATIONS, mask=mask, implementation="fused", chunk_size=2
    )
    assert calls == [(7, 7, None, True), (4, 4, None, True)] * B
    expected, _ = explicit.attention(q, k, v, scale=0.5, equations=EQUATIONS, mask=mask)
    np.testing.assert_allclose(to_numpy(out), to_numpy(expected), atol=ATOL)


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_skips_keys_of_other_documents_at_run_time(rng, monkeypatch, causal):
    """Eagerly, each chunk of one document computes logits against its document's
    keys only (and causality cuts them further), forward and backward; the results
    are the explicit kernel's."""
    widths = []
    original = logits.logits

    def spy(query, key_t):
        widths.append(int(key_t.shape[-1]))
        return original(query, key_t)

    monkeypatch.setattr(logits, "logits", spy)
    q, k, v = _inputs(rng, 16, 16)
    mask = _packed_mask((4, 8, 2), 16, causal)  # then 2 of padding
    out = chunked.attention(q, k, v, scale=0.5, mask=mask, chunk_size=4)
    # Chunks from the last: a 2-token document and padding (which sees nothing): the
    # document's 2 keys; the 8-token document's second and first chunks (causal: the
    # keys up to their last query); the 4-token document.
    assert widths == ([2, 8, 4, 4] if causal else [2, 8, 8, 4])
    expected, _ = explicit.attention(q, k, v, scale=0.5, equations=EQUATIONS, mask=mask)
    np.testing.assert_allclose(to_numpy(out), to_numpy(expected), atol=ATOL)


def test_visible_keys_narrow_the_static_range_by_padding_and_documents():
    ids = ops.convert_to_tensor(np.array([[1, 1, 1, 2, 2, 2, 0, 0]] * B, "int32"))
    valid = np.ones((B, 8), bool)
    valid[:, 5] = False
    mask = masks.AttentionMask(query_segments=ids, key_segments=ids)
    assert [int(x) for x in mask.visible_keys(0, 2, 8)] == [0, 3]
    assert [int(x) for x in mask.visible_keys(2, 2, 8)] == [0, 6]
    assert [int(x) for x in mask.visible_keys(6, 2, 8)] == [7, 8]  # nothing: one key
    padded = masks.AttentionMask(key_valid=ops.convert_to_tensor(valid), causal=True)
    assert [int(x) for x in padded.visible_keys(4, 4, 8)] == [0, 8]
    both = dataclasses.replace(mask, key_valid=ops.convert_to_tensor(valid), causal=True)
    assert [int(x) for x in both.visible_keys(3, 3, 8)] == [3, 5]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="lengths unknown when tracing: tf.function")
def test_dynamic_loop_narrows_by_data_where_lengths_are_unknown(rng):
    """Under `tf.function` with unknown lengths, the graph loop's chunks still take only
    their documents' keys (they took every key), and the results are the eager ones."""
    import tensorflow as tf

    ids = np.array([[1] * 6 + [2] * 6 + [0] * 4], "int32")
    q, k, v = (rng.standard_normal((1, 16, N, H)).astype("float32") for _ in range(3))
    spec = tf.TensorSpec((1, None, N, H))

    def packed(ids):
        return masks.AttentionMask(causal=True, query_segments=ids, key_segments=ids)

    @tf.function(input_signature=[spec, spec, tf.TensorSpec((1, None), tf.int32)])
    def ranges_and_output(q, k, ids):
        plan = chunked._Plan.make(q, k, packed(ids), 4, None, True, True)
        ranges = [plan.key_range(start, 4) for start in (0, 4, 8, 12)]
        output = chunked.attention(
            q, k, k, scale=0.5, mask=packed(ids), chunk_size=4, loop=True, dynamic=True
        )
        return ranges, output

    ranges, output = ranges_and_output(q, k, ids)
    # Queries 0-3: document 1 (keys 0-3); 4-7: documents 1 and 2 up to key 7; 8-11:
    # document 2 (keys 6-11); 12-15: padding, one masked key.
    assert [tuple(int(x) for x in r) for r in ranges] == [(0, 4), (0, 8), (6, 12), (15, 16)]
    expected = chunked.attention(q, k, k, scale=0.5, mask=packed(ids), chunk_size=4)
    np.testing.assert_allclose(to_numpy(output), to_numpy(expected), atol=ATOL)

    @tf.function(input_signature=[spec, spec, tf.TensorSpec((1, None), tf.int32)])
    def widened_ranges(q, k, ids):
        plan = chunked._Plan.make(q, k, packed(ids), 4, None, True, True, key_multiple=5)
        return [plan.key_range(start, 4) for start in (0, 4, 8, 12)]

    # Out to multiples of 5 keys, within the 16 keys: few distinct widths.
    got = [tuple(int(x) for x in r) for r in widened_ranges(q, k, ids)]
    assert got == [(0, 5), (0, 10), (5, 15), (15, 16)]


@pytest.mark.parametrize("offset", [0, 3])
def test_unrolled_chunks_see_only_their_asymmetric_window(rng, offset):
    """`(left, right)`: chunk `[start, start + 4)` of queries at `offset + t` sees keys
    `offset + start - left ... offset + start + 3 + right` only."""
    left, right, t, s = 2, 1, 12, 15
    q, k, _ = _inputs(rng, t, s)
    mask = masks.AttentionMask(window=(left, right), offset=offset)
    plan = chunked._Plan.make(q, k, mask, 4, None, False, False)
    for (start, size), (lo, hi) in zip(plan.chunks, plan.ranges):
        first, last = offset + start, offset + start + size - 1
        assert (lo, hi) == (max(0, first - left), min(s, last + right + 1))


def test_unknown_query_length_is_one_chunk_unless_the_loop_is_dynamic():
    """Symbolic `T` (a functional model with `(None, dim)` inputs) traces one chunk;
    a dynamic loop chunks it all the same."""
    q = keras.Input((None, N, H))
    causal = masks.AttentionMask(causal=True)
    plan = chunked._Plan.make(q, q, causal, 4, None, False, False)
    assert plan.chunks == ((0, None),) and plan.ranges == ((0, None),) and not plan.loop
    assert chunked._Plan.make(q, q, causal, 4, None, True, True).loop


def test_dynamic_loop_is_refused_where_shapes_are_static(rng):
    q, k, v = _inputs(rng)
    if BACKEND == "jax":
        with pytest.raises(ValueError, match="dynamic shapes"):
            chunked.attention(q, k, v, scale=0.5, loop=True, dynamic=True)
    else:  # TensorFlow graphs and torch take tensors of changing size
        chunked.attention(q, k, v, scale=0.5, loop=True, dynamic=True)


def _compiled_value_and_grads(fn, arrays, how):
    """`value_and_grads` with the forward and backward in one compiled step: `how` is
    "graph" (TensorFlow: `tf.function`; JAX: `jax.jit`), "xla" (`jit_compile=True`;
    `jax.jit`) or "unknown-length" (TensorFlow traces `T` as `None`). Torch runs it
    eagerly."""
    if BACKEND == "torch":
        return value_and_grads(fn, arrays)
    weights = np.random.default_rng(7).standard_normal(arrays[0].shape[:3] + (H,))
    weights = weights.astype("float32")
    if BACKEND == "jax":
        import jax

        def loss(*tensors):
            out = fn(*tensors)
            return ops.sum(out * weights), out

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, out), grads = step(*arrays)
        return to_numpy(out), [to_numpy(g) for g in grads]
    import tensorflow as tf

    def tf_step(*tensors):
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            out = fn(*tensors)
            value = tf.reduce_sum(out * weights)
        return out, tape.gradient(value, tensors)

    specs = None
    if how == "unknown-length":
        specs = [tf.TensorSpec((B, None) + a.shape[2:], "float32") for a in arrays]
    step = tf.function(tf_step, jit_compile=how == "xla", input_signature=specs)
    out, grads = step(*arrays)
    return to_numpy(out), [to_numpy(g) for g in grads]


@pytest.mark.parametrize("how", ["graph", "xla", "unknown-length"])
@pytest.mark.parametrize(
    "masking",
    ["causal+padding", "offset", "dense-heads+causal", "no-keys", "segments+causal+window+padding"],
)
def test_policy_kernel_in_a_compiled_step_matches_explicit(rng, masking, how):
    """The chunked kernel as the backend's policy runs it (TensorFlow: the dynamic
    loop in a graph, the static one under XLA), forward and backward in one step."""
    arrays = _inputs(rng)
    mask = MASKS[masking](T, T)
    expected, expected_grads = _explicit(mask, arrays)

    def fn(q, k, v):
        out, _ = kernels.attention(
            q,
            k,
            v,
            scale=H**-0.5,
            equations=EQUATIONS,
            mask=_tensorize(mask),
            implementation="chunked",
            chunk_size=4,
        )
        return out

    # Only TensorFlow compiles the three ways; JAX's are one `jax.jit`, torch's one
    # eager run: there the step runs once per mask, each `how` checking its result.
    key = (masking, how if BACKEND == "tensorflow" else None)
    if key not in _POLICY_STEPS:
        _POLICY_STEPS[key] = _compiled_value_and_grads(fn, arrays, how)
    out, grads = _POLICY_STEPS[key]
    np.testing.assert_allclose(out, expected, atol=ATOL)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, atol=ATOL)


_POLICY_STEPS = {}


# ------------------------------------------------------------------------- policy
def _eager_chunked(monkeypatch, rng, mask, **options):
    """Two eager calls through `kernels.attention` that land on the chunked kernel
    (key blocks of 4), the same shapes, other data, each giving the explicit kernel's
    output and reaching `chunked.attention`; returns how many times the kernel was
    traced to be compiled."""
    calls, traces = [], []
    attention, kernel = chunked.attention, chunked._attention
    monkeypatch.setattr(chunked, "attention", lambda *a, **k: calls.append(1) or attention(*a, **k))
    monkeypatch.setattr(chunked, "_attention", lambda *a, **k: traces.append(1) or kernel(*a, **k))
    # The second call's mask: each array rolled by one key or query (same shapes).
    for m in [mask, _map_arrays(mask, lambda x: np.roll(x, 1, axis=-1))]:
        q, k, v = _inputs(rng)
        kwargs = dict(scale=H**-0.5, mask=_tensorize(m), **options)
        with kernels.policy.overriding(key_block=4):
            out, _ = kernels.attention(
                q, k, v, equations=EQUATIONS, implementation="chunked", chunk_size=4, **kwargs
            )
        expected, _ = explicit.attention(q, k, v, equations=EQUATIONS, **kwargs)
        np.testing.assert_allclose(to_numpy(out), to_numpy(expected), atol=ATOL)
    assert len(calls) == 2
    return len(traces)


def _traces_expected():
    """How many traces two eager calls of one configuration make: one where the
    policy compiles eager chunks (JAX), none elsewhere (they run as they are)."""
    return 1 if kernels.policy.current().compile_eager_chunks else 0


@pytest.mark.parametrize("masking", list(MASKS))
def test_eager_chunked_calls_compile_once_where_the_policy_says(rng, monkeypatch, masking):
    """Eager calls of the chunked kernel (through `kernels.attention`), twice with the
    same shapes and other data, every mask kind: each output is the explicit kernel's,
    so the mask's tensors are the compiled program's arguments, not constants kept from
    its first call. Where the policy compiles eager chunks (JAX: `compiled.py`), the
    kernel is traced once for both calls; elsewhere each runs as it is."""
    traces = _eager_chunked(monkeypatch, rng, MASKS[masking](T, T))
    assert traces == _traces_expected()


def test_eager_chunked_calls_with_a_bias_sinks_and_a_tensor_offset_compile_once(rng, monkeypatch):
    """The bias, the sinks and a tensor offset are the compiled program's arguments too."""
    mask = masks.AttentionMask(
        causal=True, offset=ops.convert_to_tensor(2), key_valid=_padding(T, 9)
    )
    bias = ops.convert_to_tensor(rng.standard_normal((B, 1, T, T)).astype("float32"))
    sinks = ops.convert_to_tensor(rng.standard_normal((N,)).astype("float32"))
    traces = _eager_chunked(monkeypatch, rng, mask, bias=bias, sinks=sinks, soft_cap=5.0)
    assert traces == _traces_expected()


def test_eager_chunked_calls_with_a_block_mask_compile_once(rng, monkeypatch):
    """A block mask's function is compiled with the kernel (its map is static), beside
    key padding whose data changes between the calls."""

    def global_sliding(b, h, q, k):  # keys near the query, and the first two
        return ops.logical_or(ops.less(ops.abs(q - k), 2), ops.less(k, 2))

    built = block_mask.create_block_mask(global_sliding, None, None, T, T, 3)
    mask = masks.AttentionMask(block_mask=built, key_valid=_padding(T, 9))
    traces = _eager_chunked(monkeypatch, rng, mask)
    assert traces == _traces_expected()


def test_eager_chunked_calls_with_a_score_function_run_each_time(rng, monkeypatch):
    """A score function may read a tensor it closes over, whose value can change
    between calls: such calls are not compiled once, and each sees the value of now."""
    from keras_mha import score_mod

    traces, kernel = [], chunked._attention
    monkeypatch.setattr(chunked, "_attention", lambda *a, **k: traces.append(1) or kernel(*a, **k))
    state = {}

    def fn(score, b, h, q_idx, kv_idx):  # reads the tensor of now: forward only
        return score + ops.take(state["shift"], h) * ops.cast(kv_idx, "float32")

    kwargs = dict(scale=H**-0.5, mask=_tensorize(MASKS["causal+padding"](T, T)))
    kwargs["score_mod"] = score_mod.ScoreMod(fn)
    q, k, v = _inputs(rng)
    outputs = []
    for value in (0.0, 0.5):
        state["shift"] = ops.convert_to_tensor(np.full((N,), value, "float32"))
        with kernels.policy.overriding(key_block=4):
            out, _ = kernels.attention(
                q, k, v, equations=EQUATIONS, implementation="chunked", chunk_size=4, **kwargs
            )
        expected, _ = explicit.attention(q, k, v, equations=EQUATIONS, **kwargs)
        np.testing.assert_allclose(to_numpy(out), to_numpy(expected), atol=ATOL)
        outputs.append(to_numpy(out))
    assert not np.allclose(outputs[0], outputs[1])
    assert traces == []


def test_policy_choose():
    rules = kernels.policy.Policy("fused")
    choose, call = kernels.policy.choose, kernels.policy.Call
    assert choose(None, call(scores=True), rules) == "explicit"
    assert choose("chunked", call(rank4=False), rules) == "explicit"
    assert choose(None, call(), rules) == "fused"
    # The fused kernels draw their own dropout and know no soft cap or sinks.
    assert choose(None, call(dropout=True), rules) == "chunked"
    assert choose(None, call(soft_cap=True), rules) == "chunked"
    assert choose(None, call(sinks=True), rules) == "chunked"
    padded_causal = masks.AttentionMask(causal=True, key_valid=np.ones((1, 3), bool))
    assert choose(None, call(mask=padded_causal, bias=True), rules) == "fused"
    decoding = masks.AttentionMask(causal=True, offset=ops.convert_to_tensor(3))
    assert choose("fused", call(mask=decoding), rules) == "fused"
    assert choose("explicit", call(), rules) == "explicit"
    assert choose(None, call(), kernels.policy.Policy("chunked")) == "chunked"
    assert choose("fused", call(), kernels.policy.Policy("chunked")) == "fused"


def test_policy_takes_the_explicit_kernel_for_small_calls_that_skip_no_keys():
    rules = kernels.policy.Policy("chunked", explicit_up_to=100)
    choose, call = kernels.policy.choose, kernels.policy.Call
    padded = masks.AttentionMask(key_valid=np.ones((1, 3), bool))
    assert choose(None, call(score_entries=100), rules) == "explicit"
    assert choose("auto", call(score_entries=100, mask=padded, dropout=True), rules) == "explicit"
    assert choose(None, call(score_entries=101), rules) == "chunked"
    assert choose(None, call(score_entries=None), rules) == "chunked"  # unknown while tracing
    # Causal and windowed chunks skip keys: the chunked kernel stays.
    assert choose(None, call(score_entries=4, mask=masks.AttentionMask(causal=True)), rules) == (
        "chunked"
    )
    assert choose(None, call(score_entries=4, mask=masks.AttentionMask(window=2)), rules) == (
        "chunked"
    )
    # Queries in one chunk: no chunk skips a key, causal or windowed.
    for one_chunk in (masks.AttentionMask(causal=True), masks.AttentionMask(window=2)):
        assert choose(None, call(score_entries=4, mask=one_chunk, one_chunk=True), rules) == (
            "explicit"
        )
    assert choose(None, call(score_entries=101, one_chunk=True), rules) == "chunked"
    # Only the automatic choice: a requested kernel runs as asked.
    assert choose("chunked", call(score_entries=4), rules) == "chunked"
    assert choose(None, call(score_entries=4), kernels.policy.Policy("chunked")) == "chunked"
    fused = kernels.policy.Policy("fused", explicit_up_to=100)
    assert choose(None, call(score_entries=4), fused) == "fused"


def test_forward_chunks_halve_only_where_their_logits_would_reach_the_limit():
    rows = kernels.policy.forward_chunk_rows
    rules = kernels.policy.Policy("chunked", chunk_size=256, chunk_bytes=32 << 20)
    # Unmasked T=S=8192, 4 heads: 256 rows hold 32 MiB of float32 logits, 128 half that.
    assert rows(rules, (1, 8192, 4, 64), 8192, None, True) == 128
    assert rows(rules, (None, 8192, 4, 64), 8192, None, True) == 128  # B unknown: 1
    assert rows(rules, (2, 8192, 4, 64), 8192, None, True) == 64
    assert rows(rules, (64, 8192, 16, 64), 8192, None, True) == kernels.policy.MIN_CHUNK_ROWS
    assert rows(rules, (1, 4096, 4, 64), 4096, None, True) == 256
    # Causal chunks see (S + rows) / 2 keys on average: 17 MiB at 256 rows.
    causal = masks.AttentionMask(causal=True, key_valid=np.ones((1, 8192), bool))
    assert rows(rules, (1, 8192, 4, 64), 8192, causal, True) == 256
    decoding = masks.AttentionMask(causal=True, offset=ops.convert_to_tensor(3))
    assert rows(rules, (1, 8192, 4, 64), 8192, decoding, True) == 128  # offset unknown: all S
    window = masks.AttentionMask(window=512)
    assert rows(rules, (1, 8192, 8, 64), 8192, window, True) == 256  # 256 + 2 x 511 keys
    # Not in a static loop, with sizes unknown while tracing, or without a limit.
    assert rows(rules, (1, 8192, 4, 64), 8192, None, False) == 256
    assert rows(rules, (1, None, 4, 64), 8192, None, True) == 256
    assert rows(rules, (1, 8192, 4, 64), None, None, True) == 256
    assert (
        rows(dataclasses.replace(rules, chunk_bytes=None), (1, 8192, 4, 64), 8192, None, True)
        == 256
    )


def test_the_layers_call_passes_the_forward_rows_unless_told_a_chunk_size(rng, monkeypatch):
    seen = []
    monkeypatch.setattr(chunked, "attention", lambda *a, **kw: seen.append(kw) or a[0])
    q, k, v = _inputs(rng, t=16, s=16)
    # 384 bytes of float32 logits per query row here (B=2, N=3, S=16): a limit of
    # 1 KiB would take 2 rows; the floor (4 here) stops the halving at 4.
    monkeypatch.setattr(kernels.policy, "MIN_CHUNK_ROWS", 4)
    with kernels.policy.overriding(
        kernel="chunked", chunk_size=8, chunk_bytes=1 << 10, dynamic=True, loop=True
    ):
        for chunk_size in (None, 2):
            kernels.attention(
                q,
                k,
                v,
                scale=1.0,
                equations=EQUATIONS,
                implementation="chunked",
                chunk_size=chunk_size,
            )
    assert [(kw["chunk_size"], kw["forward_chunk_size"]) for kw in seen] == [(8, 4), (2, 2)]


def test_score_entries_are_known_only_for_static_sizes():
    q, k = ops.zeros((2, 5, 3, 4)), ops.zeros((2, 7, 3, 4))
    assert kernels._score_entries(q, k) == 2 * 3 * 5 * 7
    symbolic = keras.KerasTensor((None, 5, 3, 4))
    assert kernels._score_entries(symbolic, k) is None


def test_policy_table_covers_every_backend():
    for name in ("tensorflow", "jax", "torch", "numpy", "openvino"):
        entry = kernels.policy.POLICIES[(name, "cpu")]
        assert entry.kernel in kernels.IMPLEMENTATIONS
        assert entry.chunk_size > 0
    device = kernels.policy._device(BACKEND)
    assert kernels.policy.current() == kernels.policy.POLICIES[(BACKEND, device)]


def test_overriding_a_policy_row_lasts_for_its_block():
    """Nested blocks each give their row back; another thread keeps the plain row
    while a block is open; an exception leaves no block open."""
    row = kernels.policy.current()
    seen_in_thread = []
    with kernels.policy.overriding(chunk_size=row.chunk_size + 1):
        assert kernels.policy.current() == dataclasses.replace(row, chunk_size=row.chunk_size + 1)
        with kernels.policy.overriding(loop=not row.loop):
            inner = kernels.policy.current()
            assert (inner.chunk_size, inner.loop) == (row.chunk_size + 1, not row.loop)
        assert kernels.policy.current().loop == row.loop
        thread = threading.Thread(target=lambda: seen_in_thread.append(kernels.policy.current()))
        thread.start()
        thread.join()
    assert seen_in_thread == [row]
    assert kernels.policy.current() == row
    with pytest.raises(RuntimeError), kernels.policy.overriding(chunk_size=3):
        raise RuntimeError
    assert kernels.policy.current() == row and kernels.policy._open_overrides == 0


@pytest.mark.parametrize("kernel", ["fused", "folded"] + CHUNKED)
@pytest.mark.parametrize("scale", [1.0, 0.3])
@pytest.mark.parametrize("masking", ["causal+padding", "keys", "window-pair+offset+padding"])
def test_every_kernel_takes_the_scale(rng, kernel, scale, masking):
    """The logits' scale (the layer's `scale`: T5's 1.0, Gemma's
    `query_pre_attn_scalar ** -0.5`), forward and backward; the explicit kernel against
    the float64 reference."""
    t, s = T, T + 2
    mask = MASKS[masking](t, s)
    arrays = _inputs(rng, t, s)
    out, _ = _explicit(mask, arrays, scale=scale)  # the run the kernels compare with
    dense = np.broadcast_to(to_numpy(_tensorize(mask).block(0, t, 0, s)), (B, 1, t, s))
    expected, _ = reference_attention(*arrays, mask=dense[:, 0], scale=scale)
    np.testing.assert_allclose(out, expected, atol=ATOL)
    default, _ = reference_attention(*arrays, mask=dense[:, 0])
    assert np.abs(expected - default).max() > 1e-2  # the scale matters here
    _assert_same(kernel, mask, arrays, scale=scale)
