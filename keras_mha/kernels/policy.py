"""Which attention kernel runs, and with what sizes: one table, one decision.

`POLICIES` holds, per backend and device, every tuned choice the kernels make; nothing
else in the package branches on the backend to pick a kernel or a size. `choose` is a
pure function of the call's features and the policy, tested on its own. `overriding`
puts another row in place for a block (benchmarks and tests compare rows with it).
"""

import contextlib
import contextvars
import dataclasses
import functools
import threading

from keras import backend

IMPLEMENTATIONS = ("explicit", "fused", "chunked")


@dataclasses.dataclass(frozen=True)
class Policy:
    """The per-backend choices.

    Attributes:
        kernel: the kernel `implementation=None` takes when the call allows any:
            "fused" (the backend's own kernel), "chunked" or "explicit".
        chunk_size: query rows per chunk of the chunked kernel (the layer's
            `chunk_size=None`).
        key_block: keys per block of the compiled loop's chunks (`loop` without
            `dynamic`): each chunk visits only the blocks holding a key one of its
            queries may see, found at run time (causality, the window, query and key
            padding, document ids), in an inner loop with an online softmax. Larger
            blocks: fewer steps; smaller ones: less work past the visible keys. With
            a block mask, the loop's blocks are whole units of the map's key blocks,
            as many as fit in `key_block` (at least one), visited where one of them
            is non-empty (benchmarks/results/jax_block_units.md).
        key_multiple: a dynamic loop widens each chunk's key range, found at run
            time from the masks, out to a multiple of this many keys. Every new
            width is a new matmul shape, and TensorFlow's CPU kernels (oneDNN) keep a
            compiled primitive per shape: without it, a train step on packed rows
            grew the process by 16 MiB for every batch of new documents, up to the
            cache's limit.
        chunk_bytes: `None`, or a dynamic loop's forward chunks of queries halve
            (`forward_chunk_rows`, down to `MIN_CHUNK_ROWS`) until their float32
            logits, batch x heads x rows x the keys a chunk sees on average
            (causality and the window bound them), take fewer bytes than this.
            glibc's malloc serves a block of 32 MiB or more by a fresh `mmap` every
            time, whose every page then faults when written, and TensorFlow's CPU
            allocator is malloc (the Benchmarks page, "Decisions"). The backward
            keeps `chunk_size`: each of its chunks adds into the whole key and value
            gradients, a cost per chunk that more chunks multiply.
        in_flight: how many query chunks of a forward pass may run at once;
            `None` for no limit. TensorFlow's graph executor otherwise starts every
            chunk together and the memory saving is gone; two overlap one chunk's
            softmax with the next one's matmul.
        explicit_up_to: `None`, or the automatic choice takes the explicit kernel
            where "chunked" would run a call whose whole scores `B x N x T x S` are
            known when tracing and have at most this many entries, and whose chunks
            would skip no key (its mask has no causal part or window, or its queries
            fit in one chunk): its backward keeps the weights where the chunked one
            recomputes them. Time over memory for small calls.
        one_op_einsum_up_to: `None`, or the explicit kernel runs its two products as
            one backend einsum op each (`tf.einsum`) in calls whose scores are known
            when tracing and have at most this many entries. Keras's TensorFlow
            `ops.einsum` writes them as transposes around a matmul: faster on larger
            calls, but three graph ops for one, which a small model pays on every
            call; a cached decoding step's large keys lose with one op
            (benchmarks/results/small_tensorflow_einsum.md).
        loop: the chunked kernel visits its chunks in a compiled loop instead of
            unrolling them. XLA schedules unrolled chunks together and keeps all
            their buffers; a loop holds one chunk's. Its shapes are static: each
            chunk visits its visible keys by blocks of `key_block`.
        dynamic: the loop's chunks take tensors whose size changes from chunk to
            chunk (a TensorFlow graph's while loop; XLA's shapes are static): each
            chunk then sees only the keys it can attend to, and a `T` unknown when
            tracing is chunked too. An unrolled graph holds every chunk's ops,
            and TensorFlow keeps its traced graph and constant-folded masks.
        trains: the backend computes gradients (the chunked kernel then brings
            its own memory-lean backward).
        in_place_bias: the projections add their bias into the fresh product in
            place where no gradient flows (torch: a new buffer costs page faults).
        in_place_sums: the unrolled chunked kernel's backward adds each chunk's key
            and value gradients into one zeroed buffer at the chunk's keys, in place
            on torch, instead of padding each part to the running sum and adding the
            two whole: per chunk, two passes over all keys' gradients less
            (benchmarks/results/torch_backward.md).
        fused_float16: the fused kernel takes float16 as it is. TensorFlow's
            computes float16 logits, which overflow; JAX's asks for float32
            accumulation, which XLA on CPU rejects under `jax.jit`. Elsewhere the
            fused kernel gets float32 copies.
        fused_block_mask: the fused kernel takes calls with a block mask
            (`block_mask.BlockMask`): by chunks of queries, each against the key
            blocks its block map leaves non-empty (runs of them gathered together),
            the mask built for that chunk only, none where all its blocks are full.
            Torch's CPU kernel runs those chunks in C++ where the chunked kernel
            runs each step as an eager op over the whole chunk
            (benchmarks/results/torch_backward.md).
        fused_key_padding: the fused kernel takes a key-padding mask `(B, 1, 1, S)`
            whole. JAX's cuDNN kernel does not (`tests/test_gpu.py`: XLA's plain
            math, with its whole `B x N x T x S` scores, ran instead); it takes a
            mask built per chunk of queries, so padding goes by chunks there.
        direct_projections: the projections run their `call` directly where Keras's
            `Layer.__call__` would do nothing more (`_keras_private.call_is_all_it_does`).
            An eager backend (torch) pays that `__call__` in Python on every call of
            the layer, four or five times; traced graphs pay it once.
        fold_key_padding: the dtypes in which key padding, alone or with causality,
            goes into the fused kernel as one more head channel (`fused._folded`):
            one whole call, with `is_causal`, and no mask tensor. Where a flash
            kernel takes those dtypes but no key padding whole (JAX's cuDNN kernel:
            half precision). In other dtypes the backend would run whole-score math,
            and chunks of queries stay leaner.
        sizes_from_data: an eager call may take sizes from its data: padded
            tails cut off (`trim.py`), and a Python-int `cache_update_index` kept
            a constant, whose key ranges and RoPE positions then are. Not on JAX,
            whose eager ops compile again for every new shape and constant: there
            the index becomes a tensor.
        skip_zero_gradient_tail: an eager causal call whose queries run past its
            keys (`T > S`: a cut of right-padded rows whose padded queries attend, as
            in keras-hub's models) runs the queries from `S` on apart, and their
            backward only where their output's gradient is not all zero; a loss that
            ignores padded positions gives zero (`fused._causal_with_tail`).
        skip_zero_gradient_chunks: the chunked kernel's dynamic loop (`dynamic`,
            where it runs: not under XLA) visits no key, backward, for a chunk of
            queries whose output's gradient is all zero: padded queries that attend
            (keras-hub's models) and that the loss ignores. Exact: such a chunk adds
            zero to every gradient. XLA's static loops could do the same (no key
            block); on JAX it measured no faster (benchmarks/results/README.md,
            "keras-hub language models").
        remat_norms: the layer's QK-norm and value norm are recomputed in the
            backward pass instead of kept (`keras.remat`) where the call is traced.
            A norm keeps its input and two more tensors of the projection's size
            for its backward; the attention keeps its own rotated copy anyway. XLA
            keeps them all until the backward reaches the layer: a swapped keras-hub
            Gemma 3's train step at T = 8192 held 64 MiB less of XLA's buffers
            (benchmarks/results/README.md, "keras-hub language models"). Not on
            TensorFlow: `tf.recompute_grad` in a compiled train step gave other weights
            in about one run in six (a tiny layer, one SGD step: 2e-4 to 4e-4 apart).
        cut_from: an eager call without causality looks for padded tails to cut
            (`sizes_from_data`) only where its scores have more than this many
            entries, or an unknown number. The look (a host transfer of the
            padding, then NumPy) costs about 100 us, on a small call as much as
            all the padding it could cut; a causal call always looks, since a cut
            can turn its padding into a plain causal call
            (benchmarks/results/small_torch_cut.md).
        compile_eager_chunks: an eager call of the chunked kernel runs through one
            compiled program per configuration (`compiled.py`). JAX's compiled loop
            traces and compiles its body again on every eager call
            (benchmarks/results/jax_eager_chunk_loop.md).
        unit_axis_products: the explicit kernel's rank-4 products carry a unit axis
            beside the heads, so that XLA:CPU runs all four products of their
            backward in YNNPACK, not one or two of them in its slower Eigen dot
            (`explicit.RANK4_EQUATIONS`; benchmarks/results/jax_unit_axis.md).
    """

    kernel: str
    chunk_size: int = 256
    key_block: int = 512
    key_multiple: int = 1
    chunk_bytes: int | None = None
    in_flight: int | None = None
    explicit_up_to: int | None = None
    one_op_einsum_up_to: int | None = None
    loop: bool = False
    dynamic: bool = False
    trains: bool = True
    in_place_bias: bool = False
    in_place_sums: bool = False
    fused_block_mask: bool = False
    fused_float16: bool = False
    fused_key_padding: bool = True
    fold_key_padding: tuple = ()
    direct_projections: bool = False
    sizes_from_data: bool = True
    skip_zero_gradient_tail: bool = False
    skip_zero_gradient_chunks: bool = False
    remat_norms: bool = False
    compile_eager_chunks: bool = False
    unit_axis_products: bool = False
    cut_from: int = 0


