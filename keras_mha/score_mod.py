"""Score functions: elementwise changes of the attention logits, written in `keras.ops`.

A score function is FlexAttention's `score_mod`:

    score_mod(score, b, h, q_idx, kv_idx) -> score

called on a block of float32 logits `score` `(B, N, q, k)` with broadcast int32 index
tensors `b` `(B, 1, 1, 1)`, `h` `(1, N, 1, 1)`, `q_idx` `(1, 1, q, 1)` (the query's
position: with a KV cache, `cache_update_index + t`) and `kv_idx` `(1, 1, 1, k)`; what it
returns must broadcast to `score`'s shape. The kernels call it block by block, never on
the whole `(T, S)` at once (the chunked kernel), or once on the whole scores (the
explicit kernel), and differentiate it with the backend's autodiff, per block.

Where it sits among the kernels' arithmetic (`kernels/logits.py`):

    logits = (q * scale) . k
    logits = cap * tanh(logits / cap)     the layer's `logit_soft_cap`
    logits = logits + bias                `attention_bias`
    logits = score_mod(logits, b, h, q_idx, kv_idx)
    logits = masked where the mask is False; softmax (with sinks); dropout

so a score function sees the logits the softmax would see, and the masks apply after
it (a score function cannot unmask a key; use a mask for that).

Tensors a score function reads (a bias table, slopes), trainable ones included, are
given explicitly, `ScoreMod(fn, tensors)`, and come to `fn` as extra arguments,
`fn(score, b, h, q_idx, kv_idx, *tensors)`: the chunked kernel's backward is a custom
gradient, which on JAX cannot close over traced values, so it takes them as inputs and
returns their gradients (summed over its blocks). A function that closes over a tensor
instead still runs forward, but trains through the explicit kernel only: through the
chunked one no gradient reaches that tensor (TensorFlow, torch), or the train step fails
(JAX).

The named score functions below are attention-gym's score patterns, written anew from
their published definitions. The fused kernels take no score function: a call with one
runs the chunked or the explicit kernel (`kernels.policy`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
from keras import backend, ops

from keras_mha import checks


@keras.saving.register_keras_serializable(package="keras_mha")
@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: it holds tensors
class ScoreMod:
    """A score function and the tensors it reads.

    Args:
        fn: `fn(score, b, h, q_idx, kv_idx, *tensors) -> score`, elementwise
            `keras.ops` code (see the module's docstring for the shapes).
        tensors: the tensors `fn` reads, in the order it takes them; floating
            ones get gradients (trainable variables included).
        name: the name of a named score function (`alibi`, ...), which makes it
            serialisable with `config`; `None` for a user's function.
        config: the named function's arguments, plain data.
        query_offset: the position of the first query among the keys (KV-cache
            decoding); the layer sets it.
    """

    fn: Callable
    tensors: tuple = ()
    name: Any = None
    config: Any = None
    query_offset: Any = 0

    def __post_init__(self):
        if not callable(self.fn):
            raise checks.invalid("score_mod", "a callable", self.fn)
        object.__setattr__(self, "tensors", tuple(self.tensors))

    def __call__(self, score, b, h, q_idx, kv_idx, tensors=None):
        """`fn` on one block, broadcast to `score`'s shape, float32. `tensors`:
        the ones to read, when not `self.tensors` (the kernels' copies)."""
        tensors = self.tensors if tensors is None else tensors
        out = self.fn(score, b, h, q_idx, kv_idx, *tensors)
        out = ops.cast(out, "float32")
        if tuple(out.shape) != tuple(score.shape):
            out = ops.broadcast_to(out, ops.shape(score))
        return out

    def at(self, query_offset):
        """This score function with queries starting at `query_offset`."""
        return dataclasses.replace(self, query_offset=0 if query_offset is None else query_offset)

    @property
    def differentiable(self):
        """The indices in `tensors` of the floating ones (those that get gradients)."""
        return tuple(i for i, t in enumerate(self.tensors) if _floating(t))

    def indices(self, batch, heads, query_start, query_size, key_start, key_size):
        """`(b, h, q_idx, kv_idx)`, int32, broadcast shapes, for queries
        `[query_start, +query_size)` and keys `[key_start, +key_size)`."""
        b = ops.reshape(ops.arange(batch, dtype="int32"), (-1, 1, 1, 1))
        h = ops.reshape(ops.arange(heads, dtype="int32"), (1, -1, 1, 1))
        q = ops.arange(query_size, dtype="int32") + (query_start + self.query_offset)
        k = ops.arange(key_size, dtype="int32") + key_start
        return b, h, ops.reshape(q, (1, 1, -1, 1)), ops.reshape(k, (1, 1, 1, -1))

    def vjp(self, score, indices, tensors, cotangent):
        """The gradients of `sum(cotangent * self(score, *indices, tensors))` w.r.t.
        `score` and each of `tensors` (zeros for a non-floating one), by the backend's
        autodiff on this block."""
        wanted = self.differentiable
        inputs = [score] + [tensors[i] for i in wanted]

        def fn(score, *chosen):
            full = list(tensors)
            for i, t in zip(wanted, chosen):
                full[i] = t
            return self(score, *indices, tensors=full)

        grads = _vjp(fn, inputs, cotangent)
        out = [grads[0]]
        chosen = dict(zip(wanted, grads[1:]))
        for i, t in enumerate(tensors):
            g = chosen.get(i)
            out.append(ops.zeros(ops.shape(t), "float32") if g is None else g)
        return out

    def get_config(self):
        """The named function as plain data: `{"name": ..., **config}`."""
        if self.name is None or self.tensors:
            raise checks.invalid(
                "score_mod",
                "a named score function without tensors (`keras_mha.score_mod.alibi`, "
                "`soft_cap`, `relative_position`) to save it in the layer's config; pass "
                "a function or one reading tensors as the call argument `score_mod`",
                self.fn if self.name is None else self.name,
            )
        return {"name": self.name, **(self.config or {})}

    @classmethod
    def from_config(cls, config):
        """The named function of a config (`get_config`): a functional model that
        passes one as the call argument `score_mod` saves and loads."""
        return get(config)


def get(value):
    """A `ScoreMod` from `None`, a `ScoreMod`, a callable, or a config dict
    (`ScoreMod.get_config`)."""
    if value is None or isinstance(value, ScoreMod):
        return value
    if isinstance(value, dict):
        value = dict(value)
        name = value.pop("name", None)
        if name not in NAMED:
            raise checks.invalid(
                "score_mod", f"a config naming one of {sorted(NAMED)}", {"name": name, **value}
            )
        return NAMED[name](**value)
    if callable(value):
        return ScoreMod(value)
    raise checks.invalid("score_mod", "None, a callable or a `keras_mha.score_mod.ScoreMod`", value)


def config(value):
    """`value` (a `ScoreMod` or `None`) as plain data for a layer's config."""
    return None if value is None else value.get_config()


# ---------------------------------------------------------------- named functions
def alibi(num_heads, max_bias=8.0):
    """ALiBi (Press et al., 2022): `score + m_h * (kv_idx - q_idx)`, with head `h`'s
    slope `m_h = 2 ** (-(h + 1) * max_bias / num_heads)` (attention-gym's
    `generate_alibi_bias`)."""
    num_heads = checks.positive_int("num_heads", num_heads)
    max_bias = checks.positive_number("max_bias", max_bias)

    def fn(score, b, h, q_idx, kv_idx):
        slope = ops.power(2.0, -ops.cast(h + 1, "float32") * (max_bias / num_heads))
        return score + slope * ops.cast(kv_idx - q_idx, "float32")

    return ScoreMod(fn, name="alibi", config={"num_heads": num_heads, "max_bias": max_bias})


def soft_cap(cap):
    """Tanh soft-capping (Gemma 2, Grok): `cap * tanh(score / cap)` (attention-gym's
    `generate_tanh_softcap`)."""
    cap = checks.positive_number("cap", cap)

    def fn(score, b, h, q_idx, kv_idx):
        return cap * ops.tanh(score / cap)

    return ScoreMod(fn, name="soft_cap", config={"cap": cap})


def relative_position():
    """attention-gym's relative positional score: `score + (q_idx - kv_idx)`."""

    def fn(score, b, h, q_idx, kv_idx):
        return score + ops.cast(q_idx - kv_idx, "float32")

    return ScoreMod(fn, name="relative_position", config={})


def relative_bias(table, max_distance):
    """A learned relative-position bias (T5-like, without buckets): `score +
    table[h, clip(kv_idx - q_idx, -D, D) + D]`, `D = max_distance`.

    Args:
        table: `(N, 2 * max_distance + 1)` float tensor or variable; it gets gradients.
        max_distance: the distance past which keys share the last entry.
    """
    max_distance = checks.positive_int("max_distance", max_distance)
    width = 2 * max_distance + 1
    shape = tuple(table.shape)
    if len(shape) != 2 or checks.dims_differ(shape[1], width):
        raise checks.invalid(
            "table", f"a (num_heads, {width}) tensor for max_distance={max_distance}", shape
        )

    def fn(score, b, h, q_idx, kv_idx, table):
        distance = ops.clip(kv_idx - q_idx, -max_distance, max_distance) + max_distance
        flat = ops.reshape(table, (-1,))
        return score + ops.cast(ops.take(flat, h * width + distance), "float32")

    return ScoreMod(fn, (table,), name="relative_bias", config={"max_distance": max_distance})


NAMED = {"alibi": alibi, "soft_cap": soft_cap, "relative_position": relative_position}


# ----------------------------------------------------------------------- autodiff
def _floating(x):
    dtype = getattr(x, "dtype", None)
    return dtype is not None and "float" in backend.standardize_dtype(dtype)


def _vjp(fn, inputs, cotangent):
    """The gradients of `sum(cotangent * fn(*inputs))` w.r.t. each of `inputs` (float32
    zeros where one does not reach the output), by the backend's own autodiff."""
    name = backend.backend()
    if name == "jax":
        import jax

        _, pullback = jax.vjp(fn, *inputs)
        grads = pullback(cotangent)
    elif name == "tensorflow":
        import tensorflow as tf

        inputs = [tf.convert_to_tensor(x) for x in inputs]
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            out = fn(*inputs)
        grads = tape.gradient(out, inputs, output_gradients=cotangent)
        grads = [g if g is None else tf.convert_to_tensor(g) for g in grads]
    elif name == "torch":
        import torch

        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(True) for x in inputs]
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, cotangent, allow_unused=True)
    else:  # pragma: no cover
        raise NotImplementedError(name)
    return [
        ops.zeros(ops.shape(x), "float32") if g is None else ops.cast(g, "float32")
        for x, g in zip(inputs, grads)
    ]
