"""The five places where ours is right and `keras.layers.MultiHeadAttention` is not.

1. Symbolic score shapes equal the eager ones (also with `attention_axes`).
2. `value_dim != key_dim` works on every backend (the built-in crashes on JAX).
3. `return_attention_scores` is accepted by the constructor, serialised, overridable.
4. `flash_attention=True` with scores requested returns the scores.
5. Fully-masked query rows: zero weights, output = output bias, finite outputs and
   gradients, on every implementation, the same with or without scores.

Where a test mentions the built-in's behaviour it only documents it: a Keras that
fixes the built-in does not fail these tests.
"""

import keras
import numpy as np
import pytest
from helpers import gradients, random_inputs, to_numpy
from reference import reference_mha

import keras_mha

ATOL = 1e-5


# ------------------------------------------------------------ 1. symbolic score shape
@pytest.mark.parametrize(
    "query_shape, value_shape, axes, scores_shape",
    [
        ((6, 8), (10, 8), None, (2, 6, 10)),
        ((6, 8), (10, 5), None, (2, 6, 10)),
        ((3, 4, 8), (3, 5, 8), (2,), (3, 2, 4, 5)),
        ((3, 4, 8), (3, 5, 8), (-2,), (3, 2, 4, 5)),
        ((3, 4, 8), (2, 5, 8), (1, 2), (2, 3, 4, 2, 5)),
    ],
    ids=["cross", "cross_dim_v", "rank4_axis2", "rank4_axis_neg2", "rank4_axes_1_2"],
)
def test_symbolic_scores_shape_equals_eager(query_shape, value_shape, axes, scores_shape, rng):
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=axes)
    query, value = keras.Input(query_shape), keras.Input(value_shape)
    output, scores = layer(query, value, return_attention_scores=True)
    assert tuple(scores.shape) == (None,) + scores_shape
    assert tuple(output.shape) == (None,) + query_shape
    model = keras.Model([query, value], [output, scores])
    assert tuple(model.outputs[1].shape) == (None,) + scores_shape

    q, v = random_inputs(rng, (3,) + query_shape, (3,) + value_shape)
    eager_output, eager_scores = to_numpy(model([q, v]))
    assert eager_scores.shape == (3,) + scores_shape
    assert eager_output.shape == (3,) + query_shape
    direct_output, direct_scores = to_numpy(layer(q, v, return_attention_scores=True))
    np.testing.assert_allclose(direct_scores, eager_scores, atol=ATOL)
    spec_output, spec_scores = layer.compute_output_spec(
        keras.KerasTensor((3,) + query_shape),
        keras.KerasTensor((3,) + value_shape),
        return_attention_scores=True,
    )
    assert tuple(spec_scores.shape) == eager_scores.shape
    assert tuple(spec_output.shape) == eager_output.shape


def test_symbolic_scores_with_separate_key_and_constructor_default():
    layer = keras_mha.MultiHeadAttention(num_heads=3, key_dim=2, return_attention_scores=True)
    output, scores = layer(keras.Input((6, 8)), keras.Input((10, 4)), key=keras.Input((10, 5)))
    assert tuple(scores.shape) == (None, 3, 6, 10)
    assert tuple(output.shape) == (None, 6, 8)


# -------------------------------------------------------------- 2. value_dim != key_dim
@pytest.mark.parametrize(
    "num_heads, key_dim, value_dim, shape",
    [(4, 8, 3, (2, 16, 32)), (8, 64, 32, (2, 16, 512))],
    ids=["small", "issue_sizes"],
)
def test_value_dim_differs_from_key_dim(num_heads, key_dim, value_dim, shape, rng):
    (x,) = random_inputs(rng, shape)
    keras.utils.set_random_seed(0)
    layer = keras_mha.MultiHeadAttention(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim)
    out = to_numpy(layer(x, x))
    assert out.shape == shape
    assert layer.value_dense.kernel.shape == (shape[-1], num_heads, value_dim)
    assert layer.output_dense.kernel.shape == (num_heads, value_dim, shape[-1])
    ref, _ = reference_mha(layer, x, x)
    np.testing.assert_allclose(out, ref, atol=1e-4)
    # And the causal path, which runs yet another kernel on some backends.
    out = to_numpy(layer(x, x, use_causal_mask=True))
    ref, _ = reference_mha(layer, x, x, use_causal_mask=True)
    np.testing.assert_allclose(out, ref, atol=1e-4)


