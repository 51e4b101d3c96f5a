"""Attention bias, logit soft-capping, attention sinks and rotary embeddings, and the
options of keras-hub's models (`scale`, `use_output_bias`, the norms' epsilon and
`(1 + w)` scale, the value norm, `(left, right)` windows, `dropout_on`): against the
float64 reference on every kernel, with GQA, QK-norm, masks and windows, through the
backward pass, cached decoding, jit, saving, and their argument checks; against
keras-hub's own attention layers where they compute the same thing."""

import keras
import numpy as np
import pytest
from helpers import (
    BACKEND,
    compiled,
    gradients,
    output_and_gradients,
    stacked_numeric_gradient,
    to_numpy,
)
from keras import ops
from reference import reference_mha

import keras_mha

B, T, DIM, HEADS, KEY_DIM = 2, 9, 16, 4, 4
ATOL = 2e-5
FEATURES = {
    "bias": {},
    "soft_cap": {"logit_soft_cap": 1.5},
    "sinks": {"use_sinks": True},
    "rope": {"rope_max_wavelength": 50.0, "rope_scaling_factor": 2.0},
    "all+gqa+qk_norm": {
        "logit_soft_cap": 1.5,
        "use_sinks": True,
        "rope_max_wavelength": 50.0,
        "num_key_value_heads": 2,
        "normalize_qk": True,
    },
}
MASKING = {
    "causal+padding": dict(use_causal_mask=True),
    "window": dict(sliding_window=3),
}


def _layer(features, implementation=None, sliding_window=None, seed=0, **extra):
    keras.utils.set_random_seed(seed)
    layer = keras_mha.MultiHeadAttention(
        HEADS,
        KEY_DIM,
        implementation=implementation,
        chunk_size=4,
        sliding_window=sliding_window,
        **FEATURES[features],
        **extra,
    )
    layer.build((B, T, DIM), (B, T, DIM))
    if layer._use_sinks:  # non-zero sink logits, so they matter
        layer._sinks.sinks.assign(np.linspace(-1.0, 1.5, HEADS).astype("float32"))
    return layer


def _inputs(rng, features):
    x = rng.standard_normal((B, T, DIM)).astype("float32")
    padding = np.ones((B, T), bool)
    padding[1, 6:] = False
    bias = None
    if features in ("bias", "all+gqa+qk_norm"):
        bias = rng.standard_normal((1, HEADS, T, T)).astype("float32")
    return x, padding, bias


def _reference(layer, x, padding, bias, causal, window):
    mask = padding[:, None, :] & np.ones((1, T, 1), bool)
    return reference_mha(
        layer,
        x,
        x,
        mask=mask,
        use_causal_mask=causal,
        sliding_window=window,
        attention_bias=bias,
    )


@pytest.mark.parametrize("masking", list(MASKING))
@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked", None])
@pytest.mark.parametrize("features", list(FEATURES))
def test_matches_float64_reference(rng, features, implementation, masking):
    options = MASKING[masking]
    window = options.get("sliding_window")
    layer = _layer(features, implementation, sliding_window=window)
    x, padding, bias = _inputs(rng, features)
    causal = options.get("use_causal_mask", False)
    out = layer(x, x, value_mask=padding, use_causal_mask=causal, attention_bias=bias)
    expected, _ = _reference(layer, x, padding, bias, causal, window)
    np.testing.assert_allclose(to_numpy(out), expected, atol=ATOL)


@pytest.mark.parametrize("features", ["sinks", "all+gqa+qk_norm"])
def test_scores_are_the_weights_with_sinks(rng, features):
    layer = _layer(features)
    x, padding, bias = _inputs(rng, features)
    _, scores = layer(x, x, value_mask=padding, attention_bias=bias, return_attention_scores=True)
    _, expected = _reference(layer, x, padding, bias, False, None)
    np.testing.assert_allclose(to_numpy(scores), expected, atol=ATOL)
    assert (to_numpy(scores).sum(-1) < 1.0 - 1e-3).all()  # the sinks take a share


