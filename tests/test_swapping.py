"""`keras_mha.swap`, `keras_mha.swapped` and `keras_mha.save_swapped`, in this process,
on the current backend, on models written for `keras.layers.MultiHeadAttention`."""

import warnings

import keras
import numpy as np
import pytest
import swap_models
from helpers import to_numpy

import keras_mha
from keras_mha import swapping

BUILTIN = keras.layers.MultiHeadAttention
ATOL = 1e-5


def _tokens(padded=True):
    tokens = np.random.default_rng(0).integers(1, swap_models.VOCAB, (2, swap_models.MAXLEN))
    if padded:
        tokens[0, 5:] = 0  # Embedding(mask_zero=True): padding masked down to the pooling
    return tokens.astype("int32")


def _attention(model):
    return [layer for _, layer in swapping.attention_layers(model)]


@pytest.fixture(scope="module")
def classifier():
    model = swap_models.build_classifier()
    # Away from the initialisers' values: a re-initialised layer cannot pass by luck.
    model.set_weights([w + 0.1 for w in model.get_weights()])
    return model


def test_swap_replaces_top_level_and_nested_attention_keeping_weights_and_outputs(classifier):
    before = [to_numpy(w) for w in classifier.weights]
    swapped = keras_mha.swap(classifier)

    assert [type(layer) for layer in _attention(swapped)] == [keras_mha.MultiHeadAttention] * 2
    assert type(swapped.get_layer("block").att) is keras_mha.MultiHeadAttention
    assert [w.shape for w in swapped.weights] == [w.shape for w in classifier.weights]
    for got, want in zip(swapped.weights, before):
        np.testing.assert_array_equal(to_numpy(got), want)
    tokens = _tokens()
    np.testing.assert_allclose(
        swapped.predict_on_batch(tokens), classifier.predict_on_batch(tokens), atol=ATOL, rtol=0
    )
    # The original is untouched: same layers, same weights.
    assert [type(layer) for layer in _attention(classifier)] == [BUILTIN] * 2
    for got, want in zip(classifier.weights, before):
        np.testing.assert_array_equal(to_numpy(got), want)


def test_swap_leaves_no_trace_of_the_old_sublayer(classifier):
    swapped = keras_mha.swap(classifier)
    block = swapped.get_layer("block")
    tracked = block._flatten_layers(include_self=False, recursive=True)
    assert not any(isinstance(layer, BUILTIN) for layer in tracked)
    assert len(swapped.weights) == len(classifier.weights) == 27
    assert len(swapped.trainable_weights) == len(classifier.trainable_weights)
    assert len({id(w) for w in swapped.weights}) == len(swapped.weights)
    if keras.backend.backend() == "torch":  # torch modules register their own parameters
        count = len(list(swapped.parameters()))
        assert count == len(list(classifier.parameters()))


def test_swap_report_names_each_layer_by_its_path(classifier):
    swapped = keras_mha.swap(classifier)
    rows = swapping.swap_report(classifier, swapped)
    assert [(r["path"], r["status"]) for r in rows] == [
        ("block/att", swapping.SWAPPED),
        ("causal_attention", swapping.SWAPPED),
    ]
    assert rows[0]["before"] == "keras.layers.MultiHeadAttention"
    assert rows[0]["after"] == "keras_mha.MultiHeadAttention"
    assert rows[0]["config"] == f"num_heads={swap_models.HEADS}, key_dim={swap_models.EMBED}"


def test_swap_reaches_layers_two_levels_down_in_lists():
    model = swap_models.build_deep()
    swapped = keras_mha.swap(model)
    paths = [path for path, _ in swapping.attention_layers(swapped)]
    assert paths == ["encoder/blocks[0]/att", "encoder/blocks[1]/att"]
    assert all(type(layer) is keras_mha.MultiHeadAttention for layer in _attention(swapped))
    x = np.random.default_rng(1).standard_normal((2, swap_models.MAXLEN, swap_models.EMBED))
    np.testing.assert_allclose(
        swapped.predict_on_batch(x), model.predict_on_batch(x), atol=ATOL, rtol=0
    )