# (backend, device) -> Policy. The measurements behind each entry are in
# benchmarks/results (see its README); `make bench` re-measures them.
POLICIES = {
    ("tensorflow", "cpu"): Policy(
        "chunked",
        chunk_size=256,
        key_multiple=128,
        chunk_bytes=32 << 20,
        in_flight=2,
        explicit_up_to=1 << 22,
        one_op_einsum_up_to=1 << 13,
        loop=True,
        dynamic=True,
        skip_zero_gradient_chunks=True,
    ),
    ("tensorflow", "gpu"): Policy("chunked", chunk_size=512, in_flight=2, loop=True, dynamic=True),
    ("jax", "cpu"): Policy(
        "chunked",
        chunk_size=512,
        key_block=256,
        explicit_up_to=1 << 16,
        loop=True,
        sizes_from_data=False,
        remat_norms=True,
        compile_eager_chunks=True,
        unit_axis_products=True,
    ),
    ("jax", "gpu"): Policy(
        "fused",
        chunk_size=2048,
        loop=True,
        fused_float16=True,
        fused_key_padding=False,
        fold_key_padding=("bfloat16", "float16"),
        sizes_from_data=False,
        compile_eager_chunks=True,
    ),
    ("torch", "cpu"): Policy(
        "fused",
        chunk_size=256,
        in_place_bias=True,
        in_place_sums=True,
        fused_block_mask=True,
        fused_float16=True,
        direct_projections=True,
        skip_zero_gradient_tail=True,
        cut_from=1 << 15,
    ),
    ("torch", "gpu"): Policy(
        "fused",
        chunk_size=512,
        in_place_bias=True,
        in_place_sums=True,
        fused_float16=True,
        direct_projections=True,
    ),
    ("numpy", "cpu"): Policy("explicit", trains=False),
    ("openvino", "cpu"): Policy("explicit", trains=False),
}