@pytest.mark.parametrize("features", list(FEATURES))
def test_chunked_gradients_equal_explicit(rng, features):
    """Inputs, every weight (the sinks included) and a learned bias."""
    x, padding, bias = _inputs(rng, features)
    results = []
    for implementation in ("explicit", "chunked"):
        layer = _layer(features, implementation)
        inputs = {"query": x, "value": x}
        if bias is not None:
            inputs["attention_bias"] = bias
        results.append(gradients(layer, inputs, value_mask=padding, use_causal_mask=True))
    (loss_a, in_a, w_a), (loss_b, in_b, w_b) = results
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
    for name in in_a:
        assert np.abs(in_a[name]).max() > 0
        np.testing.assert_allclose(in_b[name], in_a[name], atol=1e-4)
    for a, b in zip(w_a, w_b):
        np.testing.assert_allclose(b, a, atol=1e-4)
    if FEATURES[features].get("use_sinks"):
        assert np.abs(w_a[-1]).max() > 0  # the sinks learn


@pytest.mark.parametrize("implementation", ["explicit", "chunked", None])
def test_cached_decoding_equals_one_causal_call(rng, implementation):
    layer = _layer("all+gqa+qk_norm", implementation, sliding_window=5)
    x, _, bias = _inputs(rng, "all+gqa+qk_norm")
    full = to_numpy(layer(x, x, use_causal_mask=True, attention_bias=bias))
    cache = layer.init_cache(B, T)
    steps = []
    for t in range(T):
        token = x[:, t : t + 1]
        out, cache = layer(
            token,
            token,
            cache=cache,
            cache_update_index=t,
            use_causal_mask=True,
            attention_bias=bias[:, :, t : t + 1],
        )
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=ATOL)


def test_decoding_step_compiles_once(rng):
    """A compiled decoding step: the index is data, RoPE and the masks follow it."""
    layer = _layer("all+gqa+qk_norm")
    x, _, _ = _inputs(rng, "all+gqa+qk_norm")
    full = to_numpy(layer(x, x, use_causal_mask=True))
    traces = []

    def step(token, cache, index):
        traces.append(1)
        return layer(token, token, cache=cache, cache_update_index=index, use_causal_mask=True)

    step = compiled(step)
    cache = layer.init_cache(B, T)
    outputs = []
    for t in range(T):
        token = ops.convert_to_tensor(x[:, t : t + 1])
        out, cache = step(token, cache, ops.convert_to_tensor(t, dtype="int32"))
        outputs.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), full, atol=ATOL)
    if BACKEND in ("jax", "tensorflow"):
        assert len(traces) == 1


@pytest.mark.parametrize("features", ["all+gqa+qk_norm"])
def test_saved_and_reloaded(tmp_path, rng, features):
    inputs = keras.Input((T, DIM))
    bias_input = keras.Input((HEADS, T, T))
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, **FEATURES[features])
    model = keras.Model(
        [inputs, bias_input], layer(inputs, inputs, use_causal_mask=True, attention_bias=bias_input)
    )
    layer._sinks.sinks.assign(np.linspace(-1.0, 1.0, HEADS).astype("float32"))
    x = rng.standard_normal((B, T, DIM)).astype("float32")
    bias = rng.standard_normal((B, HEADS, T, T)).astype("float32")
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    config = loaded.layers[2].get_config()
    for name, value in FEATURES[features].items():
        assert config[name] == value
    np.testing.assert_allclose(to_numpy(loaded([x, bias])), to_numpy(model([x, bias])), atol=1e-6)
    assert loaded.layers[2].weights[-1].path.endswith("sinks/sinks")


def test_all_off_keeps_todays_weights():
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM)
    layer.build((B, T, DIM), (B, T, DIM))
    assert len(layer.weights) == 8
    config = layer.get_config()
    assert config["logit_soft_cap"] is None and config["use_sinks"] is False
    assert config["rope_max_wavelength"] is None and config["rope_scaling_factor"] == 1.0


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"logit_soft_cap": 0.0}, "logit_soft_cap"),
        ({"logit_soft_cap": -1}, "logit_soft_cap"),
        ({"logit_soft_cap": "2"}, "logit_soft_cap"),
        ({"rope_max_wavelength": 0}, "rope_max_wavelength"),
        ({"rope_max_wavelength": float("inf")}, "rope_max_wavelength"),
        ({"rope_scaling_factor": 0.0, "rope_max_wavelength": 10}, "rope_scaling_factor"),
        ({"rope_max_wavelength": 10, "key_dim": 3}, "key_dim"),
        ({"use_sinks": "yes"}, "use_sinks"),
    ],
)
def test_bad_constructor_values_name_the_argument(kwargs, argument):
    kwargs = {"num_heads": 2, "key_dim": 4, **kwargs}
    with pytest.raises(ValueError, match=f"argument `{argument}`"):
        keras_mha.MultiHeadAttention(**kwargs)


