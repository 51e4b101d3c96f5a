"""`compare.compare_model` and `compare.swap_file` (what `keras-mha compare --model` and
`keras-mha swap` run in each backend's process), here in this process."""

import json
import os
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
import swap_models

import keras_mha
from keras_mha import compare, swapping
from keras_mha.compare import known
from keras_mha.user_model import UsageError

IMPORTS = ["swap_models"]
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture
def reference_imports(monkeypatch):
    """The reference's child process (another backend) imports `swap_models` too."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", TESTS if not path else f"{TESTS}{os.pathsep}{path}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    paths = {}
    for name, build in (
        ("classifier", swap_models.build_classifier),
        ("residual", swap_models.build_residual_classifier),
        ("plain", swap_models.build_plain),
    ):
        paths[name] = str(folder / f"{name}.keras")
        build().save(paths[name])
    return paths


def test_model_matches_its_swapped_copy_in_outputs_and_weight_gradients(saved):
    record = compare.compare_model(saved["classifier"], IMPORTS, repeats=1)
    assert set(compare.RECORD_KEYS) <= set(record)
    assert record["backend"] == keras.backend.backend()
    assert record["case"] == "classifier"
    assert record["ours_error"] is None and record["builtin_error"] is None
    assert record["max_abs_diff"] <= 1e-4
    assert record["grad_scale"] > 0
    assert record["grad_max_abs_diff"] <= 1e-4 * max(1.0, record["grad_scale"])
    assert record["passed"] is True
    assert record["inputs"] == {"tokens": [2, swap_models.MAXLEN]}
    assert [row["path"] for row in record["layers"]] == ["block/att", "causal_attention"]
    for key in ("ours_predict_ms", "builtin_predict_ms", "ours_train_ms", "builtin_train_ms"):
        assert record[key] > 0
    assert record["train_ratio"] == pytest.approx(
        record["ours_train_ms"] / record["builtin_train_ms"]
    )


def test_model_is_compared_on_unpadded_and_padded_inputs(saved):
    record = compare.compare_model(saved["classifier"], IMPORTS, repeats=0)
    assert list(record["input_cases"]) == ["unpadded", "padded"]
    for case in record["input_cases"].values():
        assert case["passed"] is True and case["masks_match"] is True
        assert case["max_abs_diff"] <= 1e-4
    assert compare.failed_input_cases(record) == []


def _tagger(path):
    """A per-token output read from the embedding's tensor after the attention: its
    Keras mask (what its loss reads) depends on the attention removing the masks."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(12, 8, mask_zero=True)(tokens)
    attended = keras.layers.MultiHeadAttention(2, 4)(x, x)
    classes = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(attended))
    keras.Model(tokens, [classes, keras.layers.Dense(3)(x)], name="tagger").save(path)
    return path


@pytest.fixture
def keeping_masks(monkeypatch):
    """The swapped layers keep their inputs' masks: they differ from the built-in on
    padded inputs only."""
    init = keras_mha.MultiHeadAttention.__init__

    def keeping(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "keep_input_masks": True})

    monkeypatch.setattr(keras_mha.MultiHeadAttention, "__init__", keeping)


def test_masks_read_after_the_attention_compare_equal(tmp_path):
    path = _tagger(str(tmp_path / "tagger.keras"))
    record = compare.compare_model(path, repeats=0)
    assert record["passed"] is True  # as the built-in treats masks
    assert compare.failed_input_cases(record) == []


def test_kept_input_masks_fail_on_padded_inputs(tmp_path, keeping_masks):
    path = _tagger(str(tmp_path / "tagger.keras"))
    record = compare.compare_model(path, repeats=0)
    assert record["passed"] is False
    assert compare.failed_input_cases(record) == ["padded"]
    assert record["input_cases"]["padded"]["masks_match"] is False
    assert record["input_cases"]["unpadded"]["passed"] is True
    result = compare.swap_file(path, str(tmp_path / "out.keras"))
    assert result["passed"] is False
    assert [name for name, c in result["input_cases"].items() if not c["passed"]] == ["padded"]


