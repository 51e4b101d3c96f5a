"""Saving and loading on the current backend: `.keras` round trips of the models a user
builds (outputs equal within 1e-5, weights intact, still trainable), `.weights.h5`,
`get_config` / `from_config` with the build config, and `clone_model`.

Loads use `safe_mode=True` and no `custom_objects`: `import keras_mha` registers the
layer as `keras_mha>MultiHeadAttention`.
"""

import json

import keras
import numpy as np
import pytest

import keras_mha

ATOL = 1e-5


def _np(x):
    return keras.ops.convert_to_numpy(x)


def _outputs(model, inputs):
    out = model(inputs, training=False)
    return [_np(o) for o in out] if isinstance(out, (list, tuple)) else [_np(out)]


@keras.saving.register_keras_serializable(package="keras_mha_tests")
class EncoderBlock(keras.layers.Layer):
    """A user's own layer holding the attention: created in `__init__`, built in
    `build` (the pattern whose weights other implementations lost on reload)."""

    def __init__(self, num_heads, key_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.attention = keras_mha.MultiHeadAttention(num_heads, key_dim, name="attention")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def build(self, input_shape):
        self.attention.build(input_shape, input_shape)
        self.norm.build(input_shape)

    def call(self, x):
        return self.norm(x + self.attention(x, x))

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "key_dim": self.key_dim}


# ------------------------------------------------------------------------------ models
# Each builder returns (model, inputs); inputs are NumPy, batch 2. The sizes are
# shared (width 8, T = 5, S = 3, 2 heads of 4) so JAX compiles each kernel shape once.
def _embedding_self_attention(rng):
    tokens = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    x = keras_mha.MultiHeadAttention(2, 4)(x, x)
    data = np.array([[3, 5, 7, 0, 0], [1, 2, 3, 4, 5]], "int32")
    return keras.Model(tokens, x), data


def _cross_attention(rng):
    query, value = keras.Input((5, 8)), keras.Input((3, 8))
    y = keras_mha.MultiHeadAttention(2, key_dim=4, value_dim=3)(query, value)
    data = [rng.normal(size=(2, 5, 8)).astype("float32"), rng.normal(size=(2, 3, 8))]
    return keras.Model([query, value], y), [data[0], data[1].astype("float32")]


def _with_scores(rng):
    query, value = keras.Input((5, 8)), keras.Input((3, 8))
    y, scores = keras_mha.MultiHeadAttention(2, 4)(query, value, return_attention_scores=True)
    data = [rng.normal(size=(2, 5, 8)).astype("float32"), rng.normal(size=(2, 3, 8))]
    return keras.Model([query, value], [y, scores]), [data[0], data[1].astype("float32")]


def _causal(rng):
    x = keras.Input((5, 8))
    y = keras_mha.MultiHeadAttention(2, 4)(x, x, use_causal_mask=True)
    return keras.Model(x, y), rng.normal(size=(2, 5, 8)).astype("float32")


def _output_shape_tuple(rng):
    x = keras.Input((5, 8))
    y = keras_mha.MultiHeadAttention(2, 4, output_shape=(3, 2))(x, x)
    return keras.Model(x, y), rng.normal(size=(2, 5, 8)).astype("float32")


def _nested_in_user_layer(rng):
    x = keras.Input((5, 8))
    y = EncoderBlock(2, 4, name="block")(x)
    return keras.Model(x, y), rng.normal(size=(2, 5, 8)).astype("float32")


def _gated_grouped_normalized(rng):
    x = keras.Input((5, 8))
    layer = keras_mha.MultiHeadAttention(
        2, 4, num_key_value_heads=1, normalize_qk=True, use_gate=True, sliding_window=3
    )
    return keras.Model(x, layer(x, x)), rng.normal(size=(2, 5, 8)).astype("float32")


CASES = {
    "embedding_self_attention": _embedding_self_attention,
    "cross_attention_t_ne_s_value_dim_ne_key_dim": _cross_attention,
    "outputs_with_scores": _with_scores,
    "causal_mask": _causal,
    "output_shape_tuple": _output_shape_tuple,
    "nested_in_user_layer": _nested_in_user_layer,
    "gated_grouped_normalized": _gated_grouped_normalized,
}