def test_rope_needs_rank3_inputs():
    layer = keras_mha.MultiHeadAttention(2, 4, rope_max_wavelength=10)
    with pytest.raises(ValueError, match="rank-3"):
        layer.build((2, 3, 4, 8), (2, 3, 4, 8))
    assert not layer.built and not layer.weights


@pytest.mark.parametrize(
    "bias, message",
    [
        (np.zeros((B, HEADS, T, T + 1), "float32"), "broadcastable to the scores"),
        (np.zeros((3, 1, 1, T), "float32"), "broadcastable to the scores"),
        (np.zeros((1, HEADS + 1, 1, 1), "float32"), "broadcastable to the scores"),
        (np.zeros((1, 1, B, HEADS, T, T), "float32"), "broadcastable to the scores"),
        (np.zeros((1, HEADS, T, T), "int32"), "a float tensor"),
    ],
)
def test_bad_bias_is_rejected_and_changes_nothing(bias, message):
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM)
    x = np.zeros((B, T, DIM), "float32")
    layer(x, x)
    before = [w.copy() for w in layer.get_weights()]
    with pytest.raises(ValueError, match=f"`attention_bias`.*{message}"):
        layer(x, x, attention_bias=ops.convert_to_tensor(bias))
    for a, b in zip(before, layer.get_weights()):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------- options of keras-hub's models
# Each against the float64 reference on every kernel, forward and backward (central
# differences of the reference), and through the KV cache.
OB, OT, ODIM, OHEADS, OKEY_DIM = 2, 6, 8, 2, 4
OPTIONS = {
    "scale": {"scale": 0.8},
    "scale-t5": {"scale": 1.0, "use_bias": False},
    "no_output_bias": {"use_output_bias": False},
    "output_bias_only": {"use_bias": False, "use_output_bias": True},
    "qk_norm_epsilon": {"normalize_qk": True, "norm_epsilon": 0.5},
    "qk_norm_unit_offset": {"normalize_qk": True, "norm_unit_offset": True, "norm_epsilon": 1e-5},
    "value_norm": {"normalize_value": True, "norm_epsilon": 0.1},
    "window_pair": {"sliding_window": (2, 1)},
    "gemma3-like": {
        "scale": 0.3,
        "use_bias": False,
        "normalize_qk": True,
        "norm_unit_offset": True,
        "norm_epsilon": 1e-3,
        "normalize_value": True,
        "sliding_window": (3, 1),
        "num_key_value_heads": 1,
        "logit_soft_cap": 2.0,
    },
}
KERNELS = ["explicit", "chunked", "fused"]


def _option_layer(option, implementation=None, **extra):
    keras.utils.set_random_seed(1)
    layer = keras_mha.MultiHeadAttention(
        OHEADS, OKEY_DIM, implementation=implementation, chunk_size=2, **OPTIONS[option], **extra
    )
    layer.build((OB, OT, ODIM), (OB, OT, ODIM))
    rng = np.random.default_rng(3)
    for norm in ("_query_norm", "_key_norm"):
        if hasattr(layer, norm):  # scales far from their initial values, so they matter
            getattr(layer, norm).scale.assign(rng.uniform(-0.8, 0.8, OKEY_DIM).astype("float32"))
    biases = [w for w in layer.weights if w.path.endswith("bias")]
    for w in biases:  # non-zero biases, so a missing one shows
        w.assign(rng.standard_normal(tuple(w.shape)).astype("float32"))
    return layer


