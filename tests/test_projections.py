"""`keras_mha.projections`: `Projection` is `EinsumDense` (same weights, same results),
and `add_bias` adds a bias right on every backend, in place only where nothing needs
the product afterwards."""

import keras
import numpy as np
import pytest
from helpers import BACKEND, to_numpy
from keras import ops

from keras_mha import projections


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
