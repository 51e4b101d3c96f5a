"""`keras_mha.rope`: rotary position embedding in keras-hub's rotate-half convention,
against the formula written out in `reference.py` and by its defining property."""

import numpy as np
import pytest
from helpers import compiled, to_numpy
from keras import ops
from reference import rope

from keras_mha import rope as rope_lib


@pytest.mark.parametrize("start, wavelength, scaling", [(0, 10_000.0, 1.0), (3, 100.0, 2.0)])
def test_rotate_matches_the_formula(rng, start, wavelength, scaling):
    x = rng.standard_normal((2, 6, 3, 8)).astype("float32")
    got = to_numpy(rope_lib.rotate(x, start, wavelength, scaling))
    np.testing.assert_allclose(got, rope(x, start, wavelength, scaling), atol=1e-5)


def test_start_as_a_tensor_in_a_compiled_step(rng):
    """Decoding passes the position as data: one trace serves every position."""
    x = rng.standard_normal((1, 1, 2, 4)).astype("float32")
    step = compiled(lambda x, start: rope_lib.rotate(x, start, 100.0))
    for start in (0, 5, 9):
        got = to_numpy(step(ops.convert_to_tensor(x), ops.convert_to_tensor(start, "int32")))
        np.testing.assert_allclose(got, rope(x, start, 100.0), atol=1e-5)


def test_logits_depend_on_the_distance_only(rng):
    """The same vector at every position: its rotated copies' dot products depend on
    the distance between the positions only."""
    x = rng.standard_normal((1, 1, 2, 8)).astype("float32")
    rotated = to_numpy(rope_lib.rotate(np.tile(x, (1, 6, 1, 1)), 0, 100.0))
    logits = np.einsum("btnh,bsnh->bnts", rotated, rotated)[0, 0]
    for offset in range(1, 4):
        diagonal = np.diagonal(logits, offset)
        np.testing.assert_allclose(diagonal, diagonal[0], atol=1e-4)


def test_per_token_positions_match_the_formula_at_each_position(rng):
    """`(B, T)` positions: each token rotated as if alone at its position."""
    x = rng.standard_normal((2, 5, 3, 8)).astype("float32")
    positions = np.array([[0, 1, 2, 0, 1], [4, 0, 7, 1, 2]], "int32")
    got = to_numpy(rope_lib.rotate(x, 0, 100.0, 2.0, positions=positions))
    for b, t in np.ndindex(2, 5):
        want = rope(x[b : b + 1, t : t + 1], positions[b, t], 100.0, 2.0)
        np.testing.assert_allclose(got[b : b + 1, t : t + 1], want, atol=1e-5)


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([[1, 1, 1, 2, 2, 0, 0]], [[0, 1, 2, 0, 1, 0, 1]]),
        ([[5, 5, 3, 3, 3, 3, 5]], [[0, 1, 0, 1, 2, 3, 0]]),
        ([[7] * 7, [1, 2, 3, 4, 5, 6, 7]], [list(range(7)), [0] * 7]),
    ],
    ids=["padding", "an-id-again", "one-doc-and-all-singletons"],
)
def test_segment_positions_restart_where_the_id_changes(ids, expected):
    got = to_numpy(rope_lib.segment_positions(np.asarray(ids, "int32")))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


def test_segment_positions_in_a_compiled_step():
    ids = np.array([[1, 1, 2, 2, 2, 2, 3, 0]], "int32")
    step = compiled(rope_lib.segment_positions)
    got = to_numpy(step(ops.convert_to_tensor(ids)))
    np.testing.assert_array_equal(got, [[0, 1, 0, 1, 2, 3, 0, 0]])


# ------------------------------------------------- the variants, against keras-hub
# keras-hub 0.32's own rotary code (not ours, not our reference) on random inputs, at
# positions from an offset: `start_index`, as its attention layers pass
# `cache_update_index`. Each case: (our `rotate` keyword arguments, a function that
# builds keras-hub's rotation of `x` at `start`).
H = 16
SHORT = [1.0, 1.5, 2.0, 1.2, 3.0, 1.1, 2.5, 1.7]
LONG = [4.0, 2.0, 8.0, 5.0, 1.5, 9.0, 3.0, 6.0]


def _hub_rotary(**kwargs):
    from keras_hub.src.layers.modeling.rotary_embedding import RotaryEmbedding

    layer = RotaryEmbedding(**kwargs)
    return lambda x, start: layer(x, start_index=start)


def _hub_llama3(x, start):
    from keras_hub.src.models.llama.llama_rotary_embedding import LlamaRotaryEmbedding

    layer = LlamaRotaryEmbedding(
        max_wavelength=10_000,
        frequency_adjustment_factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        pretraining_sequence_length=512,  # wavelengths on both sides of 128 and 512
    )
    return layer(x, start_index=start)


