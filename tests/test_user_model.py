"""`keras_mha.user_model`: the user's inputs, synthesised or read from a `.npz` file,
and one-line errors naming what does not fit."""

import keras
import numpy as np
import pytest

from keras_mha import user_model
from keras_mha.user_model import UsageError

SPECS = [("tokens", (None, 8), "int32"), ("context", (None, None, 4), "float32")]


def test_synthesized_inputs_follow_the_specs():
    tokens, context = user_model.synthesize(SPECS, "m.keras", seed=0)
    assert tokens.shape == (user_model.BATCH, 8) and tokens.dtype == np.int32
    assert tokens.min() >= 1 and tokens.max() < 10
    assert context.shape == (user_model.BATCH, user_model.LENGTH, 4)
    assert context.dtype == np.float32 and abs(float(context.mean())) < 0.5
    again = user_model.synthesize(SPECS, "m.keras", seed=0)
    np.testing.assert_array_equal(again[1], context)


def test_synthesized_mask_inputs_hide_nothing_and_ids_stay_in_their_embeddings():
    """Mask inputs (bool, or integers named `*mask`) are all ones: the unpadded case.
    A masked LM's `mask_positions` is no mask. Integer inputs stay below the smallest
    `input_dim` of the embeddings they reach, also inside a nested functional model
    (a keras-hub task around its backbone): segment ids below 2, tokens below 10."""
    tokens = keras.Input((None,), dtype="int32", name="token_ids")
    segments = keras.Input((None,), dtype="int32", name="segment_ids")
    embedded = keras.layers.Embedding(50, 4)(tokens) + keras.layers.Embedding(2, 4)(segments)
    backbone = keras.Model({"token_ids": tokens, "segment_ids": segments}, embedded)
    inputs = {
        "token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
        "segment_ids": keras.Input((None,), dtype="int32", name="segment_ids"),
        "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask"),
        "mask_positions": keras.Input((None,), dtype="int32", name="mask_positions"),
        "flags": keras.Input((None,), dtype="bool", name="flags"),
    }
    features = backbone({"token_ids": inputs["token_ids"], "segment_ids": inputs["segment_ids"]})
    gathered = keras.ops.take_along_axis(
        features, keras.ops.expand_dims(inputs["mask_positions"], -1), axis=1
    )
    model = keras.Model(inputs, gathered)
    specs = user_model.input_specs(model, "m.keras")
    names = [name for name, _, _ in specs]
    bounds = user_model.integer_bounds(model)
    arrays = dict(zip(names, user_model.synthesize(specs, "m.keras", bounds=bounds)))
    assert bounds[names.index("segment_ids")] == 2
    assert bounds[names.index("token_ids")] == 50
    assert (arrays["segment_ids"] < 2).all() and arrays["token_ids"].max() > 2
    assert (arrays["padding_mask"] == 1).all() and arrays["flags"].all()
    assert arrays["mask_positions"].min() >= 1  # drawn as ids, in [1, 10)
    padded = dict(zip(names, user_model.padded(model, specs, list(arrays.values()))))
    assert not padded["padding_mask"].all() and not padded["flags"].all()
    np.testing.assert_array_equal(padded["mask_positions"], arrays["mask_positions"])


def test_synthesize_refuses_a_dtype_it_cannot_make():
    with pytest.raises(UsageError, match=r"m.keras: cannot synthesize input 'text' of dtype"):
        user_model.synthesize([("text", (None,), "string")], "m.keras")


def _npz(tmp_path, *args, **kwargs):
    path = tmp_path / "inputs.npz"
    np.savez(path, *args, **kwargs)
    return str(path)


def test_inputs_are_matched_by_name_or_by_order(tmp_path):
    tokens = np.ones((3, 8), "int64")
    context = np.zeros((3, 5, 4), "float64")
    by_name = user_model.read(_npz(tmp_path, context=context, tokens=tokens), SPECS)
    assert [a.shape for a in by_name] == [(3, 8), (3, 5, 4)]
    assert by_name[1].dtype == np.float32
    by_order = user_model.read(_npz(tmp_path, tokens, context), SPECS)
    np.testing.assert_array_equal(by_order[0], tokens)


