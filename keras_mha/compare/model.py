"""The user's own model (`keras-mha compare --model`, `keras-mha swap`), on the current
backend: the `.keras` file loaded as it is and swapped (`keras_mha.swapping`), their
outputs, output masks and weight gradients compared on each input case (unpadded and,
where the model takes padding, padded: `user_model.padded`), then timed; `swap_file`
writes the swapped copy; `peak_memory` measures one model in a fresh process.
"""

import os

import numpy as np

from keras_mha.compare.records import (
    ATOL,
    BACKENDS,
    DEFAULT_REPEATS,
    RECORD_KEYS,
    _error_text,
    _max_abs_diff,
    _time_steps,
    within_tolerance,
)


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
        shape), `layers` (`swapping.swap_report`'s rows), `model_notes`
        (`_model_notes`: how the check ran the model, where not by its call) and
        `input_cases`
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
        model_notes=_model_notes(builtin),
    )
    from keras_mha import user_model

    record["input_cases"] = {}
    for name, case_arrays in _input_cases(builtin, specs, arrays, inputs):
        try:
            result, evidence = _compare_on(
                builtin, ours, user_model.model_inputs(builtin, case_arrays), rng
            )
        except Exception as error:
            record["ours_error"] = _error_text(error)
            record["passed"] = False
            return record
        record["builtin_error"] = record["builtin_error"] or result.pop("builtin_error")
        _judge(result, evidence, path, imports, case_arrays, builtin, ours)
        record["input_cases"][name] = result
        for key in ("max_abs_diff", "grad_max_abs_diff", "grad_scale"):
            values = [v for v in (record[key], result[key]) if v is not None]
            record[key] = max(values) if values else None
    feed = user_model.model_inputs(builtin, arrays)
    record["passed"] = all(case["passed"] for case in record["input_cases"].values())
    record["classification"] = _classifications(record["input_cases"])
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
    case: `(found, evidence)`. `found`, a dict with `max_abs_diff`,
    `grad_max_abs_diff`, `grad_scale`, `masks_match` (`None` where the built-in
    failed), `builtin_error` and `finite` (ours); `evidence`, the arrays behind them
    (`cotangents`, and `ours` and `builtin`, each `{"outputs", "grads"}`), for
    `_judge`. Ours failing raises."""
    found = dict(
        max_abs_diff=None,
        grad_max_abs_diff=None,
        grad_scale=None,
        masks_match=None,
        builtin_error=None,
    )
    try:
        reference = _predict(builtin, feed)
    except Exception as error:
        reference = None
        found["builtin_error"] = _error_text(error)
    result = _predict(ours, feed)
    cotangents = [rng.standard_normal(o.shape).astype("float32") for o in result]
    ours_grads = _weight_gradients(ours, feed, cotangents)
    if reference is not None:
        found["max_abs_diff"] = max(_max_abs_diff(a, b) for a, b in zip(result, reference))
        builtin_grads = in_our_layout(builtin, ours, _weight_gradients(builtin, feed, cotangents))
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
    evidence = {
        "cotangents": cotangents,
        "ours": {"outputs": result, "grads": ours_grads},
        "builtin": None if reference is None else {"outputs": reference, "grads": builtin_grads},
    }
    return found, evidence


def _case_passed(result):
    """Ours finite, differences within tolerance, the outputs' masks the same."""
    finite = result.pop("finite")
    return bool(finite and within_tolerance(result) and result["masks_match"] is not False)


def _judge(result, evidence, path, imports, arrays, builtin, ours):
    """Sets the case's `passed` and `classification`: a case that fails only in the
    pattern of a known defect of the built-in (`known.suspect`) is judged against the
    built-in on the other backends in turn (`workers.run_reference`, its gradients laid
    out as ours: `in_our_layout`), and passes, classified, when ours matches one of
    them and the built-in here does not (`known.classify`)."""
    import keras

    from keras_mha.compare import known

    finite = result["finite"]
    result["passed"] = _case_passed(result)
    result["classification"] = None
    if result["passed"] or not finite or evidence["builtin"] is None:
        return
    backend = keras.backend.backend()
    if not known.suspect(backend, result):
        return
    from keras_mha.compare import records, workers

    result["reference_backend"] = None
    for other in known.reference_backends(backend, records.installed_backends()):
        result["reference_backend"] = other
        reference = workers.run_reference(other, path, imports, arrays, evidence["cotangents"])
        if reference is not None:
            reference["grads"] = in_our_layout(builtin, ours, reference["grads"])
        classification = known.classify(evidence["ours"], evidence["builtin"], reference)
        if classification is not None:
            result["classification"] = classification
            result["passed"] = True
            return


