"""Padded tails cut off before a kernel runs, where the masks hold data.

Padding sits at the end of a row (`Embedding(mask_zero=True)` on right-padded token
ids, packed rows' trailing id 0). Where the tensors hold data (eager calls: torch's
training and inference, any backend outside a compiled function), the queries after
the last one that some batch row keeps, and the keys after the last one that some
query may see, are cut off before the kernel runs; the output gets zero rows back for
the cut queries (a padded query attends to nothing), and their gradients are zero.
A padding mask that the cut leaves all True goes: a padded causal call of one row
becomes a plain causal call, which the backends' fused kernels take with `is_causal`
and their own causal block skipping. So does a key padding that causality already
hides from every query left unpadded (right-padded causal self-attention, rows of any
lengths): the padded queries' rows are zeroed as before.

Compiled calls (a traced graph, `jax.jit`, an export) keep their static shapes; the
chunked kernel skips blocks at run time there itself.
"""

import dataclasses
import warnings

import numpy as np
from keras import backend, ops

from keras_mha import masks as masks_lib


@dataclasses.dataclass(frozen=True)
class Cut:
    """Where a call is cut: its first `queries` queries against its first `keys`
    keys, under `mask` (the call's mask over that block, all-True factors dropped)."""

    queries: int
    keys: int
    mask: object

    def inputs(self, query, key, value, bias):
        """The call's tensors over the kept block."""
        kept = (
            masks_lib.slice_along(query, 1, 0, self.queries),
            masks_lib.slice_along(key, 1, 0, self.keys),
            masks_lib.slice_along(value, 1, 0, self.keys),
        )
        if bias is not None:
            bias = masks_lib.block_of(ops.convert_to_tensor(bias), 0, self.queries, 0, self.keys)
        return kept + (bias,)

    def output(self, output, query_length):
        """`output` `(B, queries, N, Hv)` with zero rows for the cut queries."""
        if self.queries == query_length:
            return output
        return masks_lib.pad_along(output, 1, 0, query_length - self.queries)


def cut(query, key, mask, *, dropout):
    """A `Cut` of a rank-4 call `(B, T, N, H)` x `(B, S, N, H)` under `mask` (an
    `AttentionMask`), or `None` where nothing is cut or the masks hold no data.

    Not with attention dropout: its mask is a hash of each weight's position in the
    whole `(T, S)`, which a cut call would number differently from a compiled one.
    The padding and document ids are read to the host once (`(B, T)` and `(B, S)`,
    a transfer each) and the cut is found there, in NumPy: no device op, and no
    device sync, per question asked of them.
    """
    if mask is None or dropout or len(query.shape) != 4 or not holds_data(query):
        return None
    query_length, key_length = query.shape[1], key.shape[1]
    offset = mask.static_offset
    if not (isinstance(query_length, int) and isinstance(key_length, int)) or offset is None:
        return None
    query_valid = _host(mask.query_valid)
    key_valid = query_valid if mask.key_valid is mask.query_valid else _host(mask.key_valid)
    query_ids = _host(mask.query_segments)
    key_ids = query_ids if mask.key_segments is mask.query_segments else None
    if key_ids is None:
        key_ids = _host(mask.key_segments)
    queries = _kept(query_length, query_valid, query_ids)
    # The keys after the last one the kept queries may see by causality and the window.
    _, keys = mask.key_range(0, queries, _kept(key_length, key_valid, key_ids))
    if queries <= 0 or keys <= 0:
        return None  # no query sees a key: the kernels' own empty rows
    # What the cut changes is found on the host first: a call it leaves as it is
    # (most small ones) costs no device op.
    query_valid, key_valid = _head(query_valid, queries), _head(key_valid, keys)
    keeps_queries = _keeps(query_valid)
    keeps_keys = _keeps(key_valid)
    if keeps_queries and keeps_keys and _hidden_by_causality(mask, key_valid, query_valid):
        keeps_keys = False
    dropped = (mask.query_valid is not None and not keeps_queries) or (
        mask.key_valid is not None and not keeps_keys
    )
    if (queries, keys) == (query_length, key_length) and not dropped:
        return None
    kept = dataclasses.replace(
        mask,
        query_valid=_padding(mask.query_valid, keeps_queries, queries),
        key_valid=_padding(mask.key_valid, keeps_keys, keys),
        dense=None if mask.dense is None else masks_lib.block_of(mask.dense, 0, queries, 0, keys),
        query_segments=_ids(mask.query_segments, queries),
        key_segments=_ids(mask.key_segments, keys),
    )
    return Cut(queries, keys, kept)


