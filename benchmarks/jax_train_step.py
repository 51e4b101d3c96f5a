"""JAX: the compiled train step alone of each small model, ours against the built-in,
with the kernel policy as it is and with some of its fields at their defaults
(`policy.overriding`, while ours is traced).

The models are `run.py`'s `SMALL` (its `_small_model` and `_small_data`), with the same
weights. Each model's `train_step` is compiled once (`jax.jit(...).lower(...).compile()`)
and called on the same state and batch, so the times hold XLA's program and its dispatch,
not Keras's `train_on_batch` around it. The variants alternate call by call, in one
process (the same phase of the host), each timed call after one untimed call of its own;
medians in microseconds:

    .venv/bin/python benchmarks/jax_train_step.py --without unit_axis_products --calls 800
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench  # noqa: E402  (benchmarks/run.py: the small models)


def _compiled_step(model, tokens, labels):
    import jax

    model.train_on_batch(tokens, labels)  # builds the optimizer's variables
    state = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables,
        model.metrics_variables,
    )
    state = jax.tree.map(lambda v: v.value, state)
    compiled = jax.jit(model.train_step).lower(state, (tokens, labels)).compile()
    return lambda: jax.block_until_ready(compiled(state, (tokens, labels)))


def _variants(config, without):
    """`{label: step}`: ours under the policy as it is, ours with each field of
    `without` at its default (traced under that policy), and the built-in."""
    from keras_mha.kernels import policy

    tokens, labels = bench._small_data(config)
    ours = bench._small_model(config, ours=True)
    steps = {"ours": _compiled_step(ours, tokens, labels)}
    for field in without:
        default = policy.Policy.__dataclass_fields__[field].default
        with policy.overriding(**{field: default}):
            model = bench._small_model(config, ours=True)
            model.set_weights(ours.get_weights())
            steps[f"ours without {field}"] = _compiled_step(model, tokens, labels)
    builtin = bench._small_model(config, ours=False)
    builtin.set_weights(ours.get_weights())
    steps["built-in"] = _compiled_step(builtin, tokens, labels)
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--without", nargs="*", default=[], help="Policy fields to default")
    parser.add_argument("--calls", type=int, default=800)
    parser.add_argument("--models", nargs="*", default=list(bench.SMALL))
    args = parser.parse_args()
    for name in args.models:
        steps = _variants(bench.SMALL[name], args.without)
        times = {label: [] for label in steps}
        for i in range(args.calls):
            order = list(steps.items())
            for label, step in order[::-1] if i % 2 else order:
                step()
                start = time.perf_counter()
                step()
                times[label].append(time.perf_counter() - start)
        medians = {label: statistics.median(t) * 1e6 for label, t in times.items()}
        builtin = medians["built-in"]
        cells = [f"{label} {us:.1f} us ({us / builtin:.3f}x)" for label, us in medians.items()]
        print(f"{name}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