# ------------------------------------------------- 3. return_attention_scores in config
def test_return_attention_scores_in_constructor(rng):
    q, v = random_inputs(rng, (2, 5, 8), (2, 7, 8))
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, return_attention_scores=True)
    result = layer(q, v)
    assert isinstance(result, tuple) and len(result) == 2
    output, scores = to_numpy(result)
    assert scores.shape == (2, 2, 5, 7)
    assert layer.get_config()["return_attention_scores"] is True

    # A call argument overrides the default, both ways.
    alone = to_numpy(layer(q, v, return_attention_scores=False))
    assert not isinstance(alone, tuple)
    np.testing.assert_allclose(alone, output, atol=ATOL)
    plain = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
    plain.build(q.shape, v.shape)
    plain.set_weights(layer.get_weights())
    assert not isinstance(plain(q, v), tuple)
    _, plain_scores = to_numpy(plain(q, v, return_attention_scores=True))
    np.testing.assert_allclose(plain_scores, scores, atol=ATOL)

    # Serialised: a clone from the config returns scores too.
    clone = keras_mha.MultiHeadAttention.from_config(layer.get_config())
    clone.build(q.shape, v.shape)
    clone.set_weights(layer.get_weights())
    clone_output, clone_scores = to_numpy(clone(q, v))
    np.testing.assert_allclose(clone_output, output, atol=ATOL)
    np.testing.assert_allclose(clone_scores, scores, atol=ATOL)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert restored.get_config()["return_attention_scores"] is True


def test_builtin_rejects_return_attention_scores_in_constructor():
    """Documents the built-in's behaviour that fix 3 addresses (if it still has it)."""
    try:
        keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, return_attention_scores=True)
    except (TypeError, ValueError) as error:
        assert "return_attention_scores" in str(error)


def test_return_attention_scores_rejects_non_boolean():
    with pytest.raises(ValueError, match="return_attention_scores"):
        keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, return_attention_scores="yes")


# ------------------------------------------------------------- 4. flash + scores
def test_flash_attention_with_scores_returns_scores(rng):
    q, v = random_inputs(rng, (2, 5, 8), (2, 7, 8))
    mask = keras.ops.convert_to_tensor(rng.random((2, 5, 7)) > 0.3)
    flash = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, flash_attention=True)
    output, scores = to_numpy(flash(q, v, attention_mask=mask, return_attention_scores=True))
    assert scores.shape == (2, 2, 5, 7)
    assert flash.get_config()["flash_attention"] is True
    reference = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, flash_attention=False)
    reference.build(q.shape, v.shape)
    reference.set_weights(flash.get_weights())
    ref_output, ref_scores = to_numpy(
        reference(q, v, attention_mask=mask, return_attention_scores=True)
    )
    np.testing.assert_allclose(scores, ref_scores, atol=ATOL)
    np.testing.assert_allclose(output, ref_output, atol=ATOL)
    np_output, np_scores = reference_mha(flash, q, v, mask=to_numpy(mask))
    np.testing.assert_allclose(scores, np_scores, atol=ATOL)
    np.testing.assert_allclose(output, np_output, atol=ATOL)

    # Also with the constructor default asking for scores.
    layer = keras_mha.MultiHeadAttention(
        num_heads=2, key_dim=4, flash_attention=True, return_attention_scores=True
    )
    _, scores = to_numpy(layer(q, v))
    assert scores.shape == (2, 2, 5, 7)


def test_builtin_flash_with_scores_raises(rng):
    """Documents the built-in's behaviour that fix 4 addresses (if it still has it)."""
    q, v = random_inputs(rng, (2, 5, 8), (2, 7, 8))
    builtin = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, flash_attention=True)
    try:
        builtin(q, v, return_attention_scores=True)
    except ValueError as error:
        assert "flash attention" in str(error).lower()


# -------------------------------------------------------- 5. fully-masked query rows
def _masked_setup(rng):
    q, v = random_inputs(rng, (2, 5, 8), (2, 7, 6))
    mask = rng.random((2, 5, 7)) > 0.3
    mask[:, :, 0] = True
    mask[0, 1] = False  # row (0, 1) has no key
    mask[1, 4] = False  # row (1, 4) has no key
    return q, v, mask


def _layer_with_bias(implementation, q, v, rng):
    keras.utils.set_random_seed(1)
    layer = keras_mha.MultiHeadAttention(
        num_heads=2, key_dim=4, implementation=implementation, chunk_size=3
    )
    layer.build(q.shape, v.shape)
    weights = [w + rng.standard_normal(w.shape).astype(w.dtype) * 0.1 for w in layer.get_weights()]
    layer.set_weights(weights)  # non-zero biases, output bias included
    return layer


