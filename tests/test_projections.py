"""`keras_mha.projections`: `Projection` is `EinsumDense` (same weights, same results),
and `add_bias` adds a bias right on every backend, in place only where nothing needs
the product afterwards."""

import keras
import numpy as np
import pytest
from helpers import BACKEND, to_numpy
from keras import ops

from keras_mha import _keras_private, projections
from keras_mha.kernels import policy


def test_projection_equals_einsum_dense(rng):
    kwargs = dict(equation="abc,cde->abde", output_shape=(None, 2, 3), bias_axes="de")
    ours, theirs = projections.Projection(**kwargs), keras.layers.EinsumDense(**kwargs)
    x = rng.standard_normal((2, 5, 4)).astype("float32")
    ours.build(x.shape), theirs.build(x.shape)
    weights = [rng.standard_normal(w.shape).astype("float32") for w in theirs.weights]
    ours.set_weights(weights), theirs.set_weights(weights)
    assert [w.path.split("/")[-1] for w in ours.weights] == ["kernel", "bias"]
    np.testing.assert_allclose(to_numpy(ours(x)), to_numpy(theirs(x)), atol=1e-6)


@pytest.mark.parametrize("shape, bias_shape", [((1, 2, 2, 1), (2, 1)), ((2, 3, 4, 5), (4, 5))])
def test_add_bias_broadcasts_over_the_leading_axes(rng, shape, bias_shape):
    """`(N, 1)` with T == N: TensorFlow's `bias_add` would put it on the sequence axis."""
    x = rng.standard_normal(shape).astype("float32")
    bias = rng.standard_normal(bias_shape).astype("float32")
    got = projections.add_bias(ops.convert_to_tensor(x), ops.convert_to_tensor(bias))
    np.testing.assert_allclose(to_numpy(got), x + bias, atol=1e-6)


@pytest.mark.skipif(BACKEND != "torch", reason="only torch's policy adds in place")
def test_in_place_only_where_no_gradient_flows(rng):
    import torch

    bias = torch.tensor(rng.standard_normal((4, 5)).astype("float32"))
    fresh = torch.tensor(rng.standard_normal((2, 3, 4, 5)).astype("float32"))
    assert projections.add_bias(fresh, bias) is fresh  # inference: into the fresh product
    tracked = torch.tensor(rng.standard_normal((2, 3, 4, 5)).astype("float32"))
    tracked.requires_grad_(True)
    before = tracked.detach().clone()
    out = projections.add_bias(tracked, bias)
    assert out is not tracked and torch.equal(tracked.detach(), before)


# ---------------------------------------------------------------- direct calls
# Eager torch skips Keras's `Layer.__call__` around a projection where it would only
# run `call` (`Policy.direct_projections`); every other backend keeps it. The tests
# put the policy's switch on, so the rule is checked on every backend.


@pytest.fixture
def keras_calls(monkeypatch):
    """The projections that went through Keras's `Layer.__call__`, call by call."""
    seen = []
    original = keras.layers.Layer.__call__

    def counting(self, *args, **kwargs):
        if isinstance(self, projections.Projection):
            seen.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(keras.layers.Layer, "__call__", counting)
    return seen


def _pair(rng, dtype="float32", call=True, **kwargs):
    """A `Projection` and an `EinsumDense` with the same weights, each called once
    (built, and its first call through Keras) unless `call` is False."""
    args = dict(equation="abc,cde->abde", output_shape=(None, 2, 3), bias_axes="de")
    ours = projections.Projection(**args, dtype=dtype, **kwargs)
    theirs = keras.layers.EinsumDense(**args, dtype=dtype, **kwargs)
    ours.build((2, 5, 4)), theirs.build((2, 5, 4))
    theirs.set_weights(ours.get_weights())
    if call:
        x = np.ones((2, 5, 4), "float32")
        ours(x), theirs(x)
    return ours, theirs


def _input(rng, dtype="float32"):
    return ops.convert_to_tensor(rng.standard_normal((2, 5, 4)).astype(dtype))


@pytest.mark.parametrize("switch", [True, False], ids=["policy on", "policy off"])
def test_a_plain_call_runs_call_alone_where_the_policy_says(rng, keras_calls, switch):
    ours, theirs = _pair(rng)
    x = _input(rng)
    keras_calls.clear()
    with policy.overriding(direct_projections=switch):
        got = ours(x)
    assert keras_calls == ([] if switch else [ours.name])
    np.testing.assert_array_equal(to_numpy(got), to_numpy(theirs(x)))


class _Outer(keras.layers.Layer):
    """A mixed_float16 layer calling `inner` and `theirs` on its input (cast to
    float16 by its `__call__`) or on `given` as it is: its `__call__` opens the
    float16 autocast scope they run in."""

    def __init__(self, inner, theirs, given=None):
        super().__init__(dtype="mixed_float16")
        self.inner, self.theirs, self.given = inner, theirs, given

    def call(self, x):
        x = x if self.given is None else self.given
        return self.inner(x), self.theirs(x)


