"""Score functions (`keras_mha.score_mod`) against the float64 reference: attention-gym's
score patterns (ALiBi, tanh soft-cap, relative position, a learned relative-bias table),
written here again in NumPy from their published definitions, on every kernel, forward
and backward (the table's gradient included), with T and S no multiples of the chunk
size, grouped-query attention and KV-cache decoding; and the layer's argument."""

import dataclasses
import functools

import keras
import numpy as np
import pytest
from helpers import BACKEND, to_numpy, value_and_grads
from keras import ops
from reference import numeric_gradient, reference_attention

import keras_mha
from keras_mha import block_mask, equations, kernels, masks
from keras_mha import score_mod as sm
from keras_mha.kernels import chunked, explicit

B, N, H = 2, 4, 4
MAX_DISTANCE = 3
EQUATIONS = equations.attention_equations(4, (1,))[:2] + (1,)
ATOL = 1e-4


# ------------------------------------------------------- the patterns, in NumPy
def _alibi(score, b, h, q_idx, kv_idx):
    """Press et al.: head h's slope 2^(-8 (h + 1) / N) times the key's distance."""
    return score + 2.0 ** (-8.0 * (h + 1) / N) * (kv_idx - q_idx)


def _soft_cap(score, b, h, q_idx, kv_idx):
    return 2.0 * np.tanh(score / 2.0)


def _relative_position(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx)


