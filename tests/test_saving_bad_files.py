"""Bad `.keras` files fail cleanly: an exception naming the offending field, nothing
half-built, nothing executed from a config under `safe_mode=True`."""

import json
import os
import zipfile

import keras
import numpy as np
import pytest

import keras_mha


def _model():
    query, value = keras.Input((5, 8)), keras.Input((3, 8))
    y = keras_mha.MultiHeadAttention(2, 4, value_dim=3, name="mha")(query, value)
    return keras.Model([query, value], y)


def _inputs():
    rng = np.random.default_rng(0)
    return [rng.normal(size=(2, 5, 8)).astype("float32"), rng.normal(size=(2, 3, 8))]


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "good.keras"
    _model().save(path)
    return path


def _rewrite(src, dst, edit_config=None, edit_member=None):
    """Copies the `.keras` zip `src` to `dst`, editing `config.json` or other members."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == "config.json" and edit_config:
                config = json.loads(data)
                edit_config(config)
                data = json.dumps(config).encode()
            if edit_member:
                data = edit_member(item.filename, data)
                if data is None:
                    continue
            zout.writestr(item, data)
    return dst


def _mha_config(config):
    (layer,) = [x for x in config["config"]["layers"] if x["config"]["name"] == "mha"]
    return layer["config"]


def _assert_clean_failure(path, match=None, error=Exception):
    """The load raises, leaves no file behind, and a good load still works after it."""
    before = sorted(os.listdir(path.parent))
    with pytest.raises(error, match=match):
        keras.saving.load_model(path, safe_mode=True)
    assert sorted(os.listdir(path.parent)) == before
    good = path.parent / "good.keras"
    model = keras.saving.load_model(good, safe_mode=True)
    assert keras.ops.convert_to_numpy(model(_inputs())).shape == (2, 5, 8)


def test_unknown_argument_in_config_names_it(saved):
    bad = _rewrite(saved, saved.parent / "bad.keras", lambda c: _mha_config(c).update(num_headz=3))
    _assert_clean_failure(bad, match="Unrecognized keyword arguments.*num_headz")


@pytest.mark.parametrize(
    "field, value, expected",
    [("num_heads", -1, "a positive integer"), ("dropout", 1.5, r"a float in \[0, 1\)")],
)
def test_invalid_argument_in_config_names_it(saved, field, value, expected):
    bad = _rewrite(
        saved, saved.parent / "bad.keras", lambda c: _mha_config(c).update(**{field: value})
    )
    _assert_clean_failure(
        bad, match=rf"invalid value for argument `{field}`, expected {expected}.*{field}={value}"
    )


def test_weights_of_the_wrong_shape_name_the_variable(saved):
    # A valid config whose kernels no longer match the stored weights.
    bad = _rewrite(saved, saved.parent / "bad.keras", lambda c: _mha_config(c).update(key_dim=5))
    _assert_clean_failure(bad, match=r"(?s)variable\.shape=\(8, 2, 5\).*path=mha/key/kernel")


def test_load_weights_of_the_wrong_shape_names_the_variable(tmp_path):
    _model().save_weights(tmp_path / "m.weights.h5")
    query, value = keras.Input((5, 8)), keras.Input((3, 8))
    other = keras.Model(
        [query, value], keras_mha.MultiHeadAttention(2, 4, value_dim=5)(query, value)
    )
    mismatch = r"(?s)must match\. variable\.shape=.*path=\S+/(value|attention_output)/kernel"
    with pytest.raises(ValueError, match=mismatch):
        other.load_weights(tmp_path / "m.weights.h5")


CORRUPTIONS = {
    "truncated_file": None,
    "random_bytes": None,
    "config_not_json": dict(edit_member=lambda n, d: b"{not json" if n == "config.json" else d),
    "config_missing": dict(edit_member=lambda n, d: None if n == "config.json" else d),
    "weights_garbled": dict(
        edit_member=lambda n, d: d[:512] + bytes(len(d) - 512) if n.endswith(".h5") else d
    ),
    "weights_missing": dict(edit_member=lambda n, d: None if n.endswith(".h5") else d),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_tampered_or_truncated_file_fails_cleanly(saved, corruption):
    bad = saved.parent / "bad.keras"
    data = saved.read_bytes()
    if corruption == "truncated_file":
        bad.write_bytes(data[: len(data) // 2])
    elif corruption == "random_bytes":
        bad.write_bytes(np.random.default_rng(0).bytes(len(data)))
    else:
        _rewrite(saved, bad, **CORRUPTIONS[corruption])
    _assert_clean_failure(bad)


def test_failed_build_from_config_leaves_nothing_built():
    layer = keras_mha.MultiHeadAttention(2, 4)
    layer(*[np.zeros((1, 5, 8), "float32")] * 2)
    fresh = keras_mha.MultiHeadAttention.from_config(layer.get_config())
    bad = {"shapes_dict": {"query_shape": [None, 5, 8], "value_shape": [None, 8]}}
    with pytest.raises(ValueError, match="argument `value`"):
        fresh.build_from_config(bad)
    assert not fresh.built and fresh.weights == []
    fresh.build_from_config(layer.get_build_config())
    assert fresh.built and len(fresh.weights) == len(layer.weights)


def _sentinel_model():
    # No closure, no defaults: the payload finds its target in the environment.
    x = keras.Input((5, 8))
    touch = keras.layers.Lambda(
        lambda t: (
            __import__("pathlib").Path(__import__("os").environ["KERAS_MHA_SENTINEL"]).touch(),
            t,
        )[1],
        output_shape=(5, 8),
    )
    y = touch(x)
    return keras.Model(x, keras_mha.MultiHeadAttention(2, 4)(y, y))


SENTINEL = "KERAS_MHA_SENTINEL"  # read by the lambda above, which has no globals


def test_safe_mode_refuses_a_lambda_and_runs_nothing(tmp_path, monkeypatch):
    sentinel = tmp_path / "executed"
    monkeypatch.setenv(SENTINEL, str(sentinel))
    _sentinel_model().save(tmp_path / "lambda.keras")
    sentinel.unlink(missing_ok=True)

    with pytest.raises(ValueError, match="(?s)lambda.*safe_mode"):
        keras.saving.load_model(tmp_path / "lambda.keras", safe_mode=True)
    assert not sentinel.exists()

    # The payload is live: a model loaded from a trusted file runs it when called.
    trusted = keras.saving.load_model(tmp_path / "lambda.keras", safe_mode=False)
    trusted(np.zeros((1, 5, 8), "float32"))
    assert sentinel.exists()


def test_safe_mode_refuses_a_lambda_injected_into_the_layer_config(saved):
    def inject(config):
        payload = keras.saving.serialize_keras_object(lambda shape, dtype=None: None)
        assert payload["class_name"] == "__lambda__"
        _mha_config(config)["kernel_initializer"] = payload

    bad = _rewrite(saved, saved.parent / "bad.keras", inject)
    # Refused at lookup: an initializer is resolved by name, never by running code.
    _assert_clean_failure(
        bad, match=r"Could not interpret initializer identifier: \{'class_name': '__lambda__'"
    )