# A backend with no row of its own.
_UNLISTED = Policy("explicit")

_OVERRIDE = contextvars.ContextVar("keras_mha_policy_override", default=None)
# How many `overriding` blocks are open, in any thread: while none is, `current` reads
# no context variable, which `torch.compile` cannot trace (each read split the graph).
_open_overrides = 0
_open_overrides_lock = threading.Lock()


def current():
    """The policy of the running backend and its default device (or `overriding`'s)."""
    overridden = _OVERRIDE.get() if _open_overrides else None
    if overridden is not None:
        return overridden
    name = backend.backend()
    found = POLICIES.get((name, _device(name)))
    return POLICIES.get((name, "cpu"), _UNLISTED) if found is None else found


@contextlib.contextmanager
def overriding(**changes):
    """Inside the block, `current()` is the running backend's row with `changes`
    (field names of `Policy`); the kernels read it when they trace or run."""
    global _open_overrides
    token = _OVERRIDE.set(dataclasses.replace(current(), **changes))
    with _open_overrides_lock:
        _open_overrides += 1
    try:
        yield
    finally:
        with _open_overrides_lock:
            _open_overrides -= 1
        _OVERRIDE.reset(token)


@functools.cache
def _device(name):
    """ "gpu" when the backend's default device is an accelerator, else "cpu"."""
    if name == "jax":
        import jax

        return "cpu" if jax.default_backend() == "cpu" else "gpu"
    if name == "torch":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    if name == "tensorflow":
        import tensorflow as tf

        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    return "cpu"


# `Policy.chunk_bytes` halves chunks no further: smaller ones were slower (the
# Benchmarks page, "Decisions").
MIN_CHUNK_ROWS = 64


def forward_chunk_rows(rules, query_shape, key_length, mask, dynamic):
    """Query rows per chunk of the chunked kernel's forward pass: `rules.chunk_size`,
    halved while a dynamic loop's chunk would hold `rules.chunk_bytes` of logits or
    more (`Policy.chunk_bytes`).

    Args:
        rules: a `Policy`.
        query_shape: `(B, T, N, H)`; an unknown `B` counts as 1.
        key_length: `S`, or `None` when unknown while tracing.
        mask: the call's `AttentionMask`, or `None`.
        dynamic: the chunks run in a dynamic loop (`dynamic_loop`).
    """
    rows = rules.chunk_size
    batch, length, heads = query_shape[0], query_shape[1], query_shape[2]
    sizes = (length, key_length, heads)
    if rules.chunk_bytes is None or not dynamic or not all(isinstance(d, int) for d in sizes):
        return rows
    batch = batch if isinstance(batch, int) else 1
    while rows > MIN_CHUNK_ROWS and (
        4 * batch * heads * rows * _mean_keys(mask, length, key_length, rows) >= rules.chunk_bytes
    ):
        rows //= 2
    return rows