def _hub_phi3_longrope(x, start):
    from keras_hub.src.models.phi3.phi3_rotary_embedding import Phi3SuScaledRotaryEmbedding

    layer = Phi3SuScaledRotaryEmbedding(
        SHORT, LONG, max_sequence_length=256, pretraining_sequence_length=16, max_wavelength=500
    )
    return layer(x, start_index=start)


def _hub_qwen3_5(x, start, position_ids=None):
    """Qwen3.5's attention layer's own partial (and M-RoPE) rotation."""
    from keras_hub.src.models.qwen3_5.qwen3_5_attention import Qwen3_5Attention

    layer = Qwen3_5Attention(
        x.shape[2], x.shape[2], H, partial_rotary_factor=0.75, rope_max_wavelength=1000,
        rope_scaling_factor=2.0, mrope_section=[2, 2, 1],
    )  # fmt: skip
    layer.build((x.shape[0], x.shape[1], 32))
    return layer._apply_partial_rope(x, start, position_ids)


def _hub_gemma4(x, start):
    """Gemma 4's global attention: a proportion of each half rotates."""
    from keras_hub.src.models.gemma4.gemma4_attention import Gemma4TextAttention

    layer = Gemma4TextAttention(
        H, x.shape[2], x.shape[2], rope_wavelength=1000.0, rope_scaling_factor=2.0,
        rope_partial_rotary_factor=0.25, is_global_attention=True,
    )  # fmt: skip
    layer.build((x.shape[0], x.shape[1], 32))
    return layer._apply_rope(x, start)


def _hub_gpt_neox(x, start):
    """GPT-NeoX's `rotary_percentage`: keras-hub's `RotaryEmbedding` of the prefix."""
    from keras_hub.src.layers.modeling.rotary_embedding import RotaryEmbedding

    rotary_dim = int(H * 0.25)
    rotated = RotaryEmbedding(max_wavelength=100)(x[..., :rotary_dim], start_index=start)
    return ops.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


def _hub_roformer(x, start):
    """RoFormer-v2 rotates from position 0: `x` goes after `start` other tokens."""
    from keras_hub.src.models.roformer_v2.roformer_v2_attention import (
        RoformrPositionalEmbedding,
    )

    before = np.random.default_rng(3).standard_normal(x.shape[:1] + (start,) + x.shape[2:])
    longer = np.concatenate([before.astype("float32"), x], axis=1)
    return RoformrPositionalEmbedding(H, max_wavelength=1000)([longer])[:, start:]


VARIANTS = {
    # Mistral, Qwen, Gemma 3's global layers: positions / scaling_factor.
    "linear": (
        dict(max_wavelength=100.0, scaling_factor=4.0),
        _hub_rotary(max_wavelength=100, scaling_factor=4.0),
    ),
    "llama3": (
        dict(
            max_wavelength=10_000.0,
            scaling=dict(
                type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=512,
            ),
        ),
        _hub_llama3,
    ),
    "yarn (gpt-oss)": (
        dict(max_wavelength=10_000.0, scaling=dict(type="yarn", factor=4.0, truncate=False)),
        _hub_rotary(
            max_wavelength=10_000,
            scaling_factor=4.0,
            rope_type="yarn",
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=4096,
            truncate=False,
        ),  # fmt: skip
    ),
    "yarn truncated": (
        dict(
            max_wavelength=500.0,
            scaling=dict(type="yarn", factor=8.0, original_max_position_embeddings=2048),
        ),
        _hub_rotary(
            max_wavelength=500,
            scaling_factor=8.0,
            rope_type="yarn",
            original_max_position_embeddings=2048,
        ),  # fmt: skip
    ),
    "longrope (phi-3)": (
        dict(
            max_wavelength=500.0,
            scaling=dict(
                type="longrope",
                short_factor=SHORT,
                long_factor=LONG,
                original_max_position_embeddings=16,
                max_position_embeddings=256,
            ),
        ),
        _hub_phi3_longrope,
    ),
    "prefix (qwen3.5)": (
        dict(max_wavelength=1000.0, scaling_factor=2.0, rope_dim=12),
        _hub_qwen3_5,
    ),
    "prefix (gpt-neox)": (dict(max_wavelength=100.0, rope_dim=4), _hub_gpt_neox),
    "proportional (gemma 4)": (
        dict(max_wavelength=1000.0, scaling_factor=2.0, rope_dim=4, layout="proportional"),
        _hub_gemma4,
    ),
    "interleaved (roformer-v2)": (
        dict(max_wavelength=1000.0, interleaved=True),
        _hub_roformer,
    ),
}