def _option_inputs(seed=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((OB, OT, ODIM)).astype("float32")
    padding = np.ones((OB, OT), bool)
    padding[1, 4:] = False
    weights = rng.standard_normal((OB, OT, ODIM))
    return x, padding, weights


def _option_reference(layer, query, value, padding, causal, **extra):
    mask = padding[:, None, :] & np.ones((1, OT, 1), bool)
    window = layer._sliding_window
    return reference_mha(
        layer, query, value, mask=mask, use_causal_mask=causal, sliding_window=window, **extra
    )[0]


def _stacked_loss(layer, query, value, padding, causal, weights, output_keep=None):
    """`sum(reference * weights)` of each copy in a stack `(P, OB, OT, ODIM)` of queries
    or values (the other one `(OB, OT, ODIM)`), in one reference call of `P * OB` rows
    (the reference's batch rows are independent)."""
    copies = max(len(a) for a in (query, value) if a.ndim == 4)

    def rows(a):
        return np.broadcast_to(a, (copies,) + a.shape[-3:]).reshape((-1,) + a.shape[-2:])

    extra = {}
    if output_keep is not None:
        keep, rate = output_keep
        extra["output_keep"] = (np.concatenate([keep] * copies), rate)
    padding = np.concatenate([padding] * copies)
    out = _option_reference(layer, rows(query), rows(value), padding, causal, **extra)
    return np.sum(out.reshape(copies, OB, OT, ODIM) * weights, axis=(1, 2, 3))


_REFERENCE_GRADIENTS = {}


def _reference_gradients(option, causal):
    """Float64 gradients of `sum(reference * weights)` w.r.t. the query and the value,
    by central differences (once per option)."""
    if (option, causal) not in _REFERENCE_GRADIENTS:
        layer = _option_layer(option)
        x, padding, weights = _option_inputs()

        def loss_of(query, value):
            return _stacked_loss(layer, query, value, padding, causal, weights)

        _REFERENCE_GRADIENTS[option, causal] = (
            stacked_numeric_gradient(lambda q: loss_of(q, x), x),
            stacked_numeric_gradient(lambda v: loss_of(x, v), x),
        )
    return _REFERENCE_GRADIENTS[option, causal]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_matches_float64_reference_forward_and_backward(option, implementation, causal):
    layer = _option_layer(option, implementation)
    x, padding, weights = _option_inputs()
    loss = lambda y: ops.sum(y * ops.convert_to_tensor(weights.astype("float32")))  # noqa: E731
    out, _, grads, _ = output_and_gradients(
        layer, {"query": x, "value": x}, loss, value_mask=padding, use_causal_mask=causal
    )
    expected = _option_reference(layer, x, x, padding, causal)
    np.testing.assert_allclose(out, expected, atol=ATOL)
    d_query, d_value = _reference_gradients(option, causal)
    np.testing.assert_allclose(grads["query"], d_query, atol=1e-4)
    np.testing.assert_allclose(grads["value"], d_value, atol=1e-4)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_changes_the_result(option):
    """Every option case differs from the layer without it: the tests above can fail."""
    layer = _option_layer(option)
    x, padding, _ = _option_inputs()
    keras.utils.set_random_seed(1)
    config = {**layer.get_config(), **_OFF}
    plain = keras_mha.MultiHeadAttention.from_config(config)
    plain.build((OB, OT, ODIM), (OB, OT, ODIM))
    rng = np.random.default_rng(9)
    for w in plain.weights:
        source = [v for v in layer.weights if v.path.split("/", 1)[1] == w.path.split("/", 1)[1]]
        # A weight only the plain layer has (a bias) gets non-zero values.
        w.assign(source[0] if source else rng.standard_normal(tuple(w.shape)).astype("float32"))
    ours = to_numpy(layer(x, x, value_mask=padding, use_causal_mask=True))
    without = to_numpy(plain(x, x, value_mask=padding, use_causal_mask=True))
    assert np.abs(ours - without).max() > 1e-3


_OFF = {
    "scale": None,
    "use_bias": True,
    "use_output_bias": None,
    "norm_epsilon": 1e-6,
    "norm_unit_offset": False,
    "normalize_value": False,
    "sliding_window": None,
}


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_prefill_and_decode_equal_one_causal_call(option, implementation):
    """A prompt of 3 tokens at index 0, then one token at a time: the window follows
    the queries' positions in the cache."""
    layer = _option_layer(option, implementation)
    x, _, _ = _option_inputs()
    full = to_numpy(layer(x, x, use_causal_mask=True))
    cache = layer.init_cache(OB, OT)
    prompt = x[:, :3]
    out, cache = layer(prompt, prompt, cache=cache, cache_update_index=0, use_causal_mask=True)
    steps = [to_numpy(out)]
    for t in range(3, OT):
        token = x[:, t : t + 1]
        out, cache = layer(token, token, cache=cache, cache_update_index=t, use_causal_mask=True)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=ATOL)


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("window", [(2, 1), (0, 3), 2])
def test_window_with_a_query_offset_in_a_filled_cache(implementation, window):
    """Without causality (an encoder's asymmetric window over a filled cache), each
    query `t` at `cache_update_index=t` sees the keys `t - left ... t + right`."""
    keras.utils.set_random_seed(1)
    layer = keras_mha.MultiHeadAttention(
        OHEADS, OKEY_DIM, sliding_window=window, implementation=implementation, chunk_size=2
    )
    x, _, _ = _option_inputs()
    full = to_numpy(layer(x, x))
    _, cache = layer(x, x, cache=layer.init_cache(OB, OT), cache_update_index=0)
    for t in range(OT):
        token = x[:, t : t + 1]
        out, _ = layer(token, token, cache=cache, cache_update_index=t)
        np.testing.assert_allclose(to_numpy(out), full[:, t : t + 1], atol=ATOL)
    expected = reference_mha(layer, x, x, sliding_window=window)[0]
    np.testing.assert_allclose(full, expected, atol=ATOL)


