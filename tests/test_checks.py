"""`keras_mha.checks`: what is accepted (everything the built-in accepts, with its
meaning), what is rejected (with the built-in's wording where it has one), and that
unknown dimensions are never called a mismatch, on each backend's own symbolic trace.
"""

import keras
import numpy as np
import pytest
from helpers import BACKEND, make_pair, random_inputs, to_numpy
from keras import ops
from reference import reference_mha

import keras_mha
from keras_mha import checks

ATOL = 1e-5
B, T, S, DIM = 2, 5, 6, 8


class _Symbolic:
    """Stands in for a dimension that is not a Python int (torch.export's SymInt, a
    JAX symbolic dimension): comparing it would raise, so it must never be compared."""

    def __eq__(self, other):
        raise AssertionError("a symbolic dimension was compared")

    __ne__ = __lt__ = __gt__ = __le__ = __ge__ = __eq__
    __hash__ = object.__hash__


# ----------------------------------------------------------------------- dimensions
@pytest.mark.parametrize(
    "dim, known",
    [
        (3, True),
        (np.int64(3), True),
        (None, False),
        (True, False),
        (_Symbolic(), False),
    ],
    ids=["int", "numpy_int", "none", "bool", "symbolic"],
)
def test_is_known(dim, known):
    assert checks.is_known(dim) is known


def test_only_known_different_sizes_differ():
    assert checks.dims_differ(2, 3)
    assert checks.dims_differ(np.int32(2), 3)
    assert not checks.dims_differ(3, np.int64(3))
    assert not checks.dims_differ(None, 3)
    assert not checks.dims_differ(_Symbolic(), 3)
    assert not checks.dims_differ(1, 3, broadcast=True)
    assert checks.dims_differ(2, 3, broadcast=True)


def test_input_shapes_never_compare_unknown_dims():
    sym = _Symbolic()
    shapes = checks.input_shapes((sym, sym, 8), (None, sym, 6), (sym, None, 4))
    assert len(shapes) == 3
    checks.free_axes((sym, sym, 3, 8), (None, 5, sym, 8), (2,))
    checks.mask("query_mask", np.ones((2, 5), bool), (sym, sym))
    checks.attention_mask(np.ones((2, 5, 6), bool), (sym, 2, sym, sym), 1)


def test_known_batch_sizes_must_agree_but_one_broadcasts():
    checks.input_shapes((3, 5, 8), (1, 4, 8), None)
    with pytest.raises(ValueError, match="same batch size as `query`"):
        checks.input_shapes((3, 5, 8), (2, 4, 8), None)


# ---------------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    "value, expected",
    [(True, True), (False, False), (1, True), (0, False), (np.True_, True), (np.int32(0), False)],
    ids=["true", "false", "one", "zero", "numpy_bool", "numpy_int"],
)
def test_flags_take_bools_and_ints(value, expected):
    result = checks.flag("use_bias", value)
    assert result is expected


@pytest.mark.parametrize("value", ["yes", "False", 1.0, None, [True]], ids=repr)
def test_flags_reject_what_is_not_a_bool_or_int(value):
    with pytest.raises(ValueError, match=r"argument `use_gate`, expected a boolean"):
        checks.flag("use_gate", value)


def test_constructor_flags_given_as_ints_are_stored_as_bools():
    layer = keras_mha.MultiHeadAttention(
        num_heads=2, key_dim=4, use_bias=np.int64(0), use_gate=1, flash_attention=np.False_
    )
    config = layer.get_config()
    assert config["use_bias"] is False and config["use_gate"] is True
    assert config["flash_attention"] is False
    assert len(keras_mha.MultiHeadAttention.from_config(config).get_config()) == len(config)


@pytest.mark.parametrize(
    "flag", [0, 1, np.True_, np.False_, None], ids=["zero", "one", "np_true", "np_false", "none"]
)
def test_use_causal_mask_as_the_builtin_reads_it(flag, rng):
    (x,) = random_inputs(rng, (B, T, DIM))
    ours, builtin = make_pair(dict(num_heads=2, key_dim=4), x.shape)
    expected = to_numpy(ours(x, x, use_causal_mask=bool(flag)))
    np.testing.assert_allclose(to_numpy(ours(x, x, use_causal_mask=flag)), expected, atol=ATOL)
    np.testing.assert_allclose(to_numpy(builtin(x, x, use_causal_mask=flag)), expected, atol=ATOL)
    scores_flag = np.True_ if flag is None else flag
    result = ours(x, x, return_attention_scores=scores_flag)
    assert isinstance(result, tuple) == bool(scores_flag)