def _residual_classifier(path):
    """keras.io's pattern: `x + attention(x, x)` drops the mask before the pooling."""
    keras.utils.set_random_seed(1)
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(12, 8, mask_zero=True)(tokens)
    x = x + keras.layers.MultiHeadAttention(2, 4)(x, x)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(x))
    keras.Model(tokens, outputs, name="residual").save(path)
    return path


def test_padded_query_rows_reaching_the_output_compare_equal(tmp_path):
    """A padded query row, averaged in by the pooling once `x + attention` drops the
    mask: the swap builds ours with `fully_masked_rows="builtin"` (the values' mean)."""
    record = compare.compare_model(_residual_classifier(str(tmp_path / "r.keras")), repeats=0)
    if keras.backend.backend() != "torch":
        assert compare.failed_input_cases(record) == []
        assert record["passed"] is True
        return
    # torch: the built-in's backward passes those rows' logit gradients on (its additive
    # mask; docs/guide/masks.md): the outputs agree, the weight gradients do not, and
    # ours agrees with the built-in on another backend: a known difference, passed.
    padded = record["input_cases"]["padded"]
    assert padded["max_abs_diff"] < 1e-5 and padded["masks_match"]
    assert padded["grad_max_abs_diff"] > 1e-3
    assert padded["classification"]["name"] == known.TORCH_FULLY_MASKED_ROWS
    assert compare.failed_input_cases(record) == []
    assert record["passed"] is True


def test_zero_fully_masked_rows_fail_on_padded_inputs(tmp_path, monkeypatch):
    """Swapped layers left with `fully_masked_rows="zero"` (difference 5) give those
    rows a zero context: compare fails, on the padded inputs only."""
    monkeypatch.setattr(swapping, "_as_builtin", lambda layer, kwargs: layer)
    record = compare.compare_model(_residual_classifier(str(tmp_path / "r.keras")), repeats=0)
    assert compare.failed_input_cases(record) == ["padded"]
    assert record["input_cases"]["padded"]["max_abs_diff"] > 1e-3
    assert record["passed"] is False


def test_builtins_known_torch_difference_is_classified_not_failed(
    saved, reference_imports, tmp_path
):
    """keras.io's classifier with `x + attention(x, x, use_causal_mask=True)`: padded
    query rows reach the pooling. On torch the built-in's gradients through them are
    wrong; ours matches the built-in on another backend, so the case passes, classified."""
    record = compare.compare_model(saved["residual"], IMPORTS, repeats=0)
    padded = record["input_cases"]["padded"]
    assert record["input_cases"]["unpadded"]["classification"] is None
    assert record["passed"] is True and compare.failed_input_cases(record) == []
    if keras.backend.backend() != "torch":
        assert padded["classification"] is None and record["classification"] is None
        assert padded["grad_max_abs_diff"] <= 1e-4 * max(1.0, padded["grad_scale"])
        return
    assert padded["grad_max_abs_diff"] > 1.0  # torch's built-in, against ours
    found = padded["classification"]
    assert found["name"] == known.TORCH_FULLY_MASKED_ROWS
    assert found["docs"] == "docs/guide/masks.md#rows-with-no-key-to-attend-to"
    assert found["reference_backend"] in ("jax", "tensorflow")
    assert found["ours_vs_reference"] <= found["tolerance"] < found["builtin_vs_reference"]
    assert record["classification"] == [known.TORCH_FULLY_MASKED_ROWS]
    result = compare.swap_file(saved["residual"], str(tmp_path / "out.keras"), IMPORTS)
    assert result["passed"] is True
    assert result["classification"] == [known.TORCH_FULLY_MASKED_ROWS]


