"""KV-cache decoding: `cache`, `cache_update_index`, `init_cache`."""

import keras
import numpy as np
import pytest
from helpers import BACKEND, compiled
from keras import ops

import keras_mha
from keras_mha import cache as cache_lib
from keras_mha import kernels

B, L, D = 2, 6, 8
HEADS, HEAD_DIM = 4, 2


def _layer(**kwargs):
    config = {"num_heads": HEADS, "key_dim": HEAD_DIM, "bias_initializer": "random_normal"}
    layer = keras_mha.MultiHeadAttention(**{**config, **kwargs})
    layer.build((None, None, D), (None, None, D))
    return layer


def _index(t, kind):
    return t if kind == "int" else ops.convert_to_tensor(t, dtype="int32")


def _decode(layer, x, kind, prefill=0, **kwargs):
    """Feeds `x[:, :prefill]` at once, then one token at a time; returns all outputs."""
    cache = layer.init_cache(B, L)
    outputs = []
    if prefill:
        out, cache = layer(
            x[:, :prefill],
            x[:, :prefill],
            cache=cache,
            cache_update_index=_index(0, kind),
            **kwargs,
        )
        outputs.append(ops.convert_to_numpy(out))
    for t in range(prefill, L):
        step = x[:, t : t + 1]
        out, cache = layer(step, step, cache=cache, cache_update_index=_index(t, kind), **kwargs)
        outputs.append(ops.convert_to_numpy(out))
    return np.concatenate(outputs, axis=1), cache


@pytest.mark.parametrize(
    "config,kind",
    [
        pytest.param({}, "int", id="mha-int"),
        pytest.param({}, "tensor", id="mha-tensor"),
        pytest.param({"num_key_value_heads": 2}, "int", id="gqa-int"),
        pytest.param({"num_key_value_heads": 2}, "tensor", id="gqa-tensor"),
        pytest.param({"num_key_value_heads": 1, "normalize_qk": True}, "tensor", id="mqa_qk_norm"),
        pytest.param({"sliding_window": 2}, "tensor", id="sliding_window"),
        pytest.param({"implementation": "explicit"}, "tensor", id="explicit"),
        pytest.param({"implementation": "fused"}, "tensor", id="fused"),
        pytest.param({"implementation": "chunked", "chunk_size": 4}, "tensor", id="chunked"),
    ],
)
def test_greedy_decoding_matches_full_causal_attention(rng, kind, config):
    layer = _layer(**config)
    x = rng.normal(size=(B, L, D)).astype("float32")
    full = ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    decoded, cache = _decode(layer, x, kind, use_causal_mask=True)
    np.testing.assert_allclose(decoded, full, atol=1e-5)
    # The cache holds the projected keys/values of the whole sequence.
    keys = ops.convert_to_numpy(layer.key_dense(x))
    if config.get("normalize_qk"):
        keys = ops.convert_to_numpy(layer._key_norm(keys))
    np.testing.assert_allclose(ops.convert_to_numpy(cache)[:, 0], keys, atol=1e-6)


@pytest.mark.parametrize("kind", ["int", "tensor"])
def test_prefill_then_decode_matches_full_causal_attention(rng, kind):
    layer = _layer(num_key_value_heads=2)
    x = rng.normal(size=(B, L, D)).astype("float32")
    full = ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    decoded, _ = _decode(layer, x, kind, prefill=3, use_causal_mask=True)
    np.testing.assert_allclose(decoded, full, atol=1e-5)


def test_decoding_without_causal_mask_needs_a_mask_over_unwritten_positions(rng):
    layer = _layer()
    x = rng.normal(size=(B, L, D)).astype("float32")
    cache = layer.init_cache(B, L)
    for t in range(L):
        step = x[:, t : t + 1]
        written = np.broadcast_to(np.arange(L) <= t, (B, L))
        out, cache = layer(step, step, cache=cache, cache_update_index=t, value_mask=written)
        if t in (1, L - 1):
            expected = layer(step, x[:, : t + 1])
            np.testing.assert_allclose(
                ops.convert_to_numpy(out), ops.convert_to_numpy(expected), atol=1e-5
            )
    # Without the mask the zeros of unwritten positions are attended: a different result.
    fresh = layer.init_cache(B, L)
    out, _ = layer(x[:, :1], x[:, :1], cache=fresh, cache_update_index=0)
    assert (
        np.abs(ops.convert_to_numpy(out) - ops.convert_to_numpy(layer(x[:, :1], x[:, :1]))).max()
        > 1e-4
    )


