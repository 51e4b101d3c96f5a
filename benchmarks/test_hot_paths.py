"""pytest-benchmark harness for the hot paths (not collected by the test suite).

    KERAS_BACKEND=jax .venv/bin/pytest benchmarks/test_hot_paths.py
    KERAS_BACKEND=jax .venv/bin/pytest benchmarks/test_hot_paths.py --benchmark-compare

Each benchmark times one compiled call (`predict_on_batch` of a functional model, or
a kernel under the backend's compiler), so runs are comparable across commits.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_mha
from keras_mha import kernels

B, T, DIM, HEADS = 8, 256, 512, 8
LONG = 2048


def _compiled(fn):
    name = keras.backend.backend()
    if name == "jax":
        import jax

        jitted = jax.jit(fn)
        return lambda *a: jitted(*a).block_until_ready()
    if name == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


def _self_attention_model(layer):
    x = keras.Input(shape=(T, DIM), batch_size=B)
    return keras.Model(x, layer(x, x))


@pytest.fixture(scope="module")
def inputs():
    return np.random.default_rng(0).standard_normal((B, T, DIM)).astype("float32")


@pytest.mark.parametrize("which", ["ours", "builtin"])
def test_predict_on_batch(benchmark, inputs, which):
    cls = keras_mha.MultiHeadAttention if which == "ours" else keras.layers.MultiHeadAttention
    model = _self_attention_model(cls(num_heads=HEADS, key_dim=DIM // HEADS))
    model.predict_on_batch(inputs)
    benchmark(model.predict_on_batch, inputs)


@pytest.mark.parametrize("which", ["ours", "builtin"])
def test_train_on_batch(benchmark, inputs, which):
    cls = keras_mha.MultiHeadAttention if which == "ours" else keras.layers.MultiHeadAttention
    model = _self_attention_model(cls(num_heads=HEADS, key_dim=DIM // HEADS))
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(inputs, inputs)
    benchmark(model.train_on_batch, inputs, inputs)


@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
def test_attention_kernel(benchmark, implementation):
    rng = np.random.default_rng(0)
    q, k, v = (
        ops.convert_to_tensor(rng.standard_normal((1, LONG, 4, 64)).astype("float32"))
        for _ in range(3)
    )
    equations = ("aecd,abcd->acbe", "acbe,aecd->abcd", 1)

    def fn(q, k, v):
        return kernels.attention(
            q, k, v, scale=0.125, equations=equations, implementation=implementation
        )[0]

    fn = _compiled(fn)
    fn(q, k, v)
    benchmark(fn, q, k, v)