def _mean_keys(mask, length, key_length, rows):
    """The keys a chunk of `rows` queries sees on average, by causality and the window
    (the whole `S` where they are not known while tracing)."""
    widths = []
    for start in range(0, length, rows):
        lo, hi = (0, key_length) if mask is None else mask.key_range(start, rows, key_length)
        if not (isinstance(lo, int) and isinstance(hi, int)):
            return key_length
        widths.append(hi - lo)
    return sum(widths) / max(len(widths), 1)


def dynamic_loop(policy):
    """The policy's `dynamic`, unless XLA compiles the graph being traced (TensorFlow's
    `jit_compile=True`, Keras's default there with a GPU): XLA's shapes are static,
    so the loop's chunks then visit their keys by blocks (`Policy.key_block`), as on
    JAX."""
    if not policy.dynamic:
        return False
    if backend.backend() == "tensorflow":
        from keras_mha import _keras_private

        return not _keras_private.tensorflow_xla_tracing()
    return True


@dataclasses.dataclass(frozen=True)
class Call:
    """What a call needs, as far as the choice of kernel goes.

    Attributes:
        scores: the attention scores are returned.
        rank4: one attention axis, projected `(B, T, N, H)` inputs.
        dropout: attention dropout applies.
        mask: the call's `AttentionMask`, or `None`.
        bias: an `attention_bias` is added to the logits.
        soft_cap: logits are soft-capped.
        sinks: the layer has attention sinks.
        score_mod: a score function changes the logits.
        same_head_dims: `key_dim == value_dim`.
        score_entries: `B x N x T x S` when known while tracing, else `None`.
        one_chunk: the chunked kernel would take the call's queries in one chunk
            (`T` known and at most its chunk size): no chunk skips a key.
    """

    scores: bool = False
    rank4: bool = True
    dropout: bool = False
    mask: object = None
    bias: bool = False
    soft_cap: bool = False
    sinks: bool = False
    score_mod: bool = False
    same_head_dims: bool = True
    score_entries: int | None = None
    one_chunk: bool = False


def choose(requested, call, policy):
    """The kernel for one call.

    Args:
        requested: `None`/"auto", or one of `IMPLEMENTATIONS` (the layer's
            `implementation`; `flash_attention=True` asks for "fused").
        call: a `Call`.
        policy: a `Policy`.

    Returns:
        One of `IMPLEMENTATIONS`. Scores and N-d attention take the explicit kernel,
        whatever was requested. "fused" becomes "chunked" where the backend's kernel
        lacks a feature the call needs (`fusable`); the automatic choice takes the
        explicit kernel for small calls (`Policy.explicit_up_to`).
    """
    if call.scores or not call.rank4:
        return "explicit"
    automatic = requested in (None, "auto")
    if automatic:
        requested = policy.kernel
    if requested == "fused" and not fusable(call, policy):
        requested = "chunked"
    if automatic and requested == "chunked" and _small(call, policy.explicit_up_to):
        requested = "explicit"
    return requested


def looks_for_cut(score_entries, mask, policy):
    """Whether a call looks for padded tails to cut (`Policy.sizes_from_data` and
    `Policy.cut_from`); `score_entries` is `None` where unknown."""
    if not policy.sizes_from_data or mask is None:
        return False
    if mask.causal or score_entries is None:
        return True
    return score_entries > policy.cut_from


def one_op_einsum(call, policy):
    """Whether the explicit kernel runs its products as one backend einsum op each
    (`Policy.one_op_einsum_up_to`)."""
    limit = policy.one_op_einsum_up_to
    return limit is not None and call.score_entries is not None and call.score_entries <= limit


def _small(call, limit):
    """The call's scores are known, at most `limit` entries, and no chunk would skip
    a key."""
    if limit is None or call.score_entries is None or call.score_entries > limit:
        return False
    mask = call.mask
    if mask is not None and mask.block_mask is not None:
        return call.one_chunk
    return mask is None or call.one_chunk or (not mask.causal and mask.window is None)


def fusable(call, policy=None):
    """Whether the backend's fused kernel takes this call: any mask (built chunk by
    chunk where it would otherwise be a `(T, S)` tensor) and a bias, but no dropout
    (the kernels draw their own), soft cap, sinks or score function (torch's
    `flex_attention` would take one on a GPU; not measured yet, so not taken), nor a
    block mask unless the policy says so (`Policy.fused_block_mask`; the chunked
    kernel skips empty blocks too)."""
    if call.dropout or call.soft_cap or call.sinks or call.score_mod:
        return False
    if call.mask is not None and call.mask.block_mask is not None:
        if policy is None or not policy.fused_block_mask:
            return False
    # JAX's kernel needs key_dim == value_dim.
    return backend.backend() != "jax" or call.same_head_dims