def _attention_layers(model):
    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, keras_mha.MultiHeadAttention)
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_keras_file_round_trip_same_outputs_and_still_trains(case, tmp_path, rng):
    model, inputs = CASES[case](rng)
    expected = _outputs(model, inputs)
    path = tmp_path / "model.keras"
    model.save(path)

    loaded = keras.saving.load_model(path, safe_mode=True)

    assert [type(layer) for layer in _attention_layers(loaded)] == [keras_mha.MultiHeadAttention]
    for got, want in zip(_outputs(loaded, inputs), expected):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert [w.path for w in loaded.weights] == [w.path for w in model.weights]
    for got, want in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(_np(got), _np(want))

    # One SGD step on the loaded model moves the attention weights and lowers the loss.
    trainable = keras.Model(loaded.inputs, loaded.outputs[0]) if len(expected) > 1 else loaded
    trainable.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    target = np.zeros_like(expected[0])
    attention = _attention_layers(loaded)[0]
    before = [_np(w) for w in attention.trainable_weights]
    first = float(trainable.train_on_batch(inputs, target))  # loss before the step
    second = float(trainable.train_on_batch(inputs, target))  # loss after it
    assert second < first
    moved = [not np.allclose(_np(w), b) for w, b in zip(attention.trainable_weights, before)]
    assert any(moved)


def test_layer_is_registered_under_the_package_name():
    assert (
        keras.saving.get_registered_object("keras_mha>MultiHeadAttention")
        is keras_mha.MultiHeadAttention
    )
    serialized = keras.layers.serialize(keras_mha.MultiHeadAttention(2, 4))
    assert serialized["registered_name"] == "keras_mha>MultiHeadAttention"


def test_nested_user_layer_weights_survive_reload_not_reinitialised(tmp_path, rng):
    model, inputs = _nested_in_user_layer(rng)
    # Move the weights away from any initialiser's values, so a re-initialised
    # layer on reload cannot pass by luck.
    model.set_weights([w + 0.25 for w in model.get_weights()])
    expected = _outputs(model, inputs)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras", safe_mode=True)
    block = loaded.get_layer("block")
    assert block.attention.built and len(block.attention.weights) == 8
    for got, want in zip(
        block.attention.get_weights(), model.get_layer("block").attention.get_weights()
    ):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(_outputs(loaded, inputs)[0], expected[0], atol=ATOL, rtol=0)


def test_save_weights_load_weights(tmp_path, rng):
    model, inputs = _cross_attention(rng)
    expected = _outputs(model, inputs)
    path = tmp_path / "model.weights.h5"
    model.save_weights(path)

    fresh, _ = _cross_attention(rng)
    assert not np.allclose(_outputs(fresh, inputs)[0], expected[0], atol=ATOL)
    fresh.load_weights(path)
    np.testing.assert_allclose(_outputs(fresh, inputs)[0], expected[0], atol=ATOL, rtol=0)


LAYER_CONFIGS = {
    "self_attention": (dict(num_heads=2, key_dim=4), [(2, 5, 8), (2, 5, 8)]),
    "cross_with_key": (
        dict(num_heads=2, key_dim=4, value_dim=3, output_shape=(3, 2)),
        [(2, 5, 8), (2, 3, 8), (2, 3, 6)],
    ),
    "attention_axes_2d": (dict(num_heads=2, key_dim=4, attention_axes=(1, 2)), [(2, 3, 2, 8)] * 2),
}


@pytest.mark.parametrize("case", list(LAYER_CONFIGS))
def test_from_config_and_build_config_rebuild_the_same_layer(case, rng):
    kwargs, shapes = LAYER_CONFIGS[case]
    layer = keras_mha.MultiHeadAttention(**kwargs)
    inputs = [rng.normal(size=s).astype("float32") for s in shapes]
    expected = _np(layer(*inputs))

    config = json.loads(json.dumps(layer.get_config()))  # plain data only
    build_config = json.loads(json.dumps(layer.get_build_config()))
    rebuilt = keras_mha.MultiHeadAttention.from_config(config)
    assert not rebuilt.built
    rebuilt.build_from_config(build_config)
    assert rebuilt.built
    assert [w.shape for w in rebuilt.weights] == [w.shape for w in layer.weights]
    rebuilt.set_weights(layer.get_weights())
    np.testing.assert_allclose(_np(rebuilt(*inputs)), expected, atol=ATOL, rtol=0)
    assert rebuilt.get_config() == layer.get_config()

    # The generic Keras path rebuilds it too.
    again = keras.layers.deserialize(keras.layers.serialize(layer))
    assert isinstance(again, keras_mha.MultiHeadAttention)
    assert again.get_config() == layer.get_config()


