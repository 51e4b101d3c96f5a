"""Parity and speed of `keras_mha.MultiHeadAttention` against `keras.layers.MultiHeadAttention`.

The engine behind `keras-mha compare` (and the notebooks and benchmarks). For one case on
the current backend, `compare_case` builds a functional model around each layer, copies the
built-in's weights into ours, measures the largest absolute difference of the outputs, of
the attention scores (when the case asks for them) and of the gradients with respect to the
inputs, then times `predict_on_batch` and `train_on_batch` for both, alternating ours and
the built-in after a warm-up, and keeps the medians.

Keras picks its backend once per process, so `run_backend` runs a whole set of cases in a
child process with `KERAS_BACKEND` set, and `run` does that for every installed backend:

    from keras_mha import compare
    records = compare.run(backends="all", quick=True)          # list of dicts
    records = compare.run_backend("jax", compare.DEFAULT_CASES, quick=True, repeats=5)
    record = compare.compare_case(compare.DEFAULT_CASES[3], quick=True)  # this process

Each record is a plain dict (see `RECORD_KEYS`); timings are milliseconds, ratios are
ours / built-in (below 1 means ours is faster). Where the built-in fails (on JAX it cannot
run `value_dim != key_dim`) its fields are `None` and `builtin_error` holds its message.

`compare_model` does the same for the user's own model (`keras-mha compare --model`):
it loads a `.keras` file as it is and swapped (`keras_mha.swapping`), compares the
outputs and the gradients of a scalar loss with respect to the trainable weights, on
synthesised inputs without padding and, where the model takes padding (an
`Embedding(mask_zero=True)` or mask inputs), with padding (`user_model.padded`), times
`predict_on_batch` and a train step (SGD on an MSE loss against zeros, for both), and
`run_model_backend` adds the peak memory of each, measured in a fresh process per model
(the GPU's peak allocation where the backend has one, else the process's peak RSS).
`swap_file` is `keras-mha swap`: swap, check the outputs, write the swapped file.

Tolerances (float32): outputs and scores must agree to `ATOL = 1e-4` absolute. Input
gradients are sums over every output element that depends on the input (`T * dim` terms
for a query row), so their rounding error grows with their magnitude: they must agree to
`ATOL * max(1, max|gradient|)`, i.e. 1e-4 absolute for gradients up to 1 and 1e-4
relative beyond.
"""

import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

BACKENDS = ("tensorflow", "jax", "torch")
ATOL = 1e-4
DEFAULT_REPEATS = 7
QUICK_REPEATS = 21
WARMUP = 2

