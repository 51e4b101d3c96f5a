"""`keras_mha.rope`: rotary position embedding in keras-hub's rotate-half convention,
against the formula written out in `reference.py` and by its defining property."""

import numpy as np
import pytest
from helpers import compiled, to_numpy
from keras import ops
from reference import rope

from keras_mha import rope as rope_lib


@pytest.mark.parametrize("start, wavelength, scaling", [(0, 10_000.0, 1.0), (3, 100.0, 2.0)])
def test_rotate_matches_the_formula(rng, start, wavelength, scaling):
    x = rng.standard_normal((2, 6, 3, 8)).astype("float32")
    got = to_numpy(rope_lib.rotate(x, start, wavelength, scaling))
    np.testing.assert_allclose(got, rope(x, start, wavelength, scaling), atol=1e-5)


def test_start_as_a_tensor_in_a_compiled_step(rng):
    """Decoding passes the position as data: one trace serves every position."""
    x = rng.standard_normal((1, 1, 2, 4)).astype("float32")
    step = compiled(lambda x, start: rope_lib.rotate(x, start, 100.0))
    for start in (0, 5, 9):
        got = to_numpy(step(ops.convert_to_tensor(x), ops.convert_to_tensor(start, "int32")))
        np.testing.assert_allclose(got, rope(x, start, 100.0), atol=1e-5)


def test_logits_depend_on_the_distance_only(rng):
    """The same vector at every position: its rotated copies' dot products depend on
    the distance between the positions only."""
    x = rng.standard_normal((1, 1, 2, 8)).astype("float32")
    rotated = to_numpy(rope_lib.rotate(np.tile(x, (1, 6, 1, 1)), 0, 100.0))
    logits = np.einsum("btnh,bsnh->bnts", rotated, rotated)[0, 0]
    for offset in range(1, 4):
        diagonal = np.diagonal(logits, offset)
        np.testing.assert_allclose(diagonal, diagonal[0], atol=1e-4)


def test_per_token_positions_match_the_formula_at_each_position(rng):
    """`(B, T)` positions: each token rotated as if alone at its position."""
    x = rng.standard_normal((2, 5, 3, 8)).astype("float32")
    positions = np.array([[0, 1, 2, 0, 1], [4, 0, 7, 1, 2]], "int32")
    got = to_numpy(rope_lib.rotate(x, 0, 100.0, 2.0, positions=positions))
    for b, t in np.ndindex(2, 5):
        want = rope(x[b : b + 1, t : t + 1], positions[b, t], 100.0, 2.0)
        np.testing.assert_allclose(got[b : b + 1, t : t + 1], want, atol=1e-5)


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([[1, 1, 1, 2, 2, 0, 0]], [[0, 1, 2, 0, 1, 0, 1]]),
        ([[5, 5, 3, 3, 3, 3, 5]], [[0, 1, 0, 1, 2, 3, 0]]),
        ([[7] * 7, [1, 2, 3, 4, 5, 6, 7]], [list(range(7)), [0] * 7]),
    ],
    ids=["padding", "an-id-again", "one-doc-and-all-singletons"],
)
def test_segment_positions_restart_where_the_id_changes(ids, expected):
    got = to_numpy(rope_lib.segment_positions(np.asarray(ids, "int32")))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


def test_segment_positions_in_a_compiled_step():
    ids = np.array([[1, 1, 2, 2, 2, 2, 3, 0]], "int32")
    step = compiled(rope_lib.segment_positions)
    got = to_numpy(step(ops.convert_to_tensor(ids)))
    np.testing.assert_array_equal(got, [[0, 1, 0, 1, 2, 3, 0, 0]])
