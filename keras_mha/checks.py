"""Argument and input validation with messages that name the argument, the expectation
and what was received. Nothing here touches layer state, so a rejected call changes
nothing.

Two rules hold throughout:

- Where the built-in `keras.layers.MultiHeadAttention` has an error message, ours
  starts with the built-in's wording (users' code and Keras's tests match on it),
  then says which argument, what was expected and what came.
- Only known sizes can mismatch. A dimension is known when it is a Python or NumPy
  int; `None` (Keras, TensorFlow), torch.export's `SymInt`, a traced tensor, a JAX
  symbolic dimension are unknown and never called a mismatch.
"""

import math
import numbers
import sys

import numpy as np

# The built-in's messages, kept verbatim at the start of ours.
KERAS_KEY_VALUE_DIMS = "All dimensions of `value` and `key`, except the last one, must be equal."
KERAS_OUTPUT_SHAPE = "Invalid `output_shape`: {value}."
KERAS_ATTENTION_AXES = "`attention_axes` must be an int, list, or tuple."
KERAS_SLIDING_WINDOW = "`sliding_window` must be `None` or a positive integer."
KERAS_KV_HEADS = "`num_query_heads` must be divisible by `num_key_value_heads`."


def invalid(name, expected, received, extra="", keras_wording=None):
    """The ValueError every check raises, in Keras's own wording.

    Args:
        name: the argument.
        expected: what it should have been.
        received: what came (formatted with `repr`).
        extra: context appended after the received value.
        keras_wording: the built-in layer's message for the same error, put first.
    """
    suffix = f" {extra}" if extra else ""
    prefix = f"{keras_wording} " if keras_wording else ""
    return ValueError(
        f"{prefix}Received an invalid value for argument `{name}`, expected {expected}. "
        f"Received: {name}={received!r}{suffix}"
    )


# ------------------------------------------------------------------------ dimensions
def is_known(dim):
    """Whether `dim` is a concrete size (a Python or NumPy int, not a bool)."""
    return isinstance(dim, (int, np.integer)) and not isinstance(dim, (bool, np.bool_))


def dims_differ(a, b, broadcast=False):
    """Both sizes known and different (and, with `broadcast`, neither of them 1)."""
    if not (is_known(a) and is_known(b)) or a == b:
        return False
    return not (broadcast and 1 in (a, b))


def shape_str(shape):
    """`(2, None, 8)`: a shape with unknown dims as `None`, whatever their type."""
    dims = tuple(int(d) if is_known(d) else None for d in shape)
    inner = ", ".join("None" if d is None else str(d) for d in dims)
    return f"({inner},)" if len(dims) == 1 else f"({inner})"


def _shape(value):
    return tuple(getattr(value, "shape", ()))


# ---------------------------------------------------------------------- constructor
def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def positive_int(name, value, allow_none=False, keras_wording=None):
    if value is None and allow_none:
        return None
    if not _is_int(value) or value <= 0:
        expected = "a positive integer" + (" or `None`" if allow_none else "")
        raise invalid(name, expected, value, keras_wording=keras_wording)
    return int(value)


