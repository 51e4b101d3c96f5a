"""Keys and values from elsewhere: `key_value_projection="tied"` (the values are the key
projection's output, Gemma 4's `attention_k_eq_v`) and `"none"`, the `shared_key_value`
call argument (another layer's keys and values: Gemma 3n's and Gemma 4's KV-shared
layers) and `return_key_value`. Against the float64 reference on every kernel, forward
and backward (central differences), through the cache, with their argument checks,
config and saving."""

import keras
import numpy as np
import pytest
import reference as reference_lib
from helpers import output_and_gradients, stacked_numeric_gradient, to_numpy
from keras import ops
from reference import reference_mha

import keras_mha

B, T, DIM, HEADS, KV_HEADS, KEY_DIM = 2, 5, 8, 2, 1, 4
ATOL = 2e-5
KERNELS = ["explicit", "chunked", "fused"]
# A Gemma-4-like layer: QK-norm `x * w`, the value norm, RoPE, scale 1, a window.
GEMMA4 = dict(
    num_key_value_heads=KV_HEADS,
    use_bias=False,
    scale=1.0,
    normalize_qk=True,
    normalize_value=True,
    norm_epsilon=1e-2,
    rope_max_wavelength=50.0,
)
CASES = {
    "tied": dict(key_value_projection="tied", **GEMMA4),
    "tied-window": dict(key_value_projection="tied", sliding_window=2, **GEMMA4),
    "tied-bias": dict(key_value_projection="tied", num_key_value_heads=KV_HEADS),
}


def _layer(options, implementation=None, seed=1):
    keras.utils.set_random_seed(seed)
    layer = keras_mha.MultiHeadAttention(
        HEADS, KEY_DIM, implementation=implementation, chunk_size=2, **options
    )
    layer.build((B, T, DIM), (B, T, DIM))
    rng = np.random.default_rng(seed)
    for w in layer.weights:  # norms' scales and biases far from 1 and 0
        if w.path.endswith("scale") or w.path.endswith("bias"):
            w.assign(rng.uniform(0.5, 1.5, tuple(w.shape)).astype("float32"))
    return layer


def _inputs(seed=5, length=T):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, DIM)).astype("float32")
    padding = np.ones((B, length), bool)
    padding[1, length - 2 :] = False
    weights = rng.standard_normal((B, T, DIM))
    shared = rng.standard_normal((B, 2, length, KV_HEADS, KEY_DIM)).astype("float32")
    return x, padding, weights, shared


def _loss(weights):
    return lambda y: ops.sum(y * ops.convert_to_tensor(weights.astype("float32")))


def _mask(padding):
    return padding[:, None, :] & np.ones((1, T, 1), bool)


# --------------------------------------------------------------------- tied
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("case", list(CASES))
def test_tied_matches_float64_reference_forward_and_backward(case, implementation, causal):
    layer = _layer(CASES[case], implementation)
    x, padding, weights, _ = _inputs()
    out, _, grads, _ = output_and_gradients(
        layer,
        {"query": x, "value": x},
        _loss(weights),
        value_mask=padding,
        use_causal_mask=causal,
    )
    window = layer._sliding_window

    def reference(query, value):
        return reference_mha(
            layer, query, value, mask=_mask(padding), use_causal_mask=causal, sliding_window=window
        )[0]

    np.testing.assert_allclose(out, reference(x, x), atol=ATOL)

    def loss_of(query, value):  # a stack of queries or values, the other one shared
        copies = max(len(a) for a in (query, value) if a.ndim == 4)
        tile = lambda a: np.broadcast_to(a, (copies, *x.shape)).reshape(-1, T, DIM)  # noqa: E731
        out = reference_mha(
            layer,
            tile(query),
            tile(value),
            mask=np.concatenate([_mask(padding)] * copies),
            use_causal_mask=causal,
            sliding_window=window,
        )[0]
        return np.sum(out.reshape(copies, *x.shape) * weights, axis=(1, 2, 3))

    d_query = stacked_numeric_gradient(lambda q: loss_of(q, x), x)
    d_value = stacked_numeric_gradient(lambda v: loss_of(x, v), x)
    np.testing.assert_allclose(grads["query"], d_query, atol=1e-4)
    np.testing.assert_allclose(grads["value"], d_value, atol=1e-4)