# ---------------------------------------------------------------------------- masks
def _mask_cases(rng):
    base = rng.random((B, T, S)) > 0.4
    base[..., 0] = True
    return {
        "bool": (base, base),
        "int": (base.astype("int32"), base),
        "float_nonzero_attends": (np.where(base, 0.25, 0.0).astype("float32"), base),
        "list": (base.astype(int).tolist(), base),
        "two_d": (base[0], np.broadcast_to(base[0], base.shape)),
    }


@pytest.mark.parametrize("case", ["bool", "int", "float_nonzero_attends", "list", "two_d"])
def test_attention_mask_dtypes_and_forms_the_builtin_accepts(case, rng):
    q, v = random_inputs(rng, (B, T, DIM), (B, S, DIM))
    given, meaning = _mask_cases(rng)[case]
    ours, builtin = make_pair(dict(num_heads=2, key_dim=4), q.shape, v.shape)
    output = to_numpy(ours(q, v, attention_mask=given))
    expected, _ = reference_mha(ours, q, v, mask=meaning)
    np.testing.assert_allclose(output, expected, atol=ATOL)
    np.testing.assert_allclose(output, to_numpy(builtin(q, v, attention_mask=given)), atol=ATOL)


def _one_head_layer(implementation, q, v, head, heads=3):
    """A layer whose output comes from head `head` only (the others' output kernel
    is zero), so a per-head mask can be checked against a one-mask reference."""
    keras.utils.set_random_seed(3)
    layer = keras_mha.MultiHeadAttention(
        num_heads=heads, key_dim=4, implementation=implementation, chunk_size=2
    )
    layer.build(q.shape, v.shape)
    weights = layer.get_weights()
    out_kernel = weights[-2].copy()
    out_kernel[[h for h in range(heads) if h != head]] = 0.0
    layer.set_weights(weights[:-2] + [out_kernel, weights[-1]])
    return layer


@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
@pytest.mark.parametrize("extra", ["alone", "causal", "value_mask"])
def test_attention_mask_with_a_heads_axis(implementation, extra, rng):
    """`(B, N, T, S)`: each head gets its own mask, also merged with the causal mask
    and implicit padding masks (whose `(B, T, S)` form must not align B with N)."""
    q, v = random_inputs(rng, (B, T, DIM), (B, S, DIM))
    mask = rng.random((B, 3, T, S)) > 0.4
    mask[..., 0] = True
    kwargs, extra_mask = {}, np.ones((B, T, S), bool)
    if extra == "causal":
        kwargs["use_causal_mask"] = True
        extra_mask &= np.tril(np.ones((T, S), bool))
    if extra == "value_mask":
        value_mask = np.ones((B, S), bool)
        value_mask[0, -2:] = False
        kwargs["value_mask"] = value_mask
        extra_mask &= value_mask[:, None, :]
    for head in range(3):
        layer = _one_head_layer(implementation, q, v, head)
        output = to_numpy(layer(q, v, attention_mask=mask, **kwargs))
        expected, _ = reference_mha(layer, q, v, mask=mask[:, head] & extra_mask)
        np.testing.assert_allclose(output, expected, atol=ATOL, err_msg=f"head {head}")


def test_attention_mask_with_a_heads_axis_matches_the_builtin(rng):
    q, v = random_inputs(rng, (B, T, DIM), (B, S, DIM))
    mask = rng.random((B, 2, T, S)) > 0.4
    mask[..., 0] = True
    ours, builtin = make_pair(dict(num_heads=2, key_dim=4), q.shape, v.shape)
    for kwargs in ({}, {"use_causal_mask": True}):
        expected = to_numpy(builtin(q, v, attention_mask=mask, **kwargs))
        output = to_numpy(ours(q, v, attention_mask=mask, **kwargs))
        np.testing.assert_allclose(output, expected, atol=ATOL)
    _, scores = ours(q, v, attention_mask=mask, return_attention_scores=True)
    assert np.all(to_numpy(scores)[~mask] == 0.0)