def in_our_layout(builtin, ours, grads):
    """The gradients of `builtin`'s trainable weights (`grads`, in their order) laid
    out as `ours`'s (its swapped copy), in their order.

    A built-in layer swapped for ours keeps its weights' shapes and order. A keras-hub
    attention layer moved onto ours (`hub.HubAttention`) lays its weights out as its
    entry's `weights` says: reshapes, transposes and splits, which map a gradient as
    they map a weight (`HubAttention.ported`, run here on the gradients). The
    other weights pair in order.

    Raises:
        ValueError: The two models' trainable weights do not pair up (naming the
            first weight that does not).
    """
    import keras

    from keras_mha import hub, swapping

    trainable = builtin.trainable_variables
    by_variable = {id(v): g for v, g in zip(trainable, grads)}
    moved, hidden = {}, set()
    for (_, old), (_, new) in zip(
        swapping.attention_layers(builtin), swapping.attention_layers(ours)
    ):
        if not isinstance(new, hub.HubAttention) or isinstance(old, hub.HubAttention):
            continue
        hidden.update(id(v) for v in old.weights)
        saved = [(v, keras.ops.convert_to_numpy(v.value)) for v in old.trainable_weights]
        try:
            for v, value in saved:
                v.assign(by_variable.get(id(v), np.zeros_like(value)))
            moved.update((id(v), value) for v, value in new.ported(old))
        finally:
            for v, value in saved:
                v.assign(value)
    rest = iter(g for v, g in zip(trainable, grads) if id(v) not in hidden)
    laid_out = []
    for variable in ours.trainable_variables:
        found = moved.get(id(variable))
        if found is None:
            found = next(rest, None)
        if found is None or tuple(np.shape(found)) != tuple(variable.shape):
            raise ValueError(
                "the trainable weights of the two models do not pair up: "
                f"{variable.path} {tuple(variable.shape)} has no gradient of that shape "
                f"in the model as it is (next: {None if found is None else np.shape(found)})"
            )
        laid_out.append(np.asarray(found))
    if next(rest, None) is not None:
        raise ValueError(
            "the trainable weights of the two models do not pair up: the model as it is has more"
        )
    return laid_out


def _classifications(input_cases):
    """The names of the known differences found in any input case, or `None`."""
    names = sorted(
        {c["classification"]["name"] for c in input_cases.values() if c.get("classification")}
    )
    return names or None


def _output_masks(model, feed):
    """The Keras mask of each output of an eager call (what a loss reads), NumPy or
    `None`."""
    import keras

    from keras_mha.masks import get_keras_mask

    outputs = keras.tree.flatten(_call(model, feed))
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


