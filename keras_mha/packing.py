"""Packing variable-length token sequences into rows of one length (pure NumPy).

Padding every batch to its longest document wastes most of the compute on long-tailed
lengths; packing puts several documents in each row instead, and the layer's
`segment_ids` keep attention inside each document:

    rows = pack([[5, 6, 7], [8, 9], [3, 4, 5, 6]], length=6)
    rows["token_ids"]    # [[3, 4, 5, 6, 8, 9], [5, 6, 7, 0, 0, 0]]
    rows["segment_ids"]  # [[1, 1, 1, 1, 2, 2], [1, 1, 1, 0, 0, 0]]   0 = padding
    rows["positions"]    # [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 0]]
    rows["loss_mask"]    # [[1, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0]]

For a causal language model, position `t` predicts `targets[t]` (the next token of its
own document); `loss_mask` is `True` exactly where there is one, so no document learns
to predict the next document's first token, and padding counts for nothing.
"""

import numpy as np

from keras_mha import checks

OVERFLOWS = ("split", "truncate", "error")


def pack(sequences, length, pad_id=0, overflow="split", target_masks=None):
    """Packs token sequences into rows of `length` tokens, first-fit decreasing.

    Sequences are placed longest first, each in the first row with room for it (a
    new row when none has), so rows are well filled; within a row the documents keep
    the order in which they were placed. Each document gets an id, 1, 2, ... in its
    row; id 0 is padding (the layer's `segment_ids` convention).

    Args:
        sequences: an iterable of 1-d integer sequences (lists or arrays).
        length: tokens per row, `T`.
        pad_id: the token id of padding positions.
        overflow: what to do with a sequence longer than `length`: "split" it into
            pieces of at most `length` tokens (each its own document), "truncate" it
            to its first `length` tokens, or raise ("error").
        target_masks: `None` (every next token of a document is a target), or an
            iterable of 1-d boolean masks, one per sequence and of its length: which
            of its tokens are to be predicted (a prompt's tokens marked `False` are
            read but never learned). A split sequence's pieces keep their part of it.

    Returns:
        A dict of NumPy arrays, each `(R, length)`: `token_ids` (int32),
        `segment_ids` (int32, 0 for padding), `positions` (int32, each document's
        own positions from 0), `targets` (int32, the next token of the same
        document, `pad_id` where there is none) and `loss_mask` (bool, `True` where
        `targets` is a real next token, and one of `target_masks`). `R` is the
        number of rows used.
    """
    length = checks.positive_int("length", length)
    checks.one_of("overflow", overflow, OVERFLOWS)
    documents = _documents(sequences, length, overflow, target_masks)
    rows, room = [], []
    for index in sorted(range(len(documents)), key=lambda i: -len(documents[i][0])):
        document = documents[index]
        row = next((r for r, free in enumerate(room) if free >= len(document[0])), None)
        if row is None:
            rows.append([])
            room.append(length)
            row = len(rows) - 1
        rows[row].append(document)
        room[row] -= len(document[0])
    shape = (len(rows), length)
    packed = {
        "token_ids": np.full(shape, pad_id, "int32"),
        "segment_ids": np.zeros(shape, "int32"),
        "positions": np.zeros(shape, "int32"),
        "targets": np.full(shape, pad_id, "int32"),
        "loss_mask": np.zeros(shape, bool),
    }
    for r, documents_of_row in enumerate(rows):
        start = 0
        for i, (document, predicted) in enumerate(documents_of_row):
            end = start + len(document)
            packed["token_ids"][r, start:end] = document
            packed["segment_ids"][r, start:end] = i + 1
            packed["positions"][r, start:end] = np.arange(len(document))
            packed["targets"][r, start : end - 1] = document[1:]
            packed["loss_mask"][r, start : end - 1] = predicted[1:]
            start = end
    return packed


def _documents(sequences, length, overflow, target_masks):
    """The sequences as `(tokens, predicted)` pairs of 1 to `length` tokens each
    (int32 tokens, boolean masks; empty sequences dropped)."""
    sequences = list(sequences)
    if target_masks is None:
        masks = [None] * len(sequences)
    else:
        masks = list(target_masks)
        if len(masks) != len(sequences):
            raise checks.invalid(
                "target_masks",
                f"one mask per sequence ({len(sequences)})",
                f"{len(masks)} masks",
            )
    documents = []
    for i, (sequence, mask) in enumerate(zip(sequences, masks)):
        document = np.asarray(sequence)
        if document.ndim != 1 or (document.size and not np.issubdtype(document.dtype, np.integer)):
            raise checks.invalid(
                "sequences",
                "1-d integer sequences",
                f"shape {document.shape}, dtype {document.dtype}",
                extra=f"at index {i}",
            )
        document = document.astype("int32")
        predicted = np.ones(len(document), bool) if mask is None else np.asarray(mask, bool)
        if predicted.shape != document.shape:
            raise checks.invalid(
                "target_masks",
                "masks of their sequences' shapes",
                f"shape {predicted.shape} for a sequence of shape {document.shape}",
                extra=f"at index {i}",
            )
        if len(document) > length:
            if overflow == "error":
                raise checks.invalid(
                    "sequences",
                    f"sequences of at most `length={length}` tokens (or `overflow` "
                    "'split' or 'truncate')",
                    f"a sequence of {len(document)} tokens",
                    extra=f"at index {i}",
                )
            if overflow == "truncate":
                document, predicted = document[:length], predicted[:length]
        documents.extend(
            (document[s : s + length], predicted[s : s + length])
            for s in range(0, len(document), length)
        )
    return documents
