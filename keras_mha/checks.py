"""Argument and input validation with messages that name the argument, the expectation
and what was received. Nothing here touches layer state, so a rejected call changes
nothing."""

import math
import numbers


def invalid(name, expected, received, extra=""):
    """The ValueError every check raises, in Keras's own wording."""
    suffix = f" {extra}" if extra else ""
    return ValueError(
        f"Received an invalid value for argument `{name}`, expected {expected}. "
        f"Received: {name}={received!r}{suffix}"
    )


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if not _is_int(value) or value <= 0:
        expected = "a positive integer" + (" or `None`" if allow_none else "")
        raise invalid(name, expected, value)
    return int(value)


def rate(name, value):
    if (
        not isinstance(value, numbers.Real)
        or isinstance(value, bool)
        or not 0.0 <= float(value) < 1.0
    ):
        raise invalid(name, "a float in [0, 1)", value)
    return float(value)


def boolean(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        expected = "a boolean" + (" or `None`" if allow_none else "")
        raise invalid(name, expected, value)
    return value


def one_of(name, value, choices):
    if value not in choices:
        raise invalid(name, "one of " + ", ".join(repr(c) for c in choices), value)
    return value


def output_shape(value):
    """`None`, a positive int, or a non-empty tuple/list of positive ints -> tuple."""
    if value is None:
        return None
    if _is_int(value):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not value:
        raise invalid("output_shape", "a positive int or a tuple of positive ints", value)
    if not all(_is_int(d) and d > 0 for d in value):
        raise invalid("output_shape", "a positive int or a tuple of positive ints", value)
    return tuple(int(d) for d in value)


def attention_axes(value):
    """`None`, an int, or a tuple/list of distinct ints other than 0 (the batch)."""
    if value is None:
        return None
    if _is_int(value):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not value:
        raise invalid("attention_axes", "`None`, an int, or a tuple of ints", value)
    if not all(_is_int(a) for a in value):
        raise invalid("attention_axes", "`None`, an int, or a tuple of ints", value)
    if 0 in value:
        raise invalid("attention_axes", "axes other than 0 (the batch axis)", value)
    if len(set(value)) != len(value):
        raise invalid("attention_axes", "distinct axes", value)
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


def input_shapes(query_shape, value_shape, key_shape):
    """Ranks and matching dims of query/value/key, before anything is built."""
    query_shape, value_shape = tuple(query_shape), tuple(value_shape)
    key_shape = value_shape if key_shape is None else tuple(key_shape)
    if len(query_shape) < 3:
        raise invalid(
            "query",
            "a tensor of rank >= 3, (B, T, dim) or (B, ..., dim)",
            f"shape {query_shape}",
        )
    for name, shape in (("value", value_shape), ("key", key_shape)):
        if len(shape) != len(query_shape):
            raise invalid(
                name,
                f"the same rank as `query` ({len(query_shape)})",
                f"shape {shape}",
                f"with query.shape={query_shape}",
            )
        if shape[-1] is None:
            raise invalid(name, "a known last dimension", f"shape {shape}")
    if query_shape[-1] is None:
        raise invalid("query", "a known last dimension", f"shape {query_shape}")
    if not _dims_match(value_shape[1:-1], key_shape[1:-1]):
        raise ValueError(
            "All dimensions of `value` and `key`, except the last one, must be equal. "
            f"Received: value_shape={value_shape} and key_shape={key_shape}"
        )
    batches = {d for d in (query_shape[0], value_shape[0], key_shape[0]) if d is not None}
    if len(batches - {1}) > 1:
        raise invalid(
            "value",
            "the same batch size as `query`",
            f"shape {value_shape}",
            f"with query.shape={query_shape}, key.shape={key_shape}",
        )
    return query_shape, value_shape, key_shape


def call_arguments(arguments, axes):
    """A call's arguments as given, checked before Keras converts them to tensors (a
    string mask would fail there, naming nothing) or builds the layer, so a rejected
    call leaves no weights behind.

    Args:
        arguments: the call's arguments by name (`inspect.BoundArguments.arguments`).
        axes: the layer's `attention_axes` (as given, or normalized once built).
    """
    if "use_causal_mask" in arguments:
        boolean("use_causal_mask", arguments["use_causal_mask"])
    if "return_attention_scores" in arguments:
        boolean("return_attention_scores", arguments["return_attention_scores"], True)
    query, value, key = (arguments.get(name) for name in ("query", "value", "key"))
    if not all(hasattr(x, "shape") for x in (query, value) + ((key,) if key is not None else ())):
        return
    query_shape, value_shape, key_shape = input_shapes(
        query.shape, value.shape, None if key is None else key.shape
    )
    axes = attention_axes_for_rank(axes, len(query_shape))
    if arguments.get("cache") is not None:
        return  # masks then cover the cache's positions; `call` checks them
    batch = query_shape[:1]
    mask("query_mask", arguments.get("query_mask"), batch + query_shape[1:-1])
    mask("value_mask", arguments.get("value_mask"), batch + value_shape[1:-1])
    mask("key_mask", arguments.get("key_mask"), batch + key_shape[1:-1])
    extra = tuple(query_shape[i] for i in range(1, len(query_shape) - 1) if i not in axes)
    attention = tuple(query_shape[a] for a in axes) + tuple(value_shape[a] for a in axes)
    mask("attention_mask", arguments.get("attention_mask"), batch + extra + attention)


def mask(name, mask_value, expected_shape):
    """A mask must be bool/int/float and broadcast to `expected_shape`."""
    if mask_value is None:
        return
    shape = tuple(getattr(mask_value, "shape", ()))
    dtype = str(getattr(mask_value, "dtype", type(mask_value).__name__))
    if not any(k in dtype for k in ("bool", "int", "float")):
        raise invalid(name, "a boolean (or 0/1 numeric) mask", f"dtype {dtype}")
    if len(shape) > len(expected_shape) or not _broadcasts(shape, expected_shape):
        raise invalid(
            name,
            f"a mask broadcastable to {_fmt(expected_shape)}",
            f"shape {shape}",
        )


def _dims_match(a, b):
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


def _broadcasts(shape, target):
    for have, want in zip(reversed(shape), reversed(target)):
        if have is None or want is None or have == 1 or have == want:
            continue
        return False
    return True


def _fmt(shape):
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"


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
    shape = tuple(getattr(bias, "shape", ()))
    dtype = str(getattr(bias, "dtype", type(bias).__name__))
    if "float" not in dtype:
        raise invalid("attention_bias", "a float tensor", f"dtype {dtype}")
    if len(shape) > len(expected_shape) or not _broadcasts(shape, expected_shape):
        raise invalid(
            "attention_bias",
            f"a tensor broadcastable to the scores {_fmt(expected_shape)}",
            f"shape {shape}",
        )
