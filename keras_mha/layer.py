"""`MultiHeadAttention`: configuration, build and call (orchestration only).

The math lives in `kernels.py`, the masks in `masks.py`, the einsum bookkeeping in
`equations.py` and argument checks in `checks.py`. Data flows one way:
call -> masks -> projections -> attention kernel -> output projection.
"""

import dataclasses
import functools
import inspect
import math

import keras
import numpy as np
from keras import constraints, initializers, ops, regularizers

from keras_mha import block_mask as block_mask_lib
from keras_mha import builtin_hooks, checks, equations, kernels, norms, projections, rope
from keras_mha import cache as cache_lib
from keras_mha import masks as masks_lib
from keras_mha import score_mod as score_mod_lib
from keras_mha import sinks as sinks_lib

# What a query row with no visible key gets: see the `fully_masked_rows` argument.
FULLY_MASKED_ROWS = ("zero", "builtin")
# Where attention dropout applies: see the `dropout_on` argument.
DROPOUT_ON = ("weights", "output", "weights_and_projected_output")
# Where the keys and values come from: see the `key_value_projection` argument.
KEY_VALUE_PROJECTIONS = ("separate", "tied", "none")
_MASK_ARGUMENTS = ("query_mask", "value_mask", "key_mask", "attention_mask")
# Packed rows: integer per-position arguments, given as lists too.
_ID_ARGUMENTS = ("segment_ids", "key_segment_ids", "positions", "key_positions")
# Call flags -> what `None` means: no causal mask, as the built-in reads it; the
# constructor's default for the scores.
_FLAG_ARGUMENTS = {
    "use_causal_mask": False,
    "return_attention_scores": None,
    "return_key_value": False,
}