# ------------------------------------------------------------ dropout placement
def _identity_output(layer):
    """Output projection = identity on `(N * Hv)` channels, no bias: the output is the
    attention output, heads side by side, where dropout can be seen."""
    kernel = np.eye(OHEADS * OKEY_DIM, dtype="float32").reshape(OHEADS, OKEY_DIM, ODIM)
    layer._output_dense.kernel.assign(kernel)


@pytest.mark.parametrize("implementation", KERNELS)
def test_dropout_on_output_drops_attention_output_entries(implementation):
    """`dropout_on="output"`: each entry of the `(B, T, N, Hv)` attention output is 0 or
    the reference's divided by `1 - rate`, forward; backward, the reference's
    gradients through the same keep mask."""
    rate = 0.4
    layer = _option_layer("scale-t5", implementation, dropout=rate, dropout_on="output", seed=3)
    _identity_output(layer)
    x, padding, weights = _option_inputs()
    weights = weights.astype("float32")
    loss = lambda y: ops.sum(y * ops.convert_to_tensor(weights))  # noqa: E731
    out, _, grads, _ = output_and_gradients(
        layer, {"query": x, "value": x}, loss, value_mask=padding, training=True
    )
    plain = _option_reference(layer, x, x, padding, False)
    keep = out != 0
    assert keep.any() and not keep.all()
    np.testing.assert_allclose(out, np.where(keep, plain / (1 - rate), 0.0), atol=ATOL)
    keep = keep.reshape(OB, OT, OHEADS, OKEY_DIM).astype("float64")

    def loss_of(query, value):
        return _stacked_loss(layer, query, value, padding, False, weights, output_keep=(keep, rate))

    d_query = stacked_numeric_gradient(lambda q: loss_of(q, x), x)
    np.testing.assert_allclose(grads["query"], d_query, atol=1e-4)
    d_value = stacked_numeric_gradient(lambda v: loss_of(x, v), x)
    np.testing.assert_allclose(grads["value"], d_value, atol=1e-4)
    # Not in inference, and returned scores are the weights, undropped.
    np.testing.assert_allclose(to_numpy(layer(x, x, value_mask=padding)), plain, atol=ATOL)


def test_dropout_on_weights_is_not_dropout_on_output():
    """The default drops weights: the outputs are not 0-or-scaled entries (what the
    test above checks can fail)."""
    rate = 0.4
    layer = _option_layer("scale-t5", "explicit", dropout=rate, seed=3)
    _identity_output(layer)
    x, padding, _ = _option_inputs()
    out = to_numpy(layer(x, x, value_mask=padding, training=True))
    plain = _option_reference(layer, x, x, padding, False)
    assert (out != 0).all()
    assert np.abs(out - plain / (1 - rate)).max() > 1e-2


def test_dropout_on_output_keeps_the_fused_kernel_in_training(monkeypatch):
    """Dropout on the weights needs a kernel that draws them (the chunked one); on the
    output, the fused kernel runs in training too."""
    from keras_mha.kernels import chunked, fused

    calls = []
    monkeypatch.setattr(fused, "attention", _spy(fused.attention, calls, "fused"))
    monkeypatch.setattr(chunked, "attention", _spy(chunked.attention, calls, "chunked"))
    x, _, _ = _option_inputs()
    for dropout_on in ("output", "weights"):
        layer = _option_layer("scale-t5", "fused", dropout=0.2, dropout_on=dropout_on)
        layer(x, x, training=True)
    assert calls == ["fused", "chunked"]


def _spy(function, calls, name):
    def spy(*args, **kwargs):
        calls.append(name)
        return function(*args, **kwargs)

    return spy


def test_dropout_on_output_is_reproducible_with_a_seed():
    x, _, _ = _option_inputs()
    outs = []
    for _ in range(2):
        layer = _option_layer("scale-t5", dropout=0.5, dropout_on="output", seed=11)
        outs.append(to_numpy(layer(x, x, training=True)))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("implementation", KERNELS)
