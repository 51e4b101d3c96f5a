"""RoPE variants through the layer (`rope_scaling`, `rope_dim`, `rope_dim_layout`,
`rope_interleaved`): against the float64 reference on every kernel, forward and
backward (input gradients against the reference's central differences), cached
decoding equal to one causal call, LongRoPE's factors chosen per call as keras-hub
chooses them, packed rows, M-RoPE's `(B, 3, T)` positions, bad values rejected by
name before any state, the config and a `.keras` file."""

import keras
import numpy as np
import pytest
from helpers import gradients, to_numpy
from reference import layer_weights, reference_mha, rope

import keras_mha

B, T, DIM, HEADS, KEY_DIM = 2, 9, 16, 4, 8
PREFILL = 5
ATOL = 3e-5
LLAMA3 = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # wavelengths 6.3, 63, 628, 6283 against 16 and 64: kept, blended, divided
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "linear": {"rope_max_wavelength": 50.0, "rope_scaling_factor": 2.0},
    "llama3+gqa": {
        "rope_max_wavelength": 10_000.0,
        "rope_scaling": LLAMA3,
        "num_key_value_heads": 2,
    },
    "yarn": {
        "rope_max_wavelength": 10_000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "truncate": False,
        },
    },
    # T = 9 and the prefill of 5 pass the original length of 4: the long factors.
    "longrope": {
        "rope_max_wavelength": 100.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [2.0, 4.0, 6.0, 9.0],
            "original_max_position_embeddings": 4,
            "max_position_embeddings": 32,
        },
    },
    "mrope+prefix+qk_norm": {
        "rope_max_wavelength": 100.0,
        "rope_dim": 6,
        "rope_scaling": {"type": "mrope", "sections": [1, 1, 1]},
        "normalize_qk": True,
    },
    "prefix": {"rope_max_wavelength": 100.0, "rope_dim": 4},
    "proportional": {
        "rope_max_wavelength": 100.0,
        "rope_scaling_factor": 2.0,
        "rope_dim": 4,
        "rope_dim_layout": "proportional",
    },
    "interleaved": {"rope_max_wavelength": 100.0, "rope_interleaved": True},
}
IMPLEMENTATIONS = ["explicit", "chunked", "fused"]


def _layer(variant, implementation=None, seed=0):
    keras.utils.set_random_seed(seed)
    layer = keras_mha.MultiHeadAttention(
        HEADS, KEY_DIM, implementation=implementation, chunk_size=4, **VARIANTS[variant]
    )
    layer.build((B, T, DIM), (B, T, DIM))
    return layer


def _inputs(rng):
    x = rng.standard_normal((B, T, DIM)).astype("float32")
    padding = np.ones((B, T), bool)
    padding[1, 6:] = False
    return x, padding


def _reference(layer, x, padding, **kwargs):
    mask = padding[:, None, :] & np.ones((1, x.shape[1], 1), bool)
    return reference_mha(layer, x, x, mask=mask, use_causal_mask=True, **kwargs)[0]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_float64_reference(rng, variant, implementation):
    layer = _layer(variant, implementation)
    x, padding = _inputs(rng)
    out = layer(x, x, value_mask=padding, use_causal_mask=True)
    np.testing.assert_allclose(to_numpy(out), _reference(layer, x, padding), atol=ATOL)


def _directional_derivatives(fn, x, directions, step=1e-5):
    """`fn`'s float64 central differences along each direction."""
    x = x.astype(np.float64)
    return np.array([(fn(x + step * d) - fn(x - step * d)) / (2 * step) for d in directions])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_input_gradients_match_float64_reference(rng, variant, implementation):
    """`d sum(w * layer(x, x)) / dx` against the float64 reference's central
    differences along random directions (every entry of `x` in each): the rotation's
    backward pass through each kernel's."""
    layer = _layer(variant, implementation)
    x, padding = _inputs(rng)
    w = rng.standard_normal((B, T, DIM))
    weights = keras.ops.convert_to_tensor(w.astype("float32"))
    _, grads, _ = gradients(
        layer,
        {"query": x, "value": x},
        loss=lambda y: keras.ops.sum(y * weights),
        value_mask=padding,
        use_causal_mask=True,
    )
    directions = rng.standard_normal((6, B, T, DIM))
    expected = _directional_derivatives(
        lambda z: np.sum(w * _reference(layer, z, padding)), x, directions
    )
    got = np.einsum("kbtd,btd->k", directions, grads["query"] + grads["value"])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3)
    assert np.abs(expected).max() > 1e-1


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_decoding_equals_one_causal_call(rng, variant, implementation):
    """A prefill of 5 tokens, then one-token steps at `cache_update_index` 5 ... 8."""
    layer = _layer(variant, implementation)
    x, _ = _inputs(rng)
    full = to_numpy(layer(x, x, use_causal_mask=True))
    cache = layer.init_cache(B, T)
    prompt = x[:, :PREFILL]
    out, cache = layer(prompt, prompt, cache=cache, cache_update_index=0, use_causal_mask=True)
    steps = [to_numpy(out)]
    for t in range(PREFILL, T):
        token = x[:, t : t + 1]
        out, cache = layer(token, token, cache=cache, cache_update_index=t, use_causal_mask=True)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=ATOL)