@pytest.fixture(scope="module")
def hub_mistral(tmp_path_factory):
    """A tiny keras-hub Mistral whose window (4) is shorter than the padding that
    `compare --model` synthesizes: padded queries see no key. keras-hub gives them the
    values' mean on jax and torch and a zero output on tensorflow (the guarantees
    page)."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.MistralBackbone(
        vocabulary_size=50,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
        sliding_window=4,
    )
    path = str(tmp_path_factory.mktemp("hub") / "mistral.keras")
    keras_hub.models.MistralCausalLM(backbone, preprocessor=None).save(path)
    return path


def test_keras_hub_model_whose_rows_differ_by_backend_is_judged_against_its_own_path(
    hub_mistral,
):
    """Swapped, the padded case keeps keras-hub's outputs on every backend; on torch its
    gradients through those rows are Keras's torch path's (the known difference), which
    tensorflow's keras-hub (zero rows) cannot explain and jax's (the mean) does."""
    record = compare.compare_model(hub_mistral, [], repeats=0)
    padded = record["input_cases"]["padded"]
    assert record["passed"] is True, record
    assert padded["max_abs_diff"] <= 1e-4
    if keras.backend.backend() != "torch":
        assert padded["classification"] is None
        return
    found = padded["classification"]
    assert found["name"] == known.TORCH_FULLY_MASKED_ROWS
    assert found["reference_backend"] == "jax"
    assert found["ours_vs_reference"] <= found["tolerance"] < found["builtin_vs_reference"]
    perturbed = compare.compare_model(hub_mistral, [], repeats=0, perturb=0.05)
    assert perturbed["passed"] is False and perturbed["classification"] is None


def test_perturbed_model_with_the_known_difference_still_fails(saved, reference_imports):
    record = compare.compare_model(saved["residual"], IMPORTS, repeats=0, perturb=0.05)
    assert record["passed"] is False and record["classification"] is None
    assert compare.failed_input_cases(record) == ["unpadded", "padded"]


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="the known difference is torch's")
def test_a_wrong_gradient_of_ours_beside_the_known_difference_still_fails(
    saved, reference_imports, monkeypatch
):
    """A gradient of ours off by 1e-2 on the dense head (which the built-in computes
    right), outputs unchanged: the padded case has the known difference's pattern, but
    ours no longer matches the reference, so it fails unclassified."""
    from keras_mha.compare import model

    gradients = model._weight_gradients

    def wrong_for_ours(m, inputs, cotangents):
        grads = gradients(m, inputs, cotangents)
        if any(isinstance(layer, keras_mha.MultiHeadAttention) for layer in m._flatten_layers()):
            grads[-2] = grads[-2] + 1e-2
        return grads

    monkeypatch.setattr(model, "_weight_gradients", wrong_for_ours)
    record = compare.compare_model(saved["residual"], IMPORTS, repeats=0)
    padded = record["input_cases"]["padded"]
    assert padded["max_abs_diff"] < 1e-5 and padded["masks_match"] is True
    assert padded["reference_backend"] in ("jax", "tensorflow")  # judged, and refused
    assert padded["classification"] is None and padded["passed"] is False
    assert record["passed"] is False and record["classification"] is None


def _grads(*values):
    return {"outputs": [np.zeros(3, "float32")], "grads": [np.array(v, "float32") for v in values]}


@pytest.mark.parametrize(
    "ours, builtin, expected",
    [
        ((1.0, 2.0), (9.0, 2.0), True),  # ours is the reference, the built-in is not
        ((1.0, 2.1), (9.0, 2.0), False),  # ours differs from the reference too
        ((1.0, 2.0), (1.0, 2.0), False),  # nothing for the built-in to be wrong about
    ],
    ids=["ours_right", "ours_wrong", "builtin_right"],
)
def test_classify_needs_ours_on_the_reference_and_the_builtin_off_it(ours, builtin, expected):
    reference = {"backend": "jax", **_grads(1.0, 2.0)}
    found = known.classify(_grads(*ours), _grads(*builtin), reference)
    assert (found is not None) is expected
    assert known.classify(_grads(*ours), _grads(*builtin), None) is None


def test_suspect_is_torch_outputs_equal_gradients_not():
    result = {"max_abs_diff": 1e-7, "grad_max_abs_diff": 5.0, "grad_scale": 2.0}
    assert known.suspect("torch", {**result, "masks_match": True})
    assert not known.suspect("torch", {**result, "masks_match": False})
    assert not known.suspect("torch", {**result, "masks_match": True, "max_abs_diff": 1e-2})
    assert not known.suspect("jax", {**result, "masks_match": True})


def test_perturbed_swap_is_caught_in_outputs_and_gradients(saved):
    record = compare.compare_model(saved["classifier"], IMPORTS, repeats=0, perturb=0.05)
    assert record["max_abs_diff"] > 1e-4
    assert record["grad_max_abs_diff"] > 1e-4 * max(1.0, record["grad_scale"])
    assert record["passed"] is False
    assert record["ours_predict_ms"] is None


def test_padded_inputs_from_a_file_compare_equal(saved, tmp_path):
    tokens = np.array([[3, 4, 5, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]], "int32")
    path = str(tmp_path / "inputs.npz")
    np.savez(path, tokens=tokens)
    record = compare.compare_model(saved["classifier"], IMPORTS, inputs=path, repeats=0)
    assert record["inputs"] == {"tokens": [2, 8]}
    assert record["passed"] is True and record["max_abs_diff"] <= 1e-4


def test_swap_file_writes_a_file_that_loads_swapped(saved, tmp_path):
    out = str(tmp_path / "out.keras")
    result = compare.swap_file(saved["classifier"], out, IMPORTS)
    assert result["passed"] is True and result["max_abs_diff"] <= 1e-4
    assert [row["status"] for row in result["layers"]] == [swapping.SWAPPED] * 2
    loaded = keras.saving.load_model(out, safe_mode=True)
    assert type(loaded.get_layer("block").att) is keras_mha.MultiHeadAttention


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch.compile is torch's")
def test_a_file_compiled_with_jit_compile_is_checked_without_torch_compile(
    saved, tmp_path, monkeypatch
):
    """A file compiled with `jit_compile=True` (as `"auto"` saves it under JAX): on
    torch the check runs eagerly (a `torch.compile` per model costs tens of seconds
    on a CPU), and the swapped file keeps the file's compile settings."""
    model = keras.saving.load_model(saved["classifier"])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=True)
    path, out = str(tmp_path / "jit.keras"), str(tmp_path / "out.keras")
    model.save(path)
    import torch

    def refused(*args, **kwargs):
        raise AssertionError("the check ran torch.compile")

    monkeypatch.setattr(torch, "compile", refused)
    result = compare.swap_file(path, out, IMPORTS)
    assert result["passed"] is True
    with zipfile.ZipFile(out) as written:
        assert json.loads(written.read("config.json"))["compile_config"]["jit_compile"] is True