def test_dropout_on_weights_and_projected_output_drops_both(implementation):
    """`dropout_on="weights_and_projected_output"` (keras-hub's Bloom): the weights
    dropped as with "weights" (the same seed drops the same ones), then each entry of
    the projected `(B, T, out)` output 0 or divided by `1 - rate`, forward and
    backward; in inference, the float64 reference."""
    rate = 0.4
    on = "weights_and_projected_output"
    x, padding, weights = _option_inputs()
    weights = weights.astype("float32")

    def run(dropout_on, loss_weights):
        layer = _option_layer("scale", implementation, dropout=rate, dropout_on=dropout_on, seed=3)
        loss = lambda y: ops.sum(y * ops.convert_to_tensor(loss_weights))  # noqa: E731
        inputs = {"query": x, "value": x}
        out, _, grads, _ = output_and_gradients(
            layer, inputs, loss, value_mask=padding, training=True
        )
        return layer, out, grads

    layer, out, grads = run(on, weights)
    keep = out != 0
    assert keep.any() and not keep.all()
    # The same weights dropped ("weights", the same seed), then the projected output.
    _, dropped_weights, expected = run("weights", weights * keep / (1 - rate))
    np.testing.assert_allclose(
        out, np.where(keep, dropped_weights / (1 - rate), 0.0), atol=ATOL, rtol=1e-5
    )
    for name in ("query", "value"):
        np.testing.assert_allclose(grads[name], expected[name], atol=1e-4)
    plain = _option_reference(layer, x, x, padding, False)
    assert np.abs(dropped_weights - plain).max() > 1e-2  # the weights were dropped too
    np.testing.assert_allclose(to_numpy(layer(x, x, value_mask=padding)), plain, atol=ATOL)
    config = layer.get_config()
    assert config["dropout_on"] == on
    assert keras_mha.MultiHeadAttention.from_config(config).get_config() == config


# -------------------------------------------------------- weights, config, saving
def test_use_output_bias_weights_are_the_builtins_without_the_output_bias():
    builtin = keras.layers.MultiHeadAttention(OHEADS, OKEY_DIM)
    builtin.build((OB, OT, ODIM), (OB, OT, ODIM))
    names = [w.path.split("/", 1)[1] for w in builtin.weights]
    for use_bias, use_output_bias, expected in [
        (True, None, names),
        (True, True, names),
        (True, False, names[:-1]),
        (False, True, names[0:7:2] + names[-1:]),
        (False, None, names[0:7:2]),
    ]:
        layer = keras_mha.MultiHeadAttention(
            OHEADS, OKEY_DIM, use_bias=use_bias, use_output_bias=use_output_bias
        )
        layer.build((OB, OT, ODIM), (OB, OT, ODIM))
        assert [w.path.split("/", 1)[1] for w in layer.weights] == expected


def test_value_norm_adds_no_weight_and_norms_keep_their_order():
    layer = _option_layer("gemma3-like")
    paths = [w.path.split("/", 1)[1] for w in layer.weights]
    assert paths[-2:] == ["query_norm/scale", "key_norm/scale"]
    assert len(paths) == 6  # q, k, v, output kernels, two norm scales
    fresh = keras_mha.MultiHeadAttention(2, 4, normalize_qk=True, norm_unit_offset=True)
    fresh.build((1, 3, 8), (1, 3, 8))
    np.testing.assert_array_equal(to_numpy(fresh._query_norm.scale), 0.0)  # 1 + 0


ALL_OPTIONS = {
    "scale": 0.25,
    "use_output_bias": False,
    "norm_epsilon": 1e-5,
    "norm_unit_offset": True,
    "normalize_qk": True,
    "normalize_value": True,
    "sliding_window": (3, 0),
    "dropout": 0.1,
    "dropout_on": "output",
}


def test_options_config_round_trip():
    layer = keras_mha.MultiHeadAttention(OHEADS, OKEY_DIM, **ALL_OPTIONS)
    config = layer.get_config()
    for name, value in ALL_OPTIONS.items():
        assert config[name] == value
    again = keras_mha.MultiHeadAttention.from_config(config)
    assert again.get_config() == config
    # A `.keras` file's JSON holds the pair as a list.
    listed = keras_mha.MultiHeadAttention.from_config({**config, "sliding_window": [3, 0]})
    assert listed.get_config()["sliding_window"] == (3, 0)
    defaults = keras_mha.MultiHeadAttention(OHEADS, OKEY_DIM).get_config()
    assert defaults["scale"] is None and defaults["use_output_bias"] is None
    assert defaults["norm_epsilon"] == 1e-6 and defaults["norm_unit_offset"] is False
    assert defaults["normalize_value"] is False and defaults["dropout_on"] == "weights"