def test_swapped_model_trains(classifier):
    swapped = keras_mha.swap(classifier)
    assert swapped.compiled  # the compile settings came across
    attention = swapped.get_layer("block").att
    before = [to_numpy(w) for w in attention.trainable_weights]
    labels = np.array([0, 2])
    swapped.train_on_batch(_tokens(), labels)
    assert any(not np.allclose(to_numpy(w), b) for w, b in zip(attention.trainable_weights, before))


def test_swapped_context_constructs_ours_where_user_code_builds_the_builtin():
    with keras_mha.swapped():
        with keras_mha.swapped():  # nests
            model = swap_models.build_classifier()
        inner = BUILTIN(num_heads=2, key_dim=4)
    assert type(inner) is keras_mha.MultiHeadAttention
    assert [type(layer) for layer in _attention(model)] == [keras_mha.MultiHeadAttention] * 2
    # Restored on exit.
    assert type(BUILTIN(num_heads=2, key_dim=4)) is BUILTIN
    assert "__new__" not in vars(BUILTIN)


def test_swapped_context_restores_the_builtin_after_an_error():
    with pytest.raises(RuntimeError, match="boom"):
        with keras_mha.swapped():
            raise RuntimeError("boom")
    assert type(BUILTIN(num_heads=2, key_dim=4)) is BUILTIN


def test_subclasses_using_the_builtins_hooks_are_rebuilt_on_ours():
    model = swap_models.build_subclassed()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        swapped = keras_mha.swap(model)
    rows = {row["path"]: row for row in swapping.swap_report(model, swapped)}
    assert [rows[p]["status"] for p in ("cached", "hooked")] == [swapping.REBUILT] * 2
    assert not [w for w in caught if "stays on the built-in" in str(w.message)]

    cached, hooked = swapped.get_layer("cached"), swapped.get_layer("hooked")
    for layer in (cached, hooked):
        assert isinstance(layer, keras_mha.MultiHeadAttention) and not isinstance(layer, BUILTIN)
    assert type(cached).__name__ == "CachedAttention"
    assert swapping.unsupported_names(swap_models.CachedAttention) == []
    assert swapping.unsupported_names(swap_models.SoftmaxHookAttention) == []
    # The overridden `_build_attention` ran on ours and read its `_softmax`.
    assert hooked.softmax_axes == model.get_layer("hooked").softmax_axes
    x = np.random.default_rng(2).standard_normal((2, swap_models.MAXLEN, swap_models.EMBED))
    np.testing.assert_allclose(
        swapped.predict_on_batch(x), model.predict_on_batch(x), atol=ATOL, rtol=0
    )
    assert cached.get_config()["num_heads"] == 2  # zero-argument super() in the copy


def test_subclass_overriding_a_hook_ours_does_not_call_is_left_with_a_warning(monkeypatch):
    # As if `_build_attention` were a hook ours did not call where the built-in does.
    overrides = swapping.PROTECTED_OVERRIDES - {"_build_attention"}
    monkeypatch.setattr(swapping, "PROTECTED_OVERRIDES", overrides)
    monkeypatch.setattr(swapping, "_rebuilt", {})
    monkeypatch.setattr(swapping, "_warned", set())
    model = swap_models.build_subclassed()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        swapped = keras_mha.swap(model)
    rows = {row["path"]: row for row in swapping.swap_report(model, swapped)}
    assert rows["cached"]["status"] == swapping.REBUILT
    assert rows["hooked"]["status"] == swapping.LEFT
    assert rows["hooked"]["reason"] == "uses _build_attention"
    messages = [str(w.message) for w in caught if "SoftmaxHookAttention" in str(w.message)]
    assert len(messages) == 1 and "_build_attention" in messages[0]
    assert type(swapped.get_layer("hooked")) is swap_models.SoftmaxHookAttention


def test_decorator_data_and_module_globals_are_not_protected_names():
    # keras-hub's export decorator sets `_api_export_path` on its classes; keras-hub's
    # modules hold their own `_build_proj_equation`: neither keeps a class off ours.
    from keras_hub.src.layers.modeling.cached_multi_head_attention import (
        CachedMultiHeadAttention,
    )
    from keras_hub.src.models.whisper.whisper_cached_multi_head_attention import (
        WhisperCachedMultiHeadAttention,
    )

    assert "_api_export_path" in vars(CachedMultiHeadAttention)
    assert swapping.unsupported_names(CachedMultiHeadAttention) == []
    assert swapping.unsupported_names(WhisperCachedMultiHeadAttention) == []
    assert "_api_export_path" not in swapping._protected_names(BUILTIN)
    assert "_build_proj_equation" not in swapping._protected_names(BUILTIN)


