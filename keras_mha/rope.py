"""Rotary position embedding (RoPE) of projected queries and keys, with the variants
keras-hub's language models use.

The rotate-half convention of `keras_hub.layers.RotaryEmbedding(max_wavelength,
scaling_factor)` applied to `(B, T, N, H)`, so attention written for keras-hub
checkpoints (Llama, Mistral, Gemma) carries over:

    inverse_frequency[i] = max_wavelength ** (-2i / H)            i < H / 2
    angle[t, i]          = (start + t) / scaling_factor * inverse_frequency[i]
    rotate(x)[t]         = x[t] * cos([angle, angle]) + [-x2, x1][t] * sin([angle, angle])

with `x1, x2` the two halves of the head dimension. Packed rows give each token its
own position instead of `start + t` (`positions`, `(B, T)`), restarting at each
document (`segment_positions`).

The variants, each read from keras-hub 0.32's own class (the names in brackets):

- `scaling={"type": "llama3", ...}`: Llama 3.1+'s frequency smoothing
  (`LlamaRotaryEmbedding`): wavelengths above `original_max_position_embeddings /
  low_freq_factor` are divided by `factor`, those below `... / high_freq_factor`
  kept, those between blended.
- `scaling={"type": "yarn", ...}`: YaRN (GPT-OSS's `RotaryEmbedding(rope_type="yarn")`):
  a ramp between interpolated (`/ factor`) and original frequencies over the
  dimensions whose wavelengths `beta_fast`/`beta_slow` bound, and `cos`/`sin` times
  `attention_factor` (default `0.1 * ln(factor) + 1`).
- `scaling={"type": "longrope", ...}`: Phi-3's LongRoPE
  (`Phi3SuScaledRotaryEmbedding`): frequencies divided by `long_factor` when
  `start + T > original_max_position_embeddings` (keras-hub's rule: the last
  position of the call, so a long prefill and every decoding step past it use the
  long factors), else by `short_factor`; `cos`/`sin` times `attention_factor`
  (default `sqrt(1 + ln(max / original) / ln(original))`, 1 when `max <= original`).
- `scaling={"type": "mrope", "sections": [s_t, s_h, s_w]}`: Qwen3.5's multimodal RoPE
  (`qwen3_5_attention._apply_mrope`): with `(B, 3, T)` positions (temporal, height,
  width), frequency `i` follows the height stream where `i % 3 == 1` and `i < 3 *
  s_h`, the width stream where `i % 3 == 2` and `i < 3 * s_w`, the temporal one
  elsewhere. `(B, T)` positions or `start + t` give all streams the same position:
  plain RoPE (keras-hub's text-only path).
- `rope_dim` with `layout="prefix"`: the first `rope_dim` dimensions of each head
  rotate as a head of `rope_dim` (GPT-NeoX's `rotary_percentage`, Qwen3.5's
  `partial_rotary_factor`), the rest pass through.
- `rope_dim` with `layout="proportional"`: the first `rope_dim / 2` dimensions of
  each half of the head rotate, at the frequencies of the whole head (Gemma 4's
  `rope_partial_rotary_factor`, `RotaryEmbedding(denominator_dim=head_dim)`): plain
  RoPE of the whole head with the last `(H - rope_dim) / 2` frequencies zero.
- `interleaved=True`: pairs `(x[2i], x[2i + 1])` rotate together instead of `(x[i],
  x[i + H/2])` (RoFormer-v2's `RoformrPositionalEmbedding`).

`scaling_factor` divides the positions whatever the variant (keras-hub's "linear"
type: Mistral, Qwen, Gemma 3's global layers, Gemma 4).
"""

import math
import numbers

import numpy as np
from keras import ops

from keras_mha import checks

SCALING_TYPES = ("llama3", "yarn", "longrope", "mrope")
LAYOUTS = ("prefix", "proportional")

# Per type: the required keys, then the optional ones with their defaults
# (keras-hub's defaults where it has them).
_KEYS = {
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        {},
    ),
    "yarn": (
        ("factor",),
        {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": True,
            "attention_factor": None,
        },
    ),
    "longrope": (
        ("short_factor", "long_factor", "original_max_position_embeddings"),
        {"max_position_embeddings": None, "attention_factor": None},
    ),
    "mrope": (("sections",), {}),
}