def test_the_callers_autocast_scope_is_kept(rng, keras_calls):
    """Mixed precision inside a layer whose `__call__` opened the compute dtype's
    scope (the attention layer's, for its projections): `call` alone reads the
    variables cast, as Keras's `__call__` would have left them."""
    ours, theirs = _pair(rng, dtype="mixed_float16")
    outer = _Outer(ours, theirs)
    x = _input(rng)
    outer(x)
    keras_calls.clear()
    with policy.overriding(direct_projections=True):
        got, want = outer(x)
    assert keras_calls == []
    assert keras.backend.standardize_dtype(got.dtype) == "float16"
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


def _quantize(ours, theirs, x):
    ours.quantize("int8"), theirs.quantize("int8")
    return x


def _mask(ours, theirs, x):
    _keras_private.set_keras_mask(x, ops.ones(x.shape[:2], "bool"))
    return x


def _float16(ours, theirs, x):
    return ops.cast(x, "float16")


def _distribute(ours, theirs, x, monkeypatch):
    monkeypatch.setattr(keras.distribution, "distribution", lambda: object())
    return x


CASES = {
    "first call": (dict(call=False), None),
    "quantized": (dict(), _quantize),
    "activity regularizer": (dict(activity_regularizer="l2"), None),
    "a Keras mask on the input": (dict(), _mask),
    "an input of another dtype": (dict(), _float16),
    "mixed precision, no autocast scope": (dict(dtype="mixed_float16"), _float16),
    "keras.distribution in force": (dict(), _distribute),
}


@pytest.mark.parametrize("case", list(CASES))
def test_keras_call_runs_where_it_does_more(rng, keras_calls, monkeypatch, case):
    """Each thing `Layer.__call__` would do keeps the call in it; the results stay
    `EinsumDense`'s."""
    kwargs, prepare = CASES[case]
    ours, theirs = _pair(rng, **kwargs)
    x = _input(rng)
    if prepare is _distribute:
        want = theirs(x)
        x = prepare(ours, theirs, x, monkeypatch)
    elif prepare is not None:
        x = prepare(ours, theirs, x)
    if prepare is not _distribute:
        want = theirs(x)
    keras_calls.clear()
    with policy.overriding(direct_projections=True):
        got = ours(x)
    assert keras_calls == [ours.name]
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


def test_a_float32_layer_in_a_float16_scope_goes_through_keras(rng, keras_calls):
    """Inside another layer's float16 autocast scope, Keras's `__call__` clears the
    scope for a float32 layer: its variables stay float32."""
    ours, theirs = _pair(rng)
    outer = _Outer(ours, theirs, given=_input(rng))  # float32, as the layer takes
    x = _input(rng)
    outer(x)
    keras_calls.clear()
    with policy.overriding(direct_projections=True):
        got, want = outer(x)
    assert keras_calls == [ours.name]
    assert keras.backend.standardize_dtype(got.dtype) == "float32"
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


def test_a_rematerialized_projection_goes_through_keras(rng, keras_calls):
    with keras.RematScope(mode="full"):
        ours, theirs = _pair(rng)
    x = _input(rng)
    keras_calls.clear()
    with policy.overriding(direct_projections=True):
        got = ours(x)
    assert keras_calls == [ours.name]
    np.testing.assert_allclose(to_numpy(got), to_numpy(theirs(x)), atol=1e-6)


def test_a_wrong_rank_gets_keras_error(rng):
    ours, _ = _pair(rng)
    with policy.overriding(direct_projections=True):
        with pytest.raises(ValueError, match="expected ndim=3"):
            ours(ops.ones((2, 5, 4, 1)))


def test_a_symbolic_call_builds_keras_node(rng, keras_calls):
    ours, _ = _pair(rng)
    keras_calls.clear()
    with policy.overriding(direct_projections=True):
        out = ours(keras.Input((5, 4)))
    assert keras_calls == [ours.name]
    assert out._keras_history.operation is ours


def test_the_layer_runs_its_projections_directly_after_its_first_call(rng, keras_calls):
    """Through `MultiHeadAttention` (mixed precision too: the layer's own `__call__`
    opened the scope its projections keep), with the switch on: none of the four
    projections enters Keras's `__call__` after the first call."""
    import keras_mha

    x = _input(rng)
    for dtype in ("float32", "mixed_bfloat16"):
        layer = keras_mha.MultiHeadAttention(2, 3, dtype=dtype)
        with policy.overriding(direct_projections=True):
            first = layer(x, x)
            keras_calls.clear()
            again = layer(x, x)
        assert keras_calls == [], dtype
        np.testing.assert_array_equal(to_numpy(first), to_numpy(again))