def test_options_saved_and_reloaded(tmp_path):
    inputs = keras.Input((OT, ODIM))
    layer = keras_mha.MultiHeadAttention(OHEADS, OKEY_DIM, **ALL_OPTIONS)
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    rng = np.random.default_rng(2)
    layer._query_norm.scale.assign(rng.standard_normal(OKEY_DIM).astype("float32"))
    x = rng.standard_normal((OB, OT, ODIM)).astype("float32")
    path = tmp_path / "options.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    config = loaded.layers[1].get_config()
    for name, value in ALL_OPTIONS.items():
        assert config[name] == value
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)), atol=1e-6)


# ------------------------------------------------ against keras-hub's own layers
def _hub_class(module, name):
    pytest.importorskip("keras_hub")
    import importlib

    return getattr(importlib.import_module(f"keras_hub.src.models.{module}"), name)


def _load_hub_weights(ours, hub):
    """keras-hub's weights into ours by sublayer name: its `(N, D, H)` projection
    kernels (Gemma's `ndh`) transposed to our `(D, N, H)`."""
    theirs = {w.path.split("/", 1)[1]: to_numpy(w) for w in hub.weights}
    for w in ours.weights:
        name = w.path.split("/", 1)[1]
        value = theirs.pop(name)
        if name in ("query/kernel", "key/kernel", "value/kernel") and value.shape != w.shape:
            value = value.transpose(1, 0, 2)
        w.assign(value)
    assert not theirs, f"keras-hub weights left over: {sorted(theirs)}"


HUB_B, HUB_T, HUB_DIM = 2, 9, 24