RECORD_KEYS = (
    "backend",
    "case",
    "description",
    "query_shape",
    "value_shape",
    "quick",
    "max_abs_diff",
    "scores_max_abs_diff",
    "grad_max_abs_diff",
    "grad_scale",
    "ours_predict_ms",
    "builtin_predict_ms",
    "predict_ratio",
    "ours_train_ms",
    "builtin_train_ms",
    "train_ratio",
    "ours_peak_mib",
    "builtin_peak_mib",
    "peak_ratio",
    "builtin_error",
    "ours_error",
    "tolerance",
    "passed",
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One comparison: input shapes and the arguments given to both layers.

    Args:
        name: Short identifier, used by `--cases`.
        query_shape: `(B, T, dim)` of the query.
        value_shape: `(B, S, dim_v)` for cross-attention; `None` for self-attention
            (the query is also value and key).
        layer_kwargs: Constructor arguments of both layers.
        call_kwargs: Call arguments, e.g. `use_causal_mask`, `return_attention_scores`.
        quick_query_shape: The small query shape used by `--quick` (`None` keeps
            the full shape).
        quick_value_shape: The small value shape used by `--quick`.
        description: One line for tables and plots.
    """

    name: str
    query_shape: tuple
    value_shape: tuple | None = None
    layer_kwargs: dict = dataclasses.field(default_factory=dict)
    call_kwargs: dict = dataclasses.field(default_factory=dict)
    quick_query_shape: tuple | None = None
    quick_value_shape: tuple | None = None
    description: str = ""

    def shapes(self, quick=False):
        """Returns `(query_shape, value_shape or None)` for the full or quick size."""
        if quick and self.quick_query_shape is not None:
            value = self.quick_value_shape if self.value_shape is not None else None
            return tuple(self.quick_query_shape), None if value is None else tuple(value)
        value = None if self.value_shape is None else tuple(self.value_shape)
        return tuple(self.query_shape), value

    @property
    def wants_scores(self):
        return bool(self.call_kwargs.get("return_attention_scores", False))

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data):
        data = dict(data)
        for key in ("query_shape", "value_shape", "quick_query_shape", "quick_value_shape"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


DEFAULT_CASES = (
    Case(
        "h8_k64",
        (32, 128, 512),
        layer_kwargs={"num_heads": 8, "key_dim": 64},
        quick_query_shape=(4, 32, 64),
        description="(32,128,512), num_heads=8, key_dim=64",
    ),
    Case(
        "h4_k128",
        (32, 128, 512),
        layer_kwargs={"num_heads": 4, "key_dim": 128},
        quick_query_shape=(4, 32, 64),
        description="(32,128,512), num_heads=4, key_dim=128",
    ),
    Case(
        "h8_k64_v32",
        (32, 128, 512),
        layer_kwargs={"num_heads": 8, "key_dim": 64, "value_dim": 32},
        quick_query_shape=(4, 32, 64),
        description="(32,128,512), num_heads=8, key_dim=64, value_dim=32",
    ),
    Case(
        "seq6_scores",
        (10, 6, 8),
        layer_kwargs={"num_heads": 2, "key_dim": 8},
        call_kwargs={"return_attention_scores": True},
        quick_query_shape=(10, 6, 8),
        description="(10,6,8), num_heads=2, key_dim=8, return_attention_scores",
    ),
    Case(
        "causal",
        (16, 128, 256),
        layer_kwargs={"num_heads": 4, "key_dim": 64},
        call_kwargs={"use_causal_mask": True},
        quick_query_shape=(4, 32, 64),
        description="causal self-attention (16,128,256), num_heads=4, key_dim=64",
    ),
    Case(
        "cross",
        (16, 64, 256),
        value_shape=(16, 192, 128),
        layer_kwargs={"num_heads": 4, "key_dim": 64},
        quick_query_shape=(4, 16, 64),
        quick_value_shape=(4, 48, 32),
        description="cross-attention T=64, S=192, num_heads=4, key_dim=64",
    ),
    Case(
        "long_seq",
        (2, 1024, 64),
        layer_kwargs={"num_heads": 4, "key_dim": 16},
        call_kwargs={"use_causal_mask": True},
        quick_query_shape=(1, 256, 32),
        description="long causal sequence (2,1024,64), num_heads=4, key_dim=16",
    ),
)


def get_cases(names=None, cases=DEFAULT_CASES):
    """Selects cases by name, in the order given; `None` returns all of `cases`."""
    if names is None:
        return tuple(cases)
    by_name = {case.name: case for case in cases}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ValueError(
            "Received an invalid value for argument `cases`, expected names among "
            f"{sorted(by_name)}. Received: cases={list(names)}"
        )
    return tuple(by_name[name] for name in names)


def installed_backends():
    """The backends of `BACKENDS` whose framework can be imported here."""
    import importlib.util

    return tuple(name for name in BACKENDS if importlib.util.find_spec(name) is not None)


# --------------------------------------------------------------------- one process
def compare_case(case, quick=False, repeats=None, perturb=0.0, seed=0):
    """Compares ours and the built-in on one case, on the current Keras backend.

    Args:
        case: A `Case`.
        quick: Use the case's small shapes.
        repeats: Timed calls per model and step (`None`: 5 quick, 7 otherwise);
            0 skips timing.
        perturb: Standard deviation of noise added to our copied weights (testing
            aid: a planted mismatch).
        seed: Seed of the inputs, the cotangent and the perturbation.

    Returns:
        A record, a dict with the keys of `RECORD_KEYS`.
    """
    import keras

    if repeats is None:
        repeats = QUICK_REPEATS if quick else DEFAULT_REPEATS
    query_shape, value_shape = case.shapes(quick)
    record = dict.fromkeys(RECORD_KEYS)
    record.update(
        backend=keras.backend.backend(),
        case=case.name,
        description=case.description,
        query_shape=list(query_shape),
        value_shape=None if value_shape is None else list(value_shape),
        quick=bool(quick),
        tolerance=ATOL,
    )
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(query_shape).astype("float32")]
    if value_shape is not None:
        inputs.append(rng.standard_normal(value_shape).astype("float32"))

    try:
        ours = _build(case, query_shape, value_shape, builtin=False)
    except Exception as error:  # ours failing is a result to report, not a crash
        record["ours_error"] = _error_text(error)
        record["passed"] = False
        return record
    try:
        builtin = _build(case, query_shape, value_shape, builtin=True)
        _copy_weights(builtin, ours, perturb, rng)
        reference = _evaluate(builtin, inputs, case.wants_scores, rng_seed=seed)
    except Exception as error:
        builtin, reference = None, None
        record["builtin_error"] = _error_text(error)
    try:
        result = _evaluate(ours, inputs, case.wants_scores, rng_seed=seed)
    except Exception as error:
        record["ours_error"] = _error_text(error)
        record["passed"] = False
        return record

    if reference is not None:
        record["max_abs_diff"] = _max_abs_diff(result["output"], reference["output"])
        if case.wants_scores:
            record["scores_max_abs_diff"] = _max_abs_diff(result["scores"], reference["scores"])
        record["grad_max_abs_diff"] = max(
            _max_abs_diff(a, b) for a, b in zip(result["grads"], reference["grads"])
        )
        record["grad_scale"] = max(float(np.max(np.abs(g))) for g in reference["grads"])
    finite = all(np.all(np.isfinite(x)) for x in [result["output"], *result["grads"]])
    record["passed"] = bool(finite and within_tolerance(record))

    if repeats > 0:
        try:
            _time_models(record, ours, builtin, inputs, repeats)
        except Exception as error:  # only ours re-raises: the built-in's are recorded
            record["ours_error"] = _error_text(error)
            record["passed"] = False
    return record


def within_tolerance(record):
    """Whether a record's measured differences are within the float32 tolerances.

    Unmeasured differences (`None`, e.g. when the built-in failed) do not fail it.
    """
    atol = record.get("tolerance") or ATOL
    checks = [
        (record.get("max_abs_diff"), atol),
        (record.get("scores_max_abs_diff"), atol),
        (record.get("grad_max_abs_diff"), atol * max(1.0, record.get("grad_scale") or 0.0)),
    ]
    return all(diff is None or diff <= bound for diff, bound in checks)


def run_cases(cases=DEFAULT_CASES, quick=False, repeats=None, perturb=0.0, on_record=None):
    """Runs `compare_case` for each case on the current backend; returns the records."""
    records = []
    for case in cases:
        record = compare_case(case, quick=quick, repeats=repeats, perturb=perturb)
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


def _build(case, query_shape, value_shape, builtin):
    """A functional model around one layer: inputs `[query]` or `[query, value]`.

    Returns a dict with the layer, the model to compare (its outputs include the
    scores when the case asks for them) and the model to train (output only).
    """
    import keras

    import keras_mha

    layer_class = keras.layers.MultiHeadAttention if builtin else keras_mha.MultiHeadAttention
    layer = layer_class(**case.layer_kwargs)
    query = keras.Input(shape=query_shape[1:], name="query")
    value = query if value_shape is None else keras.Input(shape=value_shape[1:], name="value")
    inputs = [query] if value_shape is None else [query, value]
    call_kwargs = dict(case.call_kwargs)
    call_kwargs.pop("return_attention_scores", None)
    if case.wants_scores:
        output, scores = layer(query, value, return_attention_scores=True, **call_kwargs)
        model = keras.Model(inputs, [output, scores])
    else:
        output = layer(query, value, **call_kwargs)
        model = keras.Model(inputs, output)
    train_model = keras.Model(inputs, output)
    train_model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return {"layer": layer, "model": model, "train_model": train_model}


def _copy_weights(source, target, perturb, rng):
    weights = source["layer"].get_weights()
    if perturb:
        weights = [w + perturb * rng.standard_normal(w.shape).astype(w.dtype) for w in weights]
    target["layer"].set_weights(weights)


def _evaluate(built, inputs, wants_scores, rng_seed):
    """Outputs and scores (`predict_on_batch`) and input gradients, as NumPy.

    The gradients are those of `sum(output * cotangent)`, with a fixed random
    cotangent, so that every output element contributes with its own weight.
    """
    outputs = built["model"].predict_on_batch(inputs)
    output, scores = (outputs[0], outputs[1]) if wants_scores else (outputs, None)
    output = np.asarray(output)
    cotangent = np.random.default_rng(rng_seed + 1).standard_normal(output.shape)
    grads = _input_gradients(built["model"], inputs, cotangent.astype("float32"), wants_scores)
    return {
        "output": output,
        "scores": None if scores is None else np.asarray(scores),
        "grads": grads,
    }


def _input_gradients(model, inputs, cotangent, wants_scores):
    """Gradients of `sum(output * cotangent)` with respect to each input, per backend."""
    import keras
    from keras import ops

    def objective(xs):
        outputs = model(xs)
        output = outputs[0] if wants_scores else outputs
        return ops.sum(ops.multiply(output, ops.convert_to_tensor(cotangent)))

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        xs = [tf.constant(x) for x in inputs]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            loss = objective(xs)
        return [g.numpy() for g in tape.gradient(loss, xs)]
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        grads = jax.grad(objective)([jnp.asarray(x) for x in inputs])
        return [np.asarray(g) for g in grads]
    if backend == "torch":
        import torch

        xs = [torch.tensor(x, requires_grad=True) for x in inputs]
        objective(xs).backward()
        return [x.grad.detach().cpu().numpy() for x in xs]
    raise ValueError(
        "Received an invalid value for argument `backend`, expected one of "
        f"{BACKENDS}. Received: backend={backend}"
    )


def _time_models(record, ours, builtin, inputs, repeats):
    """Median ms of `predict_on_batch` and `train_on_batch`, alternating the two
    (A B, B A, ...)."""
    models = {"ours": ours}
    if builtin is not None:
        models["builtin"] = builtin
    target = np.zeros(ours["train_model"].outputs[0].shape[1:], "float32")
    target = np.broadcast_to(target, (inputs[0].shape[0],) + target.shape).copy()
    steps = {
        "predict": lambda m: m["model"].predict_on_batch(inputs),
        "train": lambda m: m["train_model"].train_on_batch(inputs, target),
    }
    _time_steps(record, models, steps, repeats)


def _time_steps(record, models, steps, repeats):
    """For each step, the median ms of `step(model)` for each of `models` ("ours" and
    maybe "builtin"), in alternated rounds after a warm-up; sets the record's times and
    ratios. A built-in that fails is recorded and dropped; ours failing raises."""
    models = dict(models)
    for step_name, step in steps.items():
        times = {name: [] for name in models}
        for name, built in list(models.items()):
            try:
                for _ in range(WARMUP):
                    step(built)
            except Exception as error:
                if name == "ours":
                    raise
                record["builtin_error"] = record["builtin_error"] or _error_text(error)
                del models[name]
        for i in range(repeats):
            # Every other round in reverse order: the second call of a pair can be
            # the slower one, and a fixed order would always charge the same side.
            order = list(models.items())
            for name, built in order[::-1] if i % 2 else order:
                start = time.perf_counter()
                step(built)
                times[name].append((time.perf_counter() - start) * 1e3)
        for name in ("ours", "builtin"):
            if times.get(name):
                record[f"{name}_{step_name}_ms"] = statistics.median(times[name])
        if record[f"ours_{step_name}_ms"] and record[f"builtin_{step_name}_ms"]:
            record[f"{step_name}_ratio"] = (
                record[f"ours_{step_name}_ms"] / record[f"builtin_{step_name}_ms"]
            )


def _max_abs_diff(a, b):
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def _error_text(error):
    """The error's type and first informative line (Keras wraps call errors)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Exception encountered")]
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()[:300]


# ------------------------------------------------------------- the user's model
def compare_model(path, imports=(), inputs=None, repeats=None, perturb=0.0, seed=0):
    """Compares the model of a `.keras` file with its swapped copy, on this backend.

    Args:
        path: The `.keras` file.
        imports: Modules to import first (they register the model's custom objects).
        inputs: A `.npz` file of inputs, or `None` to synthesise them from the
            model's input specs (see `keras_mha.user_model`).
        repeats: Timed calls per model and step (`None`: `DEFAULT_REPEATS`); 0 skips
            timing.
        perturb: Noise added to the swapped model's weights (testing aid).
        seed: Seed of the synthesised inputs, the cotangents and the noise.

    Returns:
        A record (the keys of `RECORD_KEYS`, `case` being the model's name; the
        differences the largest over the input cases), plus `inputs` (name ->
        shape), `layers` (`swapping.swap_report`'s rows) and `input_cases`
        ("unpadded" / "padded", or "given" for a file -> that case's differences and
        `passed`); it passes when every input case does.

    Raises:
        user_model.UsageError: The file, a module or the inputs cannot be used.
    """
    import keras

    repeats = DEFAULT_REPEATS if repeats is None else repeats
    builtin, ours, rows, arrays, specs = _load_pair(path, imports, inputs, seed)
    rng = np.random.default_rng(seed)
    if perturb:
        _perturb(ours, perturb, rng)
    record = dict.fromkeys(RECORD_KEYS)
    record.update(
        backend=keras.backend.backend(),
        case=builtin.name,
        description=f"{os.path.basename(path)}: {_describe(rows)}",
        query_shape=list(arrays[0].shape),
        quick=False,
        tolerance=ATOL,
        inputs={name: list(a.shape) for (name, _, _), a in zip(specs, arrays)},
        layers=rows,
    )
    from keras_mha import user_model

    record["input_cases"] = {}
    for name, case_arrays in _input_cases(builtin, specs, arrays, inputs):
        try:
            result = _compare_on(builtin, ours, user_model.model_inputs(builtin, case_arrays), rng)
        except Exception as error:
            record["ours_error"] = _error_text(error)
            record["passed"] = False
            return record
        record["builtin_error"] = record["builtin_error"] or result.pop("builtin_error")
        result["passed"] = _case_passed(result)
        record["input_cases"][name] = result
        for key in ("max_abs_diff", "grad_max_abs_diff", "grad_scale"):
            values = [v for v in (record[key], result[key]) if v is not None]
            record[key] = max(values) if values else None
    feed = user_model.model_inputs(builtin, arrays)
    record["passed"] = all(case["passed"] for case in record["input_cases"].values())
    if repeats > 0:
        try:
            _time_user_models(record, ours, builtin, feed, repeats)
        except Exception as error:
            record["ours_error"] = _error_text(error)
            record["passed"] = False
    return record


def _input_cases(model, specs, arrays, inputs_file):
    """`[(name, arrays)]`: the inputs as given or synthesised ("unpadded"), and, when
    synthesised for a model that takes padding, the same with padding ("padded", see
    `user_model.padded`): masks then reach the layers after the attention."""
    from keras_mha import user_model

    cases = [("unpadded" if inputs_file is None else "given", arrays)]
    if inputs_file is None:
        padded = user_model.padded(model, specs, arrays)
        if padded is not None:
            cases.append(("padded", padded))
    return cases


def _compare_on(builtin, ours, feed, rng):
    """Outputs, their Keras masks and weight gradients of both models on one input
    case: a dict with `max_abs_diff`, `grad_max_abs_diff`, `grad_scale`,
    `masks_match` (`None` where the built-in failed), `builtin_error` and `finite`
    (ours). Ours failing raises."""
    found = dict(
        max_abs_diff=None,
        grad_max_abs_diff=None,
        grad_scale=None,
        masks_match=None,
        builtin_error=None,
    )
    try:
        reference = _flat_outputs(builtin.predict_on_batch(feed))
    except Exception as error:
        reference = None
        found["builtin_error"] = _error_text(error)
    result = _flat_outputs(ours.predict_on_batch(feed))
    cotangents = [rng.standard_normal(o.shape).astype("float32") for o in result]
    ours_grads = _weight_gradients(ours, feed, cotangents)
    if reference is not None:
        found["max_abs_diff"] = max(_max_abs_diff(a, b) for a, b in zip(result, reference))
        builtin_grads = _weight_gradients(builtin, feed, cotangents)
        if [g.shape for g in ours_grads] != [g.shape for g in builtin_grads]:
            raise ValueError("the trainable weights of the two models do not pair up")
        found["grad_max_abs_diff"] = max(
            (_max_abs_diff(a, b) for a, b in zip(ours_grads, builtin_grads)), default=0.0
        )
        found["grad_scale"] = max(
            (float(np.max(np.abs(g))) for g in builtin_grads if g.size), default=0.0
        )
        found["masks_match"] = all(
            _same_mask(a, b)
            for a, b in zip(_output_masks(ours, feed), _output_masks(builtin, feed))
        )
    found["finite"] = bool(all(np.all(np.isfinite(x)) for x in [*result, *ours_grads]))
    return found


def _case_passed(result):
    """Ours finite, differences within tolerance, the outputs' masks the same."""
    finite = result.pop("finite")
    return bool(finite and within_tolerance(result) and result["masks_match"] is not False)


def _output_masks(model, feed):
    """The Keras mask of each output of an eager call (what a loss reads), NumPy or
    `None`."""
    import keras

    from keras_mha.masks import get_keras_mask

    outputs = keras.tree.flatten(model(feed, training=False))
    masks = [get_keras_mask(o) for o in outputs]
    return [None if m is None else np.asarray(keras.ops.convert_to_numpy(m)) for m in masks]


def _same_mask(a, b):
    """Whether two output masks hide the same positions (no mask = nothing hidden)."""
    if a is None or b is None:
        present = b if a is None else a
        return present is None or bool(np.all(present))
    try:
        return bool(np.array_equal(*np.broadcast_arrays(a.astype(bool), b.astype(bool))))
    except ValueError:
        return False


def failed_input_cases(record):
    """Names of the input cases ("unpadded", "padded", "given") whose results differ."""
    cases = record.get("input_cases") or {}
    return [name for name, case in cases.items() if not case.get("passed")]


def swap_file(in_path, out_path, imports=(), inputs=None, perturb=0.0, seed=0):
    """`keras-mha swap`: loads `in_path` as it is and swapped, compares their outputs
    and weight gradients on each input case (unpadded and, where the model takes
    padding, padded: `_input_cases`), writes the swapped model to `out_path` (see
    `swapping.save_swapped`).

    Returns:
        A dict: `backend`, `model`, `layers` (`swapping.swap_report`'s rows),
        `inputs` (name -> shape), `max_abs_diff`, `grad_max_abs_diff` (largest over
        the cases), `input_cases` (name -> its differences and `passed`),
        `tolerance`, `passed`, `out`.

    Raises:
        user_model.UsageError: The files, a module or the inputs cannot be used;
            nothing is written then.
    """
    import keras

    from keras_mha import swapping, user_model

    user_model.check_output_path(out_path)
    builtin, ours, rows, arrays, specs = _load_pair(in_path, imports, inputs, seed)
    if perturb:
        _perturb(ours, perturb, np.random.default_rng(seed))
    rng = np.random.default_rng(seed)
    cases = {}
    for name, case_arrays in _input_cases(builtin, specs, arrays, inputs):
        result = _compare_on(builtin, ours, user_model.model_inputs(builtin, case_arrays), rng)
        if result["builtin_error"]:
            raise RuntimeError(f"the model as it is fails: {result['builtin_error']}")
        result["passed"] = _case_passed(result)
        del result["builtin_error"]
        cases[name] = result
    swapping.save_swapped(ours, out_path)
    return {
        "backend": keras.backend.backend(),
        "model": builtin.name,
        "layers": rows,
        "inputs": {name: list(a.shape) for (name, _, _), a in zip(specs, arrays)},
        "max_abs_diff": max(case["max_abs_diff"] for case in cases.values()),
        "grad_max_abs_diff": max(case["grad_max_abs_diff"] for case in cases.values()),
        "input_cases": cases,
        "tolerance": ATOL,
        "passed": all(case["passed"] for case in cases.values()),
        "out": out_path,
    }


def peak_memory(path, which, imports=(), inputs=None, seed=0):
    """MiB at the peak of one predict and one train step of one model ("ours": the
    swapped copy, "builtin": the file as it is), in this (fresh) process."""
    builtin, ours, _, arrays, _ = _load_pair(path, imports, inputs, seed, which=which)
    model = ours if which == "ours" else builtin
    from keras_mha import user_model

    feed = user_model.model_inputs(model, arrays)
    _compile_for_timing(model)
    targets = _targets(model.predict_on_batch(feed))
    model.train_on_batch(feed, targets)
    return _peak_mib()


def _load_pair(path, imports, inputs, seed, which=None):
    """`(builtin, ours, rows, arrays, specs)`: the file loaded as it is and swapped (only
    `which` of the two when given, the other `None`), the swap report (`None` unless
    both are loaded) and the input arrays."""
    from keras_mha import swapping, user_model

    user_model.import_modules(imports)
    builtin = None if which == "ours" else user_model.load(path)
    ours = None if which == "builtin" else user_model.load(path, swapped=True)
    model = builtin if builtin is not None else ours
    specs = user_model.input_specs(model, path, required=inputs is None)
    if inputs is None:
        arrays = user_model.synthesize(specs, path, seed)
    else:
        arrays = user_model.read(inputs, specs)
        if specs is None:
            specs = [(f"input_{i}", a.shape, str(a.dtype)) for i, a in enumerate(arrays)]
    rows = None
    if builtin is not None and ours is not None:
        rows = swapping.swap_report(builtin, ours)
        if not any(row["status"] in (swapping.SWAPPED, swapping.REBUILT) for row in rows):
            raise user_model.UsageError(
                f"{path}: no keras.layers.MultiHeadAttention to swap ({swapping.describe(rows)})"
            )
    return builtin, ours, rows, arrays, specs


def _describe(rows):
    from keras_mha import swapping

    return swapping.describe(rows)


def _perturb(model, scale, rng):
    model.set_weights(
        [w + scale * rng.standard_normal(w.shape).astype(w.dtype) for w in model.get_weights()]
    )


def _flat_outputs(outputs):
    import keras

    return [np.asarray(o) for o in keras.tree.flatten(outputs)]


def _weight_gradients(model, inputs, cotangents):
    """Gradients of `sum_i sum(output_i * cotangent_i)` (float outputs, inference mode)
    with respect to the model's trainable weights, in their order, as NumPy."""
    import keras
    from keras import ops

    def loss_of(outputs):
        terms = [
            ops.sum(ops.multiply(ops.cast(o, "float32"), ops.convert_to_tensor(c)))
            for o, c in zip(keras.tree.flatten(outputs), cotangents)
            if "float" in str(o.dtype)
        ]
        return sum(terms[1:], terms[0])

    variables = model.trainable_variables
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_of(model(inputs, training=False))
        grads = tape.gradient(loss, [v.value for v in variables])
        # An embedding's gradient is `IndexedSlices`: made dense here.
        return [
            np.zeros(v.shape, "float32") if g is None else tf.convert_to_tensor(g).numpy()
            for v, g in zip(variables, grads)
        ]
    if backend == "jax":
        import jax

        non_trainable = [v.value for v in model.non_trainable_variables]

        def objective(trainable):
            outputs, _ = model.stateless_call(trainable, non_trainable, inputs, training=False)
            return loss_of(outputs)

        grads = jax.grad(objective)([v.value for v in variables])
        return [np.asarray(g) for g in grads]
    if backend == "torch":
        for v in variables:
            v.value.grad = None
        loss_of(model(inputs, training=False)).backward()
        grads = [
            np.zeros(v.shape, "float32")
            if v.value.grad is None
            else v.value.grad.detach().cpu().numpy()
            for v in variables
        ]
        for v in variables:
            v.value.grad = None
        return grads
    raise ValueError(
        "Received an invalid value for argument `backend`, expected one of "
        f"{BACKENDS}. Received: backend={backend}"
    )


def _compile_for_timing(model):
    import keras

    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")


def _targets(outputs):
    import keras

    return keras.tree.map_structure(lambda o: np.zeros(np.shape(o), "float32"), outputs)


def _time_user_models(record, ours, builtin, feed, repeats):
    models = {"ours": ours, "builtin": builtin}
    for model in models.values():
        _compile_for_timing(model)
    targets = _targets(builtin.predict_on_batch(feed))
    steps = {
        "predict": lambda m: m.predict_on_batch(feed),
        "train": lambda m: m.train_on_batch(feed, targets),
    }
    _time_steps(record, models, steps, repeats)


def _peak_mib():
    """The GPU's peak allocation where the backend has a GPU, else the peak RSS."""
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**20
    elif backend == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform == "gpu":
            return device.memory_stats()["peak_bytes_in_use"] / 2**20
    else:
        import tensorflow as tf

        if tf.config.list_physical_devices("GPU"):
            return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------- across backends
def run_backend(
    backend, cases=DEFAULT_CASES, quick=False, repeats=None, perturb=0.0, on_record=None
):
    """Runs `cases` on one backend in a child process and returns its records.

    Args:
        backend: One of `BACKENDS`.
        cases: `Case`s (any, not only the defaults: they travel as JSON).
        quick: Use the small shapes.
        repeats: Timed calls per model and step (`None`: the default for the mode).
        perturb: Noise on our copied weights (testing aid).
        on_record: Called with each record as soon as the child reports it.

    Returns:
        A list of records (see `RECORD_KEYS`). A child that dies is reported as one
        record per missing case with `ours_error` set and `passed=False`.
    """
    _check_backend(backend)
    cases = tuple(cases)
    spec = {
        "job": "cases",
        "cases": [case.to_dict() for case in cases],
        "quick": quick,
        "repeats": repeats,
        "perturb": perturb,
    }
    records, code, tail = _spawn(backend, spec, on_record)
    done = {record["case"] for record in records}
    for case in cases:
        if case.name in done:
            continue
        record = dict.fromkeys(RECORD_KEYS)
        why = tail[0] if tail else f"exit status {code}"
        record.update(
            backend=backend,
            case=case.name,
            description=case.description,
            quick=bool(quick),
            tolerance=ATOL,
            ours_error=f"worker process failed: {why}"[:300],
            passed=False,
        )
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


def run(backends="all", cases=DEFAULT_CASES, quick=False, repeats=None, on_record=None, **kw):
    """Runs `cases` on each backend (each in its own process); returns all records.

    Args:
        backends: "all" (every installed backend), one name, or a list of names.

    The other arguments (`cases`, `quick`, `repeats`, `on_record`, `**kw`) are those of
    `run_backend`.
    """
    if backends == "all":
        backends = installed_backends()
    elif isinstance(backends, str):
        backends = (backends,)
    records = []
    for backend in backends:
        records.extend(
            run_backend(backend, cases, quick=quick, repeats=repeats, on_record=on_record, **kw)
        )
    return records


def run_model_backend(
    backend, path, imports=(), inputs=None, repeats=None, memory=True, perturb=0.0, on_record=None
):
    """`compare_model` in a child process on `backend`, then (with `memory`) the peak
    memory of each model, each in a fresh child process; returns `[record]`.

    Raises:
        user_model.UsageError: The child found the file, a module or the inputs unusable.
    """
    _check_backend(backend)
    with _shared_compile_cache(backend) as env:
        record = _model_and_memory(backend, path, imports, inputs, repeats, memory, perturb, env)
    if on_record is not None:
        on_record(record)
    return [record]


@contextlib.contextmanager
def _shared_compile_cache(backend):
    """Environment for the child processes of one model's comparison: on JAX, a
    persistent compilation cache of their own (unless the caller set one), so the
    memory runs load the programs that the comparison compiled instead of compiling
    them again, and their peaks leave the compiler out (the Benchmarks page,
    "`keras-mha compare`")."""
    if backend != "jax" or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="keras-mha-jax-cache-") as cache:
        yield {
            "JAX_COMPILATION_CACHE_DIR": cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }


def _model_and_memory(backend, path, imports, inputs, repeats, memory, perturb, env):
    job = {"path": os.path.abspath(path), "imports": list(imports), "seed": 0}
    job["inputs"] = None if inputs is None else os.path.abspath(inputs)
    records, code, tail = _spawn(
        backend, {"job": "model", **job, "repeats": repeats, "perturb": perturb}, env=env
    )
    if not records:
        record = dict.fromkeys(RECORD_KEYS)
        why = tail[0] if tail else f"exit status {code}"
        record.update(
            backend=backend,
            case=os.path.basename(path),
            tolerance=ATOL,
            ours_error=f"worker process failed: {why}"[:300],
            passed=False,
        )
        records = [record]
    record = records[0]
    if memory and record["ours_error"] is None:
        for which in ("builtin", "ours"):
            found, _, tail = _spawn(backend, {"job": "memory", "which": which, **job}, env=env)
            if found:
                record[f"{which}_peak_mib"] = found[0]["peak_mib"]
            elif which == "ours":
                record["ours_error"] = f"memory run failed: {tail[0] if tail else ''}"[:300]
                record["passed"] = False
            else:
                record["builtin_error"] = f"memory run failed: {tail[0] if tail else ''}"[:300]
        if record["ours_peak_mib"] and record["builtin_peak_mib"]:
            record["peak_ratio"] = record["ours_peak_mib"] / record["builtin_peak_mib"]
    return record