def test_scores_with_cache(rng):
    layer = _layer()
    x = rng.normal(size=(B, L, D)).astype("float32")
    cache = layer.init_cache(B, L)
    result = layer(
        x[:, :2],
        x[:, :2],
        cache=cache,
        cache_update_index=0,
        use_causal_mask=True,
        return_attention_scores=True,
    )
    assert len(result) == 3
    output, scores, cache = result
    scores = ops.convert_to_numpy(scores)
    assert scores.shape == (B, HEADS, 2, L) and tuple(cache.shape) == (B, 2, L, HEADS, HEAD_DIM)
    np.testing.assert_array_equal(scores[..., 0, 1:], 0.0)
    np.testing.assert_array_equal(scores[..., 1, 2:], 0.0)
    np.testing.assert_allclose(scores.sum(-1), 1.0, atol=1e-6)


def test_cache_without_index_is_used_as_is_for_cross_attention(rng):
    layer = _layer(num_key_value_heads=2)
    memory = rng.normal(size=(B, L, D)).astype("float32")
    query = rng.normal(size=(B, 3, D)).astype("float32")
    _, cache = layer(memory, memory, cache=layer.init_cache(B, L), cache_update_index=0)
    expected = ops.convert_to_numpy(layer(query, memory))
    out, same = layer(query, query, cache=cache)
    np.testing.assert_allclose(ops.convert_to_numpy(out), expected, atol=1e-5)
    np.testing.assert_array_equal(ops.convert_to_numpy(same), ops.convert_to_numpy(cache))


def test_decoding_step_compiles_once(rng):
    layer = _layer(num_key_value_heads=2, normalize_qk=True)
    x = rng.normal(size=(B, L, D)).astype("float32")
    full = ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    traces = []

    def step(token, cache, index):
        traces.append(1)
        return layer(token, token, cache=cache, cache_update_index=index, use_causal_mask=True)

    step = compiled(step)
    cache = layer.init_cache(B, L)
    outputs = []
    for t in range(L):
        token = ops.convert_to_tensor(x[:, t : t + 1])
        out, cache = step(token, cache, ops.convert_to_tensor(t, dtype="int32"))
        outputs.append(ops.convert_to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), full, atol=1e-5)
    if BACKEND in ("jax", "tensorflow"):
        assert len(traces) == 1  # the index is data, not a Python value


def test_eager_decoding_with_a_python_int_index(rng, monkeypatch):
    """A decoding loop run eagerly with a Python-int index, as a notebook writes it.
    Where an eager call's sizes may follow its data (`Policy.sizes_from_data`), the
    kernels get the index as an int (a cut's key range follows it); on JAX, whose
    eager ops compile again for every new constant, as a tensor: after the first
    step, no step compiles anything."""
    layer = _layer(num_key_value_heads=2, normalize_qk=True, rope_max_wavelength=100)
    x = rng.normal(size=(B, L, D)).astype("float32")
    full = ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    offsets, lowered = [], []
    real = kernels.attention

    def spy(*args, **kwargs):
        offsets.append(kwargs["mask"].offset)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "attention", spy)
    listener = None
    if BACKEND == "jax":
        import jax

        def listener(event, *args, **kwargs):
            if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and offsets:
                lowered.append(len(offsets))

        jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        decoded, _ = _decode(layer, x, "int", use_causal_mask=True)
    finally:
        if listener is not None:
            jax.monitoring.unregister_event_duration_listener(listener)
    np.testing.assert_allclose(decoded, full, atol=1e-5)
    from_data = kernels.policy.current().sizes_from_data
    assert len(offsets) >= L and {isinstance(offset, int) for offset in offsets} == {from_data}
    assert [step for step in lowered if step > 1] == []  # steps 2 ... L compiled nothing