class _ReadsItsValues(keras.layers.Layer):
    """Identity that reads its input's values in Python: runs eagerly only."""

    def call(self, x):
        if float(keras.ops.convert_to_numpy(keras.ops.max(x))) > 1e30:
            raise ValueError("unreachable")
        return x

    def compute_output_shape(self, shape):
        return shape


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's compiled gradient")
@pytest.mark.parametrize("eager_only", [False, True], ids=["traces", "reads_values"])
def test_jax_weight_gradients_compile_where_the_model_traces(eager_only, monkeypatch):
    """The parity check's gradient on JAX is one compiled program where the model
    traces, and eager where its code reads values: the same gradients either way."""
    import jax

    from keras_mha.compare import model as compare_model

    inputs = keras.Input((4,))
    hidden = _ReadsItsValues()(inputs) if eager_only else inputs
    net = keras.Model(inputs, keras.layers.Dense(2, use_bias=False)(hidden))
    x = np.random.default_rng(0).standard_normal((3, 4)).astype("float32")
    cotangent = np.random.default_rng(1).standard_normal((3, 2)).astype("float32")
    compiled, jit = [], jax.jit

    def counting_jit(fn, *args, **kwargs):
        run = jit(fn, *args, **kwargs)

        def call(*call_args):
            found = run(*call_args)
            compiled.append(fn)
            return found

        return call

    monkeypatch.setattr(jax, "jit", counting_jit)
    (grad,) = compare_model._weight_gradients(net, x, [cotangent])
    np.testing.assert_allclose(grad, x.T @ cotangent, rtol=1e-5, atol=1e-6)
    assert len(compiled) == (0 if eager_only else 1)