def run_swap(backend, in_path, out_path, imports=(), inputs=None, perturb=0.0):
    """`swap_file` in a child process on `backend`; returns its result dict.

    Raises:
        user_model.UsageError: The files, a module or the inputs cannot be used.
        RuntimeError: The child failed otherwise (its last line of stderr).
    """
    _check_backend(backend)
    spec = {
        "job": "swap",
        "in_path": os.path.abspath(in_path),
        "out_path": os.path.abspath(out_path),
        "imports": list(imports),
        "inputs": None if inputs is None else os.path.abspath(inputs),
        "perturb": perturb,
    }
    results, code, tail = _spawn(backend, spec)
    if not results:
        raise RuntimeError(f"the {backend} worker failed: {tail[0] if tail else code}")
    return results[0]


def _check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(
            "Received an invalid value for argument `backend`, expected one of "
            f"{BACKENDS}. Received: backend={backend}"
        )


def _spawn(backend, spec, on_record=None, env=None):
    """Runs `python -m keras_mha.compare SPEC` with `KERAS_BACKEND=backend` (and `env`).

    Returns `(records, exit status, [last line of stderr])`. A usage error reported by
    the child is raised here as `user_model.UsageError`.
    """
    from keras_mha.user_model import UsageError

    with tempfile.TemporaryDirectory(prefix="keras-mha-compare-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {
            **os.environ,
            "KERAS_BACKEND": backend,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONWARNINGS": "ignore",
            **(env or {}),
        }
        log_path = os.path.join(tmp, "stderr.log")
        records, usage_error = [], None
        with open(log_path, "w") as log:
            child = subprocess.Popen(
                [sys.executable, "-m", "keras_mha.compare", spec_path],
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
            )
            for line in child.stdout:
                if line.startswith(_RECORD_PREFIX):
                    record = json.loads(line[len(_RECORD_PREFIX) :])
                    records.append(record)
                    if on_record is not None:
                        on_record(record)
                elif line.startswith(_USAGE_PREFIX):
                    usage_error = line[len(_USAGE_PREFIX) :].strip()
            code = child.wait()
        with open(log_path) as log:
            tail = log.read().strip().splitlines()[-1:]
    if usage_error is not None:
        raise UsageError(usage_error)
    return records, code, tail