def swap_file(in_path, out_path, imports=(), inputs=None, perturb=0.0, seed=0):
    """`keras-mha swap`: loads `in_path` as it is and swapped, compares their outputs
    and weight gradients on each input case (unpadded and, where the model takes
    padding, padded: `_input_cases`), writes the swapped model to `out_path` (see
    `swapping.save_swapped`).

    Returns:
        A dict: `backend`, `model`, `layers` (`swapping.swap_report`'s rows),
        `inputs` (name -> shape), `max_abs_diff`, `grad_max_abs_diff` (largest over
        the cases), `input_cases` (name -> its differences and `passed`),
        `tolerance`, `passed`, `classification`, `model_notes` (`_model_notes`),
        `out`.

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
        feed = user_model.model_inputs(builtin, case_arrays)
        result, evidence = _compare_on(builtin, ours, feed, rng)
        if result["builtin_error"]:
            raise RuntimeError(f"the model as it is fails: {result['builtin_error']}")
        _judge(result, evidence, in_path, imports, case_arrays, builtin, ours)
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
        "classification": _classifications(cases),
        "model_notes": _model_notes(builtin),
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


def builtin_reference(path, imports, arrays, cotangents):
    """The file's model as it is, on this backend: `{"outputs", "grads"}` on `arrays`
    (flat, as `user_model.synthesize` gives them), the gradients of
    `sum_i sum(output_i * cotangent_i)` with respect to its trainable weights (what
    `_compare_on` measures); the reference of `_judge`, run by `workers.run_reference`."""
    from keras_mha import user_model

    user_model.import_modules(imports)
    builtin = user_model.load(path)
    feed = user_model.model_inputs(builtin, list(arrays))
    outputs = _predict(builtin, feed)
    return {"outputs": outputs, "grads": _weight_gradients(builtin, feed, list(cotangents))}


def _load_pair(path, imports, inputs, seed, which=None):
    """`(builtin, ours, rows, arrays, specs)`: the file loaded as it is and swapped (only
    `which` of the two when given, the other `None`), the swap report (`None` unless
    both are loaded) and the input arrays."""
    from keras_mha import swapping, user_model

    user_model.import_modules(imports)
    builtin = None if which == "ours" else _load_eager_on_torch(path)
    ours = None if which == "builtin" else _load_eager_on_torch(path, swapped=True)
    model = builtin if builtin is not None else ours
    specs = user_model.input_specs(model, path, required=inputs is None)
    if inputs is None:
        arrays = user_model.synthesize(specs, path, seed, user_model.integer_bounds(model))
    else:
        arrays = user_model.read(inputs, specs)
        if specs is None:
            specs = [(f"input_{i}", a.shape, str(a.dtype)) for i, a in enumerate(arrays)]
    rows = None
    if builtin is not None and ours is not None:
        rows = swapping.swap_report(builtin, ours)
        if not any(row["status"] in swapping.MOVED_STATUSES for row in rows):
            raise user_model.UsageError(
                f"{path}: no keras.layers.MultiHeadAttention to swap ({swapping.describe(rows)})"
            )
    return builtin, ours, rows, arrays, specs


def _load_eager_on_torch(path, swapped=False):
    """`user_model.load`; on torch, with `jit_compile` off for this check. A file saved
    under JAX (or compiled with `jit_compile=True`) loads compiled, and its first
    predict on torch is a `torch.compile` of the whole model: about 25 s per model on
    a CPU for a check on two rows. The check runs torch eagerly, as Keras's
    `jit_compile="auto"` (and this module's timing) do there; the compile settings
    written with the swapped file are the file's own."""
    import keras

    from keras_mha import user_model

    model = user_model.load(path, swapped=swapped)
    if keras.backend.backend() == "torch":
        model.jit_compile = False
    return model


def _describe(rows):
    from keras_mha import swapping

    return swapping.describe(rows)


def _perturb(model, scale, rng):
    model.set_weights(
        [w + scale * rng.standard_normal(w.shape).astype(w.dtype) for w in model.get_weights()]
    )


def _model_notes(model):
    """One line per way the check runs the model other than by its call: `[]`, or
    `hub.task_forward`'s note, the task's class named."""
    from keras_mha import hub

    forward = hub.task_forward(model)
    return [] if forward is None else [f"{type(model).__name__}: {forward[1]}"]


def _call(model, inputs):
    """The model's outputs on `inputs`, inference mode, eagerly: its call, or for a
    keras-hub task whose call is not the function of its weights, what
    `hub.task_forward` runs in its place."""
    from keras_mha import hub

    forward = hub.task_forward(model)
    if forward is None:
        return model(inputs, training=False)
    return forward[0](model, inputs)


def _predict(model, feed):
    """`predict_on_batch`'s outputs, flat NumPy (`_call`'s, eagerly, where
    `hub.task_forward` names the model)."""
    from keras_mha import hub

    if hub.task_forward(model) is None:
        return _flat_outputs(model.predict_on_batch(feed))
    return _flat_outputs(_numpy(_call(model, feed)))


def _numpy(outputs):
    import keras

    return keras.tree.map_structure(keras.ops.convert_to_numpy, outputs)


def _flat_outputs(outputs):
    import keras

    return [np.asarray(o) for o in keras.tree.flatten(outputs)]


def _weight_gradients(model, inputs, cotangents):
    """Gradients of `sum_i sum(output_i * cotangent_i)` (float outputs, inference mode)
    with respect to the model's trainable weights, in their order, as NumPy."""
    import keras
    from keras import ops

    def loss_of(outputs, cotangents=cotangents):
        terms = [
            ops.sum(ops.multiply(ops.cast(o, "float32"), ops.convert_to_tensor(c)))
            for o, c in zip(keras.tree.flatten(outputs), cotangents)
            if "float" in str(o.dtype)
        ]
        return sum(terms[1:], terms[0])

    from keras_mha import hub

    variables = model.trainable_variables
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_of(_call(model, inputs))
        grads = tape.gradient(loss, [v.value for v in variables])
        # An embedding's gradient is `IndexedSlices`: made dense here.
        return [
            np.zeros(v.shape, "float32") if g is None else tf.convert_to_tensor(g).numpy()
            for v, g in zip(variables, grads)
        ]
    if backend == "jax":
        import jax

        non_trainable = [v.value for v in model.non_trainable_variables]

        def objective(trainable, inputs, cotangents):
            if hub.task_forward(model) is None:
                outputs, _ = model.stateless_call(trainable, non_trainable, inputs, training=False)
            else:
                mapping = [*zip(variables, trainable)]
                mapping += zip(model.non_trainable_variables, non_trainable)
                with keras.StatelessScope(state_mapping=mapping):
                    outputs = _call(model, inputs)
            return loss_of(outputs, cotangents)

        # Compiled: one program per model and input shape (the padded case reuses it)
        # instead of every eager op compiled on its own. A model that does not trace
        # (its code reads its tensors' values: Keras then raises whatever the
        # rewrapped JAX error becomes) runs eagerly, where a genuine error raises
        # again (`keras-mha swap` on JAX: the Benchmarks page, "Test-suite times").
        gradient, args = jax.grad(objective), ([v.value for v in variables], inputs, cotangents)
        try:
            grads = jax.jit(gradient)(*args)
        except Exception:
            grads = gradient(*args)
        return [np.asarray(g) for g in grads]
    if backend == "torch":
        for v in variables:
            v.value.grad = None
        loss_of(_call(model, inputs)).backward()
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