@pytest.mark.parametrize(
    "shape",
    [(B, 3, T, S), (B, 1, 2, T, S), (S,) * 5, (B, T + 1, S)],
    ids=["wrong_heads", "rank_5", "too_many_axes", "wrong_length"],
)
def test_attention_mask_that_cannot_broadcast_to_the_scores(shape, rng):
    q, v = random_inputs(rng, (B, T, DIM), (B, S, DIM))
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
    with pytest.raises(ValueError) as error:
        layer(q, v, attention_mask=np.ones(shape, bool))
    message = str(error.value)
    assert "argument `attention_mask`" in message and "(2, 2, 5, 6)" in message
    assert checks.shape_str(shape) in message
    assert not layer.built


def test_a_ragged_list_mask_is_rejected_by_name(rng):
    q, v = random_inputs(rng, (B, T, DIM), (B, S, DIM))
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
    with pytest.raises(ValueError, match=r"argument `attention_mask`, expected a mask of one"):
        layer(q, v, attention_mask=[[1, 0], [1]])
    assert not layer.built


def test_a_call_like_one_that_passed_skips_only_the_same_checks(rng):
    """`call_arguments` does not check again a call like one that passed, by what it
    reads: each argument's type, shape and dtype, and the layer's settings. A mask
    that another layer's heads took, another dtype, another shape: each is checked."""
    q, v = random_inputs(rng, (B, T, DIM), (B, S, DIM))
    heads_mask = np.ones((B, 2, T, S), bool)
    two = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
    for _ in range(2):
        two(q, v, attention_mask=heads_mask)
    four = keras_mha.MultiHeadAttention(num_heads=4, key_dim=4)
    with pytest.raises(ValueError, match=r"argument `attention_mask`.*\(2, 4, 5, 6\)"):
        four(q, v, attention_mask=heads_mask)
    assert not four.built
    with pytest.raises(ValueError, match=r"argument `attention_mask`, expected a boolean"):
        two(q, v, attention_mask=heads_mask.astype(str))
    with pytest.raises(ValueError, match=r"argument `query_mask`"):
        two(q, v, query_mask=np.ones((B, T + 1), bool))
    two(q, v, query_mask=np.ones((B, T), bool))
    with pytest.raises(ValueError, match=r"argument `query_mask`"):
        two(q, v, query_mask=np.ones((B, T + 1), bool))


# ------------------------------------------------------------------------- wording
@pytest.mark.parametrize(
    "kwargs, keras_words, name",
    [
        ({"output_shape": 8.0}, "Invalid `output_shape`", "output_shape"),
        ({"sliding_window": 0}, "`sliding_window` must be `None` or a positive", "sliding_window"),
        (
            {"attention_axes": "1"},
            "`attention_axes` must be an int, list, or tuple",
            "attention_axes",
        ),
        (
            {"num_heads": 4, "num_key_value_heads": 3},
            "`num_query_heads` must be divisible by `num_key_value_heads`",
            "num_key_value_heads",
        ),
    ],
    ids=["output_shape", "sliding_window", "attention_axes", "num_key_value_heads"],
)
def test_constructor_errors_keep_the_builtin_wording(kwargs, keras_words, name):
    with pytest.raises(ValueError) as error:
        keras_mha.MultiHeadAttention(**{"num_heads": 2, "key_dim": 4, **kwargs})
    message = str(error.value)
    assert message.startswith(keras_words), message
    assert f"Received an invalid value for argument `{name}`, expected" in message
    assert f"Received: {name}=" in message