def _relative_bias(table):
    def fn(score, b, h, q_idx, kv_idx):
        distance = np.clip(kv_idx - q_idx, -MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE
        return score + np.asarray(table, np.float64)[h, distance]

    return fn


# name -> (ours from the table tensor, the NumPy function from the table array)
PATTERNS = {
    "alibi": (lambda table: sm.alibi(N), lambda table: _alibi),
    "soft_cap": (lambda table: sm.soft_cap(2.0), lambda table: _soft_cap),
    "relative_position": (lambda table: sm.relative_position(), lambda t: _relative_position),
    "learned_table": (lambda table: sm.relative_bias(table, MAX_DISTANCE), _relative_bias),
}

# Chunks of 4 queries and key blocks of 4 keys: T = 7, S = 9 are no multiples.
KERNELS = ["explicit", "chunked", "looped"] + (["dynamic"] if BACKEND != "jax" else [])


def _key_padding(s):
    valid = np.ones((B, s), bool)
    valid[0, s - 3 :] = False
    return valid


MASKINGS = {
    "none": dict(),
    "causal+padding": dict(causal=True, key_valid=True),
    "offset+causal": dict(causal=True, offset=2),
}
# A block mask (`keras_mha.block_mask`) with empty key blocks inside a chunk's key range:
# key blocks of 4, the even ones seen by every query, an odd one by its own queries only.
# The chunked kernels compute such a chunk's runs of blocks apart and merge them.
HOLES = {"block mask with holes": dict(holes=True)}


def _holes(b, h, q_idx, kv_idx):
    return ops.logical_or(ops.equal((kv_idx // 4) % 2, 0), ops.equal(q_idx // 4, kv_idx // 4))


def _mask_of(masking, t, s):
    spec = {**MASKINGS, **HOLES}[masking]
    if not spec:
        return None, None, 0
    if spec.get("holes"):
        rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
        dense = np.broadcast_to(((cols // 4) % 2 == 0) | (rows // 4 == cols // 4), (B, t, s))
        built = block_mask.create_block_mask(_holes, None, None, t, s, block_size=4)
        assert built.segments(0, 3, 0, s) == [(0, 4), (8, s)]  # a hole for queries 0-3
        return masks.AttentionMask(block_mask=built), dense.copy(), 0
    offset = spec.get("offset", 0)
    rows, cols = np.arange(t)[:, None] + offset, np.arange(s)[None, :]
    dense = np.broadcast_to(rows >= cols, (B, t, s)).copy()
    key_valid = None
    if spec.get("key_valid"):
        key_valid = _key_padding(s)
        dense &= key_valid[:, None, :]
    described = masks.AttentionMask(
        causal=True,
        offset=offset,
        key_valid=None if key_valid is None else ops.convert_to_tensor(key_valid),
    )
    return described, dense, offset


def _run(kernel, pattern, mask, offset):
    def fn(q, k, v, table):
        mod = PATTERNS[pattern][0](table).at(offset)
        options = dict(scale=H**-0.5, mask=mask, score_mod=mod)
        if kernel == "explicit":
            return explicit.attention(q, k, v, equations=EQUATIONS, **options)[0]
        loop, dynamic = kernel in ("looped", "dynamic"), kernel == "dynamic"
        return chunked.attention(
            q, k, v, chunk_size=4, key_block=4, loop=loop, dynamic=dynamic, **options
        )

    return fn


@functools.cache
def _reference(pattern, masking, t, s, seed=0):
    """The float64 output and the gradients of `sum(output * w)` (the `w` of
    `value_and_grads`) w.r.t. q, k, v and the table, by central differences."""
    arrays = _arrays(t, s, seed)
    _, dense, offset = _mask_of(masking, t, s)

    def output(q, k, v, table):
        fn = PATTERNS[pattern][1](table)
        return reference_attention(
            q, k, v, dense, score_mod=fn, query_offset=offset, scale=H**-0.5
        )[0]

    out = output(*arrays)
    weights = np.random.default_rng(7).standard_normal(out.shape).astype("float32")
    grads = []
    for i in range(len(arrays)):

        def loss(x, i=i):
            args = list(arrays)
            args[i] = x
            return float(np.sum(output(*args) * weights))

        grads.append(numeric_gradient(loss, arrays[i]))
    return out, grads


def _arrays(t, s, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t, N, H)).astype("float32")
    k = rng.standard_normal((B, s, N, H)).astype("float32")
    v = rng.standard_normal((B, s, N, H)).astype("float32")
    table = rng.standard_normal((N, 2 * MAX_DISTANCE + 1)).astype("float32")
    return q, k, v, table


def _assert_close(got, want):
    out, grads = got
    want_out, want_grads = want
    np.testing.assert_allclose(out, want_out, atol=ATOL)
    for name, g, w in zip(("query", "key", "value", "table"), grads, want_grads):
        if g.dtype == object:  # a table no pattern reads: no gradient (torch, TensorFlow)
            assert name == "table" and not np.any(w), name
            continue
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w, atol=ATOL, err_msg=name)


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("masking", list(MASKINGS))
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_pattern_matches_reference_forward_and_backward(kernel, masking, pattern):
    t, s = 7, 9
    mask, _, offset = _mask_of(masking, t, s)
    got = value_and_grads(_run(kernel, pattern, mask, offset), _arrays(t, s))
    _assert_close(got, _reference(pattern, masking, t, s))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("pattern", ["alibi", "learned_table"])
def test_pattern_with_a_block_mask_matches_reference_forward_and_backward(kernel, pattern):
    """A score function with a `mask_mod`'s block mask: the chunked kernels skip the empty
    key blocks and still sum the table's gradient over the runs they compute."""
    t, s = 7, 9
    masking = next(iter(HOLES))
    mask, _, offset = _mask_of(masking, t, s)
    got = value_and_grads(_run(kernel, pattern, mask, offset), _arrays(t, s))
    _assert_close(got, _reference(pattern, masking, t, s))


def test_learned_table_gets_a_gradient_that_is_not_zero():
    """The table's gradient is checked against the reference's above; here, that it is
    there at all (a kernel that dropped it would give zeros, which sum to about 0)."""
    _, grads = _reference("learned_table", "none", 7, 9)
    assert np.abs(grads[3]).max() > 1e-2


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("implementation", [None, "explicit", "chunked", "fused"])
def test_functional_attention_with_grouped_heads(pattern, implementation):
    """`keras_mha.attention` with 2 key/value heads for 4 query heads: each serves two
    adjacent query heads; whatever is asked, a score function never takes the fused
    kernel."""
    t, s = 7, 9
    q, k, v, table = _arrays(t, s, seed=1)
    k, v = k[:, :, :2], v[:, :, :2]

    def fn(q, k, v, table):
        mod = PATTERNS[pattern][0](table)
        return keras_mha.attention(
            q, k, v, score_mod=mod, use_causal_mask=True, implementation=implementation,
            chunk_size=4,
        )  # fmt: skip

    out, grads = value_and_grads(fn, [q, k, v, table])
    want_out, want_grads = _grouped_reference(pattern, t, s)
    np.testing.assert_allclose(out, want_out, atol=ATOL)
    for i, (g, want) in enumerate(zip(grads, want_grads)):
        if g.dtype == object:  # a table no pattern reads: no gradient (torch, TensorFlow)
            assert i == 3 and not np.any(want)
            continue
        np.testing.assert_allclose(g, want, atol=ATOL)


@functools.cache
def _grouped_reference(pattern, t, s):
    """The float64 output with 2 key/value heads for 4 query heads (the arrays of seed
    1), and the gradients of `sum(output * w)` by central differences: once per
    pattern, for every implementation."""
    q, k, v, table = _arrays(t, s, seed=1)
    arrays = [q, k[:, :, :2], v[:, :, :2], table]

    def output(q, k, v, table):
        causal = np.tril(np.ones((t, s), bool))[None]
        k, v = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
        fn = PATTERNS[pattern][1](table)
        return reference_attention(q, k, v, causal, score_mod=fn)[0]

    out = output(*arrays)
    weights = np.random.default_rng(7).standard_normal(out.shape).astype("float32")
    grads = []
    for i in range(len(arrays)):

        def loss(x, i=i):
            args = list(arrays)
            args[i] = x
            return float(np.sum(output(*args) * weights))

        grads.append(numeric_gradient(loss, arrays[i]))
    return out, grads


def test_score_functions_never_take_the_fused_kernel():
    policy = kernels.policy.current()
    call = kernels.policy.Call(score_mod=True)
    assert kernels.policy.choose("fused", call, policy) != "fused"
    fused_first = dataclasses.replace(policy, kernel="fused")
    assert kernels.policy.choose(None, call, fused_first) != "fused"
    assert kernels.policy.choose("fused", kernels.policy.Call(), policy) == "fused"


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_kv_cache_decoding_matches_the_whole_call(pattern):
    """Decoding one query at a time through the cache: `q_idx` is the query's position
    `cache_update_index + t`, so every step matches the whole causal call's row."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((B, 6, 8)).astype("float32")
    table = rng.standard_normal((N, 2 * MAX_DISTANCE + 1)).astype("float32")
    layer = keras_mha.MultiHeadAttention(
        N, H, num_key_value_heads=2, score_mod=PATTERNS[pattern][0](table)
    )
    whole = to_numpy(layer(x, x, use_causal_mask=True))
    cache = layer.init_cache(B, 6)
    steps = []
    for t in range(6):
        out, cache = layer(
            x[:, t : t + 1], x[:, t : t + 1], cache=cache, cache_update_index=t,
            use_causal_mask=True,
        )  # fmt: skip
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, atol=ATOL)
    plain = keras_mha.MultiHeadAttention(N, H, num_key_value_heads=2)
    plain.build(x.shape, x.shape)
    plain.set_weights(layer.get_weights())
    assert np.abs(to_numpy(plain(x, x, use_causal_mask=True)) - whole).max() > 1e-3


def test_layer_call_argument_overrides_the_constructor():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((B, 5, 8)).astype("float32")
    table = rng.standard_normal((N, 2 * MAX_DISTANCE + 1)).astype("float32")
    layer = keras_mha.MultiHeadAttention(N, H, score_mod=sm.alibi(N))
    by_call = to_numpy(layer(x, x, score_mod=sm.relative_bias(table, MAX_DISTANCE)))
    twin = keras_mha.MultiHeadAttention(N, H)
    twin.build(x.shape, x.shape)
    twin.set_weights(layer.get_weights())
    expected = to_numpy(twin(x, x, score_mod=sm.relative_bias(table, MAX_DISTANCE)))
    np.testing.assert_allclose(by_call, expected, atol=ATOL)
    assert np.abs(by_call - to_numpy(layer(x, x))).max() > 1e-3


@pytest.mark.parametrize("pattern", ["alibi", "soft_cap", "relative_position"])
def test_named_score_functions_round_trip_the_config(pattern):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((B, 5, 8)).astype("float32")
    layer = keras_mha.MultiHeadAttention(N, H, score_mod=PATTERNS[pattern][0](None))
    out = to_numpy(layer(x, x, use_causal_mask=True))
    config = layer.get_config()
    assert isinstance(config["score_mod"], dict)
    again = keras_mha.MultiHeadAttention.from_config(config)
    again.build(x.shape, x.shape)
    again.set_weights(layer.get_weights())
    np.testing.assert_allclose(to_numpy(again(x, x, use_causal_mask=True)), out, atol=1e-6)


def test_unnamed_or_tensor_reading_score_functions_do_not_serialise():
    table = np.zeros((N, 2 * MAX_DISTANCE + 1), "float32")
    for mod in (lambda s, b, h, q, k: s, sm.relative_bias(table, MAX_DISTANCE)):
        layer = keras_mha.MultiHeadAttention(N, H, score_mod=mod)
        with pytest.raises(ValueError, match="Received an invalid value for argument `score_mod`"):
            layer.get_config()


def test_invalid_score_functions_are_rejected_before_any_state():
    with pytest.raises(ValueError, match="argument `score_mod`"):
        keras_mha.MultiHeadAttention(N, H, score_mod=3)
    with pytest.raises(ValueError, match="argument `score_mod`"):
        keras_mha.MultiHeadAttention(N, H, score_mod={"name": "nope"})
    with pytest.raises(ValueError, match="argument `table`"):
        sm.relative_bias(np.zeros((N, 5), "float32"), MAX_DISTANCE)
    layer = keras_mha.MultiHeadAttention(N, H, attention_axes=(1, 2), score_mod=sm.alibi(N))
    x = np.zeros((B, 3, 3, 8), "float32")
    with pytest.raises(ValueError, match="argument `score_mod`"):
        layer(x, x)
    assert not layer.weights


def test_a_plain_function_is_a_score_function():
    """A function of `keras.ops` code, no `ScoreMod` around it: the same as the named
    one it writes out."""
    q, k, v, _ = _arrays(5, 6, seed=6)

    def fn(score, b, h, q_idx, kv_idx):
        return score + ops.cast(q_idx - kv_idx, "float32")

    plain = to_numpy(keras_mha.attention(q, k, v, score_mod=fn))
    named = to_numpy(keras_mha.attention(q, k, v, score_mod=sm.relative_position()))
    np.testing.assert_allclose(plain, named, atol=1e-6)
    assert np.abs(plain - to_numpy(keras_mha.attention(q, k, v))).max() > 1e-3


@pytest.mark.parametrize("implementation", ["explicit", "chunked"])
def test_a_function_closing_over_a_variable_runs_forward(implementation):
    """A score function that reads a `keras.Variable` it closes over, not named in
    `ScoreMod(fn, tensors)`, gives the output of the same function taking it as a named
    tensor, eagerly and in a traced model. TensorFlow tells a custom gradient which
    variables its forward read: the chunked kernel's took no such argument, and failed."""
    q, k, v, _ = _arrays(7, 9, seed=7)
    shift = keras.Variable(np.linspace(0.5, 2.0, N).astype("float32"))

    def named(score, b, h, q_idx, kv_idx, shift):
        return score + ops.take(shift, h) * ops.cast(kv_idx - q_idx, "float32")

    def closing(score, b, h, q_idx, kv_idx):
        return named(score, b, h, q_idx, kv_idx, shift)

    def call(q, k, v, mod, implementation=implementation):
        return keras_mha.attention(
            q, k, v, score_mod=mod, use_causal_mask=True, implementation=implementation,
            chunk_size=4,
        )  # fmt: skip

    expected = to_numpy(call(q, k, v, sm.ScoreMod(named, (shift,)), "explicit"))
    assert np.abs(expected - to_numpy(call(q, k, v, None, "explicit"))).max() > 1e-2
    np.testing.assert_allclose(to_numpy(call(q, k, v, closing)), expected, atol=ATOL)
    inputs = [keras.Input(x.shape[1:], batch_size=B) for x in (q, k, v)]
    outputs = keras.layers.Lambda(lambda xs: call(*xs, closing))(inputs)
    traced = keras.Model(inputs, outputs).predict_on_batch([q, k, v])
    np.testing.assert_allclose(to_numpy(traced), expected, atol=ATOL)


class _TableAttention(keras.layers.Layer):
    """Self-attention whose learned relative-bias table is this layer's weight, passed
    to our layer per call: what a model with T5-style biases writes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras_mha.MultiHeadAttention(N, H, implementation="chunked")

    def build(self, shape):
        self.table = self.add_weight(shape=(N, 2 * MAX_DISTANCE + 1), initializer="zeros")
        self.attention.build(shape, shape)

    def call(self, x):
        mod = sm.relative_bias(self.table, MAX_DISTANCE)
        return self.attention(x, x, use_causal_mask=True, score_mod=mod)


def test_a_learned_table_trains_in_a_compiled_fit():
    """`model.fit` compiles its step as the backend does (XLA on JAX and TensorFlow):
    the table, read only by the score function, moves."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 6, 8)).astype("float32")
    y = rng.standard_normal((4, 6, 8)).astype("float32")
    inputs = keras.Input((6, 8))
    model = keras.Model(inputs, _TableAttention()(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    table = model.layers[-1].table
    model.fit(x, y, epochs=1, batch_size=4, verbose=0)
    assert np.abs(to_numpy(table)).max() > 1e-4


@pytest.mark.parametrize("implementation", ["chunked", "explicit"])
def test_padding_cut_off_keeps_the_positions(implementation):
    """Eager calls cut padded tails off before the kernel (`kernels/trim.py`): the
    score function still sees each query's and key's own position. Padding given as
    `value_mask` (cut) and as the same dense `attention_mask` (not cut) agree."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((B, 7, 8)).astype("float32")
    valid = np.ones((B, 7), bool)
    valid[:, 4:] = False

    def parity(score, b, h, q_idx, kv_idx):  # not shift-invariant, unlike ALiBi
        return score + ops.cast(kv_idx % 2 + q_idx % 3, "float32")

    layer = keras_mha.MultiHeadAttention(N, H, score_mod=parity, implementation=implementation)
    cut = to_numpy(layer(x, x, query_mask=valid, value_mask=valid, use_causal_mask=True))
    dense = np.broadcast_to(valid[:, None, :] & valid[:, :, None], (B, 7, 7))
    whole = to_numpy(layer(x, x, attention_mask=dense, use_causal_mask=True))
    np.testing.assert_allclose(cut[:, :4], whole[:, :4], atol=ATOL)


def test_a_functional_model_passing_a_named_score_mod_saves_and_loads(tmp_path, rng):
    """The call argument `score_mod` of a functional model (a named function without
    tensors) is saved with the model and applied after loading."""
    x = keras.Input((6, 8))
    layer = keras_mha.MultiHeadAttention(2, 4, name="attention")
    model = keras.Model(x, layer(x, x, score_mod=sm.alibi(2)))
    data = rng.standard_normal((2, 6, 8)).astype("float32")
    path = tmp_path / "alibi.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    attention = loaded.get_layer("attention")
    expected = to_numpy(attention(data, data, score_mod=sm.alibi(2)))
    assert np.abs(expected - to_numpy(attention(data, data))).max() > 1e-3  # it matters
    np.testing.assert_allclose(to_numpy(loaded(data)), expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(model(data)), expected, atol=1e-5)