@keras.saving.register_keras_serializable(package="keras_mha")
class MultiHeadAttention(builtin_hooks.BuiltinHooks, keras.layers.Layer):
    """Multi-head attention, a drop-in for `keras.layers.MultiHeadAttention`.

    For each head `i` (of `num_heads`), with `d = key_dim`:

        Q_i = query @ Wq_i + bq_i            (B, T, d)
        K_i = key   @ Wk_i + bk_i            (B, S, d)
        V_i = value @ Wv_i + bv_i            (B, S, value_dim)
        A_i = softmax(Q_i K_i^T * scale, masked)           (B, T, S)
        output = sum_i (A_i V_i) @ Wo_i + bo                (B, T, out)

    `scale` is `1 / sqrt(d)` unless given. With the options of recent models on (all
    off by default): Q_i and K_i RMS-normalised (`normalize_qk`), V_i too
    (`normalize_value`), then Q_i and K_i rotated by position (`rope_max_wavelength`);
    the logits soft-capped (`logit_soft_cap`), then `attention_bias` added, then
    masked; sink logits in the softmax's denominator (`use_sinks`). A score function
    (`score_mod`) changes the logits after the bias, before the masks.

    Same arguments, same weights (same order, names and shapes) and the same results
    as the built-in layer, on the tensorflow, jax and torch backends, with these
    differences, each one tested:

    1. The symbolic shape of the returned scores is right: `(B, N, T, S)` for a
       `(B, T, dim)` query and `(B, S, dim)` value, also with `attention_axes`.
    2. `value_dim != key_dim` works on every backend (the built-in fails on JAX).
    3. `return_attention_scores` may also be given to the constructor, as the
       layer's default; a call argument overrides it.
    4. `flash_attention=True` with scores requested returns the scores (that call
       uses the explicit kernel) instead of raising; with dropout it is accepted.
    5. A query row whose keys are all masked gets zero attention weights, hence a
       zero context (its output is the output projection's bias), with finite
       outputs and gradients, on every kernel and backend. The built-in gives it
       uniform weights (the mean of the values) on its default path and zero weights
       when it returns scores or has dropout; `fully_masked_rows="builtin"` (what
       `keras_mha.swap` builds) does the same.
    6. A model holding it, quantized (`model.quantize("int8" | "float8" | "int4")`),
       saves to `.keras` and loads back with the same outputs: the config records
       the projections' quantized dtype policies (Keras 3.15 rebuilds the built-in's
       projections in float on load, and the load fails).
    7. `mixed_float16` in a compiled (XLA) model on JAX's CPU predicts and trains
       (the built-in fails there: "The precision 'F16_F16_F32' is not supported by
       dot_general on CPU").
    8. An explicit `query_mask` call argument masks the queries; the built-in
       ignores it (it reads only the query's Keras mask). The output's Keras mask
       is the query's Keras mask (or none), as with the built-in.
    9. With `keep_input_masks=True` (off by default), the tensors passed in keep
       their Keras masks; by default they lose them, as with the built-in.

    Args:
        num_heads: Number of attention heads `N`.
        key_dim: Size `H` of each head for query and key (per head, not in total).
        value_dim: Size of each head for value; `None` means `key_dim`.
        dropout: Dropout rate, in [0, 1): on the attention weights, or where
            `dropout_on` says.
        use_bias: Whether the projections have biases (the output projection's:
            see `use_output_bias`).
        output_shape: Trailing output shape, an int or a tuple; `None` projects back
            to the query's last dimension.
        attention_axes: Axes attention runs over (an int or a tuple); `None` means
            every axis between batch and features. Negative axes count from the end
            of the input, whose last axis is features.
        sliding_window: `None`, a positive int `w`, or a pair `(left, right)` of
            non-negative ints. An int (the built-in's meaning): query `t` attends
            only to keys `s` with `|t - s| < w`; with `use_causal_mask`, to
            `t - w < s <= t`, the `w` latest keys including its own. A pair (an
            asymmetric window, FlashAttention's `window_size` convention): keys
            `t - left <= s <= t + right`, `left` keys before its own and `right`
            after; `w` is `(w - 1, w - 1)`. Models state windows two ways: as
            `t - s < W` (keras-hub's Gemma 1-4, Qwen and Mistral masks, Keras's
            built-in): pass `W`; as `t - s <= W`, `W` keys before the query plus
            its own (keras-hub's GPT-OSS): pass `W + 1`. EmbeddingGemma's
            bidirectional window of size `W` is `(W - W // 2 - 1, W // 2)`. With a
            cache, `t` is the query's position `cache_update_index + t`, so
            decoding keeps the same window.
        flash_attention: `None` (the Keras default), `True` or `False`; passed to the
            backend's fused kernel when that kernel runs.
        kernel_initializer: Initializer of the projections' kernels.
        bias_initializer: Initializer of the projections' biases.
        kernel_regularizer: Regularizer of the projections' kernels.
        bias_regularizer: Regularizer of the projections' biases.
        activity_regularizer: Regularizer of the projections' outputs.
        kernel_constraint: Constraint on the projections' kernels.
        bias_constraint: Constraint on the projections' biases.
        use_gate: Adds a sigmoid gate `sigmoid(query @ Wg + bg)` that multiplies the
            attention output per head before the output projection.
        seed: Seed of the attention dropout.
        return_attention_scores: Default for the call argument of the same name.
        implementation: Which attention kernel runs: `None`/"auto" (the backend's
            entry in `kernels.policy.POLICIES`: "fused" on torch and on JAX with a
            GPU, "chunked" elsewhere), "explicit" (materialises the scores), "fused"
            (the backend's fused kernel; a mask it cannot take whole is built per
            chunk of queries), or "chunked" (chunks of queries, forward and
            backward; never the whole `(T, S)` scores). Calls that return scores or
            use N-d attention run "explicit"; dropout in training, `logit_soft_cap`
            and `use_sinks`, which the fused kernels lack, run "chunked".
        chunk_size: Query rows per chunk of the chunked kernel (and of the fused
            one where it builds its mask by chunks); `None` takes the policy's size
            for the backend (`kernels.policy.POLICIES`), chosen when the layer runs,
            so a saved layer re-chooses where it loads.
        num_key_value_heads: Grouped-query attention: number `Nkv` of key/value
            heads, a divisor of `num_heads` (1 is multi-query attention); `None`
            means `num_heads`. Key/value kernels are `(dim, Nkv, key_dim/value_dim)`
            and each serves `num_heads / Nkv` adjacent query heads, as in
            `keras.layers.GroupQueryAttention`, whose weights load with `set_weights`.
        normalize_qk: QK-norm: RMS-normalise the projected queries and keys over the
            head dimension, each with a learned `(key_dim,)` scale (weights
            `query_norm/scale`, `key_norm/scale`, created after all the others).
        logit_soft_cap: `None` or a positive float `c`: logits become
            `c * tanh(logits / c)` before the bias and the masks.
        use_sinks: A learned logit per head (weight `sinks/sinks`, `(num_heads,)`,
            zeros at first, created last) in every row's softmax denominator: a
            query may attend to nothing; returned scores then sum to less than 1.
        rope_max_wavelength: `None` or a positive number: rotary position
            embedding of the projected queries and keys (after QK-norm), exactly
            `keras_hub.layers.RotaryEmbedding(max_wavelength, scaling_factor)`;
            positions are `cache_update_index + t` when decoding. Needs an even
            `key_dim` and `(B, T, dim)` inputs.
        rope_scaling_factor: Positions are divided by it (position interpolation,
            keras-hub's "linear" scaling: Mistral, Qwen, Gemma 3's global layers,
            Gemma 4), with every `rope_scaling` variant too.
        rope_scaling: `None` or a dict of plain data naming a RoPE variant of
            keras-hub's language models by its "type" (`keras_mha.rope` has the
            formulas; a missing optional key takes the default shown):
            `{"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}` (Llama 3.1+'s frequency
            smoothing); `{"type": "yarn", "factor", "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 4096,
            "truncate": True, "attention_factor": None}` (GPT-OSS: set "truncate"
            to `False`; `cos`/`sin` times `attention_factor`, by default `0.1 *
            ln(factor) + 1`); `{"type": "longrope", "short_factor",
            "long_factor", "original_max_position_embeddings",
            "max_position_embeddings": None, "attention_factor": None}` (Phi-3's
            LongRoPE: `rope_dim / 2` factors each; the long ones apply when
            `cache_update_index + T > original_max_position_embeddings`, as
            keras-hub decides); `{"type": "mrope", "sections": [s_t, s_h, s_w]}`
            (Qwen3.5's interleaved multimodal RoPE: `positions` may then be
            `(B, 3, T)`, one stream each for time, height and width; `(B, T)`
            positions or none give plain RoPE, keras-hub's text-only path).
        rope_dim: `None` (every dimension of each head rotates) or an even number
            of dimensions, at most `key_dim`, that rotate (partial rotary; see
            `rope_dim_layout`); the others pass through.
        rope_dim_layout: Where the `rope_dim` rotated dimensions sit: "prefix"
            (the first `rope_dim`, rotated as a head of `rope_dim`: GPT-NeoX's
            `rotary_percentage`, Qwen3.5's `partial_rotary_factor`) or
            "proportional" (the first `rope_dim / 2` of each half of the head, at
            the whole head's frequencies: Gemma 4's `rope_partial_rotary_factor`).
        rope_interleaved: Rotate the pairs `(x[2i], x[2i + 1])` (RoFormer-v2)
            instead of keras-hub's halves `(x[i], x[i + H/2])`.
        fully_masked_rows: What a query row whose keys are all masked gets: "zero"
            (zero weights, so its output is the output projection's bias, on every
            path; difference 5) or "builtin": what the built-in gives it, the mean of
            all the values (uniform weights) where the built-in runs
            `ops.dot_product_attention` (no dropout on the weights, no scores requested,
            one attention axis) and that kernel gives the mean (not torch's CUDA
            kernels), zero weights elsewhere. `keras_mha.swap` and
            `swapped()` build ours with "builtin", so a moved model predicts as before
            where padded query rows reach its output (e.g. pooled after `x + attention`).
        keep_input_masks: Opt-in, off by default (a difference from the built-in
            when on): the `query`, `value` and `key` tensors passed in keep their
            Keras masks after the call. By default they lose them, as with the
            built-in, so mask-aware layers that read those tensors afterwards (a
            residual add, pooling, recurrent layers, the loss) see what they see
            with the built-in.
        scale: `None` or a positive float: the logits are `(Q_i * scale) K_i^T`;
            `None` means `1 / sqrt(key_dim)`. Gemma 2 and 3 and T5Gemma use
            `query_pre_attn_scalar ** -0.5` (keras-hub: `1 / sqrt(hidden_dim //
            num_heads)` where `query_head_dim_normalize=False`); Gemma 3n, Gemma 4
            and T5 use 1.0. Every kernel takes it (the fused ones as their `scale`).
        use_output_bias: `None` (the default: `use_bias`) or a bool: whether the
            output projection has a bias. `use_bias=True, use_output_bias=False` is
            Qwen 2/2.5, Qwen-MoE and SmolLM3's attention (biases on the query, key
            and value projections only): 7 weights, the built-in's order without
            `attention_output/bias`.
        norm_epsilon: Added to the mean square in the layer's RMS norms
            (`normalize_qk`, `normalize_value`); 1e-6 by default. Qwen3 and Gemma 3
            pass their `layer_norm_epsilon`.
        norm_unit_offset: With `normalize_qk`: the norms' learned scales are
            offsets from 1, `x_hat * (1 + w)` with `w` initialised to zeros, the
            parametrisation of Gemma 3, Qwen3.5 and T5Gemma 2 (whose checkpoints
            hold `w`); by default `x_hat * w` with `w` initialised to ones (Qwen3,
            Gemma 4). The norms compute in float32 inside, as keras-hub's do.
        normalize_value: RMS-normalise the projected values over `value_dim`, with
            no learned scale (so no weight), before the cache is written: the value
            norm of Gemma 3n and Gemma 4.
        score_mod: `None`, a `keras_mha.score_mod.ScoreMod` (`alibi`, `soft_cap`,
            `relative_position`, ...) or a function `fn(score, b, h, q_idx, kv_idx)`
            of `keras.ops` code over the logits after the soft cap and the bias,
            before the masks (FlexAttention's `score_mod`; the shapes in
            `keras_mha.score_mod`). `q_idx` is the query's position, with a cache
            `cache_update_index + t`. The call argument of the same name overrides
            it. Calls with one run the chunked or the explicit kernel (not the fused
            ones), `(B, T, dim)` inputs only. Saved in the config only when named
            and reading no tensor. The layer does not track the tensors a score
            function reads: own a learned bias table in your model and pass it per
            call (the call argument).
        dropout_on: Where `dropout` applies: "weights" (the default, the
            built-in's: the attention weights after the softmax; the mask is a hash
            of the seed and each weight's position, the same on every kernel and
            backend for the same seed); "output": the attention output
            `(B, T, N, value_dim)`, just before the output projection, as keras-hub's
            Llama, Mistral, Qwen, Phi-3 and GPT-OSS attention drop it (a
            `keras.layers.Dropout` drawing from the layer's `seed`: the same masks
            for the same seed on one backend, other masks on another). With
            "output", training calls keep the fused kernel. Or
            "weights_and_projected_output": the attention weights (as "weights"),
            then, at the same rate, the layer's output `(B, T, out)` after the
            output projection and its bias (a `keras.layers.Dropout` as
            "output"), as keras-hub's Bloom attention drops both.
        key_value_projection: Where the keys and values come from: "separate" (the
            default: a key and a value projection), "tied" (one key projection: the
            values are its output before the key norm and RoPE, then the value norm
            if `normalize_value`; Gemma 4's `attention_k_eq_v` global layers: no
            `value` weights, needs `value_dim == key_dim`) or "none" (no key or
            value projection nor key norm: every call attends over keys and values
            another layer computed, its `shared_key_value`; the KV-shared layers of
            Gemma 4). Any layer may be given `shared_key_value`; with "none" it must.
        **kwargs: Base `Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        query: `(B, T, dim)` or, with N-d attention, `(B, ..., dim)`.
        value: `(B, S, dim_v)`, same rank as `query`.
        key: Optional `(B, S, dim_k)`; `None` uses `value`.
        query_mask: Optional `(B, T)` padding mask of the query.
        value_mask: Optional `(B, S)` padding mask of the value.
        key_mask: Optional `(B, S)` padding mask of the key. Keras implicit masks
            (`Embedding(mask_zero=True)`, `Masking`) on the inputs fill these three
            automatically; the query's Keras mask is set on the output, and the
            inputs' Keras masks are removed, as the built-in does (see
            `keep_input_masks`).
        attention_mask: Optional mask broadcastable to the scores as the built-in
            broadcasts it: `(T, S)`, `(B, T, S)` or, per head, `(B, N, T, S)` (for
            N-d attention, missing axes are inserted before the query attention
            dims). Bool, int or float (also a list); `True`/non-zero means "may
            attend".
        return_attention_scores: If `True`, return `(output, scores)`; `None` uses
            the constructor's value.
        training: Whether dropout applies.
        use_causal_mask: Query `t` attends only to keys `s <= t`. Flags take Python
            or NumPy bools and ints, as the built-in reads them.
        cache: Optional KV cache `(B, 2, max_length, Nkv, key_dim)` (see
            `init_cache`; needs `value_dim == key_dim` and `(B, T, dim)` inputs).
            Attention then runs over the cache's `max_length` positions: masks over
            keys (`value_mask`, `key_mask`, `attention_mask`) cover those positions.
        cache_update_index: With a cache, where the new keys and values are written
            (a Python int or a scalar integer tensor); queries sit at positions
            `cache_update_index + t`, which the causal and window masks follow, so
            with `use_causal_mask=True` unwritten positions are never attended. Without
            causal masking, pass an `attention_mask` that hides them. `None` uses the
            cache as it is (e.g. cross-attention over a precomputed cache).
        cache_update_mask: Optional `(B, T)` flags (bool or 0/1) with a
            `cache_update_index`: where false, the cache keeps what it holds at that
            position instead of the new key and value, and attention reads the kept
            entry (Gemma 3's decoding protocol, where a prompt's own positions stay
            prefilled).
        attention_bias: Optional float tensor broadcastable to the scores
            `(B, N, T, S)` (with a cache, `S` is its length), added to the logits:
            ALiBi, relative position bias, any learned bias (it gets gradients).
        segment_ids: Optional `(B, T)` integer document ids of packed rows: a
            query attends only to keys of its own document. Id 0 is padding: such
            a query attends to nothing (zero output), such a key is seen by no
            query. Combines with every other mask. With RoPE and no `positions`,
            positions restart at 0 wherever the id changes (`rope.segment_positions`;
            not with a cache, whose positions stay `cache_update_index + t`).
            `(B, T, dim)` inputs only.
        key_segment_ids: Optional `(B, S)` document ids of the keys (with a cache,
            `S` is its length); `None` uses `segment_ids` (self-attention). Needed
            when the keys are not the queries.
        positions: Optional `(B, T)` integer RoPE positions per token, replacing
            `cache_update_index + t` (or those derived from `segment_ids`) for the
            queries and the new keys. Needs `rope_max_wavelength`. With
            `rope_scaling={"type": "mrope", ...}`, also `(B, 3, T)`: time, height
            and width positions per token.
        score_mod: Optional score function for this call (see the constructor
            argument), e.g. `score_mod.relative_bias(table, max_distance)` reading a
            trainable table the caller owns; its floating tensors get gradients.
        key_positions: Optional `(B, S)` integer RoPE positions of the keys passed
            (the new ones, with a cache), when they are not the queries'
            (`positions`, or `cache_update_index + s`): e.g. queries rotated at
            `t` while the keys sit at `cache_update_index + s`, what keras-hub's
            GPT-NeoX computes when decoding. `None` rotates them as the queries.
            Needs `rope_max_wavelength`; M-RoPE also takes `(B, 3, S)`.
        mask_mod: Optional attention pattern as code: a function
            `(b, h, q_idx, kv_idx) -> bool` written in `keras.ops` over broadcast
            int32 index tensors, or a `BlockMask` built from one by
            `keras_mha.block_mask.create_block_mask` (build it once, outside any
            `jit`, and pass it to every layer and step). ANDed with every other
            mask; the chunked kernel never computes the blocks it leaves empty
            (see the guide, "Attention patterns"). With a cache, `q_idx` is the
            query's position `cache_update_index + t`, and a `BlockMask` covers the
            cache's positions. A function is evaluated once per function and
            lengths, which must be known when tracing. `(B, T, dim)` inputs only.
        shared_key_value: Optional `(B, 2, S, Nkv, key_dim)` keys and values that
            another layer computed, in the cache's layout (`[:, 0]` keys, `[:, 1]`
            values, projected, normed and rotated): another layer's returned `cache`
            or its `return_key_value` output (KV sharing across layers: Gemma 3n and
            Gemma 4). Attention then runs over those `S` positions, as over a cache
            it does not write: this layer's own key and value projections (if any)
            are not used, `key` and `value` are not projected (pass the query);
            masks over keys cover the `S` positions; with `cache_update_index`, the
            queries sit at `cache_update_index + t` (RoPE, causal and window masks)
            as when decoding. Not with `cache`; needs `value_dim == key_dim`.
        return_key_value: If `True`, also return the keys and values attention ran
            over, `(B, 2, S, Nkv, key_dim)` in the cache's layout, last: for a later
            layer's `shared_key_value`. With a cache they are the updated cache
            (returned once); with `shared_key_value`, that tensor.

    Returns:
        output: `(B, T, dim)`, or `(B, T) + output_shape` when given.
        scores: (if requested) `(B, N, T, S)`; for N-d attention
            `(B, <other axes>, N, <query attention axes>, <key attention axes>)`.
        cache: (if a cache is given) the updated cache, last in the returned tuple;
            else, with `return_key_value`, the call's keys and values, last.

    FAQ, on conventions that confuse people:

    - `key_dim` is the size of *each* head, not the model width: `key_dim=64`
      with 8 heads on a 512-wide input is the classic "512 / 8"; nothing requires
      `key_dim` to equal the input's last dimension.
    - Kernels are `(dim, num_heads, key_dim)`, not `(dim, dim)`: query/key/value
      kernels `(dim, N, H)`, their biases `(N, H)`, the output kernel `(N, Hv, dim)`
      and bias `(dim,)`. With biases there are 8 weights, not 4. Reshaping a
      `(dim, N, H)` kernel to `(dim, N * H)` gives the usual fused matrix: h
      per-head `(dim -> H)` projections are exactly one stacked projection.
    - PyTorch's `nn.MultiheadAttention` packs `in_proj_weight` as `(3 * E, E)`,
      rows `[Wq; Wk; Wv]`, each `(E, E)` used as `x @ W.T`; our query kernel is
      `Wq.T.reshape(E, N, E // N)` (see `keras_mha.interop`).
    - The returned scores are the attention weights after the softmax and before
      dropout.
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        attention_axes=None,
        sliding_window=None,
        flash_attention=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        use_gate=False,
        seed=None,
        return_attention_scores=False,
        implementation=None,
        chunk_size=None,
        num_key_value_heads=None,
        normalize_qk=False,
        logit_soft_cap=None,
        use_sinks=False,
        rope_max_wavelength=None,
        rope_scaling_factor=1.0,
        rope_scaling=None,
        rope_dim=None,
        rope_dim_layout="prefix",
        rope_interleaved=False,
        fully_masked_rows="zero",
        keep_input_masks=False,
        scale=None,
        use_output_bias=None,
        norm_epsilon=1e-6,
        norm_unit_offset=False,
        normalize_value=False,
        dropout_on="weights",
        score_mod=None,
        key_value_projection="separate",
        **kwargs,
    ):
        num_heads = checks.positive_int("num_heads", num_heads)
        num_key_value_heads = checks.positive_int(
            "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        if num_key_value_heads is not None and num_heads % num_key_value_heads:
            raise checks.invalid(
                "num_key_value_heads",
                f"a divisor of num_heads={num_heads}",
                num_key_value_heads,
                keras_wording=checks.KERAS_KV_HEADS,
            )
        normalize_qk = checks.flag("normalize_qk", normalize_qk)
        key_dim = checks.positive_int("key_dim", key_dim)
        logit_soft_cap = checks.positive_number("logit_soft_cap", logit_soft_cap, allow_none=True)
        use_sinks = checks.flag("use_sinks", use_sinks)
        rope_max_wavelength = checks.positive_number(
            "rope_max_wavelength", rope_max_wavelength, allow_none=True
        )
        rope_scaling_factor = checks.positive_number("rope_scaling_factor", rope_scaling_factor)
        rope_scaling, rope_dim, rope_dim_layout, rope_interleaved = rope.check_options(
            key_dim, rope_scaling, rope_dim, rope_dim_layout, rope_interleaved
        )
        keep_input_masks = checks.flag("keep_input_masks", keep_input_masks)
        if rope_max_wavelength is None:
            for name, value, default in (
                ("rope_scaling", rope_scaling, None),
                ("rope_dim", rope_dim, None),
                ("rope_interleaved", rope_interleaved, False),
            ):
                if value != default:
                    expected = f"{default!r} without rotary embeddings (`rope_max_wavelength`)"
                    raise checks.invalid(name, expected, value)
        whole_halves = rope_dim is None or rope_dim_layout == "proportional"
        if rope_max_wavelength is not None and key_dim % 2 and whole_halves:
            raise checks.invalid(
                "key_dim", "an even size per head to rotate with `rope_max_wavelength`", key_dim
            )
        value_dim = checks.positive_int("value_dim", value_dim, allow_none=True)
        dropout = checks.rate("dropout", dropout)
        use_bias = checks.flag("use_bias", use_bias)
        output_shape = checks.output_shape(output_shape)
        attention_axes = checks.attention_axes(attention_axes)
        sliding_window = checks.sliding_window(sliding_window)
        flash_attention = checks.flag("flash_attention", flash_attention, allow_none=True)
        use_gate = checks.flag("use_gate", use_gate)
        seed = checks.integer("seed", seed, allow_none=True)
        return_attention_scores = checks.flag("return_attention_scores", return_attention_scores)
        if implementation == "auto":
            implementation = None
        checks.one_of("implementation", implementation, (None,) + kernels.IMPLEMENTATIONS)
        chunk_size = checks.positive_int("chunk_size", chunk_size, allow_none=True)
        checks.one_of("fully_masked_rows", fully_masked_rows, FULLY_MASKED_ROWS)
        scale = checks.positive_number("scale", scale, allow_none=True)
        use_output_bias = checks.flag("use_output_bias", use_output_bias, allow_none=True)
        norm_epsilon = checks.positive_number("norm_epsilon", norm_epsilon)
        norm_unit_offset = checks.flag("norm_unit_offset", norm_unit_offset)
        normalize_value = checks.flag("normalize_value", normalize_value)
        checks.one_of("dropout_on", dropout_on, DROPOUT_ON)
        score_mod = score_mod_lib.get(score_mod)
        checks.one_of("key_value_projection", key_value_projection, KEY_VALUE_PROJECTIONS)
        if key_value_projection == "tied" and value_dim not in (None, key_dim):
            raise checks.invalid(
                "value_dim",
                f"`None` or key_dim={key_dim} with key_value_projection='tied' (the values "
                "are the key projection's output)",
                value_dim,
            )
        super().__init__(**kwargs)
        self.supports_masking = True
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._value_dim = value_dim if value_dim else key_dim
        self._dropout = dropout
        self._use_bias = use_bias
        self._use_gate = use_gate
        self._output_shape = output_shape
        self._attention_axes = attention_axes
        self._sliding_window = sliding_window
        self._flash_attention = flash_attention
        self._kernel_initializer = initializers.get(kernel_initializer)
        self._bias_initializer = initializers.get(bias_initializer)
        self._kernel_regularizer = regularizers.get(kernel_regularizer)
        self._bias_regularizer = regularizers.get(bias_regularizer)
        self._activity_regularizer = regularizers.get(activity_regularizer)
        self._kernel_constraint = constraints.get(kernel_constraint)
        self._bias_constraint = constraints.get(bias_constraint)
        self.seed = seed
        self._return_attention_scores = return_attention_scores
        self._implementation = implementation
        self._chunk_size = chunk_size
        self._num_key_value_heads = num_key_value_heads or num_heads
        self._normalize_qk = normalize_qk
        self._logit_soft_cap = logit_soft_cap
        self._use_sinks = use_sinks
        self._rope_max_wavelength = rope_max_wavelength
        self._rope_scaling_factor = rope_scaling_factor
        self._rope_scaling = rope_scaling
        self._rope_dim = rope_dim
        self._rope_dim_layout = rope_dim_layout
        self._rope_interleaved = rope_interleaved
        self._fully_masked_rows = fully_masked_rows
        self._keep_input_masks = keep_input_masks
        self._scale = scale
        # The built-in's attribute, read by its explicit path and by subclasses written
        # for it: the logits' scale, `scale` where one is given.
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(key_dim)) if scale is None else scale
        self._use_output_bias = use_output_bias
        self._output_bias = use_bias if use_output_bias is None else use_output_bias
        self._norm_epsilon = norm_epsilon
        self._norm_unit_offset = norm_unit_offset
        self._normalize_value = normalize_value
        self._dropout_on = dropout_on
        self._score_mod = score_mod
        self._key_value_projection = key_value_projection

    # ------------------------------------------------------------------ properties
    @property
    def num_heads(self):
        return self._num_heads

    @property
    def key_dim(self):
        return self._key_dim

    @property
    def value_dim(self):
        return self._value_dim

    @property
    def num_key_value_heads(self):
        return self._num_key_value_heads

    @property
    def dropout(self):
        return self._dropout

    @property
    def use_bias(self):
        return self._use_bias

    @property
    def attention_axes(self):
        return self._attention_axes

    @property
    def query_dense(self):
        return self._query_dense

    @property
    def key_dense(self):
        """The key projection; `None` with `key_value_projection="none"`."""
        return self._key_dense

    @property
    def value_dense(self):
        """The value projection; `None` with `key_value_projection` "tied" or "none"."""
        return self._value_dense

    @property
    def output_dense(self):
        return self._output_dense

    def __dir__(self):
        # Each projection is reachable as `query_dense` and `_query_dense`. Keras's
        # loader walks `dir()`: after a failed load it revisits the private alias
        # with an empty store and reports "received 0 variables" instead of the
        # real shape mismatch. Listing each sublayer once keeps the real error.
        names = super().__dir__()
        public = set(names)
        return [n for n in names if not (n.startswith("_") and n[1:] in public)]

    # ---------------------------------------------------------------------- config
    def get_config(self):
        config = {
            "num_heads": self._num_heads,
            "key_dim": self._key_dim,
            "value_dim": self._value_dim,
            "dropout": self._dropout,
            "use_bias": self._use_bias,
            "use_gate": self._use_gate,
            "output_shape": self._output_shape,
            "attention_axes": self._attention_axes,
            "sliding_window": self._sliding_window,
            "flash_attention": self._flash_attention,
            "kernel_initializer": initializers.serialize(self._kernel_initializer),
            "bias_initializer": initializers.serialize(self._bias_initializer),
            "kernel_regularizer": regularizers.serialize(self._kernel_regularizer),
            "bias_regularizer": regularizers.serialize(self._bias_regularizer),
            "activity_regularizer": regularizers.serialize(self._activity_regularizer),
            "kernel_constraint": constraints.serialize(self._kernel_constraint),
            "bias_constraint": constraints.serialize(self._bias_constraint),
            "seed": self.seed,
            "return_attention_scores": self._return_attention_scores,
            "implementation": self._implementation,
            "chunk_size": self._chunk_size,
            "num_key_value_heads": self._num_key_value_heads,
            "normalize_qk": self._normalize_qk,
            "logit_soft_cap": self._logit_soft_cap,
            "use_sinks": self._use_sinks,
            "rope_max_wavelength": self._rope_max_wavelength,
            "rope_scaling_factor": self._rope_scaling_factor,
            "rope_scaling": rope.plain(self._rope_scaling),
            "rope_dim": self._rope_dim,
            "rope_dim_layout": self._rope_dim_layout,
            "rope_interleaved": self._rope_interleaved,
            "fully_masked_rows": self._fully_masked_rows,
            # Quantized projections are rebuilt quantized (see `policy_for_config`).
            "dtype": keras.dtype_policies.serialize(projections.policy_for_config(self)),
            "keep_input_masks": self._keep_input_masks,
            "scale": self._scale,
            "use_output_bias": self._use_output_bias,
            "norm_epsilon": self._norm_epsilon,
            "norm_unit_offset": self._norm_unit_offset,
            "normalize_value": self._normalize_value,
            "dropout_on": self._dropout_on,
            "score_mod": score_mod_lib.config(self._score_mod),
            "key_value_projection": self._key_value_projection,
        }
        return {**super().get_config(), **config}

    # ----------------------------------------------------------------------- build
    def build(self, query_shape, value_shape, key_shape=None):
        """Creates the projections, in the built-in layer's order and names.

        Args:
            query_shape: `(B, T, dim)` or `(B, ..., dim)`.
            value_shape: `(B, S, dim_v)`, same rank.
            key_shape: Optional `(B, S, dim_k)`; `None` means `value_shape`.
        """
        query_shape, value_shape, key_shape = checks.input_shapes(
            query_shape, value_shape, key_shape, building=True
        )
        rank = len(query_shape)
        # Validated before any state exists, so a rejected build leaves nothing.
        normalized_axes = checks.attention_axes_for_rank(self._attention_axes, rank)
        if self._rope_max_wavelength is not None and rank != 3:
            raise checks.invalid(
                "query",
                "rank-3 (B, T, dim) inputs with `rope_max_wavelength` (positions run along "
                "one sequence axis)",
                f"shape {tuple(query_shape)}",
            )
        checks.free_axes(query_shape, value_shape, normalized_axes)
        if self._score_mod is not None:
            _check_score_mod_rank(rank, normalized_axes)

        self._query_dense = self._projection(rank, self._num_heads, self._key_dim, "query")
        self._query_dense.build(query_shape)
        kv_heads = self._num_key_value_heads
        projects = self._key_value_projection
        self._key_dense = self._value_dense = None
        if projects != "none":
            self._key_dense = self._projection(rank, kv_heads, self._key_dim, "key")
            self._key_dense.build(key_shape)
        if self._use_gate:
            self._gate_dense = self._projection(
                rank, self._num_heads, self._value_dim, "gate", activation="sigmoid"
            )
            self._gate_dense.build(query_shape)
        if projects == "separate":
            self._value_dense = self._projection(rank, kv_heads, self._value_dim, "value")
            self._value_dense.build(value_shape)

        self._attention_axes = normalized_axes
        self._build_attention(rank + 1)
        self._output_dense = self._make_output_dense(
            query_shape, self._get_common_kwargs_for_sublayer(), "attention_output"
        )
        self._output_dense.build(tuple(query_shape[:-1]) + (self._num_heads, self._value_dim))
        if self._normalize_qk:
            # Created last, so the first weights stay those of the built-in layer.
            self._query_norm = self._norm("query_norm", self._key_dim)
            if projects != "none":
                self._key_norm = self._norm("key_norm", self._key_dim)
        if self._normalize_value:
            # No weight: the weights' list and order stay as they are.
            self._value_norm = self._norm("value_norm", self._value_dim, use_scale=False)
        if self._use_sinks:
            # Created last, after QK-norm's scales: the earlier weights keep their order.
            self._sinks = sinks_lib.Sinks(self._num_heads, name="sinks", dtype=self.dtype_policy)
            self._sinks.build()
        self._built_shapes = (query_shape, value_shape, key_shape)

    def _norm(self, name, size, use_scale=True):
        """A built `norms.RMSNorm` over heads of `size` channels, the layer's kind."""
        norm = norms.RMSNorm(
            epsilon=self._norm_epsilon,
            unit_offset=self._norm_unit_offset,
            use_scale=use_scale,
            name=name,
            dtype=self.dtype_policy,
        )
        norm.build((None, size))
        return norm

    def _projection(self, rank, heads, size, name, activation=None):
        equation, bias_axes, output_rank = equations.projection_equation(
            rank - 1, bound_dims=1, output_dims=2
        )
        return projections.Projection(
            equation,
            output_shape=equations.projection_output_shape(output_rank, [heads, size]),
            bias_axes=bias_axes if self._use_bias else None,
            activation=activation,
            name=name,
            **self._get_common_kwargs_for_sublayer(),
        )

    # ------------------------------------------------------------------------ call
    def __call__(self, *args, **kwargs):
        try:
            bound = _call_signature(type(self)).bind(*args, **kwargs)
        except TypeError:
            bound = None  # a wrong signature: Keras reports it
        if bound is not None:
            args, kwargs = _as_the_builtin_reads_them(bound, args, kwargs)
            if type(self).call is MultiHeadAttention.call:
                # A subclass's own `call` gives its arguments its own meaning.
                checks.call_arguments(
                    bound.arguments,
                    self._attention_axes,
                    self._num_heads,
                    rotates=self._rope_max_wavelength is not None,
                    position_streams=self._position_streams(),
                )
                # Before Keras builds the layer: a rejected call leaves no weights.
                query = bound.arguments.get("query")
                if hasattr(query, "shape"):
                    self._check_shared(
                        query, bound.arguments.get("cache"), bound.arguments.get("shared_key_value")
                    )
        return super().__call__(*args, **kwargs)

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=None,
        training=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
        attention_bias=None,
        segment_ids=None,
        key_segment_ids=None,
        positions=None,
        cache_update_mask=None,
        key_positions=None,
        score_mod=None,
        mask_mod=None,
        shared_key_value=None,
        return_key_value=False,
    ):
        if key is None:
            key = value
        # The built-in sets the query's Keras mask (not an explicit `query_mask`) on
        # the output, and removes the inputs' Keras masks (`_project`).
        callers_tensors = (query, value, key)
        output_mask = masks_lib.get_keras_mask(query)
        if query_mask is None:
            query_mask = output_mask
        value, key = (self._broadcast_free_axes(query, x) for x in (value, key))
        need_scores = self._wants_scores(return_attention_scores)
        self._check_shared(query, cache, shared_key_value)
        cache_update_index = self._check_cache(
            query, cache, cache_update_index, shared=shared_key_value is not None
        )
        if shared_key_value is not None:
            checks.cache_update_mask(cache_update_mask, None, tuple(query.shape))
        checks.cache_update_mask(cache_update_mask, cache_update_index, tuple(query.shape))
        # The keys attention runs over: the call's, a cache's or another layer's.
        held = cache if shared_key_value is None else shared_key_value
        self._check_call(
            query,
            value,
            key,
            query_mask,
            value_mask,
            key_mask,
            attention_mask,
            key_length=None if held is None else held.shape[2],
        )
        keys = tuple(key.shape) if held is None else (None, held.shape[2])
        checks.attention_bias(
            attention_bias,
            checks.scores_shape(tuple(query.shape), keys, self._attention_axes, self._num_heads),
        )

        own_keys = shared_key_value is None
        projected_query, projected_key, projected_value, gate = self._project(
            query, key, value, callers_tensors, own_keys
        )
        if self._normalize_qk or self._normalize_value:
            normalize = self._norm_caller(projected_query)
        if self._normalize_qk:
            projected_query = normalize(self._query_norm, projected_query)
            if own_keys:
                projected_key = normalize(self._key_norm, projected_key)
        if self._normalize_value and own_keys:
            projected_value = normalize(self._value_norm, projected_value)
        if self._rope_max_wavelength is not None:
            # Queries and the new keys sit at `cache_update_index + t` when decoding.
            start = 0 if cache_update_index is None else cache_update_index
            if positions is None and segment_ids is not None and held is None:
                positions = rope.segment_positions(segment_ids)  # restart per document
            projected_query = self._rotate(projected_query, start, positions)
            if key_positions is None:
                key_positions = positions
            if own_keys:
                projected_key = self._rotate(projected_key, start, key_positions)
        if cache is not None:
            if cache_update_index is not None:
                cache = cache_lib.update(
                    cache, projected_key, projected_value, cache_update_index, cache_update_mask
                )
            projected_key, projected_value = cache_lib.split(cache)
        elif not own_keys:
            shared_key_value = ops.cast(shared_key_value, self.compute_dtype)
            projected_key, projected_value = cache_lib.split(shared_key_value)
        elif return_key_value:
            shared_key_value = ops.stack([projected_key, projected_value], axis=1)
        projected_key, projected_value = self._repeat_key_value_heads(
            projected_key, projected_value
        )
        masks = dict(
            query_mask=query_mask,
            value_mask=value_mask,
            key_mask=key_mask,
            attention_mask=attention_mask,
            use_causal_mask=use_causal_mask,
            # Decoding: the new queries sit at `cache_update_index ...` in the cache.
            query_offset=cache_update_index,
        )
        overridden = type(self)._compute_attention is not MultiHeadAttention._compute_attention
        described = not (overridden or builtin_hooks.overrides_mask_hooks(self))
        if described:
            mask = self._describe_masks(projected_query, projected_key, **masks)
        else:
            # Hooks overridden as for the built-in (`_compute_attention`, the mask
            # and softmax hooks) see its dense mask, causality merged in.
            mask = self._compute_attention_mask(
                query, value if held is None else projected_key, **masks
            )
        if segment_ids is not None:
            mask = self._with_segments(mask, segment_ids, key_segment_ids, described)
        if mask_mod is not None:
            mask = self._with_block_mask(
                mask, mask_mod, projected_query, projected_key, cache_update_index, described
            )
        bias = {} if attention_bias is None else {"attention_bias": attention_bias}
        score_mod = self._score_mod if score_mod is None else score_mod_lib.get(score_mod)
        if score_mod is not None:
            _check_score_mod_rank(len(query.shape), self._attention_axes)
            bias["score_mod"] = score_mod.at(cache_update_index)
        attention_output, scores = self._compute_attention(
            projected_query, projected_key, projected_value, mask, training, need_scores, **bias
        )
        if gate is not None:
            attention_output = ops.multiply(attention_output, gate)
        if self._dropout_on == "output" and self._dropout > 0.0:
            attention_output = self._dropout_layer(attention_output, training=training)
        output = self._output_dense(attention_output)
        if self._dropout_on == "weights_and_projected_output" and self._dropout > 0.0:
            output = self._dropout_layer(output, training=training)
        if output_mask is not None:
            masks_lib.set_keras_mask(output, output_mask)
        if need_scores and len(query.shape) == 3:
            self._mask_scores(scores, query, value if held is None else projected_key, masks)
        if cache is None and return_key_value:
            cache = shared_key_value  # the keys and values attended over
        if cache is not None:
            return (output, scores, cache) if need_scores else (output, cache)
        return (output, scores) if need_scores else output

    def init_cache(self, batch_size, max_length, dtype=None):
        """An empty KV cache `(batch_size, 2, max_length, num_key_value_heads, key_dim)`.

        Zeros in `dtype` (default: the layer's compute dtype), for the `cache`
        call argument; needs `value_dim == key_dim`.
        """
        cache_lib.check_layout(self._value_dim, self._key_dim)
        return cache_lib.init(
            batch_size,
            max_length,
            self._num_key_value_heads,
            self._key_dim,
            dtype or self.compute_dtype,
        )

    def _check_shared(self, query, cache, shared_key_value):
        """`shared_key_value`: given where the layer has no keys of its own, never with a
        cache, shaped as a cache of this layer."""
        if shared_key_value is None:
            if self._key_value_projection == "none":
                raise checks.invalid(
                    "shared_key_value",
                    "the keys and values of another layer, (B, 2, S, "
                    f"{self._num_key_value_heads}, {self._key_dim}), on a layer with "
                    "key_value_projection='none'",
                    None,
                )
            return
        if cache is not None:
            raise checks.invalid(
                "shared_key_value",
                "`None` when a `cache` is given (a layer reads another's keys and values "
                "or its own cache, not both)",
                f"shape {checks.shape_str(tuple(shared_key_value.shape))}",
            )
        cache_lib.check_layout(self._value_dim, self._key_dim)
        cache_lib.validate(
            shared_key_value,
            query_shape=tuple(query.shape),
            num_key_value_heads=self._num_key_value_heads,
            key_dim=self._key_dim,
            index_given=False,
            name="shared_key_value",
        )

    def _check_cache(self, query, cache, cache_update_index, shared=False):
        """Validates the cache arguments; returns the index as an int or int32 tensor.
        With `shared` keys and values, the index is the queries' offset among them."""
        if cache is None and not shared:
            if cache_update_index is not None:
                raise checks.invalid(
                    "cache_update_index",
                    "`None` when no `cache` (or `shared_key_value`) is given",
                    cache_update_index,
                )
            return None
        if cache is None:
            if cache_update_index is None:
                return None
            return cache_lib.as_index(cache_update_index)
        cache_lib.check_layout(self._value_dim, self._key_dim)
        cache_lib.validate(
            cache,
            query_shape=tuple(query.shape),
            num_key_value_heads=self._num_key_value_heads,
            key_dim=self._key_dim,
            index_given=cache_update_index is not None,
        )
        if cache_update_index is None:
            return None
        index = cache_lib.as_index(cache_update_index)
        if isinstance(index, int) and not kernels.policy.current().sizes_from_data:
            if kernels.trim.holds_data(query):
                return ops.convert_to_tensor(index, "int32")  # one compiled step for all
        return index

    @staticmethod
    def _norm_caller(x):
        """How this call applies its norms, `(norm, x) -> norm(x)`, decided once for
        the call: recomputed in the backward pass instead of kept where the policy
        says so (`Policy.remat_norms`) and `x` is traced. `keras.remat` of a function
        calling the norm, not of the layer: of the layer object, Keras's JAX train
        step read its weight as a constant, which then did not train (the symptom of
        keras-team/keras#20936)."""
        if kernels.policy.current().remat_norms and not kernels.trim.holds_data(x):
            return lambda norm, t: keras.remat(lambda u: norm(u))(t)
        return lambda norm, t: norm(t)

    def _rotate(self, x, start, positions=None):
        return rope.rotate(
            x,
            start,
            self._rope_max_wavelength,
            self._rope_scaling_factor,
            positions,
            scaling=self._rope_scaling,
            rope_dim=self._rope_dim,
            layout=self._rope_dim_layout,
            interleaved=self._rope_interleaved,
        )

    def _position_streams(self):
        """M-RoPE's number of position streams (`positions` may be `(B, 3, T)`)."""
        scaling = self._rope_scaling
        return 3 if scaling is not None and scaling["type"] == "mrope" else None

    def _with_segments(self, mask, segment_ids, key_segment_ids, described):
        """The call's mask with packed rows' document ids: described (an
        `AttentionMask` or `None`), or dense (`(B or 1, T, S)` or `None`, for an
        overridden `_compute_attention`)."""
        ids = masks_lib.segments(segment_ids, key_segment_ids)
        if described:
            return dataclasses.replace(mask or masks_lib.AttentionMask(), **ids)
        same = masks_lib.same_segment(ids["query_segments"], ids["key_segments"])
        return masks_lib.logical_and(mask, same)

    def _with_block_mask(self, mask, mask_mod, query, key, offset, described):
        """The call's `AttentionMask` with the `mask_mod` argument's block mask ANDed
        (`query`, `key`: projected, the keys the cache's when decoding)."""
        if not described or len(query.shape) != 4:
            raise checks.invalid(
                "mask_mod",
                "a call over `(B, T, dim)` inputs of a layer whose attention and mask "
                "hooks are its own",
                mask_mod,
            )
        built = block_mask_lib.for_call(
            mask_mod,
            query.shape[0],
            self._num_heads,
            query.shape[1],
            key.shape[1],
            offset,
            cached=offset is not None,
        )
        return masks_lib.with_block_mask(mask, built, offset)

    def _repeat_key_value_heads(self, key, value):
        """Grouped-query attention: each key/value head serves `N / Nkv` adjacent
        query heads (`keras.layers.GroupQueryAttention`'s convention)."""
        repeats = self._num_heads // self._num_key_value_heads
        if repeats == 1:
            return key, value
        return ops.repeat(key, repeats, axis=-2), ops.repeat(value, repeats, axis=-2)

    def _wants_scores(self, return_attention_scores):
        if return_attention_scores is None:
            return self._return_attention_scores
        return checks.flag("return_attention_scores", return_attention_scores)

    def _project(self, query, key, value, callers_tensors, own_keys=True):
        """Runs the projections; returns `(query, key, value, gate or None)` (key and
        value `None` without `own_keys`; with `key_value_projection="tied"`, the value
        is the key projection's output).

        The Keras masks of `callers_tensors` (the `query`, `value` and `key` the call
        received) are removed, as the built-in removes them: layers after the
        attention that read the caller's tensors (a residual add, pooling, a loss)
        see no mask there, and the (mask-unaware) projections raise no warning. With
        `keep_input_masks=True` they are put back once the projections have run.
        """
        saved = [masks_lib.get_keras_mask(x) for x in callers_tensors]
        for x in callers_tensors:
            masks_lib.set_keras_mask(x, None)
        try:
            gate = self._gate_dense(query) if self._use_gate else None
            projected = (self._query_dense(query), None, None)
            if own_keys:
                projected_key = self._key_dense(key)
                projected_value = (
                    projected_key if self._value_dense is None else self._value_dense(value)
                )
                projected = (projected[0], projected_key, projected_value)
        finally:
            if self._keep_input_masks:
                for x, mask in zip(callers_tensors, saved):
                    if mask is not None:
                        masks_lib.set_keras_mask(x, mask)
        return (*projected, gate)

    def _mask_scores(self, scores, query, keys, masks):
        """Sets the call's merged mask on the returned scores as their Keras mask, as
        the built-in's softmax layer does (`(B or 1, 1, T, S)`; none when nothing is
        masked)."""
        dense = masks_lib.as_bool(self._compute_attention_mask(query, keys, **masks))
        if dense is not None:
            dense = masks_lib.expand_to_scores(dense, len(scores.shape), 1)
            masks_lib.set_keras_mask(scores, dense)

    def _broadcast_free_axes(self, query, x):
        """N-d attention over some axes: a value/key of size 1 on an axis attention does
        not run over broadcasts to the query's size there (as einsum does on JAX and
        torch, and TensorFlow's does not)."""
        free = [i for i in range(1, len(x.shape) - 1) if i not in self._attention_axes]
        grow = [
            i
            for i in free
            if checks.is_known(x.shape[i])
            and x.shape[i] == 1
            and checks.is_known(query.shape[i])
            and query.shape[i] != 1
        ]
        if not grow:
            return x
        shape = ops.shape(x)
        target = [query.shape[i] if i in grow else shape[i] for i in range(len(x.shape))]
        return ops.broadcast_to(x, target)

    def _check_call(
        self, query, value, key, query_mask, value_mask, key_mask, mask, key_length=None
    ):
        """`key_length`: with a cache, keys are its `max_length` positions, not `value`'s."""
        checks.input_shapes(query.shape, value.shape, key.shape)
        built_query, built_value, built_key = self._built_shapes
        for name, tensor, built in (
            ("query", query, built_query),
            ("value", value, built_value),
            ("key", key, built_key),
        ):
            if len(tensor.shape) != len(built) or checks.dims_differ(tensor.shape[-1], built[-1]):
                raise checks.invalid(
                    name,
                    f"shape (..., {built[-1]}) of rank {len(built)}, as when the layer was built",
                    f"shape {checks.shape_str(tensor.shape)}",
                )
        axes = self._attention_axes
        query_shape, value_shape = tuple(query.shape), tuple(value.shape)
        checks.free_axes(query_shape, value_shape, axes)
        batch = query_shape[:1]
        value_dims, key_input_dims = value_shape[1:-1], tuple(key.shape[1:-1])
        if key_length is not None:
            value_dims = key_input_dims = (key_length,)
            value_shape = batch + value_dims + value_shape[-1:]
        checks.mask("query_mask", query_mask, batch + query_shape[1:-1])
        checks.mask("value_mask", value_mask, batch + value_dims)
        checks.mask("key_mask", key_mask, batch + key_input_dims)
        scores = checks.scores_shape(query_shape, value_shape, axes, self._num_heads)
        checks.attention_mask(mask, scores, len(axes))

    # -------------------------------------------------------------------- attention
    def _describe_masks(
        self,
        query,
        key,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        use_causal_mask=False,
        query_offset=None,
    ):
        """The call's masks as one `masks.AttentionMask` (or `None`).

        Args:
            query: projected `(B, T, N, H)` (or N-d); key: projected `(B, S, N, H)`.
            query_mask: `(B, T)`; value_mask, key_mask: `(B, S)` padding masks.
            attention_mask: broadcastable to `(B, T, S)` or `(B, N, T, S)`.
            use_causal_mask: causal masking.
            query_offset: position of the first query among the keys (KV-cache
                decoding); `None` means 0.
        """
        if len(self._attention_axes) == 1 and len(query.shape) == 4:
            return masks_lib.describe(
                query_mask=query_mask,
                value_mask=value_mask,
                key_mask=key_mask,
                attention_mask=attention_mask,
                use_causal_mask=use_causal_mask,
                sliding_window=self._sliding_window,
                offset=query_offset,
            )
        # N-d attention: the explicit kernel takes one dense mask in the scores' layout.
        dense = self._compute_attention_mask(
            query,
            key,
            query_mask=query_mask,
            value_mask=value_mask,
            key_mask=key_mask,
            attention_mask=attention_mask,
            use_causal_mask=use_causal_mask,
            query_offset=query_offset,
        )
        return self._dense_mask(dense, len(query.shape))

    def _dense_mask(self, mask, projected_rank):
        """A dense mask (the built-in's `(B, T, S)` form) as an `AttentionMask`."""
        mask = masks_lib.as_bool(mask)
        if mask is None:
            return None
        num_axes = len(self._attention_axes)
        if projected_rank == 4 and num_axes == 1:
            return masks_lib.describe(attention_mask=mask)
        scores_rank = projected_rank - 1 + num_axes
        return masks_lib.AttentionMask(
            dense=masks_lib.expand_to_scores(mask, scores_rank, num_axes)
        )

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
        attention_bias=None,
        score_mod=None,
    ):
        """Attention over projected heads: the documented override point.

        Args:
            query: `(B, T, N, key_dim)` projected query.
            key: `(B, S, N, key_dim)` projected key.
            value: `(B, S, N, value_dim)` projected value.
            attention_mask: a `masks.AttentionMask` (what `call` passes), or a
                boolean mask broadcastable to `(B, T, S)` (what subclasses written
                for the built-in pass), or `None`.
            training: Whether dropout applies.
            return_attention_scores: Whether to compute and return the scores.
            use_causal_mask: AND a causal mask (with a dense or no `attention_mask`).
            attention_bias: float, broadcastable to `(B, N, T, S)`, added to the
                logits.
            score_mod: `None` or a `score_mod.ScoreMod`, applied after the bias.

        Returns:
            `(attention_output, attention_scores)`: `(B, T, N, value_dim)` and
            `(B, N, T, S)`, or `None` for the scores when not requested.
        """
        mask = attention_mask
        if builtin_hooks.overridden(self, "_masked_softmax") and score_mod is not None:
            raise checks.invalid(
                "score_mod", "None with a `_masked_softmax` written for the built-in", score_mod
            )
        if builtin_hooks.overridden(self, "_masked_softmax"):
            # A softmax written for the built-in: its explicit path, which calls it.
            if use_causal_mask:
                causal = self._compute_causal_mask(query, value)
                mask = masks_lib.logical_and(masks_lib.as_bool(mask), causal)
            return self._explicit_attention(
                query, key, value, mask, training, return_attention_scores
            )
        if not isinstance(mask, masks_lib.AttentionMask):
            mask = self._dense_mask(mask, len(query.shape))
            if use_causal_mask:
                causal = masks_lib.AttentionMask(causal=True)
                mask = causal if mask is None else dataclasses.replace(mask, causal=True)
        seed = None
        if self._drops_weights and training:
            seed = self._dropout_layer.seed_generator.next()
        empty_rows = "zero"
        if mask is not None and len(query.shape) == 4:
            empty_rows = self._fully_masked(return_attention_scores, query)
        output, scores = kernels.attention(
            query,
            key,
            value,
            scale=self._inverse_sqrt_key_dim,
            equations=(
                self._dot_product_equation,
                self._combine_equation,
                len(self._attention_axes),
            ),
            mask=mask,
            bias=attention_bias,
            soft_cap=self._logit_soft_cap,
            sinks=self._sinks.sinks if self._use_sinks else None,
            score_mod=score_mod,
            dropout=self._dropout if self._drops_weights else 0.0,
            seed=seed,
            return_scores=return_attention_scores,
            implementation=self._implementation or ("fused" if self._flash_attention else None),
            chunk_size=self._chunk_size,
            flash=self._flash_attention,
            empty_rows=empty_rows,
        )
        return output, scores

    def _fully_masked(self, return_attention_scores, query):
        """What a row with no visible key gets in this call: "mean" (the values' mean,
        the kernels' `empty_rows="mean"`) where the built-in's call would run
        `ops.dot_product_attention` (no dropout on the weights, no scores, one attention
        axis; it has no sinks) and that gives the mean where `query` lives, with
        `fully_masked_rows="builtin"`; else "zero"."""
        builtin_fused_path = (
            not self._drops_weights
            and not return_attention_scores
            and len(self._attention_axes) == 1
            and not self._use_sinks
            and kernels.fused_gives_mean(query)
        )
        return "mean" if self._fully_masked_rows == "builtin" and builtin_fused_path else "zero"

    @property
    def _drops_weights(self):
        """Whether attention dropout applies to the weights (`dropout_on="weights"`
        or "weights_and_projected_output")."""
        return self._dropout > 0.0 and self._dropout_on in (
            "weights",
            "weights_and_projected_output",
        )

    # ---------------------------------------------------------------------- shapes
    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        query_shape, value_shape, _ = checks.input_shapes(query_shape, value_shape, key_shape)
        axes = checks.attention_axes_for_rank(self._attention_axes, len(query_shape))
        checks.free_axes(query_shape, value_shape, axes)
        if self._output_shape:
            return tuple(query_shape[:-1]) + tuple(self._output_shape)
        return tuple(query_shape)

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=None,
        training=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
        attention_bias=None,
        segment_ids=None,
        key_segment_ids=None,
        positions=None,
        cache_update_mask=None,
        key_positions=None,
        score_mod=None,
        mask_mod=None,
        shared_key_value=None,
        return_key_value=False,
    ):
        key_shape = None if key is None else key.shape
        output = keras.KerasTensor(
            self.compute_output_shape(query.shape, value.shape, key_shape),
            dtype=self.compute_dtype,
        )
        cache_spec = ()
        if cache is not None:
            cache_spec = (keras.KerasTensor(cache.shape, cache.dtype),)
        elif return_key_value and shared_key_value is not None:
            cache_spec = (keras.KerasTensor(shared_key_value.shape, self.compute_dtype),)
        elif return_key_value:
            keys = (value if key is None else key).shape
            held = (keys[0], 2, keys[1], self._num_key_value_heads, self._key_dim)
            cache_spec = (keras.KerasTensor(held, self.compute_dtype),)
        if not self._wants_scores(return_attention_scores):
            return (output, *cache_spec) if cache_spec else output
        rank = len(query.shape)
        axes = checks.attention_axes_for_rank(self._attention_axes, rank)
        heads = (self._num_heads, self._key_dim)
        key_positions = tuple((value if key is None else key).shape[:-1])
        held = cache if shared_key_value is None else shared_key_value
        if held is not None:
            key_positions = (query.shape[0], held.shape[2])
        scores = equations.scores_shape(
            tuple(query.shape[:-1]) + heads, key_positions + heads, axes
        )
        return (output, keras.KerasTensor(scores, dtype=self.compute_dtype), *cache_spec)