def rotate(
    x,
    start,
    max_wavelength,
    scaling_factor=1.0,
    positions=None,
    scaling=None,
    rope_dim=None,
    layout="prefix",
    interleaved=False,
):
    """RoPE of `x` `(B, T, N, H)` at positions `start ... start + T - 1`.

    Args:
        x: projected queries or keys; `H` even.
        start: position of `x[:, 0]`: a Python int or an integer scalar tensor.
        max_wavelength: the longest wavelength of the rotations.
        scaling_factor: positions are divided by it (position interpolation).
        positions: `None`, or `(B, T)` per-token positions (packed rows), which
            replace `start + t` (`start` then only decides LongRoPE's factors);
            with `scaling` of type "mrope", also `(B, 3, T)`: one stream each for
            time, height and width.
        scaling: `None` or a variant's dict as `check_scaling` returns it.
        rope_dim: how many dimensions of each head rotate (even); `None`: all.
        layout: where the `rope_dim` rotated dimensions sit: "prefix" or
            "proportional" (see the module's docstring).
        interleaved: rotate pairs `(x[2i], x[2i + 1])` instead of halves.

    Returns:
        A tensor like `x`.
    """
    x = ops.convert_to_tensor(x)
    head_dim = x.shape[-1]
    dim = head_dim if rope_dim is None else rope_dim
    if dim < head_dim and layout == "prefix":
        rotated = rotate(
            x[..., :dim], start, max_wavelength, scaling_factor, positions, scaling, None,
            interleaved=interleaved,
        )  # fmt: skip
        return ops.concatenate([rotated, x[..., dim:]], axis=-1)
    if scaling is None and dim == head_dim and not interleaved:
        return _rotate_half(x, start, max_wavelength, scaling_factor, positions)
    inverse_frequency, factor = _frequencies(
        dim, head_dim, max_wavelength, scaling, start, ops.shape(x)[1]
    )
    if dim < head_dim:  # proportional: the trailing frequencies stay still
        zeros = ops.zeros(((head_dim - dim) // 2,), "float32")
        inverse_frequency = ops.concatenate([inverse_frequency, zeros], axis=0)
    angles = _angles(x, start, scaling_factor, positions, inverse_frequency, scaling)
    cos, sin = ops.cos(angles), ops.sin(angles)  # (B or 1, T, H/2)
    if factor != 1.0:
        cos, sin = ops.multiply(cos, factor), ops.multiply(sin, factor)
    cos = ops.cast(cos, x.dtype)[:, :, None, :]
    sin = ops.cast(sin, x.dtype)[:, :, None, :]
    if interleaved:
        pairs = ops.reshape(x, (*ops.shape(x)[:-1], head_dim // 2, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        out_even = ops.subtract(ops.multiply(even, cos), ops.multiply(odd, sin))
        out_odd = ops.add(ops.multiply(odd, cos), ops.multiply(even, sin))
        return ops.reshape(ops.stack([out_even, out_odd], axis=-1), ops.shape(x))
    cos = ops.concatenate([cos, cos], axis=-1)
    sin = ops.concatenate([sin, sin], axis=-1)
    first, second = ops.split(x, 2, axis=-1)
    rotated = ops.concatenate([ops.negative(second), first], axis=-1)
    return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin))


def _rotate_half(x, start, max_wavelength, scaling_factor, positions):
    """Plain RoPE: the default path, no op more than it needs."""
    head_dim = x.shape[-1]
    exponents = ops.arange(0, head_dim, 2, dtype="float32") / float(head_dim)
    inverse_frequency = 1.0 / ops.power(float(max_wavelength), exponents)
    if positions is None:
        positions = ops.arange(ops.shape(x)[1], dtype="float32") + ops.cast(start, "float32")
        positions = positions[None, :]  # (1, T)
    positions = ops.cast(positions, "float32") / float(scaling_factor)
    angles = ops.einsum("bt,i->bti", positions, inverse_frequency)
    angles = ops.concatenate([angles, angles], axis=-1)[:, :, None, :]  # (B or 1, T, 1, H)
    cos = ops.cast(ops.cos(angles), x.dtype)
    sin = ops.cast(ops.sin(angles), x.dtype)
    first, second = ops.split(x, 2, axis=-1)
    rotated = ops.concatenate([ops.negative(second), first], axis=-1)
    return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin))