@pytest.mark.parametrize(
    "value_shape, key_shape",
    [((B, S, DIM), (B, S + 1, DIM)), ((B, S, DIM), (B,)), ((B, 1, S, DIM), (B, 2, S, DIM))],
    ids=["length", "rank", "n_d"],
)
def test_key_value_mismatch_keeps_the_builtin_wording(value_shape, key_shape):
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
    query_shape = (B, T) + value_shape[2:]
    for check in (
        lambda: layer.compute_output_shape(query_shape, value_shape, key_shape),
        lambda: layer(np.ones(query_shape), np.ones(value_shape), np.ones(key_shape)),
    ):
        with pytest.raises(ValueError) as error:
            check()
        message = str(error.value)
        assert "All dimensions of `value` and `key`, except the last one, must be equal" in message
        assert "argument `key`" in message and checks.shape_str(key_shape) in message
    assert not layer.built


# --------------------------------------------------------- N-d attention free axes
QUERY_ND, VALUE_ND = (3, 5, 2, 8), (3, 6, 2, 8)


def _assert_names_query_and_value(error, query_shape=QUERY_ND, value_shape=VALUE_ND):
    message = str(error.value)
    assert "argument `value`" in message and "`query`" in message, message
    assert checks.shape_str(value_shape) in message and checks.shape_str(query_shape) in message


def test_free_axes_mismatch_is_a_value_error_before_any_arithmetic(rng):
    q, v = random_inputs(rng, QUERY_ND, VALUE_ND)
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=[2])
    with pytest.raises(ValueError) as error:
        layer(q, v)
    _assert_names_query_and_value(error)
    assert not layer.built and layer.weights == []
    # Built on good shapes, a rejected call changes nothing.
    good = random_inputs(rng, QUERY_ND, QUERY_ND)
    before = to_numpy(layer(*good))
    weights = [w.copy() for w in layer.get_weights()]
    with pytest.raises(ValueError) as error:
        layer(q, v)
    _assert_names_query_and_value(error)
    for w, w_after in zip(weights, layer.get_weights()):
        np.testing.assert_array_equal(w, w_after)
    np.testing.assert_array_equal(to_numpy(layer(*good)), before)


def test_free_axes_mismatch_at_build_and_symbolic_time():
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=[2])
    with pytest.raises(ValueError) as error:
        layer.build(QUERY_ND, VALUE_ND)
    _assert_names_query_and_value(error)
    with pytest.raises(ValueError) as error:
        layer.compute_output_shape(QUERY_ND, VALUE_ND)
    _assert_names_query_and_value(error)
    query, value = keras.Input(batch_shape=QUERY_ND), keras.Input(batch_shape=VALUE_ND)
    with pytest.raises(ValueError) as error:
        layer(query, value)
    _assert_names_query_and_value(error)
    assert not layer.built
    # Unknown sizes are not mismatches.
    query, value = keras.Input((None, 2, 8)), keras.Input((None, 2, 8))
    assert tuple(layer(query, value).shape) == (None, None, 2, 8)


def test_size_one_free_axis_broadcasts_on_every_backend(rng):
    """The built-in's einsum broadcasts a size-1 value axis on JAX and torch (and
    fails on TensorFlow); ours broadcasts it everywhere."""
    q, v = random_inputs(rng, QUERY_ND, (3, 1, 2, 8))
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=[2])
    output, scores = to_numpy(layer(q, v, return_attention_scores=True))
    expected, expected_scores = reference_mha(layer, q, np.broadcast_to(v, QUERY_ND))
    np.testing.assert_allclose(output, expected, atol=ATOL)
    np.testing.assert_allclose(scores, expected_scores, atol=ATOL)


# ------------------------------------------------------- each backend's symbolic trace
def _model():
    query, value = keras.Input((None, DIM), name="query"), keras.Input((None, DIM), name="value")
    mask = keras.Input((None, None), name="mask", dtype="bool")
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, name="attention")
    output = layer(query, value, attention_mask=mask, use_causal_mask=True)
    return keras.Model([query, value, mask], output)