def test_longrope_factors_follow_each_call_with_a_cache(rng):
    """keras-hub's rule (`Phi3SuScaledRotaryEmbedding`): a call whose last position
    `cache_update_index + T` passes the original length rotates with the long
    factors, else with the short ones. A prefill of 3 within an original length of 5
    writes short-rotated keys; the steps at 3 and 4 too; those from 5 on long ones."""
    options = dict(VARIANTS["longrope"])
    options["rope_scaling"] = dict(options["rope_scaling"], original_max_position_embeddings=5)
    keras.utils.set_random_seed(0)
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, use_bias=False, **options)
    x, _ = _inputs(rng)
    cache = layer.init_cache(B, T)
    _, cache = layer(x[:, :3], x[:, :3], cache=cache, cache_update_index=0)
    for t in range(3, T):
        _, cache = layer(x[:, t : t + 1], x[:, t : t + 1], cache=cache, cache_update_index=t)
    key_kernel, _ = layer_weights(layer)["key"]
    keys = np.einsum("btd,dnh->btnh", x.astype(np.float64), key_kernel)
    scaling = layer._rope_scaling
    expected = [rope(keys[:, :3], 0, 100.0, scaling=scaling)]  # 0 + 3 <= 5: short
    expected += [rope(keys[:, t : t + 1], t, 100.0, scaling=scaling) for t in range(3, T)]
    expected = np.concatenate(expected, axis=1)
    np.testing.assert_allclose(to_numpy(cache)[:, 0], expected, atol=ATOL)
    short = dict(scaling, long_factor=scaling["short_factor"])
    assert np.abs(rope(keys[:, 5:6], 5, 100.0, scaling=short) - expected[:, 5:6]).max() > 1e-3


def _segment_ids():
    ids = np.zeros((B, T), "int32")
    ids[0, :4], ids[0, 4:] = 1, 2
    ids[1, :2], ids[1, 2:7] = 3, 4  # then 2 tokens of padding (id 0)
    return ids


def _segment_positions(ids):
    positions = np.zeros_like(ids)
    for b, t in np.ndindex(ids.shape):
        positions[b, t] = 0 if t == 0 or ids[b, t] != ids[b, t - 1] else positions[b, t - 1] + 1
    return positions


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_rows_restart_positions_per_document(rng, variant):
    """`segment_ids`: each document's RoPE positions restart at 0, and it attends
    within itself; the reference with those positions and a block-diagonal mask."""
    layer = _layer(variant, "chunked")
    x, _ = _inputs(rng)
    ids = _segment_ids()
    out = to_numpy(layer(x, x, segment_ids=ids, use_causal_mask=True))
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] != 0)
    expected, _ = reference_mha(
        layer, x, x, mask=same, use_causal_mask=True, positions=_segment_positions(ids)
    )
    np.testing.assert_allclose(out, expected, atol=ATOL)


def _mrope_positions(rng, length=T):
    """Time, height and width streams, as Qwen3.5's image tokens have them."""
    return rng.integers(0, 12, (B, 3, length)).astype("int32")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_mrope_streams_match_float64_reference(rng, implementation):
    layer = _layer("mrope+prefix+qk_norm", implementation)
    x, padding = _inputs(rng)
    positions = _mrope_positions(rng)
    out = layer(x, x, value_mask=padding, use_causal_mask=True, positions=positions)
    expected = _reference(layer, x, padding, positions=positions)
    np.testing.assert_allclose(to_numpy(out), expected, atol=ATOL)
    plain = _reference(layer, x, padding, positions=positions[:, 0])
    assert np.abs(expected - plain).max() > 1e-3  # the streams matter