def test_clone_model(rng):
    model, inputs = _with_scores(rng)
    expected = _outputs(model, inputs)
    clone = keras.models.clone_model(model)
    (attention,) = _attention_layers(clone)
    assert attention is not _attention_layers(model)[0]
    assert attention.get_config() == _attention_layers(model)[0].get_config()
    clone.set_weights(model.get_weights())
    for got, want in zip(_outputs(clone, inputs), expected):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------ quantized
def _quantized_builtin_fails_to_load(model, path):
    """Keras 3.15 rebuilds the built-in's projections in floating point on load: its
    quantized variables do not fit (asserted, so this test notices when Keras changes)."""
    model.save(path)
    with pytest.raises(ValueError, match="expected 2 variables, but received 0 variables"):
        keras.saving.load_model(path, safe_mode=True)


@pytest.mark.parametrize("mode", ["int8", "float8", "int4"])
def test_quantized_model_round_trip(mode, tmp_path, rng):
    query, value = keras.Input((5, 8)), keras.Input((3, 8))
    inputs = [rng.normal(size=(2, 5, 8)).astype("float32"), rng.normal(size=(2, 3, 8))]
    inputs[1] = inputs[1].astype("float32")
    models = []
    keras.utils.set_random_seed(0)
    for base in (keras_mha.MultiHeadAttention, keras.layers.MultiHeadAttention):
        layer = base(2, key_dim=4, name="mha")
        models.append(keras.Model([query, value], layer(query, value)))
    ours, builtin = models
    builtin.set_weights(ours.get_weights())
    for model in models:
        model.quantize(mode)
    expected = _outputs(ours, inputs)[0]
    # The built-in's quantized outputs, before saving (it cannot load).
    np.testing.assert_allclose(_outputs(builtin, inputs)[0], expected, atol=1e-6, rtol=0)
    _quantized_builtin_fails_to_load(builtin, tmp_path / "builtin.keras")

    ours.save(tmp_path / "ours.keras")
    loaded = keras.saving.load_model(tmp_path / "ours.keras", safe_mode=True)
    (attention,) = _attention_layers(loaded)
    for dense in (attention.query_dense, attention.output_dense):
        assert dense.quantization_mode == mode
    weights = {w.path: (str(w.dtype), tuple(w.shape)) for w in loaded.weights}
    assert weights == {w.path: (str(w.dtype), tuple(w.shape)) for w in ours.weights}
    np.testing.assert_array_equal(_outputs(loaded, inputs)[0], expected)


def test_quantized_model_nested_in_models_round_trip(tmp_path, rng):
    """Ours in a functional model in a `Sequential` in a functional model: each
    projection's recorded path (`"mha/query"`) is the one it is rebuilt at."""
    inner_input = keras.Input((5, 8))
    attention = keras_mha.MultiHeadAttention(2, 4, name="mha")
    inner = keras.Model(inner_input, attention(inner_input, inner_input), name="inner")
    middle = keras.Sequential([keras.Input((5, 8)), keras.layers.Dense(8), inner], name="seq")
    outer_input = keras.Input((5, 8))
    model = keras.Model(outer_input, middle(outer_input))
    model.quantize("int8")
    inputs = rng.normal(size=(2, 5, 8)).astype("float32")
    expected = _outputs(model, inputs)[0]
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras", safe_mode=True)
    (attention,) = _attention_layers(loaded)
    assert attention.key_dense.quantization_mode == "int8"
    np.testing.assert_array_equal(_outputs(loaded, inputs)[0], expected)