def test_tied_values_are_the_key_projection_before_its_norm_and_rope():
    """The same layer with a separate value projection holding the key's kernel gives
    the same output; with another kernel, another output (the test above can fail)."""
    tied = _layer(CASES["tied"])
    separate = _layer({k: v for k, v in CASES["tied"].items() if k != "key_value_projection"})
    by_path = {w.path.split("/", 1)[1]: w for w in tied.weights}
    for w in separate.weights:
        name = w.path.split("/", 1)[1]
        w.assign(by_path["key/kernel" if name == "value/kernel" else name])
    x, padding, _, _ = _inputs()
    expected = to_numpy(tied(x, x, value_mask=padding, use_causal_mask=True))
    got = to_numpy(separate(x, x, value_mask=padding, use_causal_mask=True))
    np.testing.assert_allclose(got, expected, atol=1e-6)
    separate._value_dense.kernel.assign(-to_numpy(separate._value_dense.kernel) + 0.5)
    other = to_numpy(separate(x, x, value_mask=padding, use_causal_mask=True))
    assert np.abs(other - expected).max() > 1e-3


def test_tied_weights_have_no_value_projection():
    layer = _layer(CASES["tied"])
    paths = [w.path.split("/", 1)[1] for w in layer.weights]
    assert paths == [
        "query/kernel",
        "key/kernel",
        "attention_output/kernel",
        "query_norm/scale",
        "key_norm/scale",
    ]
    assert layer.value_dense is None


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("case", list(CASES))
def test_tied_prefill_and_decode_equal_one_causal_call(case, implementation):
    layer = _layer(CASES[case], implementation)
    x, _, _, _ = _inputs()
    full = to_numpy(layer(x, x, use_causal_mask=True))
    cache = layer.init_cache(B, T)
    out, cache = layer(x[:, :3], x[:, :3], cache=cache, cache_update_index=0, use_causal_mask=True)
    steps = [to_numpy(out)]
    for t in range(3, T):
        token = x[:, t : t + 1]
        out, cache = layer(token, token, cache=cache, cache_update_index=t, use_causal_mask=True)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=ATOL)


# -------------------------------------------------------------- shared keys
SHARED = {
    "none": dict(key_value_projection="none", **GEMMA4),
    "none-window": dict(key_value_projection="none", sliding_window=2, **GEMMA4),
    # A layer with projections of its own (Gemma 3n's KV-shared layers keep theirs).
    "separate": dict(num_key_value_heads=KV_HEADS, normalize_qk=True, rope_max_wavelength=50.0),
}