def _hub_inputs():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((HUB_B, HUB_T, HUB_DIM)).astype("float32")
    padding = np.ones((HUB_B, HUB_T), bool)
    padding[1, 6:] = False
    return x, padding


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("bidirectional", [False, True], ids=["local-causal", "embedding-gemma"])
def test_matches_keras_hubs_gemma3_attention(implementation, bidirectional):
    """`CachedGemma3Attention` (code we did not write): the scale `1 / sqrt(hidden /
    heads)` (`query_head_dim_normalize=False`), QK-norm `x_hat * (1 + w)` with its
    epsilon, the soft cap, RoPE, and its window: a causal `t - s < W` band, or
    EmbeddingGemma's bidirectional window of size `W`, our `(W - W // 2 - 1, W // 2)`."""
    window, heads, head_dim, epsilon = 4, 4, 8, 1e-3  # head_dim != HUB_DIM // heads
    keras.utils.set_random_seed(2)
    hub = _hub_class("gemma3.gemma3_attention", "CachedGemma3Attention")(
        head_dim=head_dim,
        num_query_heads=heads,
        num_key_value_heads=2,
        logit_soft_cap=3.0,
        use_sliding_window_attention=True,
        sliding_window_size=window,
        query_head_dim_normalize=False,
        use_query_key_norm=True,
        layer_norm_epsilon=epsilon,
        rope_wavelength=100.0,
        use_bidirectional_attention=bidirectional,
    )
    hub.build((HUB_B, HUB_T, HUB_DIM))
    rng = np.random.default_rng(0)
    for norm in (hub.query_norm, hub.key_norm):
        norm.scale.assign(rng.uniform(-0.5, 0.5, head_dim).astype("float32"))
    ours = keras_mha.MultiHeadAttention(
        heads,
        head_dim,
        num_key_value_heads=2,
        use_bias=False,
        scale=(HUB_DIM // heads) ** -0.5,
        normalize_qk=True,
        norm_unit_offset=True,
        norm_epsilon=epsilon,
        logit_soft_cap=3.0,
        rope_max_wavelength=100.0,
        sliding_window=(window - window // 2 - 1, window // 2) if bidirectional else window,
        implementation=implementation,
        chunk_size=4,
    )
    ours.build((HUB_B, HUB_T, HUB_DIM), (HUB_B, HUB_T, HUB_DIM))
    _load_hub_weights(ours, hub)
    x, padding = _hub_inputs()
    mask = np.broadcast_to(padding[:, None, :], (HUB_B, HUB_T, HUB_T))
    if not bidirectional:
        mask = mask & np.tri(HUB_T, dtype=bool)
    expected = to_numpy(hub(x, attention_mask=mask))
    got = to_numpy(ours(x, x, value_mask=padding, use_causal_mask=not bidirectional))
    np.testing.assert_allclose(got, expected, atol=2e-5)
    assert ours._inverse_sqrt_key_dim != head_dim**-0.5  # the scale is not the default


@pytest.mark.parametrize("implementation", KERNELS)
def test_matches_keras_hubs_gemma4_attention_with_cache(implementation):
    """`Gemma4TextAttention`: scale 1.0, QK-norm `x_hat * w` with its epsilon, the
    value norm (no weight), RoPE; a prompt then decode steps through the same cache
    layout `(B, 2, S, Nkv, H)` as ours."""
    heads, head_dim, epsilon = 2, 8, 1e-2
    keras.utils.set_random_seed(3)
    hub = _hub_class("gemma4.gemma4_attention", "Gemma4TextAttention")(
        head_dim=head_dim,
        num_query_heads=heads,
        num_key_value_heads=1,
        layer_norm_epsilon=epsilon,
        rope_wavelength=100.0,
    )
    hub.build((HUB_B, HUB_T, HUB_DIM))
    rng = np.random.default_rng(1)
    for norm in (hub.query_norm, hub.key_norm):
        norm.scale.assign(rng.uniform(0.5, 1.5, head_dim).astype("float32"))
    ours = keras_mha.MultiHeadAttention(
        heads,
        head_dim,
        num_key_value_heads=1,
        use_bias=False,
        scale=1.0,
        normalize_qk=True,
        normalize_value=True,
        norm_epsilon=epsilon,
        rope_max_wavelength=100.0,
        implementation=implementation,
        chunk_size=4,
    )
    ours.build((HUB_B, HUB_T, HUB_DIM), (HUB_B, HUB_T, HUB_DIM))
    _load_hub_weights(ours, hub)
    x, _ = _hub_inputs()
    causal = np.broadcast_to(np.tri(HUB_T, dtype=bool), (HUB_B, HUB_T, HUB_T))
    hub_cache = ops.zeros((HUB_B, 2, HUB_T, 1, head_dim))
    expected, _ = hub(x, attention_mask=causal, cache=hub_cache, cache_update_index=0)
    cache = ours.init_cache(HUB_B, HUB_T)
    out, cache = ours(x[:, :5], x[:, :5], cache=cache, cache_update_index=0, use_causal_mask=True)
    steps = [to_numpy(out)]
    for t in range(5, HUB_T):
        token = x[:, t : t + 1]
        out, cache = ours(token, token, cache=cache, cache_update_index=t, use_causal_mask=True)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), to_numpy(expected), atol=2e-5)


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("window", [None, 3])
def test_matches_keras_hubs_qwen_attention(monkeypatch, implementation, window):
    """`QwenAttention` (Qwen 2/2.5): biases on the query, key and value projections,
    none on the output (`use_output_bias=False`: the same 7 weights in the same
    order), RoPE, its causal `t - s < W` window. keras-hub 0.32 applies the window on
    its explicit path only: where `fused_attention_op_available()` (JAX and torch, not
    TensorFlow) the window is ignored, so the window case runs the explicit path."""
    if window is not None:
        module = _hub_class("qwen.qwen_attention", "QwenAttention").__module__
        monkeypatch.setattr(f"{module}.fused_attention_op_available", lambda: False)
    heads = 4
    keras.utils.set_random_seed(4)
    hub = _hub_class("qwen.qwen_attention", "QwenAttention")(
        num_query_heads=heads,
        num_key_value_heads=2,
        rope_max_wavelength=100.0,
        use_sliding_window_attention=window is not None,
        sliding_window_size=window or 4096,
    )
    hub.build((HUB_B, HUB_T, HUB_DIM))
    rng = np.random.default_rng(5)
    hub.set_weights([rng.standard_normal(w.shape).astype("float32") * 0.3 for w in hub.weights])
    ours = keras_mha.MultiHeadAttention(
        heads,
        HUB_DIM // heads,
        num_key_value_heads=2,
        use_output_bias=False,
        rope_max_wavelength=100.0,
        sliding_window=window,
        implementation=implementation,
        chunk_size=4,
    )
    ours.build((HUB_B, HUB_T, HUB_DIM), (HUB_B, HUB_T, HUB_DIM))
    assert [tuple(w.shape) for w in ours.weights] == [tuple(w.shape) for w in hub.weights]
    ours.set_weights(hub.get_weights())
    x, padding = _hub_inputs()
    mask = padding[:, None, :] & np.tri(HUB_T, dtype=bool)[None]
    expected = to_numpy(hub(x, attention_mask=mask))
    got = to_numpy(ours(x, x, value_mask=padding, use_causal_mask=True))
    np.testing.assert_allclose(got, expected, atol=2e-5)