def _host(x):
    """A `(B, L)` padding or ids as a NumPy array (booleans as they are), or `None`.

    Keras's torch `convert_to_numpy` warns (NumPy's `copy` keyword) on the way: the
    layer's call must raise no warning (Keras's `test_no_warning_with_keras_mask`)."""
    if x is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return np.asarray(ops.convert_to_numpy(x))


def _head(x, length):
    """A host `(B, L)` array's first `length` positions (a `(B, 1)` one as it is)."""
    return x if x is None or x.shape[1] == 1 else x[:, :length]


def _kept(length, valid, segments):
    """How many leading positions some batch row keeps: up to the last one whose
    padding is True and whose document id is not 0 (host arrays)."""
    kept = None
    if valid is not None and valid.shape[1] == length and length != 1:
        kept = valid.astype(bool)
    if segments is not None:
        kept = segments != 0 if kept is None else kept & (segments != 0)
    if kept is None:
        return length
    positions = np.flatnonzero(kept.any(axis=0))
    return int(positions[-1]) + 1 if positions.size else 0


def _hidden_by_causality(mask, keys, queries):
    """Whether causality alone already hides every padded key from every kept query:
    each row's keys are right-padded (a prefix of True), and each query past its row's
    last key is padded too (its output is zeroed). A right-padded causal self-attention
    (`Embedding(mask_zero=True)`) then needs no key mask: the fused kernels take it
    with `is_causal`, rows of any lengths. `keys`, `queries`: the kept padding on the
    host."""
    if not mask.causal or mask.static_offset != 0:
        return False
    if keys.shape[1] == 1 or queries.shape[1] == 1:
        return False
    keys, queries = keys.astype(bool), queries.astype(bool)
    lengths = keys.sum(axis=1, keepdims=True)
    prefix = np.all(keys == (np.arange(keys.shape[1])[None] < lengths))
    before = np.arange(queries.shape[1])[None] < lengths
    return bool(prefix and np.all(~queries | before))


def _keeps(host):
    """Whether a cut padding mask (on the host, or `None`) still hides a position."""
    return host is not None and not host.astype(bool).all()


def _padding(valid, keeps, length):
    """A `(B, L)` padding mask cut to `length` positions; `None` where it hides no
    position any more (`keeps` is False)."""
    if valid is None or not keeps:
        return None
    return valid if valid.shape[1] == 1 else masks_lib.slice_along(valid, 1, 0, length)


def _ids(segments, length):
    return None if segments is None else masks_lib.slice_along(segments, 1, 0, length)


def holds_data(x):
    """Whether `x` holds data now: an eager call, not a trace (`torch.jit.trace`
    included), an export or the shape inference of a symbolic call."""
    name = backend.backend()
    if name == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    if name == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    if name == "torch":
        import torch

        # `torch.jit.trace` (OpenVINO's export, ONNX's TorchScript one) records Python
        # ints read from the data as constants: a trace holds no data either.
        compiling = torch.compiler.is_compiling() or torch.compiler.is_exporting()
        compiling = compiling or torch.jit.is_tracing()
        device = getattr(x, "device", None)  # NumPy arrays name theirs as a string
        return not compiling and getattr(device, "type", device) != "meta"
    return False
