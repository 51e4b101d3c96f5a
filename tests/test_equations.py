"""`keras_mha.equations`: the einsum equations of the projections and of N-d attention,
checked by evaluating them with NumPy against loops over the axes they name. Pure
Python, so run once (`once`), not per backend."""

import itertools

import numpy as np
import pytest

from keras_mha import equations

pytestmark = pytest.mark.once


@pytest.mark.parametrize(
    "free, bound, out, expected",
    [
        (2, 1, 2, ("abc,cde->abde", "de", 4)),  # (B, T, dim) -> (B, T, N, H)
        (3, 1, 2, ("abcd,def->abcef", "ef", 5)),  # (B, X, Y, dim) -> (B, X, Y, N, H)
        (2, 2, 1, ("abcd,cde->abe", "e", 3)),  # output: (B, T, N, H) -> (B, T, dim)
    ],
)
def test_projection_equation(free, bound, out, expected):
    assert equations.projection_equation(free, bound, out) == expected


def test_projection_equation_contracts_the_bound_axes(rng):
    equation, _, rank = equations.projection_equation(2, 2, 1)
    x, kernel = rng.normal(size=(2, 3, 4, 5)), rng.normal(size=(4, 5, 6))
    out = np.einsum(equation, x, kernel)
    assert out.ndim == rank
    np.testing.assert_allclose(out, np.tensordot(x, kernel, axes=2))


def test_projection_output_shape():
    # EinsumDense's `output_shape` leaves out the batch axis.
    assert equations.projection_output_shape(4, [8, 64]) == [None, 8, 64]
    assert equations.projection_output_shape(3, [512]) == [None, 512]


@pytest.mark.parametrize(
    "axes, rank, expected",
    [(None, 4, (1,)), (None, 5, (1, 2)), ((2,), 5, (2,)), ((-2,), 5, (2,)), ((-3, -2), 5, (1, 2))],
)
def test_normalize_attention_axes(axes, rank, expected):
    # Negative axes count from the end of the input (features last), like the built-in.
    assert equations.normalize_attention_axes(axes, rank) == expected


@pytest.mark.parametrize(
    "query_shape, key_shape, axes",
    [
        ((2, 3, 2, 4), (2, 5, 2, 4), (1,)),  # 1-d attention, T=3 S=5
        ((2, 3, 4, 2, 3), (2, 5, 4, 2, 3), (1,)),  # free axis 2
        ((2, 3, 4, 2, 3), (2, 3, 6, 2, 3), (2,)),  # free axis 1
        ((2, 3, 4, 2, 3), (2, 2, 5, 2, 3), (1, 2)),  # 2-d attention
    ],
)
def test_attention_equations_match_loops(rng, query_shape, key_shape, axes):
    rank = len(query_shape)
    dot, combine, scores_rank = equations.attention_equations(rank, axes)
    query, key = rng.normal(size=query_shape), rng.normal(size=key_shape)
    value = rng.normal(size=key_shape)
    scores = np.einsum(dot, key, query)
    expected_shape = equations.scores_shape(query_shape, key_shape, axes)
    assert scores.shape == expected_shape and scores.ndim == scores_rank

    batch = equations.score_batch_axes(rank, axes)
    assert batch == tuple(i for i in range(rank - 1) if i not in axes)  # heads included
    # Every score is the dot product of one query row with one key row over H.
    n_batch, n_att = len(batch), len(axes)
    for index in itertools.product(*map(range, expected_shape)):
        b, t, s = index[:n_batch], index[n_batch : n_batch + n_att], index[n_batch + n_att :]
        q_index, k_index = [None] * (rank - 1), [None] * (rank - 1)
        for axis, i in zip(batch, b):
            q_index[axis] = k_index[axis] = i
        for axis, i, j in zip(axes, t, s):
            q_index[axis], k_index[axis] = i, j
        expected = query[tuple(q_index)] @ key[tuple(k_index)]
        np.testing.assert_allclose(scores[index], expected)

    # The combination sums the scores against the values over the key positions.
    context = np.einsum(combine, scores, value)
    assert context.shape == query_shape[:-1] + key_shape[-1:]
    flat = scores.reshape(scores.shape[: n_batch + n_att] + (-1,))
    moved = np.moveaxis(value, [*batch, *axes], range(n_batch + n_att))
    moved = moved.reshape(moved.shape[:n_batch] + (-1, value.shape[-1]))
    expected = np.einsum(
        "...ts,...sh->...th", flat.reshape(flat.shape[:n_batch] + (-1,) + flat.shape[-1:]), moved
    )
    expected = expected.reshape(tuple(query_shape[i] for i in (*batch, *axes)) + (value.shape[-1],))
    np.testing.assert_allclose(
        np.moveaxis(context, [*batch, *axes], range(n_batch + n_att)), expected
    )
