"""The case engine: ours and the built-in, each in a functional model around one layer,
on synthetic inputs, on the current backend (`compare_case`), for the cases of
`DEFAULT_CASES` or any `Case`.

`compare_case` builds both models, copies the built-in's weights into ours, measures the
largest absolute difference of the outputs, of the attention scores (when the case asks
for them) and of the gradients with respect to the inputs, then times
`predict_on_batch` and `train_on_batch` for both, alternating ours and the built-in
after a warm-up, and keeps the medians.
"""

import dataclasses

import numpy as np

from keras_mha.compare.records import (
    ATOL,
    BACKENDS,
    DEFAULT_REPEATS,
    QUICK_REPEATS,
    RECORD_KEYS,
    _error_text,
    _max_abs_diff,
    _time_steps,
    within_tolerance,
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