def _trace_with_dynamic_dims(model, example):
    """The backend's own tracer with batch and lengths unknown: TensorFlow's `None`
    dims, JAX's symbolic shapes (jax.export), torch.export's SymInts. Returns the
    traced function's output on `example`."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        specs = [
            tf.TensorSpec((None, None, DIM)),
            tf.TensorSpec((None, None, DIM)),
            tf.TensorSpec((None, None, None), tf.bool),
        ]
        traced = tf.function(lambda q, v, m: model([q, v, m])).get_concrete_function(*specs)
        return traced(*(tf.constant(x) for x in example))
    if BACKEND == "jax":
        import jax
        from jax import export

        b, t, s = export.symbolic_shape("b, t, s")
        variables = [v.value for v in model.variables]

        def fn(q, v, m):
            return model.stateless_call(variables, [], [q, v, m])[0]

        specs = [
            jax.ShapeDtypeStruct((b, t, DIM), "float32"),
            jax.ShapeDtypeStruct((b, s, DIM), "float32"),
            jax.ShapeDtypeStruct((b, t, s), "bool"),
        ]
        return export.export(jax.jit(fn))(*specs).call(*example)
    import torch

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, q, v, m):
            return self.model([q, v, m])

    batch, t, s = torch.export.Dim("b"), torch.export.Dim("t"), torch.export.Dim("s")
    dynamic = ({0: batch, 1: t}, {0: batch, 1: s}, {0: batch, 1: t, 2: s})
    traced = [torch.as_tensor(np.concatenate([x] * 2)) for x in example]  # other sizes
    program = torch.export.export(Module(), tuple(traced), dynamic_shapes=dynamic)
    return program.module()(*(torch.as_tensor(x) for x in example))


def test_validation_passes_on_the_backends_symbolic_trace(rng):
    model = _model()
    q, v = random_inputs(rng, (3, 4, DIM), (3, 7, DIM))
    mask = rng.random((3, 4, 7)) > 0.3
    mask[..., 0] = True
    expected = to_numpy(model([q, v, mask]))
    got = to_numpy(_trace_with_dynamic_dims(model, [q, v, mask]))
    np.testing.assert_allclose(got, expected, atol=ATOL)
    assert ops.convert_to_numpy(expected).shape == (3, 4, DIM)


# --------------------------------------------------------------------- packed rows
PACKED_ERRORS = {
    "float ids": (dict(segment_ids=np.ones((B, T), "float32")), "segment_ids", "integer"),
    "ids of another length": (
        dict(segment_ids=np.ones((B, T + 1), "int32")),
        "segment_ids",
        r"shape \(2, 5\)",
    ),
    "key ids alone": (
        dict(key_segment_ids=np.ones((B, S), "int32")),
        "key_segment_ids",
        "no `segment_ids`",
    ),
    "keys of another length without their ids": (
        dict(segment_ids=np.ones((B, T), "int32")),
        "key_segment_ids",
        "the keys' document ids",
    ),
    "key ids of the wrong length": (
        dict(segment_ids=np.ones((B, T), "int32"), key_segment_ids=np.ones((B, T), "int32")),
        "key_segment_ids",
        r"shape \(2, 6\)",
    ),
    "positions without rope": (
        dict(positions=np.zeros((B, T), "int32")),
        "positions",
        "rope_max_wavelength",
    ),
}


@pytest.mark.parametrize("case", list(PACKED_ERRORS))
def test_packed_arguments_are_rejected_by_name_before_building(rng, case):
    kwargs, name, expected = PACKED_ERRORS[case]
    layer = keras_mha.MultiHeadAttention(2, 4)
    query, value = random_inputs(rng, (B, T, DIM), (B, S, DIM))
    with pytest.raises(ValueError, match=rf"argument `{name}`, expected .*{expected}"):
        layer(query, value, **kwargs)
    assert not layer.built and not layer.weights


def test_packed_arguments_need_sequences_and_rotated_keys_of_the_queries_length(rng):
    layer = keras_mha.MultiHeadAttention(2, 4, attention_axes=(1, 2))
    x = rng.standard_normal((B, 3, 4, DIM)).astype("float32")
    with pytest.raises(ValueError, match=r"argument `segment_ids`, expected `None` unless"):
        layer(x, x, segment_ids=np.ones((B, 3), "int32"))
    rotating = keras_mha.MultiHeadAttention(2, 4, rope_max_wavelength=100.0)
    query, value = random_inputs(rng, (B, T, DIM), (B, S, DIM))
    with pytest.raises(ValueError, match=r"argument `positions`, expected `None` when the keys"):
        rotating(query, value, positions=np.zeros((B, T), "int32"))