def _check_score_mod_rank(rank, axes):
    """A score function reads `(B, N, T, S)` logits: `(B, T, dim)` inputs only."""
    if rank != 3 or len(axes) != 1:
        raise checks.invalid(
            "score_mod",
            "None with N-d attention (a score function needs `(B, T, dim)` inputs)",
            f"a score function on rank-{rank} inputs with attention_axes={tuple(axes)}",
        )


@functools.cache
def _call_signature(cls):
    """The signature of `cls.call` without `self` (a subclass may change it)."""
    signature = inspect.signature(cls.call)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def _as_the_builtin_reads_them(bound, args, kwargs):
    """The call's arguments, with flags and masks in the form `call` works with:
    flags given as ints or NumPy bools (which Keras would turn into tensors) become
    Python bools, masks given as (nested) lists become NumPy arrays (which Keras turns
    into tensors). Everything else is passed on as given; invalid flags are rejected.
    `bound.arguments` gets the same replacements.
    """
    args, kwargs = list(args), dict(kwargs)
    positions = list(bound.signature.parameters)

    def replace(name, value):
        bound.arguments[name] = value
        if name in kwargs:
            kwargs[name] = value
        else:
            args[positions.index(name)] = value

    for name in _MASK_ARGUMENTS + _ID_ARGUMENTS:
        value = bound.arguments.get(name)
        if isinstance(value, (list, tuple)):
            try:
                replace(name, np.asarray(value))
            except ValueError:  # ragged
                raise checks.invalid(name, "a mask of one shape", value) from None
    for name, if_none in _FLAG_ARGUMENTS.items():
        if name in bound.arguments:
            value = bound.arguments[name]
            replace(name, if_none if value is None else checks.flag(name, value))
    return tuple(args), kwargs