@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
def test_fully_masked_rows(implementation, rng):
    q, v, mask = _masked_setup(rng)
    layer = _layer_with_bias(implementation, q, v, rng)
    mask_tensor = keras.ops.convert_to_tensor(mask)
    plain = to_numpy(layer(q, v, attention_mask=mask_tensor))
    output, scores = to_numpy(layer(q, v, attention_mask=mask_tensor, return_attention_scores=True))
    bias = to_numpy(layer.output_dense.bias)

    assert np.isfinite(plain).all() and np.isfinite(output).all()
    np.testing.assert_allclose(plain, output, atol=ATOL)
    np.testing.assert_array_equal(scores[0, :, 1], 0.0)
    np.testing.assert_array_equal(scores[1, :, 4], 0.0)
    for row in (plain[0, 1], plain[1, 4]):
        np.testing.assert_allclose(row, bias, atol=1e-6)
    ref, _ = reference_mha(layer, q, v, mask=mask)
    np.testing.assert_allclose(plain, ref, atol=ATOL)

    loss, input_grads, weight_grads = gradients(
        layer, {"query": q, "value": v}, attention_mask=mask_tensor
    )
    assert np.isfinite(loss)
    for grad in list(input_grads.values()) + weight_grads:
        assert grad is not None and np.isfinite(grad).all()
    # The masked query rows influence nothing but the output bias.
    np.testing.assert_array_equal(input_grads["query"][0, 1], 0.0)


@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
def test_fully_masked_rows_from_implicit_masks_and_causal(implementation, rng):
    """A padded query row (implicit mask), and a causal row with padded keys."""
    q, v = random_inputs(rng, (2, 5, 8), (2, 5, 8))
    q[0, -2:] = 0.0  # query padding
    v[1, :2] = 0.0  # the first keys padded: causal row 0 and 1 of batch 1 see nothing
    layer = _layer_with_bias(implementation, q, v, rng)
    query_input, value_input = keras.Input((5, 8)), keras.Input((5, 8))
    masking = keras.layers.Masking(0.0)
    outputs = layer(masking(query_input), masking(value_input), use_causal_mask=True)
    model = keras.Model([query_input, value_input], outputs)
    out = to_numpy(model([q, v]))
    bias = to_numpy(layer.output_dense.bias)
    assert np.isfinite(out).all()
    for row in (out[0, 3], out[0, 4], out[1, 0], out[1, 1]):
        np.testing.assert_allclose(row, bias, atol=1e-6)
    merged = (np.abs(q).sum(-1) > 0)[:, :, None] & (np.abs(v).sum(-1) > 0)[:, None, :]
    ref, _ = reference_mha(layer, q, v, mask=merged, use_causal_mask=True)
    np.testing.assert_allclose(out, ref, atol=ATOL)


def test_fully_masked_rows_every_implementation_agrees(rng):
    q, v, mask = _masked_setup(rng)
    mask_tensor = keras.ops.convert_to_tensor(mask)
    results = []
    for implementation in ("explicit", "fused", "chunked", None):
        layer = _layer_with_bias(implementation, q, v, np.random.default_rng(5))
        results.append(to_numpy(layer(q, v, attention_mask=mask_tensor)))
    for other in results[1:]:
        np.testing.assert_allclose(other, results[0], atol=ATOL)


def test_builtin_scores_path_agrees_with_ours_on_masked_rows(rng):
    """Ours equals the built-in's explicit (scores) path, whose weights are zero."""
    q, v, mask = _masked_setup(rng)
    ours = _layer_with_bias(None, q, v, rng)
    builtin = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    builtin.build(q.shape, v.shape)
    builtin.set_weights(ours.get_weights())
    mask_tensor = keras.ops.convert_to_tensor(mask)
    expected, expected_scores = to_numpy(
        builtin(q, v, attention_mask=mask_tensor, return_attention_scores=True)
    )
    output = to_numpy(ours(q, v, attention_mask=mask_tensor))
    np.testing.assert_allclose(output, expected, atol=ATOL)
    # The built-in's fused path (no scores) may answer differently on those rows:
    # that is the bug; on the other rows it must agree.
    fused = to_numpy(builtin(q, v, attention_mask=mask_tensor))
    rows = mask.any(-1)
    np.testing.assert_allclose(fused[rows], output[rows], atol=ATOL)


# ------------------------- 5b. fully_masked_rows="builtin": the built-in's answer, path by path
def _builtin_pair(rng, q, v, implementation=None, **config):
    ours = _layer_with_bias(implementation, q, v, rng)
    ours = keras_mha.MultiHeadAttention.from_config(
        {**ours.get_config(), **config, "fully_masked_rows": "builtin"}
    )
    ours.build(q.shape, v.shape)
    builtin = keras.layers.MultiHeadAttention(
        num_heads=2, key_dim=4, dropout=config.get("dropout", 0.0)
    )
    builtin.build(q.shape, v.shape)
    weights = [w + rng.standard_normal(w.shape).astype(w.dtype) * 0.1 for w in ours.get_weights()]
    ours.set_weights(weights)
    builtin.set_weights(weights)
    return ours, builtin