def integer(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if not _is_int(value):
        raise invalid(name, "an integer" + (" or `None`" if allow_none else ""), value)
    return int(value)


def rate(name, value):
    if (
        not isinstance(value, numbers.Real)
        or isinstance(value, (bool, np.bool_))
        or not 0.0 <= float(value) < 1.0
    ):
        raise invalid(name, "a float in [0, 1)", value)
    return float(value)


def flag(name, value, allow_none=False):
    """A boolean flag, given as the built-in accepts it: a Python or NumPy bool or an
    int (truthy or not). Returns a Python bool, or `None` when allowed and given."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or _is_int(value):
        return bool(value)
    expected = "a boolean (or an int)" + (" or `None`" if allow_none else "")
    raise invalid(name, expected, value)


def one_of(name, value, choices):
    if value not in choices:
        raise invalid(name, "one of " + ", ".join(repr(c) for c in choices), value)
    return value


def sliding_window(value):
    """`None`, a positive int `w` (`|t - s| < w`), or a pair `(left, right)` of
    non-negative ints (`t - left <= s <= t + right`), given as a tuple or list ->
    an int or a tuple."""
    if value is None:
        return None
    if _is_int(value) and value > 0:
        return int(value)
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(_is_int(side) and side >= 0 for side in value)
    ):
        return (int(value[0]), int(value[1]))
    raise invalid(
        "sliding_window",
        "`None`, a positive integer, or a pair `(left, right)` of non-negative integers",
        value,
        keras_wording=KERAS_SLIDING_WINDOW,
    )


def output_shape(value):
    """`None`, a positive int, or a non-empty tuple/list of positive ints -> tuple."""
    if value is None:
        return None
    given = value
    if _is_int(value):
        value = (value,)
    if (
        not isinstance(value, (tuple, list))
        or not value
        or not all(_is_int(d) and d > 0 for d in value)
    ):
        raise invalid(
            "output_shape",
            "a positive int or a tuple of positive ints",
            given,
            keras_wording=KERAS_OUTPUT_SHAPE.format(value=given),
        )
    return tuple(int(d) for d in value)


def attention_axes(value):
    """`None`, an int, or a tuple/list of distinct ints other than 0 (the batch)."""
    if value is None:
        return None
    given = value
    if _is_int(value):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not value:
        raise invalid(
            "attention_axes",
            "`None`, an int, or a tuple of ints",
            given,
            keras_wording=KERAS_ATTENTION_AXES,
        )
    if not all(_is_int(a) for a in value):
        raise invalid("attention_axes", "`None`, an int, or a tuple of ints", given)
    if 0 in value:
        raise invalid("attention_axes", "axes other than 0 (the batch axis)", given)
    if len(set(value)) != len(value):
        raise invalid("attention_axes", "distinct axes", given)
    return tuple(int(a) for a in value)


def attention_axes_for_rank(axes, input_rank):
    """Checks `axes` against a rank-`input_rank` query; returns them non-negative."""
    if axes is None:
        return tuple(range(1, input_rank - 1))
    high = input_rank - 2
    normalized = tuple(a if a >= 0 else input_rank + a for a in axes)
    if any(not 1 <= a <= high for a in normalized) or len(set(normalized)) != len(axes):
        raise invalid(
            "attention_axes",
            f"distinct axes in [1, {high}] or [{1 - input_rank}, -2] (neither the "
            f"batch axis nor the feature axis) for rank-{input_rank} inputs",
            axes,
        )
    return normalized


# --------------------------------------------------------------------------- inputs
def input_shapes(query_shape, value_shape, key_shape, building=False):
    """Ranks and matching dims of query/value/key.

    With `building`, the last dimensions must be known: the projections' weights are
    made from them. Afterwards they may be symbolic (a tracer's), like any other.
    """
    query_shape, value_shape = _as_shape("query", query_shape), _as_shape("value", value_shape)
    key_shape = value_shape if key_shape is None else _as_shape("key", key_shape)
    # The built-in's first check, with its wording: key and value agree but for
    # their last dimension (a rank mismatch included).
    if len(key_shape) != len(value_shape) or any(
        dims_differ(v, k) for v, k in zip(value_shape[1:-1], key_shape[1:-1])
    ):
        raise invalid(
            "key",
            f"the dimensions of `value` but the last one, {shape_str(value_shape[:-1])}",
            f"shape {shape_str(key_shape)}",
            f"with value.shape={shape_str(value_shape)}",
            keras_wording=KERAS_KEY_VALUE_DIMS,
        )
    if len(query_shape) < 3:
        raise invalid(
            "query",
            "a tensor of rank >= 3, (B, T, dim) or (B, ..., dim)",
            f"shape {shape_str(query_shape)}",
        )
    for name, shape in (("value", value_shape), ("key", key_shape)):
        if len(shape) != len(query_shape):
            raise invalid(
                name,
                f"the same rank as `query` ({len(query_shape)})",
                f"shape {shape_str(shape)}",
                f"with query.shape={shape_str(query_shape)}",
            )
    for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
        if building and not is_known(shape[-1]):
            raise invalid(name, "a known last dimension", f"shape {shape_str(shape)}")
    batches = {int(d) for d in (query_shape[0], value_shape[0], key_shape[0]) if is_known(d)}
    if len(batches - {1}) > 1:
        raise invalid(
            "value",
            "the same batch size as `query`",
            f"shape {shape_str(value_shape)}",
            f"with query.shape={shape_str(query_shape)}, key.shape={shape_str(key_shape)}",
        )
    return query_shape, value_shape, key_shape


def _as_shape(name, shape):
    try:
        return tuple(shape)
    except TypeError:
        raise invalid(name, "a shape (a tuple of dimensions)", shape) from None


def free_axes(query_shape, value_shape, axes):
    """N-d attention: on the axes attention does not run over (but the batch), value
    and key must have the query's sizes, or 1 to broadcast over them.

    Args:
        query_shape, value_shape: the inputs' shapes, of the same rank.
        axes: non-negative attention axes (see `attention_axes_for_rank`).
    """
    free = [i for i in range(1, len(query_shape) - 1) if i not in axes]
    if any(dims_differ(value_shape[i], query_shape[i], broadcast=True) for i in free):
        raise invalid(
            "value",
            f"the sizes of `query` (or 1) on axes {tuple(free)}, which attention "
            f"(attention_axes={tuple(axes)}) does not run over",
            f"shape {shape_str(value_shape)}",
            f"with query.shape={shape_str(query_shape)}",
        )


def scores_shape(query_shape, value_shape, axes, num_heads):
    """`(B, <free axes>, N, <query attention dims>, <key attention dims>)`."""
    free = tuple(query_shape[i] for i in range(1, len(query_shape) - 1) if i not in axes)
    return (
        (query_shape[0],)
        + free
        + (num_heads,)
        + tuple(query_shape[a] for a in axes)
        + tuple(value_shape[a] for a in axes)
    )


# Calls that passed `call_arguments`, by what it can read of them: each argument's
# name, type, shape and dtype, and the layer's settings. The same again passes
# unchecked (a small model's eager call repeats the same shapes, and the checks'
# Python was a few percent of its predict on torch).
_PASSED = set()
_PASSED_LIMIT = 4096


def call_arguments(arguments, axes, num_heads, rotates=False, position_streams=None):
    """A call's inputs and masks, checked before Keras converts them to tensors (a
    string mask would fail there, naming nothing) or builds the layer, so a rejected
    call leaves no weights behind. (Its flags are checked by `flag` as they come.)
    A call like one that passed (`_passed_key`) is not checked again.

    Args:
        arguments: the call's arguments by name (`inspect.BoundArguments.arguments`).
        axes: the layer's `attention_axes` (as given, or normalized once built).
        num_heads: the layer's number of (query) heads.
        rotates: the layer applies rotary embeddings (`positions` needs them).
        position_streams: `None`, or M-RoPE's number of position streams `P`:
            `positions` may then also be `(B, P, T)`.
    """
    passed = _passed_key(arguments, axes, num_heads, rotates, position_streams)
    if passed is not None and passed in _PASSED:
        return
    _call_arguments(arguments, axes, num_heads, rotates, position_streams)
    if passed is not None:
        if len(_PASSED) >= _PASSED_LIMIT:
            _PASSED.clear()
        _PASSED.add(passed)


def _passed_key(arguments, axes, num_heads, rotates, position_streams):
    """What `call_arguments` reads of a call, hashable; `None` where it is not (a
    symbolic size torch.export traces) or while torch's compiler traces the call."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.compiler.is_compiling():
        return None
    parts = []
    try:
        for name, value in arguments.items():
            shape = tuple(value.shape) if hasattr(value, "shape") else None
            parts.append((name, type(value), shape, str(getattr(value, "dtype", None))))
        if axes is not None and not isinstance(axes, int):
            axes = tuple(axes)
        key = (tuple(parts), axes, num_heads, rotates, position_streams)
        hash(key)
    except (TypeError, ValueError):  # a shape of unknown rank, a symbolic size
        return None
    return key


def _call_arguments(arguments, axes, num_heads, rotates, position_streams):
    query, value, key = (arguments.get(name) for name in ("query", "value", "key"))
    if not all(hasattr(x, "shape") for x in (query, value) + ((key,) if key is not None else ())):
        return
    query_shape, value_shape, key_shape = input_shapes(
        query.shape, value.shape, None if key is None else key.shape
    )
    axes = attention_axes_for_rank(axes, len(query_shape))
    free_axes(query_shape, value_shape, axes)
    cache = arguments.get("cache")
    if cache is None:
        cache = arguments.get("shared_key_value")  # keys and values held elsewhere
    packed(
        arguments.get("segment_ids"),
        arguments.get("key_segment_ids"),
        arguments.get("positions"),
        query_shape,
        key_shape if cache is None else (query_shape[0], _shape(cache)[2]),
        cached=cache is not None,
        rotates=rotates,
        position_streams=position_streams,
    )
    _key_positions(arguments.get("key_positions"), key_shape, rotates, position_streams)
    if cache is not None:
        return  # masks then cover the cache's positions; `call` checks them
    scores = scores_shape(query_shape, value_shape, axes, num_heads)
    attention_bias(arguments.get("attention_bias"), scores)
    batch = query_shape[:1]
    mask("query_mask", arguments.get("query_mask"), batch + query_shape[1:-1])
    mask("value_mask", arguments.get("value_mask"), batch + value_shape[1:-1])
    mask("key_mask", arguments.get("key_mask"), batch + key_shape[1:-1])
    attention_mask(arguments.get("attention_mask"), scores, len(axes))


def packed(
    segment_ids,
    key_segment_ids,
    positions,
    query_shape,
    key_shape,
    cached,
    rotates,
    position_streams=None,
):
    """Packed rows' document ids and positions: integer `(B, T)` (the keys' ids
    `(B, S)`), on `(B, T, dim)` inputs; keys of another length than the queries (or a
    cache) need their own ids; `positions` need rotary embeddings and keys rotated
    along with the queries (self-attention or a cache).

    Args:
        segment_ids, key_segment_ids, positions: the call's arguments, or `None`.
        query_shape: `(B, T, dim)`; key_shape: `(B, S, ...)` (with a cache, `S` is
            its length).
        cached: a cache is given.
        rotates: the layer has rotary embeddings.
        position_streams: `None`, or M-RoPE's number of position streams `P`:
            `positions` may then also be `(B, P, T)`.
    """
    given = [
        (name, value)
        for name, value in (
            ("segment_ids", segment_ids),
            ("key_segment_ids", key_segment_ids),
            ("positions", positions),
        )
        if value is not None
    ]
    if not given:
        return
    if len(query_shape) != 3:
        name, value = given[0]
        raise invalid(
            name,
            "`None` unless the inputs are (B, T, dim) sequences",
            f"shape {shape_str(_shape(value))}",
            extra=f"with a query of shape {shape_str(query_shape)}",
        )
    queries, keys = query_shape[:2], tuple(key_shape[:2])
    streams = None if position_streams is None else (queries[0], position_streams, queries[1])
    for name, value, expected in (
        ("segment_ids", segment_ids, queries),
        ("key_segment_ids", key_segment_ids, keys),
        ("positions", positions, queries),
    ):
        if name == "positions" and streams is not None and len(_shape(value)) == 3:
            expected = streams
        _integer_ids(name, value, expected)
    if key_segment_ids is not None and segment_ids is None:
        raise invalid(
            "key_segment_ids",
            "`None` when no `segment_ids` are given (the queries' document ids)",
            f"shape {shape_str(_shape(key_segment_ids))}",
        )
    if segment_ids is not None and key_segment_ids is None:
        if cached or dims_differ(queries[1], keys[1]):
            raise invalid(
                "key_segment_ids",
                f"the keys' document ids, shape {shape_str(keys)}, when the keys are "
                "not the queries (another length, or a cache)",
                None,
            )
    if positions is not None:
        if not rotates:
            raise invalid(
                "positions",
                "`None` on a layer without rotary embeddings (`rope_max_wavelength`)",
                f"shape {shape_str(_shape(positions))}",
            )
        if not cached and dims_differ(queries[1], keys[1]):
            raise invalid(
                "positions",
                "`None` when the keys (rotated at the same positions) are not as long as "
                f"the queries; keys: {shape_str(keys)}",
                f"shape {shape_str(_shape(positions))}",
            )


def _key_positions(key_positions, key_shape, rotates, position_streams):
    """The keys' own RoPE positions: integer `(B, S)` (`S` the keys passed, not a
    cache's length; M-RoPE's `(B, P, S)` too), on a layer with rotary embeddings."""
    if key_positions is None:
        return
    if not rotates or len(key_shape) != 3:
        raise invalid(
            "key_positions",
            "`None` unless the layer has rotary embeddings (`rope_max_wavelength`) and the "
            "inputs are (B, T, dim) sequences",
            f"shape {shape_str(_shape(key_positions))}",
        )
    expected = tuple(key_shape[:2])
    if position_streams is not None and len(_shape(key_positions)) == 3:
        expected = (expected[0], position_streams, expected[1])
    _integer_ids("key_positions", key_positions, expected)


def _integer_ids(name, value, expected_shape):
    """An integer tensor (or array) of `expected_shape` (`(B, L)`, or M-RoPE's
    `(B, P, T)` positions)."""
    if value is None:
        return
    dtype = str(getattr(value, "dtype", type(value).__name__))
    if "int" not in dtype:
        raise invalid(name, "an integer tensor", f"dtype {dtype}")
    shape = _shape(value)
    if len(shape) != len(expected_shape) or any(
        dims_differ(a, b) for a, b in zip(shape, expected_shape)
    ):
        raise invalid(
            name, f"a tensor of shape {shape_str(expected_shape)}", f"shape {shape_str(shape)}"
        )


def _mask_dtype(name, mask_value):
    dtype = str(getattr(mask_value, "dtype", type(mask_value).__name__))
    if not any(k in dtype for k in ("bool", "int", "float")):
        raise invalid(name, "a boolean (or 0/1 numeric) mask", f"dtype {dtype}")


def cache_update_mask(mask_value, cache_update_index, query_shape):
    """`(B, T)` (bool or 0/1) flags of the new cache entries, only with a
    `cache_update_index` (hence a cache)."""
    if mask_value is None:
        return
    if cache_update_index is None:
        raise invalid(
            "cache_update_mask",
            "`None` unless a `cache` and a `cache_update_index` are given",
            f"shape {shape_str(_shape(mask_value))}",
        )
    _mask_dtype("cache_update_mask", mask_value)
    shape = _shape(mask_value)
    expected = tuple(query_shape[:2])
    if len(shape) != 2 or any(dims_differ(a, b) for a, b in zip(shape, expected)):
        raise invalid(
            "cache_update_mask",
            f"a mask of shape {shape_str(expected)}",
            f"shape {shape_str(shape)}",
        )


def mask(name, mask_value, expected_shape):
    """A padding mask must be bool/int/float and broadcast to `expected_shape`."""
    if mask_value is None:
        return
    _mask_dtype(name, mask_value)
    shape = _shape(mask_value)
    if len(shape) > len(expected_shape) or not _broadcasts(shape, expected_shape):
        raise invalid(
            name,
            f"a mask broadcastable to {shape_str(expected_shape)}",
            f"shape {shape_str(shape)}",
        )


def attention_mask(mask_value, scores_shape_, num_attention_axes):
    """`attention_mask` must be bool/int/float and broadcast to the scores
    `(B, <free axes>, N, <query attention dims>, <key attention dims>)` the way the
    built-in broadcasts it: missing axes are inserted just before the query attention
    dims, so `(T, S)`, `(B, T, S)` and `(B, N, T, S)` all fit `(B, N, T, S)` scores.

    Args:
        mask_value: the mask, or `None`.
        scores_shape_: the scores' shape (see `scores_shape`).
        num_attention_axes: how many axes attention runs over (1 for sequences).
    """
    if mask_value is None:
        return
    _mask_dtype("attention_mask", mask_value)
    shape = _shape(mask_value)
    scores_rank = len(scores_shape_)
    n = num_attention_axes
    if len(shape) > scores_rank:
        ok = False
    else:
        at = max(len(shape) - 2 * n, 0)
        expanded = shape[:at] + (1,) * (scores_rank - len(shape)) + shape[at:]
        ok = _broadcasts(expanded, scores_shape_)
    if not ok:
        raise invalid(
            "attention_mask",
            f"a mask broadcastable to the scores {shape_str(scores_shape_)} "
            "(B, <other axes>, num_heads, <query attention dims>, <key attention dims>); "
            "missing axes are inserted before the query attention dims",
            f"shape {shape_str(shape)}",
        )


def _broadcasts(shape, target):
    """Whether a mask of `shape` broadcasts to `target` (aligned on the right)."""
    for have, want in zip(reversed(shape), reversed(target)):
        if is_known(have) and have == 1:
            continue
        if dims_differ(have, want):
            return False
    return True


def positive_number(name, value, allow_none=False):
    """A finite real number > 0 (or `None` when allowed) -> float."""
    if value is None and allow_none:
        return None
    if (
        not isinstance(value, numbers.Real)
        or isinstance(value, bool)
        or not math.isfinite(float(value))
        or float(value) <= 0.0
    ):
        expected = "a positive number" + (" or `None`" if allow_none else "")
        raise invalid(name, expected, value)
    return float(value)


def attention_bias(bias, expected_shape):
    """A float tensor broadcastable to the scores `(B, N, T, S)`."""
    if bias is None:
        return
    shape = _shape(bias)
    dtype = str(getattr(bias, "dtype", type(bias).__name__))
    if "float" not in dtype:
        raise invalid("attention_bias", "a float tensor", f"dtype {dtype}")
    if len(shape) > len(expected_shape) or not _broadcasts(shape, expected_shape):
        raise invalid(
            "attention_bias",
            f"a tensor broadcastable to the scores {shape_str(expected_shape)}",
            f"shape {shape_str(shape)}",
        )


def block_mask(value, batch, heads, query_length, key_length, offset):
    """A `BlockMask` describes the call: its `S` is the keys', its batch and heads are
    the call's (where it has them), and it covers the queries' positions `offset + t`.

    Args:
        value: the `block_mask.BlockMask`.
        batch, heads: the call's `B` and number of heads (`None` when unknown).
        query_length, key_length: the call's `T` and `S` (`None` when unknown).
        offset: the first query's position: `None` (0), an int or a tensor.
    """
    expected = None
    if dims_differ(value.key_length, key_length):
        expected = f"a mask over S={key_length} keys"
    elif value.batch is not None and dims_differ(value.batch, batch):
        expected = f"a mask for batch size {batch} (or built with B=None)"
    elif value.heads is not None and dims_differ(value.heads, heads):
        expected = f"a mask for {heads} heads (or built with H=None)"
    else:
        start = 0 if offset is None else offset
        if is_known(start) and is_known(query_length):
            if start + query_length > value.query_length:
                expected = f"a mask over at least {start + query_length} query positions"
    if expected is not None:
        raise invalid("mask_mod", expected, value)
