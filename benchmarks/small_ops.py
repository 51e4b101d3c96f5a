"""The ops each small model's step runs, ours against the built-in: a count that no
host's noise moves, beside the small-model section's timings (`run.py --only small`).

The models are `run.py`'s `SMALL` (its `_small_model` and `_small_data`), ours built where
the built-in would be, with the same weights. Per backend, for `model(x)` (predict) and for
a step that takes the gradients of the mean cross-entropy (train):
- tensorflow: the nodes of the `tf.function`'s concrete graph and its function library;
- jax: the instructions of the optimized XLA program's entry computation (a `dot` there
  is one that XLA's CPU backend runs in its Eigen dot, outside any YNNPACK fusion);
- torch: the aten ops dispatched (`TorchDispatchMode`), forward without gradients, then
  forward and backward.

Prints a markdown table per backend (one process per backend, as Keras picks its backend
once per process):

    .venv/bin/python benchmarks/small_ops.py                      # every backend
    .venv/bin/python benchmarks/small_ops.py --backends torch --types
"""

import argparse
import collections
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench  # noqa: E402  (benchmarks/run.py: the small models)


def _tensorflow_counts(model, tokens, labels):
    import keras
    import tensorflow as tf

    def count(fn, *args):
        graph = tf.function(fn).get_concrete_function(*args).graph.as_graph_def()
        nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
        return collections.Counter(node.op for node in nodes)

    def step(x, y):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, out))
        return tape.gradient(loss, model.trainable_variables)

    x, y = tf.constant(tokens), tf.constant(labels)
    return count(lambda x: model(x, training=False), x), count(step, x, y)


def _jax_counts(model, tokens, labels):
    import jax
    import keras

    trainable = [v.value for v in model.trainable_variables]
    others = [v.value for v in model.non_trainable_variables]

    def predict(trainable, x):
        return model.stateless_call(trainable, others, x, training=False)[0]

    def loss(trainable, x, y):
        out = model.stateless_call(trainable, others, x, training=True)[0]
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, out))

    def count(fn, *args):
        text = jax.jit(fn).lower(*args).compile().as_text()
        entry = text[text.index("ENTRY") :].splitlines()[1:]
        kinds = (re.search(r"= .*?\s([\w-]+)\(", line) for line in entry)
        return collections.Counter(k.group(1) for k in kinds if k)

    return count(predict, trainable, tokens), count(jax.grad(loss), trainable, tokens, labels)


def _torch_counts(model, tokens, labels):
    import keras
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    x, y = torch.as_tensor(tokens), torch.as_tensor(labels)
    model(x)  # built, so that the counts hold the calls alone
    with torch.no_grad(), Count() as predict:
        model(x, training=False)
    with Count() as train:
        out = model(x, training=True)
        keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, out)).backward()
    return predict.ops, train.ops


COUNTS = {"tensorflow": _tensorflow_counts, "jax": _jax_counts, "torch": _torch_counts}


def _differences(ours, builtin):
    kinds = sorted(set(ours) | set(builtin))
    return [f"{k} {ours[k]} / {builtin[k]}" for k in kinds if ours[k] != builtin[k]]


def worker(types):
    import keras

    backend = keras.backend.backend()
    print(f"\n{backend}: ops per call, ours / built-in\n")
    kinds = " predict: the kinds that differ | train: the kinds that differ |"
    print("| model | predict | train |" + (kinds if types else ""))
    print("|---|---|---|" + ("---|---|" if types else ""))
    for name, config in bench.SMALL.items():
        tokens, labels = bench._small_data(config)
        ours, builtin = (
            COUNTS[backend](bench._small_model(config, ours=which), tokens, labels)
            for which in (True, False)
        )
        row = f"| {name} | {ours[0].total()} / {builtin[0].total()} | "
        row += f"{ours[1].total()} / {builtin[1].total()} |"
        if types:
            row += f" {', '.join(_differences(ours[0], builtin[0]))} |"
            row += f" {', '.join(_differences(ours[1], builtin[1]))} |"
        print(row, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=list(COUNTS), choices=list(COUNTS))
    parser.add_argument("--types", action="store_true", help="list the kinds that differ")
    parser.add_argument("--worker", action="store_true", help="internal")
    args = parser.parse_args()
    if args.worker:
        return worker(args.types)
    code = 0
    for backend in args.backends:
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
        command = [sys.executable, __file__, "--worker"] + (["--types"] if args.types else [])
        code |= subprocess.run(command, env=env).returncode
    return code


if __name__ == "__main__":
    sys.exit(main())