def _ours(x, start, options, positions=None):
    options = dict(options)
    scaling = options.pop("scaling", None)
    if scaling is not None:
        scaling = rope_lib.check_scaling(scaling, options.get("rope_dim") or x.shape[-1])
    return rope_lib.rotate(x, start, positions=positions, scaling=scaling, **options)


# Offsets 0, at and just past LongRoPE's original length of 16 with T = 6 (the long
# factors apply from `start + 6 > 16`: 10 is short, 11 long), and far.
@pytest.mark.parametrize("start", [0, 10, 11, 40])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_keras_hub(rng, variant, start):
    options, hub = VARIANTS[variant]
    x = rng.standard_normal((2, 6, 3, H)).astype("float32")
    want = to_numpy(hub(x, start))
    got = to_numpy(_ours(x, start, options))
    # float32 angles of up to ~46 radians, computed in another order: ~1e-6 apart.
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(got - x).max() > 1e-2  # something rotated


@pytest.mark.parametrize("start", [0, 11])
def test_variant_matches_keras_hub_in_a_compiled_step(rng, start):
    """LongRoPE's choice of factors from a traced `start`, as decoding passes it."""
    options, hub = VARIANTS["longrope (phi-3)"]
    x = rng.standard_normal((1, 6, 2, H)).astype("float32")
    step = compiled(lambda x, start: _ours(x, start, options))
    got = to_numpy(step(ops.convert_to_tensor(x), ops.convert_to_tensor(start, "int32")))
    np.testing.assert_allclose(got, to_numpy(hub(x, start)), atol=2e-6)


def test_mrope_matches_keras_hub_qwen3_5(rng):
    """Qwen3.5's interleaved M-RoPE over `(B, 4, T)` position ids (text, time, height,
    width; keras-hub reads the last three), on its partial rotary dimensions."""
    options = dict(
        VARIANTS["prefix (qwen3.5)"][0], scaling={"type": "mrope", "sections": [2, 2, 1]}
    )
    x = rng.standard_normal((2, 6, 3, H)).astype("float32")
    position_ids = rng.integers(0, 50, (2, 4, 6)).astype("int32")
    want = to_numpy(_hub_qwen3_5(x, 0, position_ids))
    got = to_numpy(_ours(x, 0, options, positions=position_ids[:, 1:]))
    np.testing.assert_allclose(got, want, atol=2e-6)
    equal = np.repeat(position_ids[:, 1:2], 3, axis=1)  # one stream for all: plain RoPE
    plain = to_numpy(_ours(x, 0, VARIANTS["prefix (qwen3.5)"][0], positions=equal[:, 0]))
    np.testing.assert_allclose(to_numpy(_ours(x, 0, options, positions=equal)), plain, atol=2e-6)


def test_keras_hub_llama_ignores_its_position_scaling_factor(rng):
    """A fact the Llama adapter relies on: `LlamaRotaryEmbedding` overrides the
    frequencies and so never divides by `position_scaling_factor`: ours with
    `scaling_factor=1` is keras-hub's Llama at any `position_scaling_factor`."""
    from keras_hub.src.models.llama.llama_rotary_embedding import LlamaRotaryEmbedding

    x = rng.standard_normal((1, 5, 2, 8)).astype("float32")
    hub = to_numpy(LlamaRotaryEmbedding(100, position_scaling_factor=4.0)(x, start_index=3))
    np.testing.assert_allclose(to_numpy(rope_lib.rotate(x, 3, 100.0)), hub, atol=2e-6)


# ------------------------------------------ the variants, against the float64 formula
@pytest.mark.parametrize("start", [0, 11])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_the_float64_reference(rng, variant, start):
    options = dict(VARIANTS[variant][0])
    x = rng.standard_normal((2, 6, 3, H)).astype("float32")
    scaling = options.pop("scaling", None)
    if scaling is not None:
        scaling = rope_lib.check_scaling(scaling, options.get("rope_dim") or H)
    got = to_numpy(rope_lib.rotate(x, start, scaling=scaling, **options))
    np.testing.assert_allclose(got, rope(x, start, scaling=scaling, **options), atol=2e-6)


def test_proportional_is_the_whole_head_with_still_trailing_frequencies(rng):
    """Gemma 4's layout: dimensions `[r/2, H/2)` and `[H/2 + r/2, H)` do not move, the
    rest is the whole head's RoPE."""
    x = rng.standard_normal((1, 5, 2, H)).astype("float32")
    got = to_numpy(rope_lib.rotate(x, 2, 100.0, rope_dim=6, layout="proportional"))
    whole = to_numpy(rope_lib.rotate(x, 2, 100.0))
    still = np.r_[3:8, 11:16]
    np.testing.assert_array_equal(got[..., still], x[..., still])
    moved = np.r_[0:3, 8:11]
    np.testing.assert_allclose(got[..., moved], whole[..., moved], atol=1e-6)