def test_mrope_streams_with_a_cache(rng):
    """A multimodal prefill with its `(B, 3, 5)` positions, then steps with `(B, 3, 1)`
    ones, equal one call with all the positions."""
    layer = _layer("mrope+prefix+qk_norm")
    x, _ = _inputs(rng)
    positions = _mrope_positions(rng)
    full = to_numpy(layer(x, x, use_causal_mask=True, positions=positions))
    cache = layer.init_cache(B, T)
    kwargs = dict(use_causal_mask=True, positions=positions[..., :PREFILL])
    out, cache = layer(x[:, :PREFILL], x[:, :PREFILL], cache=cache, cache_update_index=0, **kwargs)
    steps = [to_numpy(out)]
    for t in range(PREFILL, T):
        token = x[:, t : t + 1]
        kwargs = dict(use_causal_mask=True, positions=positions[..., t : t + 1])
        out, cache = layer(token, token, cache=cache, cache_update_index=t, **kwargs)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=ATOL)


def test_mrope_without_streams_is_plain_partial_rope(rng):
    """keras-hub's Qwen3.5 text path: no streams, plain RoPE of the rotary prefix."""
    layer = _layer("mrope+prefix+qk_norm")
    plain = keras_mha.MultiHeadAttention(
        HEADS, KEY_DIM, rope_max_wavelength=100.0, rope_dim=6, normalize_qk=True
    )
    x, _ = _inputs(rng)
    plain(x, x)
    plain.set_weights(layer.get_weights())
    np.testing.assert_allclose(
        to_numpy(layer(x, x, use_causal_mask=True)),
        to_numpy(plain(x, x, use_causal_mask=True)),
        atol=1e-6,
    )


# ------------------------------------------------------------------ config, saving
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_round_trips(variant):
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, **VARIANTS[variant])
    config = layer.get_config()
    for name, value in VARIANTS[variant].items():
        if name == "rope_scaling":  # given keys kept, the defaults filled in
            assert config[name].items() >= value.items()
        else:
            assert config[name] == value
    again = keras_mha.MultiHeadAttention.from_config(config)
    assert again.get_config() == config


def test_default_config_has_the_options_off():
    config = keras_mha.MultiHeadAttention(HEADS, KEY_DIM).get_config()
    assert config["rope_scaling"] is None and config["rope_dim"] is None
    assert config["rope_dim_layout"] == "prefix" and config["rope_interleaved"] is False


@pytest.mark.parametrize("variant", ["llama3+gqa", "yarn", "longrope", "proportional"])
def test_saved_and_reloaded(tmp_path, rng, variant):
    inputs = keras.Input((T, DIM))
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, **VARIANTS[variant])
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    x, _ = _inputs(rng)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert loaded.layers[1].get_config() == layer.get_config()
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)), atol=1e-6)


# ---------------------------------------------------------------------- bad values
def _llama3(**changes):
    return {"rope_scaling": dict(LLAMA3, **changes)}


