"""The per-backend helpers of the tests, in one place: calling a layer the fast way
(`call`: one `jax.jit` per layer on JAX), compiling a step (`compiled`), gradients
(`gradients` of a layer, `output_and_gradients` with its output from the same call,
`value_and_grads` of a function), plus a builder of (ours, built-in) layer pairs with
the same weights.

Everything here works on the tensorflow, jax and torch backends and takes / returns
NumPy arrays, so tests can compare results without knowing the backend. The float64
reference they compare with is `reference.py`.
"""

import dataclasses
import weakref

import keras
import numpy as np

import keras_mha

BACKEND = keras.backend.backend()


def make_pair(config, query_shape, value_shape=None, key_shape=None, seed=0, copy="to_ours"):
    """Builds ours and the built-in layer from one config, with identical weights.

    Args:
        config: constructor kwargs understood by both layers.
        query_shape, value_shape, key_shape: build shapes (`value_shape` defaults
            to `query_shape`).
        seed: seeds the built-in's initialisation.
        copy: "to_ours" copies the built-in's weights into ours, "to_builtin" the
            reverse (then ours is the one seeded).

    Returns:
        `(ours, builtin)`, both built.
    """
    value_shape = query_shape if value_shape is None else value_shape
    keras.utils.set_random_seed(seed)
    ours = keras_mha.MultiHeadAttention(**config)
    builtin = keras.layers.MultiHeadAttention(**config)
    for layer in (ours, builtin):
        layer.build(query_shape, value_shape, key_shape)
    source, target = (builtin, ours) if copy == "to_ours" else (ours, builtin)
    target.set_weights(source.get_weights())
    return ours, builtin


def random_inputs(rng, *shapes, dtype="float32"):
    """One standard-normal array per shape."""
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


def to_numpy(x):
    """Backend tensor (or nested tuple of them) -> NumPy."""
    if isinstance(x, (tuple, list)):
        return type(x)(to_numpy(y) for y in x)
    return np.asarray(keras.ops.convert_to_numpy(x))


# ------------------------------------------------------------------------ gradients
def gradients(layer, inputs, loss=None, **call_kwargs):
    """Gradients of `loss(layer(**inputs, **call_kwargs))` w.r.t. inputs and weights.

    Dispatches on the backend: `tf.GradientTape`, `jax.grad` over
    `layer.stateless_call`, or torch autograd.

    Args:
        layer: a built layer.
        inputs: dict of call-argument name -> NumPy float array, differentiated.
        loss: maps the layer's output (first output, if a tuple) to a scalar with
            `keras.ops`; default `sum(output ** 2) / 2`.
        **call_kwargs: other call arguments (masks, flags), not differentiated.

    Returns:
        `(loss_value, input_grads, weight_grads)`: a float, a dict like `inputs`, and a
        list in `layer.trainable_weights` order, all NumPy.
    """
    return output_and_gradients(layer, inputs, loss, **call_kwargs)[1:]


def output_and_gradients(layer, inputs, loss=None, **call_kwargs):
    """`gradients`, with the layer's output (first output, if a tuple) of the same
    call in front: `(output, loss_value, input_grads, weight_grads)`. On JAX the
    output comes out of the one compiled program that computes the gradients."""
    ops = keras.ops
    loss = loss or (lambda y: ops.sum(ops.square(y)) / 2.0)

    def first(y):
        return y[0] if isinstance(y, (tuple, list)) else y

    names = list(inputs)
    variables = layer.trainable_weights
    if BACKEND == "tensorflow":
        import tensorflow as tf

        tensors = {n: tf.constant(inputs[n]) for n in names}
        with tf.GradientTape() as tape:
            tape.watch(list(tensors.values()))
            output = first(layer(**tensors, **call_kwargs))
            value = loss(output)
        grads = tape.gradient(value, [tensors[n] for n in names] + [v.value for v in variables])
    elif BACKEND == "jax":
        import jax

        def fn(arrays, trainable):
            out, _ = layer.stateless_call(
                trainable,
                [v.value for v in layer.non_trainable_variables],
                **dict(zip(names, arrays)),
                **call_kwargs,
            )
            return loss(first(out)), first(out)

        arrays = [jax.numpy.asarray(inputs[n]) for n in names]
        # One compiled graph is much faster on CPU than op-by-op eager dispatch.
        (value, output), (g_in, g_w) = jax.jit(
            jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)
        )(arrays, [v.value for v in variables])
        grads = list(g_in) + list(g_w)
    elif BACKEND == "torch":
        tensors = {n: leaf(inputs[n]) for n in names}
        for v in variables:
            v.value.grad = None
        output = first(layer(**tensors, **call_kwargs))
        value = loss(output)
        value.backward()
        grads = [tensors[n].grad for n in names] + [v.value.grad for v in variables]
    else:  # pragma: no cover
        raise NotImplementedError(BACKEND)
    grads = [None if g is None else to_numpy(g) for g in grads]
    return (
        to_numpy(output),
        float(to_numpy(value)),
        dict(zip(names, grads[: len(names)])),
        grads[len(names) :],
    )