@pytest.mark.parametrize(
    "arrays, message",
    [
        (
            {"tokens": np.ones((2, 8), "int32"), "ctx": np.zeros((2, 5, 4), "float32")},
            r"no array for input 'context' \(arrays: tokens, ctx; inputs: tokens, context\)",
        ),
        (
            {"tokens": np.ones((2, 7), "int32"), "context": np.zeros((2, 5, 4), "float32")},
            r"input 'tokens' expects shape \(None, 8\) of int32, got shape \(2, 7\) of int32",
        ),
        (
            {"tokens": np.ones((2, 8), "float32"), "context": np.zeros((2, 5, 4), "float32")},
            r"input 'tokens' expects shape \(None, 8\) of int32, got shape \(2, 8\) of float32",
        ),
        (
            {"tokens": np.ones((2, 8), "int32"), "context": np.zeros((3, 5, 4), "float32")},
            r"input 'context' has batch size 3, the others 2",
        ),
        (
            {"arr_0": np.ones((2, 8), "int32")},
            r"holds 1 arrays, the model takes 2 inputs \(tokens, context\)",
        ),
    ],
    ids=["unknown_name", "wrong_length", "wrong_dtype", "batch_mismatch", "too_few"],
)
def test_mismatched_inputs_are_one_line_errors_naming_the_file_and_input(tmp_path, arrays, message):
    path = _npz(tmp_path, **arrays)
    with pytest.raises(UsageError, match=message) as raised:
        user_model.read(path, SPECS)
    assert str(raised.value).startswith(path + ": ")
    assert "\n" not in str(raised.value)


def test_a_file_that_is_not_npz_is_named(tmp_path):
    path = tmp_path / "inputs.npz"
    path.write_text("not numpy")
    with pytest.raises(UsageError, match=r"inputs.npz: not a NumPy .npz file"):
        user_model.read(str(path), SPECS)


def test_loading_names_the_file(tmp_path):
    with pytest.raises(UsageError, match=r"nope.keras: no such file"):
        user_model.load(str(tmp_path / "nope.keras"))
    bad = tmp_path / "bad.keras"
    bad.write_text("not a zip")
    with pytest.raises(UsageError, match=r"bad.keras: not a .keras model file"):
        user_model.load(str(bad))


def test_an_unimportable_module_is_named():
    with pytest.raises(UsageError, match=r"--import no_such_module_here: cannot import it: "):
        user_model.import_modules(["no_such_module_here"])


class Unregistered(keras.layers.Layer):
    def call(self, x):
        return x


def test_an_unregistered_custom_layer_is_named_with_the_fix(tmp_path):
    x = keras.Input((3,))
    path = str(tmp_path / "custom.keras")
    keras.Model(x, Unregistered()(x)).save(path)
    with pytest.raises(UsageError) as raised:
        user_model.load(path)
    message = str(raised.value)
    assert message == (
        f"{path}: cannot load the model: 'Unregistered' is not registered with Keras "
        "(import the module that registers it with --import MODULE)"
    )


def test_model_inputs_follow_the_models_structure():
    a, b = keras.Input((2,), name="a"), keras.Input((3,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Concatenate()([a, b]))
    arrays = [np.ones((1, 2)), np.ones((1, 3))]
    fed = user_model.model_inputs(model, arrays)
    assert isinstance(fed, dict) and fed["b"].shape == (1, 3)
    single = keras.Model(a, a)
    assert user_model.model_inputs(single, arrays[:1]) is arrays[0]


def test_padded_inputs_pad_what_reaches_a_masked_embedding_and_the_mask_inputs():
    ids = keras.Input((6,), dtype="int32", name="ids")
    features = keras.Input((6, 3), name="features")
    padding_mask = keras.Input((6,), dtype="int32", name="padding_mask")
    embedded = keras.layers.Embedding(10, 3, mask_zero=True)(ids + 0)  # through an op
    outputs = embedded + features + keras.ops.cast(padding_mask, "float32")[..., None]
    model = keras.Model([ids, features, padding_mask], outputs)
    specs = user_model.input_specs(model, "m.keras")
    arrays = user_model.synthesize(specs, "m.keras")
    padded_ids, padded_features, mask = user_model.padded(model, specs, arrays)
    kept = np.array([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], bool)
    np.testing.assert_array_equal(padded_ids != 0, kept)
    np.testing.assert_array_equal(padded_ids[kept], arrays[0][kept])
    np.testing.assert_array_equal(padded_features, arrays[1])  # floats stay as they are
    np.testing.assert_array_equal(mask, kept.astype("int32"))
    assert mask.dtype == np.int32 and padded_ids.dtype == np.int32
    # A bool mask input is padded the same way.
    flags = keras.Input((6,), dtype="bool", name="flags")
    model = keras.Model(flags, keras.ops.cast(flags, "float32"))
    specs = user_model.input_specs(model, "m.keras")
    (padded_flags,) = user_model.padded(model, specs, user_model.synthesize(specs, "m.keras"))
    np.testing.assert_array_equal(padded_flags, kept)


def test_no_padded_inputs_where_the_model_takes_no_padding():
    ids = keras.Input((6,), dtype="int32", name="ids")
    model = keras.Model(ids, keras.layers.Embedding(10, 3)(ids))  # mask_zero=False
    specs = user_model.input_specs(model, "m.keras")
    assert user_model.padded(model, specs, user_model.synthesize(specs, "m.keras")) is None
    features = keras.Input((6, 3), name="features")
    model = keras.Model(features, keras.layers.Dense(2)(features))
    specs = user_model.input_specs(model, "m.keras")
    assert user_model.padded(model, specs, user_model.synthesize(specs, "m.keras")) is None