def test_save_swapped_loads_swapped_with_safe_mode(classifier, tmp_path):
    swapped = keras_mha.swap(classifier)
    path = tmp_path / "swapped.keras"
    keras_mha.save_swapped(swapped, path)

    loaded = keras.saving.load_model(path, safe_mode=True)
    assert [type(layer) for layer in _attention(loaded)] == [keras_mha.MultiHeadAttention] * 2
    tokens = _tokens()
    np.testing.assert_allclose(
        loaded.predict_on_batch(tokens), classifier.predict_on_batch(tokens), atol=ATOL, rtol=0
    )
    assert loaded.compiled
    assert not keras.saving.load_model(path, compile=False).compiled


def test_save_swapped_keeps_rebuilt_subclasses(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = keras_mha.swap(swap_models.build_subclassed())
        keras_mha.save_swapped(swapped, tmp_path / "sub.keras")
        loaded = keras.saving.load_model(tmp_path / "sub.keras", safe_mode=True)
    for name in ("cached", "hooked"):
        assert isinstance(loaded.get_layer(name), keras_mha.MultiHeadAttention)
    assert type(loaded.get_layer("hooked")).__name__ == "SoftmaxHookAttention"


def test_plain_save_keeps_only_the_layers_the_config_describes(classifier, tmp_path):
    # Why save_swapped exists: the block's config re-creates the built-in on load.
    swapped = keras_mha.swap(classifier)
    swapped.save(tmp_path / "plain.keras")
    loaded = keras.saving.load_model(tmp_path / "plain.keras")
    assert type(loaded.get_layer("block").att) is BUILTIN
    assert type(loaded.get_layer("causal_attention")) is keras_mha.MultiHeadAttention


@pytest.mark.parametrize(
    "model, message",
    [
        ("not a model", "expected a `keras.Model`. Received: model=str"),
        (swap_models.build_plain, r"Received: model=plain \(no attention layer\)"),
    ],
    ids=["not_a_model", "no_attention"],
)
def test_swap_rejects_what_it_cannot_swap(model, message):
    model = model() if callable(model) else model
    with pytest.raises(ValueError, match=r"argument `model`.*" + message):
        keras_mha.swap(model)


def test_save_swapped_rejects_other_extensions(classifier, tmp_path):
    with pytest.raises(ValueError, match=r"argument `filepath`.*\.keras"):
        keras_mha.save_swapped(classifier, tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()


def test_protected_names_a_rebuilt_subclass_may_use_exist_on_a_built_layer():
    # The surface the eligibility check trusts: names both classes' code touches.
    layer = keras_mha.MultiHeadAttention(2, 4)
    layer.build((1, 3, 8), (1, 3, 8))
    shared = swapping._protected_names(BUILTIN) & swapping._protected_names(type(layer))
    for name in ("_query_dense", "_key_dense", "_value_dense", "_output_dense", "_num_heads"):
        assert name in shared
        assert hasattr(layer, name)
    assert swapping.PROTECTED_OVERRIDES <= shared
    # Every protected name the built-in's code touches, ours provides (`_gate_dense`
    # exists on both with `use_gate=True` only).
    assert swapping._protected_names(BUILTIN) <= swapping._protected_names(type(layer))
    missing = {n for n in swapping._protected_names(BUILTIN) if not hasattr(layer, n)}
    assert missing == {"_gate_dense"}


def test_swapped_layers_give_fully_masked_rows_what_the_builtin_gives(classifier, tmp_path):
    """Swapping builds ours with `fully_masked_rows="builtin"`, and a saved swap keeps it;
    a layer constructed directly keeps the default."""
    swapped = keras_mha.swap(classifier)
    layers = _attention(swapped)
    assert layers and all(layer.get_config()["fully_masked_rows"] == "builtin" for layer in layers)
    path = tmp_path / "swapped.keras"
    keras_mha.save_swapped(swapped, path)
    loaded = keras.saving.load_model(path)
    assert all(layer.get_config()["fully_masked_rows"] == "builtin" for layer in _attention(loaded))
    assert keras_mha.MultiHeadAttention(2, 4).get_config()["fully_masked_rows"] == "zero"