def value_and_grads(fn, arrays):
    """`fn(*tensors)`'s output and the gradients of `sum(output * w)` (a fixed random
    `w`) w.r.t. each array, as NumPy."""
    ops = keras.ops
    weights = None

    def loss(*tensors):
        nonlocal weights
        out = fn(*tensors)
        if weights is None:
            shape = tuple(out.shape)
            weights = np.random.default_rng(7).standard_normal(shape).astype("float32")
        return ops.sum(out * ops.convert_to_tensor(weights)), out

    if BACKEND == "tensorflow":
        import tensorflow as tf

        tensors = [tf.constant(a) for a in arrays]
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            value, out = loss(*tensors)
        grads = tape.gradient(value, tensors)
    elif BACKEND == "jax":
        import jax

        argnums = tuple(range(len(arrays)))
        # Compiled whole, as a train step runs: eager dispatch compiles every op of the
        # chunked kernel's many chunk shapes one by one (tests/run_backends.py's
        # persistent cache then shares the programs that tests repeat).
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(
            *[jax.numpy.asarray(a) for a in arrays]
        )
    else:
        tensors = [leaf(a) for a in arrays]
        value, out = loss(*tensors)
        value.backward()
        grads = [t.grad for t in tensors]
    return to_numpy(out), [to_numpy(g) for g in grads]


# ------------------------------------------------------------------ compiled calls
def compiled(fn):
    """`fn` compiled as each backend compiles a step: `jax.jit`, `tf.function` with
    XLA; torch runs it eagerly (the same code path, tensors as arguments)."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True)
    return fn


_JITTED = weakref.WeakKeyDictionary()


def call(layer, *args, **kwargs):
    """`layer(*args, **kwargs)` as NumPy. On JAX through `jax.jit` of its stateless
    call, once per layer and set of non-array arguments: one compilation instead of
    one per op keeps the JAX run as fast as the others. Array arguments are traced,
    everything else (flags, `None`) is static."""
    if BACKEND != "jax":
        return to_numpy(layer(*args, **kwargs))
    import jax

    arrays = {k: v for k, v in kwargs.items() if isinstance(v, np.ndarray)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    functions = _JITTED.setdefault(layer, {})
    signature = (len(args), tuple(sorted(arrays)), repr(sorted(static.items())))
    if signature not in functions:

        def run(variables, args, arrays):
            return layer.stateless_call(variables, [], *args, **arrays, **static)[0]

        functions[signature] = jax.jit(run)
    variables = [v.value for v in layer.trainable_variables]
    return to_numpy(functions[signature](variables, args, arrays))


def leaf(array):
    """A torch tensor that takes gradients, on Keras's device (the GPU where there is one)."""
    return keras.ops.convert_to_tensor(array).detach().requires_grad_(True)


# ------------------------------------------------------------ reference gradients
def stacked_numeric_gradient(fn, array, step=1e-6):
    """`reference.numeric_gradient(fn_one, array)` with every perturbed copy in one call:
    `fn` maps a stack `(P, *array.shape)` of arrays to their `P` float64 losses (the
    reference runs them as one batch of `P * B` rows), `fn_one` is `fn` of one copy.

    The same central differences, one NumPy pass instead of `2 * array.size`."""
    array = np.asarray(array, np.float64)
    n = array.size
    steps = (np.eye(n) * step).reshape((n,) + array.shape)
    losses = np.asarray(fn(np.concatenate([array + steps, array - steps])), np.float64)
    return ((losses[:n] - losses[n:]) / (2 * step)).reshape(array.shape)


def fingerprint(value):
    """A hashable stand-in for nested arrays, tensors, dataclasses (masks), tuples,
    dicts and scalars: equal exactly when the values are (arrays by dtype, shape and
    bytes). Keys the results a test module computes once and several tests compare with."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(fingerprint(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, fingerprint(v)) for k, v in sorted(value.items()))
    if dataclasses.is_dataclass(value):
        fields = dataclasses.fields(value)
        return (type(value).__name__,) + tuple(
            (f.name, fingerprint(getattr(value, f.name))) for f in fields
        )
    array = np.asarray(to_numpy(value))
    return (str(array.dtype), array.shape, array.tobytes())