@pytest.mark.parametrize("scores", [False, True], ids=["output", "with_scores"])
def test_symbolic_call_in_a_functional_model(rng, scores):
    layer = _layer(num_key_value_heads=2)
    token = keras.Input((1, D))
    cache_in = keras.Input((2, L, 2, HEAD_DIM))
    result = layer(
        token,
        token,
        cache=cache_in,
        cache_update_index=0,
        use_causal_mask=True,
        return_attention_scores=scores,
    )
    assert len(result) == (3 if scores else 2)
    assert tuple(result[0].shape) == (None, 1, D)
    assert tuple(result[-1].shape) == (None, 2, L, 2, HEAD_DIM)
    if scores:
        assert tuple(result[1].shape) == (None, HEADS, 1, L)
    model = keras.Model([token, cache_in], list(result))
    x = rng.normal(size=(B, 1, D)).astype("float32")
    cache = ops.convert_to_numpy(layer.init_cache(B, L))
    got = model([x, cache])
    want = layer(x, x, cache=cache, cache_update_index=0, use_causal_mask=True)
    np.testing.assert_allclose(
        ops.convert_to_numpy(got[0]), ops.convert_to_numpy(want[0]), atol=1e-6
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(got[-1]), ops.convert_to_numpy(want[-1]), atol=1e-6
    )


def test_init_cache():
    layer = keras_mha.MultiHeadAttention(num_heads=4, key_dim=3, num_key_value_heads=2)
    cache = layer.init_cache(2, 7)
    assert tuple(cache.shape) == (2, 2, 7, 2, 3)
    assert "float32" in str(cache.dtype)
    assert not np.any(ops.convert_to_numpy(cache))
    assert "float16" in str(layer.init_cache(1, 2, dtype="float16").dtype)
    with pytest.raises(ValueError, match="max_length"):
        layer.init_cache(2, 0)


def test_cache_needs_value_dim_equal_to_key_dim(rng):
    layer = _layer(value_dim=3)
    with pytest.raises(ValueError, match="`value_dim`.*value_dim=3"):
        layer.init_cache(B, L)
    x = rng.normal(size=(B, 1, D)).astype("float32")
    with pytest.raises(ValueError, match="`value_dim`"):
        layer(x, x, cache=np.zeros((B, 2, L, HEADS, HEAD_DIM), "float32"), cache_update_index=0)


_GOOD_CACHE = np.zeros((B, 2, L, HEADS, HEAD_DIM), "float32")


@pytest.mark.parametrize(
    "cache,index,name",
    [
        pytest.param(np.zeros((B, L, HEADS, HEAD_DIM)), 0, "cache", id="rank4"),
        pytest.param(np.zeros((B, 3, L, HEADS, HEAD_DIM)), 0, "cache", id="not_2"),
        pytest.param(np.zeros((B, 2, L, 1, HEAD_DIM)), 0, "cache", id="heads"),
        pytest.param(np.zeros((B, 2, L, HEADS, 5)), 0, "cache", id="key_dim"),
        pytest.param(np.zeros((3, 2, L, HEADS, HEAD_DIM)), 0, "cache", id="batch"),
        pytest.param(np.zeros((B, 2, 1, HEADS, HEAD_DIM)), 0, "cache", id="too_short"),
        pytest.param(None, 0, "cache_update_index", id="index_without_cache"),
        pytest.param(_GOOD_CACHE, 1.5, "cache_update_index", id="float_index"),
        pytest.param(_GOOD_CACHE, -1, "cache_update_index", id="negative_index"),
        pytest.param(_GOOD_CACHE, np.array([1]), "cache_update_index", id="vector_index"),
    ],
)
def test_invalid_cache_arguments(rng, cache, index, name):
    layer = _layer()
    x = rng.normal(size=(B, 2, D)).astype("float32")
    with pytest.raises(ValueError, match=f"argument `{name}`"):
        layer(x, x, cache=cache, cache_update_index=index)


def test_cache_rejects_nd_attention(rng):
    layer = keras_mha.MultiHeadAttention(2, 2, attention_axes=(1, 2))
    x = rng.normal(size=(1, 3, 2, D)).astype("float32")
    layer.build(x.shape, x.shape)
    with pytest.raises(ValueError, match="`query`"):
        layer(x, x, cache=np.zeros((1, 2, 4, 2, 2), "float32"), cache_update_index=0)


