"""`keras_mha.packing`: token sequences packed into rows (pure NumPy, no backend):
every token kept once, in order within its document, ids/positions/targets/loss mask
as documented, rows well filled, bad input rejected by name."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_mha import packing

pytestmark = pytest.mark.once  # needs no backend


def test_the_documented_example():
    rows = packing.pack([[5, 6, 7], [8, 9], [3, 4, 5, 6]], length=6)
    np.testing.assert_array_equal(rows["token_ids"], [[3, 4, 5, 6, 8, 9], [5, 6, 7, 0, 0, 0]])
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1, 2, 2], [1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 0]])
    np.testing.assert_array_equal(rows["targets"], [[4, 5, 6, 0, 9, 0], [6, 7, 0, 0, 0, 0]])
    np.testing.assert_array_equal(rows["loss_mask"], [[1, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0]])
    assert {k: v.dtype for k, v in rows.items()} == {
        "token_ids": np.int32,
        "segment_ids": np.int32,
        "positions": np.int32,
        "targets": np.int32,
        "loss_mask": bool,
    }


def _unpack(rows):
    """The documents of packed rows, as lists, from the ids."""
    documents = []
    for tokens, ids in zip(rows["token_ids"], rows["segment_ids"]):
        for i in range(1, ids.max() + 1):
            documents.append(tokens[ids == i].tolist())
        assert (ids[ids > 0] == np.sort(ids[ids > 0])).all()  # contiguous, in order
    return documents


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 20), max_size=12),
    length=st.integers(1, 16),
    overflow=st.sampled_from(["split", "truncate"]),
)
def test_every_token_lands_once_with_its_document(lengths, length, overflow):
    rng = np.random.default_rng(len(lengths))
    sequences = [rng.integers(1, 100, n).tolist() for n in lengths]
    rows = packing.pack(sequences, length, pad_id=-1, overflow=overflow)
    expected = []
    for s in sequences:
        s = s[:length] if overflow == "truncate" else s
        expected.extend(s[i : i + length] for i in range(0, len(s), length))
    assert sorted(_unpack(rows)) == sorted(expected)
    padding = rows["segment_ids"] == 0
    assert (rows["token_ids"][padding] == -1).all()
    for r in range(len(rows["token_ids"])):
        ids, positions = rows["segment_ids"][r], rows["positions"][r]
        for i in range(1, ids.max() + 1):
            np.testing.assert_array_equal(positions[ids == i], np.arange((ids == i).sum()))
        # The target is the next token of the same document, where there is one.
        same_next = np.append((ids[1:] == ids[:-1]) & (ids[1:] > 0), False)
        np.testing.assert_array_equal(rows["loss_mask"][r], same_next)
        np.testing.assert_array_equal(
            rows["targets"][r][same_next], rows["token_ids"][r][1:][same_next[:-1]]
        )
    # First fit: no two rows' documents would have fitted in one.
    used = (~padding).sum(axis=1)
    for a in range(len(used)):
        for b in range(a + 1, len(used)):
            smallest = min(len(d) for d in _unpack({k: v[b : b + 1] for k, v in rows.items()}))
            assert used[a] + smallest > length


@pytest.mark.parametrize(
    "kwargs, name, expected",
    [
        (dict(sequences=[[1, 2, 3]], length=2, overflow="error"), "sequences", "of at most"),
        (dict(sequences=[[1.5, 2.0]], length=4), "sequences", "1-d integer"),
        (dict(sequences=[[[1, 2]]], length=4), "sequences", "1-d integer"),
        (dict(sequences=[[1]], length=0), "length", "a positive integer"),
        (dict(sequences=[[1]], length=4, overflow="drop"), "overflow", "one of"),
    ],
)
def test_bad_input_is_rejected_by_name(kwargs, name, expected):
    with pytest.raises(ValueError, match=rf"argument `{name}`, expected .*{expected}"):
        packing.pack(**kwargs)


def test_no_sequences_give_no_rows():
    rows = packing.pack([], 8)
    assert rows["token_ids"].shape == (0, 8)