@pytest.mark.parametrize("offset", [0, 2], ids=["prefill", "offset"])
@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("case", list(SHARED))
def test_shared_key_value_matches_float64_reference_forward_and_backward(
    case, implementation, offset
):
    """Queries at `offset + t` among `T + offset` shared positions (a decoding step's
    view of another layer's cache), causal, the keys' padding; gradients reach the
    query and the shared keys and values."""
    layer = _layer(SHARED[case], implementation)
    x, padding, weights, shared = _inputs(length=T + offset)
    index = {"cache_update_index": offset} if offset else {}
    out, _, grads, _ = output_and_gradients(
        layer,
        {"query": x, "value": x, "shared_key_value": shared},
        _loss(weights),
        key_mask=padding,
        use_causal_mask=True,
        **index,
    )
    window = layer._sliding_window
    mask = padding[:, None, :] & np.ones((1, T, 1), bool)

    def reference(query, kv):
        return reference_mha(
            layer,
            query,
            query,
            mask=mask,
            use_causal_mask=True,
            sliding_window=window,
            shared_key_value=kv,
            query_offset=offset,
        )[0]

    np.testing.assert_allclose(out, reference(x, shared), atol=ATOL)

    def loss_of(query, kv):  # a stack of queries or of shared keys and values
        copies = len(query) if query.ndim == 4 else len(kv)
        query = np.broadcast_to(query, (copies, *x.shape)).reshape(-1, T, DIM)
        kv = np.broadcast_to(kv, (copies, *shared.shape)).reshape(-1, *shared.shape[1:])
        out = reference_mha(
            layer,
            query,
            query,
            mask=np.concatenate([mask] * copies),
            use_causal_mask=True,
            sliding_window=window,
            shared_key_value=kv,
            query_offset=offset,
        )[0]
        return np.sum(out.reshape(copies, *x.shape) * weights, axis=(1, 2, 3))

    d_query = stacked_numeric_gradient(lambda q: loss_of(q, shared), x)
    d_shared = stacked_numeric_gradient(lambda kv: loss_of(x, kv), shared)
    np.testing.assert_allclose(grads["query"], d_query, atol=1e-4)
    np.testing.assert_allclose(grads["shared_key_value"], d_shared, atol=1e-4)
    unused = grads["value"]  # the layer's own keys are not used: None (torch) or zeros
    assert unused is None or np.abs(unused).max() == 0


@pytest.mark.parametrize("implementation", KERNELS)
def test_a_layer_reading_anothers_cache_decodes_as_one_causal_call(implementation):
    """Layer A decodes with its cache (a prompt, then a token at a time); layer B
    (no keys of its own) reads A's updated cache at the same index at each step: B's
    outputs equal one causal call of B over A's keys and values (`return_key_value`)."""
    source = _layer(dict(CASES["tied"], key_value_projection="separate"), implementation, 2)
    reader = _layer(SHARED["none-window"], implementation, 3)
    x, _, _, _ = _inputs()
    _, held = source(x, x, use_causal_mask=True, return_key_value=True)
    full = to_numpy(reader(x, x, use_causal_mask=True, shared_key_value=held))
    cache = source.init_cache(B, T)
    _, cache = source(x[:, :3], x[:, :3], cache=cache, cache_update_index=0, use_causal_mask=True)
    np.testing.assert_allclose(to_numpy(cache)[:, :, :3], to_numpy(held)[:, :, :3], atol=1e-6)
    steps = [
        reader(
            x[:, :3], x[:, :3], use_causal_mask=True, shared_key_value=cache, cache_update_index=0
        )
    ]
    for t in range(3, T):
        token = x[:, t : t + 1]
        _, cache = source(token, token, cache=cache, cache_update_index=t, use_causal_mask=True)
        out = reader(
            token, token, use_causal_mask=True, shared_key_value=cache, cache_update_index=t
        )
        steps.append(out)
    np.testing.assert_allclose(to_numpy(cache), to_numpy(held), atol=1e-6)
    steps = np.concatenate([to_numpy(s) for s in steps], axis=1)
    np.testing.assert_allclose(steps, full, atol=ATOL)


def test_return_key_value_gives_the_keys_and_values_attended_over():
    layer = _layer(CASES["tied"])
    x, _, _, shared = _inputs()
    out, held = layer(x, x, use_causal_mask=True, return_key_value=True)
    np.testing.assert_allclose(to_numpy(out), to_numpy(layer(x, x, use_causal_mask=True)))
    # The keys and values the reference computes (projected, normed, rotated).
    q = reference_lib._project(x, *reference_lib.layer_weights(layer)["key"], 1)
    keys = reference_lib.rope(reference_lib._rms_norm(q, layer._key_norm), 0, 50.0)
    values = reference_lib.rms_norm(q, 1.0, 1e-2)
    np.testing.assert_allclose(to_numpy(held), np.stack([keys, values], 1), atol=1e-5)
    cache = layer.init_cache(B, T)
    _, again = layer(x, x, cache=cache, cache_update_index=0, return_key_value=True)
    np.testing.assert_allclose(to_numpy(again), to_numpy(held), atol=1e-6)  # the cache, once
    reader = _layer(SHARED["none"])
    _, passed = reader(x, x, shared_key_value=shared, return_key_value=True)
    np.testing.assert_allclose(to_numpy(passed), shared)