def _angles(x, start, scaling_factor, positions, inverse_frequency, scaling):
    """`(B or 1, T, H/2)` float32 angles."""
    if positions is None:
        positions = ops.arange(ops.shape(x)[1], dtype="float32") + ops.cast(start, "float32")
        positions = positions[None, :]  # (1, T)
    positions = ops.cast(positions, "float32")
    if scaling_factor != 1.0:
        positions = positions / float(scaling_factor)
    if len(positions.shape) == 3:  # M-RoPE: (B, 3, T), one stream per frequency
        streams = ops.convert_to_tensor(mrope_streams(scaling["sections"], x.shape[-1] // 2))
        return ops.einsum("bst,si->bti", positions, streams * inverse_frequency[None, :])
    return ops.einsum("bt,i->bti", positions, inverse_frequency)


def mrope_streams(sections, half):
    """`(3, half)` float32 one-hot: which position stream (time, height, width) each
    frequency follows, as keras-hub's Qwen3.5 interleaves them."""
    streams = np.zeros((3, half), "float32")
    for i in range(half):
        if i < 3 * sections[1] and i % 3 == 1:
            streams[1, i] = 1.0
        elif i < 3 * sections[2] and i % 3 == 2:
            streams[2, i] = 1.0
        else:
            streams[0, i] = 1.0
    return streams


def _frequencies(dim, head_dim, max_wavelength, scaling, start, length):
    """`(dim / 2,)` float32 inverse frequencies of a variant, and the factor its
    `cos` and `sin` are multiplied by (a Python float)."""
    denominator = head_dim if dim < head_dim else dim  # proportional: the whole head's
    exponents = ops.arange(0, dim, 2, dtype="float32") / float(denominator)
    inverse = 1.0 / ops.power(float(max_wavelength), exponents)
    kind = None if scaling is None else scaling["type"]
    if kind == "llama3":
        return _llama3(inverse, scaling), 1.0
    if kind == "yarn":
        return _yarn(inverse, denominator, max_wavelength, scaling), yarn_attention_factor(scaling)
    if kind == "longrope":
        short = ops.convert_to_tensor(scaling["short_factor"], "float32")
        long = ops.convert_to_tensor(scaling["long_factor"], "float32")
        original = scaling["original_max_position_embeddings"]
        last = start + length  # the call's last position, as keras-hub keys it
        if isinstance(last, int):
            factors = long if last > original else short
        else:
            factors = ops.where(ops.greater(last, original), long, short)
        return inverse / factors, longrope_attention_factor(scaling)
    return inverse, 1.0


def _llama3(inverse, scaling):
    """`LlamaRotaryEmbedding._get_inverse_freq`'s smoothing, op for op."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    low_freq_wavelength = original / low
    high_freq_wavelength = original / high
    wavelength = 2 * math.pi / inverse
    adjusted = ops.where(ops.greater(wavelength, low_freq_wavelength), inverse / factor, inverse)
    smooth = ((original / wavelength) - low) / (high - low)
    smoothed = (1 - smooth) * (adjusted / factor) + smooth * adjusted
    medium = ops.logical_and(
        ops.greater_equal(wavelength, high_freq_wavelength),
        ops.less_equal(wavelength, low_freq_wavelength),
    )
    return ops.where(medium, smoothed, adjusted)


def _yarn(inverse, dim, max_wavelength, scaling):
    """`RotaryEmbedding._get_yarn_inverse_freq`, op for op."""
    factor = scaling["factor"]

    def correction_dim(rotations):
        original = float(scaling["original_max_position_embeddings"])
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (
            2 * math.log(max_wavelength)
        )

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0.0), min(high, float(dim - 1))
    ramp = (ops.arange(0, ops.shape(inverse)[0], dtype="float32") - low) / max(high - low, 0.001)
    extrapolation = 1.0 - ops.clip(ramp, 0.0, 1.0)
    return (inverse / factor) * (1.0 - extrapolation) + inverse * extrapolation


def yarn_attention_factor(scaling):
    """YaRN's `cos`/`sin` factor: `attention_factor`, or `0.1 * ln(factor) + 1`."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 0.1 * math.log(scaling["factor"]) + 1.0


def longrope_attention_factor(scaling):
    """LongRoPE's `cos`/`sin` factor: `attention_factor`, or `sqrt(1 + ln(m / o) /
    ln(o))` for `m / o > 1` (`m`, `o`: the maximum and original lengths), else 1."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    ratio = (scaling["max_position_embeddings"] or original) / original
    if ratio <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(ratio) / math.log(original))


# ------------------------------------------------------------------------ checks
def check_options(key_dim, rope_scaling, rope_dim, layout, interleaved):
    """The layer's RoPE arguments, checked before any state: returns them normalised
    (`rope_scaling` a plain dict with every key, its defaults filled in).

    Args:
        key_dim: the size of each head.
        rope_scaling, rope_dim, layout, interleaved: the layer's `rope_scaling`,
            `rope_dim`, `rope_dim_layout` and `rope_interleaved`.
    """
    interleaved = checks.flag("rope_interleaved", interleaved)
    checks.one_of("rope_dim_layout", layout, LAYOUTS)
    rope_dim = checks.positive_int("rope_dim", rope_dim, allow_none=True)
    if rope_dim is not None and (rope_dim % 2 or rope_dim > key_dim):
        raise checks.invalid(
            "rope_dim", f"an even number of dimensions, at most key_dim={key_dim}", rope_dim
        )
    rotated = key_dim if rope_dim is None else rope_dim
    return check_scaling(rope_scaling, rotated), rope_dim, layout, interleaved


def check_scaling(value, rotated_dim):
    """`rope_scaling`: `None` or a dict `{"type": one of SCALING_TYPES, ...}` of plain
    data; returns a new dict with the optional keys' defaults filled in."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in SCALING_TYPES:
        raise checks.invalid(
            "rope_scaling",
            "`None` or a dict whose 'type' is one of " + ", ".join(map(repr, SCALING_TYPES)),
            value,
        )
    kind = value["type"]
    required, optional = _KEYS[kind]
    missing = [key for key in required if key not in value]
    unknown = sorted(set(value) - {"type"} - set(required) - set(optional))
    if missing or unknown:
        allowed = ", ".join(map(repr, required + tuple(optional)))
        raise checks.invalid(
            "rope_scaling",
            f"a {kind!r} dict with the keys {allowed} (required: "
            + ", ".join(map(repr, required))
            + ")",
            value,
            extra=f"(missing: {missing}, unknown: {unknown})",
        )
    result = {"type": kind, **optional, **{k: v for k, v in value.items() if k != "type"}}

    def number(key, allow_none=False):
        try:
            result[key] = checks.positive_number(key, result[key], allow_none=allow_none)
        except ValueError:
            raise _bad(value, f"{key!r}: a positive number", result[key]) from None

    def length(key, allow_none=False):
        given = result[key]
        if (given is None and allow_none) or (checks._is_int(given) and given > 0):
            result[key] = None if given is None else int(given)
        else:
            raise _bad(value, f"{key!r}: a positive integer", given)

    if kind == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            number(key)
        length("original_max_position_embeddings")
        if result["high_freq_factor"] <= result["low_freq_factor"]:
            expected = "'high_freq_factor' greater than 'low_freq_factor'"
            raise _bad(value, expected, result["high_freq_factor"])
    elif kind == "yarn":
        for key in ("factor", "beta_fast", "beta_slow"):
            number(key)
        number("attention_factor", allow_none=True)
        length("original_max_position_embeddings")
        try:
            result["truncate"] = checks.flag("truncate", result["truncate"])
        except ValueError:
            raise _bad(value, "'truncate': a boolean", result["truncate"]) from None
    elif kind == "longrope":
        length("original_max_position_embeddings")
        length("max_position_embeddings", allow_none=True)
        number("attention_factor", allow_none=True)
        for key in ("short_factor", "long_factor"):
            factors = result[key]
            if not _positive_numbers(factors) or len(factors) != rotated_dim // 2:
                raise _bad(
                    value,
                    f"{key!r}: a list of {rotated_dim // 2} positive numbers (one per "
                    "rotated frequency: half of `rope_dim`, or of `key_dim`)",
                    factors,
                )
            result[key] = [float(f) for f in factors]
    else:  # mrope
        sections = result["sections"]
        if (
            not isinstance(sections, (list, tuple))
            or len(sections) != 3
            or not all(checks._is_int(s) and s >= 0 for s in sections)
        ):
            raise _bad(
                value,
                "'sections': 3 non-negative integers (the time, height and width "
                "streams' numbers of frequencies)",
                sections,
            )
        result["sections"] = [int(s) for s in sections]
    return result


def plain(scaling):
    """`rope_scaling` as plain data (a layer's attributes hold Keras's tracked dicts
    and lists): a new dict, its lists new lists."""
    if scaling is None:
        return None
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in scaling.items()}


def _positive_numbers(values):
    return isinstance(values, (list, tuple)) and all(
        isinstance(v, numbers.Real)
        and not isinstance(v, bool)
        and math.isfinite(float(v))
        and float(v) > 0
        for v in values
    )


def _bad(value, expected, received):
    return checks.invalid(
        "rope_scaling", f"a {value['type']!r} dict with {expected}", value,
        extra=f"(got {received!r})",
    )  # fmt: skip


def segment_positions(segment_ids):
    """Each token's position within its document: `(B, T)` int32, restarting at 0
    wherever the id changes from the previous token's.

    Args:
        segment_ids: `(B, T)` integer document ids of packed rows.
    """
    ids = ops.convert_to_tensor(segment_ids)
    steps = ops.arange(ops.shape(ids)[1], dtype="int32")[None, :]
    changed = ops.not_equal(ids[:, 1:], ids[:, :-1])
    starts_here = ops.concatenate([ops.ones_like(ids[:, :1], "bool"), changed], axis=1)
    # The start of each token's document: the last start at or before it, a running
    # maximum taken in log2(T) doubling steps (shapes stay fixed, T may be unknown).
    starts = ops.where(starts_here, steps, ops.zeros_like(steps))
    length = ids.shape[1]
    shift = 1
    while shift < (length if isinstance(length, int) else 2**30):
        before = ops.where(steps >= shift, ops.roll(starts, shift, axis=1), 0)
        starts = ops.maximum(starts, before)
        shift *= 2
    return ops.cast(steps - starts, "int32")