def test_cache_update_writes_only_the_new_positions(rng):
    cache = np.zeros((1, 2, 5, 1, 2), "float32")
    key = rng.normal(size=(1, 2, 1, 2)).astype("float32")
    value = rng.normal(size=(1, 2, 1, 2)).astype("float32")
    for index in (2, ops.convert_to_tensor(2, dtype="int32")):
        updated = ops.convert_to_numpy(cache_lib.update(cache, key, value, index))
        np.testing.assert_array_equal(updated[:, 0, 2:4], key)
        np.testing.assert_array_equal(updated[:, 1, 2:4], value)
        assert not np.any(updated[:, :, :2]) and not np.any(updated[:, :, 4:])


def test_cache_update_mask_keeps_what_the_cache_holds(rng):
    cache = rng.normal(size=(2, 2, 5, 1, 2)).astype("float32")
    key = rng.normal(size=(2, 2, 1, 2)).astype("float32")
    value = rng.normal(size=(2, 2, 1, 2)).astype("float32")
    write = np.array([[True, False], [False, True]])
    for index in (2, ops.convert_to_tensor(2, dtype="int32")):
        updated = ops.convert_to_numpy(cache_lib.update(cache, key, value, index, write))
        for b in range(2):
            for t in range(2):
                expected = (key, value) if write[b, t] else (cache[:, 0, 2:4], cache[:, 1, 2:4])
                np.testing.assert_array_equal(updated[b, 0, 2 + t], expected[0][b, t])
                np.testing.assert_array_equal(updated[b, 1, 2 + t], expected[1][b, t])
        np.testing.assert_array_equal(updated[:, :, :2], cache[:, :, :2])
        np.testing.assert_array_equal(updated[:, :, 4:], cache[:, :, 4:])


@pytest.mark.parametrize("kind", ["int", "tensor"])
def test_decoding_with_a_cache_update_mask_attends_to_the_kept_entries(rng, kind):
    """A decoding step whose flags are false at some positions attends to what the
    cache held there: the same as feeding, at those positions, the tokens that were
    prefilled (keys and values of the same token at the same position)."""
    layer = _layer(rope_max_wavelength=10.0)
    first = rng.normal(size=(B, L, D)).astype("float32")
    second = rng.normal(size=(B, 2, D)).astype("float32")
    _, cache = layer(first, first, cache=layer.init_cache(B, L), cache_update_index=0)
    write = np.array([[False, True], [True, True]])
    output, updated = layer(
        second,
        second,
        cache=cache,
        cache_update_index=_index(2, kind),
        use_causal_mask=True,
        cache_update_mask=write,
    )
    mixed = np.where(write[..., None], second, first[:, 2:4])
    expected, expected_cache = layer(
        mixed, mixed, cache=cache, cache_update_index=_index(2, kind), use_causal_mask=True
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(updated), ops.convert_to_numpy(expected_cache), atol=1e-6
    )
    output, expected = ops.convert_to_numpy(output), ops.convert_to_numpy(expected)
    np.testing.assert_allclose(output[write], expected[write], atol=1e-5)
    unmasked, _ = layer(
        second, second, cache=cache, cache_update_index=_index(2, kind), use_causal_mask=True
    )
    assert np.abs(ops.convert_to_numpy(unmasked)[0, 1] - output[0, 1]).max() > 1e-4


@pytest.mark.parametrize(
    "cache,mask",
    [
        pytest.param(None, np.ones((B, 2), bool), id="without_cache"),
        pytest.param(_GOOD_CACHE, np.ones((B, 3), bool), id="length"),
        pytest.param(_GOOD_CACHE, np.ones((B, 2, 1), bool), id="rank"),
    ],
)
def test_invalid_cache_update_mask(rng, cache, mask):
    layer = _layer()
    x = rng.normal(size=(B, 2, D)).astype("float32")
    index = None if cache is None else 0
    with pytest.raises(ValueError, match="argument `cache_update_mask`"):
        layer(x, x, cache=cache, cache_update_index=index, cache_update_mask=mask)