def test_symbolic_return_key_value():
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, num_key_value_heads=KV_HEADS)
    inputs = keras.Input((None, DIM))
    out, held = layer(inputs, inputs, return_key_value=True)
    assert tuple(out.shape) == (None, None, DIM)
    assert tuple(held.shape) == (None, 2, None, KV_HEADS, KEY_DIM)
    reader = keras_mha.MultiHeadAttention(
        HEADS, KEY_DIM, num_key_value_heads=KV_HEADS, key_value_projection="none"
    )
    model = keras.Model(inputs, reader(inputs, inputs, shared_key_value=held))
    x, _, _, _ = _inputs()
    _, expected_held = layer(x, x, return_key_value=True)
    np.testing.assert_allclose(
        to_numpy(model(x)), to_numpy(reader(x, x, shared_key_value=expected_held)), atol=1e-6
    )


def test_none_has_no_key_or_value_weights():
    layer = _layer(SHARED["none"])
    paths = [w.path.split("/", 1)[1] for w in layer.weights]
    assert paths == ["query/kernel", "attention_output/kernel", "query_norm/scale"]
    assert layer.key_dense is None and layer.value_dense is None


# ------------------------------------------------------------ config, checks
def test_config_round_trip_and_saving(tmp_path):
    for options in (CASES["tied"], SHARED["none"]):
        layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, **options)
        config = layer.get_config()
        assert config["key_value_projection"] == options["key_value_projection"]
        assert keras_mha.MultiHeadAttention.from_config(config).get_config() == config
    assert keras_mha.MultiHeadAttention(2, 4).get_config()["key_value_projection"] == "separate"
    inputs = keras.Input((T, DIM))
    source = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, **CASES["tied"])
    reader = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, **SHARED["none"])
    out, held = source(inputs, inputs, use_causal_mask=True, return_key_value=True)
    out = reader(out, out, use_causal_mask=True, shared_key_value=held)
    model = keras.Model(inputs, out)
    x, _, _, _ = _inputs()
    path = tmp_path / "shared.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"key_value_projection": "shared"}, "key_value_projection"),
        ({"key_value_projection": "tied", "value_dim": 3}, "value_dim"),
    ],
)
def test_bad_constructor_values_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=f"argument `{argument}`"):
        keras_mha.MultiHeadAttention(HEADS, KEY_DIM, **kwargs)


def test_bad_shared_key_value_is_rejected_before_building():
    x, _, _, shared = _inputs()
    reader = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, key_value_projection="none")
    with pytest.raises(
        ValueError, match="argument `shared_key_value`.*key_value_projection='none'"
    ):
        reader(x, x)
    assert not reader.built
    with pytest.raises(ValueError, match="argument `shared_key_value`, expected a tensor of shape"):
        reader(x, x, shared_key_value=shared)  # 1 key/value head, the layer has 2
    assert not reader.built
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, num_key_value_heads=KV_HEADS)
    cache = np.zeros((B, 2, T, KV_HEADS, KEY_DIM), "float32")
    with pytest.raises(ValueError, match="argument `shared_key_value`, expected `None` when a"):
        layer(x, x, cache=cache, cache_update_index=0, shared_key_value=shared)
    with pytest.raises(ValueError, match="argument `cache_update_index`"):
        layer(x, x, cache_update_index=0)
    with pytest.raises(ValueError, match="argument `cache_update_mask`"):
        layer(
            x, x, shared_key_value=shared, cache_update_index=0, cache_update_mask=np.ones((B, T))
        )