def test_swap_file_reports_a_difference_above_tolerance(saved, tmp_path):
    result = compare.swap_file(saved["classifier"], str(tmp_path / "o.keras"), perturb=0.05)
    assert result["passed"] is False and result["max_abs_diff"] > 1e-4


def _not_keras(tmp_path, saved):
    path = tmp_path / "notes.keras"
    path.write_text("hello")
    return str(path), [], None, r"notes.keras: not a .keras model file$"


def _no_attention(tmp_path, saved):
    message = r"plain.keras: no keras.layers.MultiHeadAttention to swap \(no attention layer\)$"
    return saved["plain"], [], None, message


def _missing_module(tmp_path, saved):
    return saved["classifier"], ["swap_models_gone"], None, r"^--import swap_models_gone: "


def _bad_inputs(tmp_path, saved):
    path = tmp_path / "inputs.npz"
    np.savez(path, words=np.ones((2, 8), "int32"))
    return saved["classifier"], [], str(path), r"inputs.npz: no array for input 'tokens'"


@pytest.mark.parametrize(
    "case", [_not_keras, _no_attention, _missing_module, _bad_inputs], ids=lambda c: c.__name__
)
def test_usage_errors_name_the_culprit_and_write_nothing(case, saved, tmp_path):
    model_path, imports, inputs, message = case(tmp_path, saved)
    out = tmp_path / "out.keras"
    with pytest.raises(UsageError, match=message) as raised:
        compare.swap_file(model_path, str(out), imports, inputs)
    assert "\n" not in str(raised.value)
    assert not out.exists()
    with pytest.raises(UsageError, match=message):
        compare.compare_model(model_path, imports, inputs, repeats=0)


def test_swap_file_refuses_an_output_that_is_not_keras(saved, tmp_path):
    with pytest.raises(UsageError, match=r"out.h5: the output file must end in .keras"):
        compare.swap_file(saved["classifier"], str(tmp_path / "out.h5"))
    assert not (tmp_path / "out.h5").exists()


def test_peak_memory_is_measured_for_each_side(saved):
    for which in ("builtin", "ours"):
        assert compare.peak_memory(saved["classifier"], which, IMPORTS) > 10


def test_the_reference_is_the_first_installed_backend_free_of_the_defect():
    """tensorflow first (it answers one eager gradient without compiling), then jax;
    never the backend being judged."""
    assert known.reference_backend("torch", {"jax", "tensorflow", "torch"}) == "tensorflow"
    assert known.reference_backend("torch", {"jax", "torch"}) == "jax"
    assert known.reference_backend("tensorflow", {"jax", "tensorflow"}) == "jax"
    assert known.reference_backend("torch", {"torch"}) is None


def test_a_reference_is_computed_once_per_file_inputs_and_cotangents(tmp_path, monkeypatch):
    """`compare --model` and `swap` of one file in one process share the reference's
    child; a file changed on disk, other cotangents or a failed child run it again."""
    from keras_mha.compare import workers

    monkeypatch.setattr(workers, "_REFERENCES", {})
    spawned, fail = [], []

    def spawn(backend, spec, on_record=None, env=None):
        spawned.append(spec["path"])
        if fail:
            return [], 1, ["boom"]
        np.savez(spec["found"], output_0=np.ones(2, "float32"), grad_0=np.zeros(3, "float32"))
        return [{"outputs": 1, "grads": 1}], 0, []

    monkeypatch.setattr(workers, "_spawn", spawn)
    path = tmp_path / "m.keras"
    path.write_bytes(b"model")
    arrays, cotangents = [np.arange(4, dtype="int32")], [np.ones(2, "float32")]

    def reference(cotangents=cotangents):
        return workers.run_reference("tensorflow", str(path), ["m"], arrays, cotangents)

    first = reference()
    assert first["backend"] == "tensorflow" and first["outputs"][0].tolist() == [1.0, 1.0]
    assert reference() is first and len(spawned) == 1
    reference([np.full(2, 2.0, "float32")])
    assert len(spawned) == 2
    path.write_bytes(b"model, saved again")
    reference()
    assert len(spawned) == 3
    fail.append(True)
    path.write_bytes(b"a third model")
    assert reference() is None and reference() is None
    assert len(spawned) == 5