def summary(records):
    """Per backend: `{"cases", "passed", "failed", "builtin_failed", "passed_all"}`."""
    result = {}
    for record in records:
        entry = result.setdefault(
            record["backend"], {"cases": 0, "passed": 0, "failed": 0, "builtin_failed": 0}
        )
        entry["cases"] += 1
        entry["passed" if record["passed"] else "failed"] += 1
        entry["builtin_failed"] += record.get("builtin_error") is not None
    for entry in result.values():
        entry["passed_all"] = entry["failed"] == 0
    return result


_RECORD_PREFIX = "@@keras-mha-record "
_USAGE_PREFIX = "@@keras-mha-usage-error "


def _worker(spec_path):
    """Child process entry: runs the job of a spec file, one record per stdout line
    (a usage error: one line with its message, exit status 2)."""
    with open(spec_path) as f:
        spec = json.load(f)
    job = spec.get("job", "cases")
    if job == "cases":
        return _cases_worker(spec)
    from keras_mha.user_model import UsageError

    try:
        if job == "model":
            result = compare_model(
                spec["path"], spec["imports"], spec["inputs"], spec["repeats"], spec["perturb"]
            )
        elif job == "swap":
            result = swap_file(
                spec["in_path"],
                spec["out_path"],
                spec["imports"],
                spec["inputs"],
                perturb=spec["perturb"],
            )
        else:
            peak = peak_memory(spec["path"], spec["which"], spec["imports"], spec["inputs"])
            result = {"peak_mib": peak}
    except UsageError as error:
        print(_USAGE_PREFIX + str(error).replace("\n", " "), flush=True)
        sys.exit(2)
    print(_RECORD_PREFIX + json.dumps(result), flush=True)


def _cases_worker(spec):
    cases = [Case.from_dict(data) for data in spec["cases"]]
    for case in cases:
        try:
            record = compare_case(
                case, quick=spec["quick"], repeats=spec["repeats"], perturb=spec["perturb"]
            )
        except Exception as error:
            traceback.print_exc()
            record = dict.fromkeys(RECORD_KEYS)
            record.update(case=case.name, ours_error=_error_text(error), passed=False)
            import keras

            record["backend"] = keras.backend.backend()
        print(_RECORD_PREFIX + json.dumps(record), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1])