BAD = {
    "scaling not a dict": ({"rope_scaling": "yarn"}, "rope_scaling", "'type' is one of"),
    "unknown type": ({"rope_scaling": {"type": "ntk"}}, "rope_scaling", "'type' is one of"),
    "missing key": (
        {"rope_scaling": {"type": "yarn"}},
        "rope_scaling",
        r"missing: \['factor'\]",
    ),
    "unknown key": (
        {"rope_scaling": {"type": "yarn", "factor": 2.0, "beta": 1.0}},
        "rope_scaling",
        r"unknown: \['beta'\]",
    ),
    "llama3 factor": (_llama3(factor=0.0), "rope_scaling", "'factor': a positive number"),
    "llama3 length": (
        _llama3(original_max_position_embeddings=8.5),
        "rope_scaling",
        "'original_max_position_embeddings': a positive integer",
    ),
    "llama3 high <= low": (_llama3(high_freq_factor=1.0), "rope_scaling", "greater than"),
    "yarn truncate": (
        {"rope_scaling": {"type": "yarn", "factor": 2.0, "truncate": "no"}},
        "rope_scaling",
        "'truncate': a boolean",
    ),
    "longrope factors' length": (
        {
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0] * 4,
                "long_factor": [1.0] * 3,
                "original_max_position_embeddings": 4,
            }
        },
        "rope_scaling",
        "'long_factor': a list of 4 positive numbers",
    ),
    "longrope factor 0": (
        {
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0, 0.0, 1.0, 1.0],
                "long_factor": [1.0] * 4,
                "original_max_position_embeddings": 4,
            }
        },
        "rope_scaling",
        "'short_factor': a list of 4",
    ),
    "mrope sections": (
        {"rope_scaling": {"type": "mrope", "sections": [2, 2]}},
        "rope_scaling",
        "'sections': 3 non-negative integers",
    ),
    "rope_dim odd": ({"rope_dim": 3}, "rope_dim", "an even number"),
    "rope_dim too large": ({"rope_dim": 10}, "rope_dim", "at most key_dim=8"),
    "rope_dim not an int": ({"rope_dim": 4.0}, "rope_dim", "a positive integer"),
    "layout": ({"rope_dim_layout": "suffix"}, "rope_dim_layout", "'prefix'"),
    "interleaved": ({"rope_interleaved": "yes"}, "rope_interleaved", "a boolean"),
    "scaling without rope": (
        {"rope_max_wavelength": None, "rope_scaling": LLAMA3},
        "rope_scaling",
        "without rotary embeddings",
    ),
    "rope_dim without rope": (
        {"rope_max_wavelength": None, "rope_dim": 4},
        "rope_dim",
        "without rotary embeddings",
    ),
    "interleaved without rope": (
        {"rope_max_wavelength": None, "rope_interleaved": True},
        "rope_interleaved",
        "without rotary embeddings",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_are_rejected_by_name(case):
    kwargs, name, expected = BAD[case]
    kwargs = {"rope_max_wavelength": 100.0, **kwargs}
    with pytest.raises(ValueError, match=rf"argument `{name}`, expected .*{expected}"):
        keras_mha.MultiHeadAttention(HEADS, KEY_DIM, **kwargs)


def test_an_odd_key_dim_rotates_an_even_prefix(rng):
    """GPT-NeoX's `rotary_percentage` on an odd head size: the prefix is what must be
    even; the halves layouts need an even head."""
    layer = keras_mha.MultiHeadAttention(2, 5, rope_max_wavelength=100.0, rope_dim=2)
    x, padding = _inputs(rng)
    out = layer(x, x, value_mask=padding, use_causal_mask=True)
    np.testing.assert_allclose(to_numpy(out), _reference(layer, x, padding), atol=ATOL)
    with pytest.raises(ValueError, match="argument `key_dim`"):
        keras_mha.MultiHeadAttention(
            2, 5, rope_max_wavelength=100.0, rope_dim=2, rope_dim_layout="proportional"
        )


@pytest.mark.parametrize(
    "variant, positions, expected",
    [
        ("prefix", np.zeros((B, 3, T), "int32"), r"shape \(2, 9\)"),
        ("mrope+prefix+qk_norm", np.zeros((B, 2, T), "int32"), r"shape \(2, 3, 9\)"),
        ("mrope+prefix+qk_norm", np.zeros((B, 3, T), "float32"), "an integer tensor"),
    ],
    ids=["streams without mrope", "two streams", "float streams"],
)
def test_bad_positions_are_rejected_before_building(rng, variant, positions, expected):
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, **VARIANTS[variant])
    x, _ = _inputs(rng)
    with pytest.raises(ValueError, match=rf"argument `positions`, expected .*{expected}"):
        layer(x, x, positions=positions)
    assert not layer.built and not layer.weights


@pytest.mark.parametrize("variant", ["longrope", "interleaved", "mrope+prefix+qk_norm"])
def test_an_unknown_length_in_a_functional_model(rng, variant):
    """`keras.Input((None, dim))`: LongRoPE's choice and the pairs' reshape follow the
    length the data brings."""
    inputs = keras.Input((None, DIM))
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, **VARIANTS[variant])
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    x, _ = _inputs(rng)
    expected, _ = reference_mha(layer, x, x, use_causal_mask=True)
    np.testing.assert_allclose(to_numpy(model(x)), expected, atol=ATOL)