def _padded_masks(rng):
    """A query-padding Keras-style mask and a key padding hiding all of batch 1's keys."""
    q, v = random_inputs(rng, (2, 5, 8), (2, 7, 8))
    query_valid = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    key_valid = np.array([[1, 1, 1, 1, 1, 0, 0], [0] * 7], bool)
    return q, v, query_valid, key_valid


@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
def test_fully_masked_rows_builtin_mode_matches_builtins_default_path(implementation, rng):
    """No dropout, no scores: the built-in runs `ops.dot_product_attention`, which gives
    a row with no visible key uniform weights (the values' mean; zero weights on torch
    with a CUDA GPU); so does ours."""
    q, v, query_valid, key_valid = _padded_masks(rng)
    ours, builtin = _builtin_pair(rng, q, v, implementation)
    mask = query_valid[:, :, None] & key_valid[:, None, :]
    expected = to_numpy(builtin(q, v, attention_mask=mask))
    got = to_numpy(ours(q, v, query_mask=query_valid, value_mask=key_valid))
    np.testing.assert_allclose(got, expected, atol=ATOL)
    # The mean, not the zero rows of difference 5, where the kernel gives the mean: the
    # check can fail.
    bias = to_numpy(ours.output_dense.bias)
    gives_mean = keras_mha.kernels.fused_gives_mean(keras.ops.convert_to_tensor(q))
    assert (np.abs(got[1, 0] - bias).max() > 1e-3) == gives_mean
    # Gradients agree too (the mean passes them to every value, 1 / S each). On torch
    # the built-in's additive float mask leaves those rows uniform only by rounding, and
    # its backward differs there: its gradients are compared through the other rows.
    seen = mask.any(-1)[:, :, None].astype("float32")
    losses = [None]
    if keras.backend.backend() == "torch":
        losses = [lambda y: keras.ops.sum(keras.ops.square(keras.ops.multiply(y, seen))) / 2.0]
    for loss in losses:
        _, ours_grads, _ = gradients(ours, {"query": q, "value": v}, loss, attention_mask=mask)
        _, expected, _ = gradients(builtin, {"query": q, "value": v}, loss, attention_mask=mask)
        for name in ("query", "value"):
            np.testing.assert_allclose(ours_grads[name], expected[name], atol=1e-4)


@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
def test_fully_masked_rows_builtin_mode_with_causal_and_window(implementation, rng):
    """Rows that see no key because causality or a window leaves only padded keys."""
    q, v = random_inputs(rng, (2, 6, 8), (2, 6, 8))
    key_valid = np.ones((2, 6), bool)
    key_valid[0, :3] = False  # left padding: causal rows 0-2 of batch 0 see nothing
    key_valid[1, 2:] = False  # with a window of 2, rows 4-5 of batch 1 see nothing
    for window, causal in ((None, True), (2, False)):
        ours, builtin = _builtin_pair(rng, q, v, implementation)
        ours = keras_mha.MultiHeadAttention.from_config(
            {**ours.get_config(), "sliding_window": window}
        )
        ours.build(q.shape, v.shape)
        ours.set_weights(builtin.get_weights())
        rows, cols = np.arange(6)[:, None], np.arange(6)[None, :]
        band = np.ones((6, 6), bool) if window is None else np.abs(rows - cols) < window
        dense = key_valid[:, None, :] & band & ((rows >= cols) if causal else True)
        expected = to_numpy(builtin(q, v, attention_mask=dense))
        got = to_numpy(ours(q, v, value_mask=key_valid, use_causal_mask=causal))
        np.testing.assert_allclose(got, expected, atol=ATOL)


def test_fully_masked_rows_builtin_mode_zero_where_the_builtin_gives_zero(rng):
    """With scores requested, or with attention dropout, the built-in takes its softmax
    path, whose fully masked rows get zero weights: so does ours in "builtin" mode."""
    q, v, query_valid, key_valid = _padded_masks(rng)
    mask = query_valid[:, :, None] & key_valid[:, None, :]
    ours, builtin = _builtin_pair(rng, q, v)
    expected, expected_scores = to_numpy(
        builtin(q, v, attention_mask=mask, return_attention_scores=True)
    )
    got, scores = to_numpy(ours(q, v, attention_mask=mask, return_attention_scores=True))
    np.testing.assert_allclose(got, expected, atol=ATOL)
    np.testing.assert_allclose(scores, expected_scores, atol=ATOL)
    ours, builtin = _builtin_pair(rng, q, v, dropout=0.5)
    np.testing.assert_allclose(
        to_numpy(ours(q, v, attention_mask=mask)),
        to_numpy(builtin(q, v, attention_mask=mask)),
        atol=ATOL,
    )


def test_fully_masked_rows_rejects_other_values():
    with pytest.raises(ValueError, match="fully_masked_rows"):
        keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, fully_masked_rows="mean")
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, fully_masked_rows="builtin")
    assert layer.get_config()["fully_masked_rows"] == "builtin"
