"""`MultiHeadAttention`: configuration, build and call (orchestration only).

The math lives in `kernels.py`, the masks in `masks.py`, the einsum bookkeeping in
`equations.py` and argument checks in `checks.py`. Data flows one way:
call -> masks -> projections -> attention kernel -> output projection.
"""

import math

import keras
from keras import constraints, initializers, ops, regularizers
from keras.layers import Dropout

from keras_mha import cache as cache_lib
from keras_mha import checks, equations, kernels, norms, projections
from keras_mha import masks as masks_lib


@keras.saving.register_keras_serializable(package="keras_mha")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention, a drop-in for `keras.layers.MultiHeadAttention`.

    For each head `i` (of `num_heads`), with `d = key_dim`:

        Q_i = query @ Wq_i + bq_i            (B, T, d)
        K_i = key   @ Wk_i + bk_i            (B, S, d)
        V_i = value @ Wv_i + bv_i            (B, S, value_dim)
        A_i = softmax(Q_i K_i^T / sqrt(d), masked)          (B, T, S)
        output = sum_i (A_i V_i) @ Wo_i + bo                (B, T, out)

    Same arguments, same weights (same order, names and shapes) and the same results
    as the built-in layer, on the tensorflow, jax and torch backends, with these
    differences, each one tested:

    1. The symbolic shape of the returned scores is right: `(B, N, T, S)` for a
       `(B, T, dim)` query and `(B, S, dim)` value, also with `attention_axes`.
    2. `value_dim != key_dim` works on every backend (the built-in fails on JAX).
    3. `return_attention_scores` may also be given to the constructor, as the
       layer's default; a call argument overrides it.
    4. `flash_attention=True` with scores requested returns the scores (that call
       uses the explicit kernel) instead of raising.
    5. A query row whose keys are all masked gets zero attention weights, hence a
       zero context (its output is the output projection's bias), with finite
       outputs and gradients, on every kernel and backend.

    Args:
        num_heads: Number of attention heads `N`.
        key_dim: Size `H` of each head for query and key (per head, not in total).
        value_dim: Size of each head for value; `None` means `key_dim`.
        dropout: Dropout rate on the attention weights, in [0, 1).
        use_bias: Whether the projections have biases.
        output_shape: Trailing output shape, an int or a tuple; `None` projects back
            to the query's last dimension.
        attention_axes: Axes attention runs over (an int or a tuple); `None` means
            every axis between batch and features. Negative axes count from the end
            of the input, whose last axis is features.
        sliding_window: `None` or a positive int `w`: query `t` attends only to keys
            `s` with `|t - s| < w`. Combine with `use_causal_mask` for a causal window.
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
        implementation: Which attention kernel runs: `None`/"auto" (the fastest
            measured on the backend: "fused" on torch and on JAX with a GPU,
            "chunked" elsewhere), "explicit" (materialises the scores), "fused"
            (the backend's fused kernel), or "chunked" (chunks of keys with an online
            softmax on JAX, of queries elsewhere; never the whole
            `(T, S)` scores). Calls that return scores, apply dropout or use N-d
            attention always run "explicit".
        chunk_size: Keys (or queries) per chunk of the "chunked" kernel; `None`
            takes the backend's measured default (`kernels.DEFAULT_CHUNK_SIZE`:
            128 queries on TensorFlow, 256 keys on JAX, 256 queries on torch),
            chosen when the layer runs, so a saved layer re-chooses where it loads.
        num_key_value_heads: Grouped-query attention: number `Nkv` of key/value
            heads, a divisor of `num_heads` (1 is multi-query attention); `None`
            means `num_heads`. Key/value kernels are `(dim, Nkv, key_dim/value_dim)`
            and each serves `num_heads / Nkv` adjacent query heads, as in
            `keras.layers.GroupQueryAttention`, whose weights load with `set_weights`.
        normalize_qk: QK-norm: RMS-normalise the projected queries and keys over the
            head dimension, each with a learned `(key_dim,)` scale (weights
            `query_norm/scale`, `key_norm/scale`, created after all the others).
        **kwargs: Base `Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        query: `(B, T, dim)` or, with N-d attention, `(B, ..., dim)`.
        value: `(B, S, dim_v)`, same rank as `query`.
        key: Optional `(B, S, dim_k)`; `None` uses `value`.
        query_mask: Optional `(B, T)` padding mask of the query.
        value_mask: Optional `(B, S)` padding mask of the value.
        key_mask: Optional `(B, S)` padding mask of the key. Keras implicit masks
            (`Embedding(mask_zero=True)`, `Masking`) on the inputs fill these three
            automatically; the query's mask is set on the output.
        attention_mask: Optional boolean mask broadcastable to `(B, T, S)`;
            `True` means "may attend".
        return_attention_scores: If `True`, return `(output, scores)`; `None` uses
            the constructor's value.
        training: Whether dropout applies.
        use_causal_mask: Query `t` attends only to keys `s <= t`.
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

    Returns:
        output: `(B, T, dim)`, or `(B, T) + output_shape` when given.
        scores: (if requested) `(B, N, T, S)`; for N-d attention
            `(B, <other axes>, N, <query attention axes>, <key attention axes>)`.
        cache: (if a cache is given) the updated cache, last in the returned tuple.

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
            )
        normalize_qk = checks.boolean("normalize_qk", normalize_qk)
        key_dim = checks.positive_int("key_dim", key_dim)
        value_dim = checks.positive_int("value_dim", value_dim, allow_none=True)
        dropout = checks.rate("dropout", dropout)
        use_bias = checks.boolean("use_bias", use_bias)
        output_shape = checks.output_shape(output_shape)
        attention_axes = checks.attention_axes(attention_axes)
        sliding_window = checks.positive_int("sliding_window", sliding_window, allow_none=True)
        flash_attention = checks.boolean("flash_attention", flash_attention, True)
        use_gate = checks.boolean("use_gate", use_gate)
        if seed is not None and not isinstance(seed, int):
            raise checks.invalid("seed", "an integer or `None`", seed)
        return_attention_scores = checks.boolean("return_attention_scores", return_attention_scores)
        if implementation == "auto":
            implementation = None
        checks.one_of("implementation", implementation, (None,) + kernels.IMPLEMENTATIONS)
        chunk_size = checks.positive_int("chunk_size", chunk_size, allow_none=True)
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
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(self._key_dim))

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
        return self._key_dense

    @property
    def value_dense(self):
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
            query_shape, value_shape, key_shape
        )
        rank = len(query_shape)
        # Validated before any state exists, so a rejected build leaves nothing.
        normalized_axes = checks.attention_axes_for_rank(self._attention_axes, rank)

        self._query_dense = self._projection(rank, self._num_heads, self._key_dim, "query")
        self._query_dense.build(query_shape)
        kv_heads = self._num_key_value_heads
        self._key_dense = self._projection(rank, kv_heads, self._key_dim, "key")
        self._key_dense.build(key_shape)
        if self._use_gate:
            self._gate_dense = self._projection(
                rank, self._num_heads, self._value_dim, "gate", activation="sigmoid"
            )
            self._gate_dense.build(query_shape)
        self._value_dense = self._projection(rank, kv_heads, self._value_dim, "value")
        self._value_dense.build(value_shape)

        self._attention_axes = normalized_axes
        projected_rank = rank + 1
        (
            self._dot_product_equation,
            self._combine_equation,
            _,
        ) = equations.attention_equations(projected_rank, normalized_axes)
        self._dropout_layer = Dropout(rate=self._dropout, dtype=self.dtype_policy, seed=self.seed)

        output_dims = self._output_shape or (query_shape[-1],)
        equation, bias_axes, output_rank = equations.projection_equation(
            rank - 1, bound_dims=2, output_dims=len(output_dims)
        )
        self._output_dense = projections.Projection(
            equation,
            output_shape=equations.projection_output_shape(output_rank, output_dims),
            bias_axes=bias_axes if self._use_bias else None,
            name="attention_output",
            **self._sublayer_kwargs(),
        )
        self._output_dense.build(tuple(query_shape[:-1]) + (self._num_heads, self._value_dim))
        if self._normalize_qk:
            # Created last, so the first weights stay those of the built-in layer.
            self._query_norm = norms.RMSNorm(name="query_norm", dtype=self.dtype_policy)
            self._query_norm.build((None, self._key_dim))
            self._key_norm = norms.RMSNorm(name="key_norm", dtype=self.dtype_policy)
            self._key_norm.build((None, self._key_dim))
        self._built_shapes = (query_shape, value_shape, key_shape)

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
            **self._sublayer_kwargs(),
        )

    def _sublayer_kwargs(self):
        # Fresh initializer instances per sublayer: a shared stateless initializer
        # would give every kernel the same values.
        def clone(initializer):
            return initializer.__class__.from_config(initializer.get_config())

        return dict(
            kernel_initializer=clone(self._kernel_initializer),
            bias_initializer=clone(self._bias_initializer),
            kernel_regularizer=self._kernel_regularizer,
            bias_regularizer=self._bias_regularizer,
            activity_regularizer=self._activity_regularizer,
            kernel_constraint=self._kernel_constraint,
            bias_constraint=self._bias_constraint,
            dtype=self.dtype_policy,
        )

    # ------------------------------------------------------------------------ call
    def __call__(self, *args, **kwargs):
        try:
            arguments = self._call_signature.bind(*args, **kwargs).arguments
        except TypeError:
            arguments = None  # a wrong signature: Keras reports it
        if arguments is not None:
            checks.call_arguments(arguments, self._attention_axes)
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
    ):
        if key is None:
            key = value
        if query_mask is None:
            query_mask = masks_lib.get_keras_mask(query)
        need_scores = self._wants_scores(return_attention_scores)
        cache_update_index = self._check_cache(query, cache, cache_update_index)
        self._check_call(
            query,
            value,
            key,
            query_mask,
            value_mask,
            key_mask,
            attention_mask,
            key_length=None if cache is None else cache.shape[2],
        )

        projected_query, projected_key, projected_value, gate = self._project(query, key, value)
        if self._normalize_qk:
            projected_query = self._query_norm(projected_query)
            projected_key = self._key_norm(projected_key)
        if cache is not None:
            if cache_update_index is not None:
                cache = cache_lib.update(cache, projected_key, projected_value, cache_update_index)
            projected_key, projected_value = cache_lib.split(cache)
        projected_key, projected_value = self._repeat_key_value_heads(
            projected_key, projected_value
        )
        # Decoding: the new queries sit at `cache_update_index ...` in the cache.
        offset = {} if cache_update_index is None else {"query_offset": cache_update_index}
        overridden = type(self)._compute_attention is not MultiHeadAttention._compute_attention
        mask = self._compute_attention_mask(
            query,
            value if cache is None else projected_key,
            query_mask=query_mask,
            value_mask=value_mask,
            key_mask=key_mask,
            attention_mask=attention_mask,
            # Our own `_compute_attention` takes causality as a flag, so kernels
            # can apply it without building a (T, S) mask; an override written for
            # the built-in receives it merged into the mask, as it expects.
            use_causal_mask=use_causal_mask and overridden,
            **offset,
        )
        extra = {"use_causal_mask": True, **offset} if use_causal_mask and not overridden else {}
        attention_output, scores = self._compute_attention(
            projected_query,
            projected_key,
            projected_value,
            mask,
            training,
            need_scores,
            **extra,
        )
        if gate is not None:
            attention_output = ops.multiply(attention_output, gate)
        output = self._output_dense(attention_output)
        if query_mask is not None:
            masks_lib.set_keras_mask(output, query_mask)
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

    def _check_cache(self, query, cache, cache_update_index):
        """Validates the cache arguments; returns the index as an int or int32 tensor."""
        if cache is None:
            if cache_update_index is not None:
                raise checks.invalid(
                    "cache_update_index", "`None` when no `cache` is given", cache_update_index
                )
            return None
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
        return cache_lib.as_index(cache_update_index)

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
        return checks.boolean("return_attention_scores", return_attention_scores)

    def _project(self, query, key, value):
        """Runs the projections; returns `(query, key, value, gate or None)`.

        Keras masks are detached while the (mask-unaware) projections run, so they
        raise no warning, and put back afterwards: the caller's tensors keep them.
        """
        inputs = (query, key, value)
        saved = [masks_lib.get_keras_mask(x) for x in inputs]
        for x in inputs:
            masks_lib.set_keras_mask(x, None)
        try:
            gate = self._gate_dense(query) if self._use_gate else None
            denses = (self._query_dense, self._key_dense, self._value_dense)
            projected = tuple(dense(x) for dense, x in zip(denses, inputs))
        finally:
            for x, mask in zip(inputs, saved):
                if mask is not None:
                    masks_lib.set_keras_mask(x, mask)
        return (*projected, gate)

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
            if len(tensor.shape) != len(built) or tensor.shape[-1] != built[-1]:
                raise checks.invalid(
                    name,
                    f"shape (..., {built[-1]}) of rank {len(built)}, as when the layer was built",
                    f"shape {tuple(tensor.shape)}",
                )
        axes = self._attention_axes
        batch = (query.shape[0],)
        query_dims = tuple(query.shape[a] for a in axes)
        key_dims = tuple(value.shape[a] for a in axes)
        value_dims, key_input_dims = tuple(value.shape[1:-1]), tuple(key.shape[1:-1])
        if key_length is not None:
            key_dims = value_dims = key_input_dims = (key_length,)
        checks.mask("query_mask", query_mask, batch + tuple(query.shape[1:-1]))
        checks.mask("value_mask", value_mask, batch + value_dims)
        checks.mask("key_mask", key_mask, batch + key_input_dims)
        extra = tuple(query.shape[i] for i in range(1, len(query.shape) - 1) if i not in axes)
        checks.mask("attention_mask", mask, batch + extra + query_dims + key_dims)

    # -------------------------------------------------------------------- attention
    def _compute_attention_mask(
        self,
        query,
        value,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        use_causal_mask=False,
        query_offset=None,
    ):
        """Merges the Keras masks, `attention_mask`, causal and window masks.

        Args:
            query: `(B, T, ...)`; value: `(B, S, ...)` (inputs or projections).
            query_mask: `(B, T)`; value_mask, key_mask: `(B, S)`.
            attention_mask: broadcastable to `(B, T, S)`.
            use_causal_mask: AND a causal mask.
            query_offset: position of the first query among the keys (KV-cache
                decoding), for the causal and window masks; `None` means 0.

        Returns:
            A boolean `(B or 1, T, S)` mask, or `None` when nothing is masked.
        """
        return masks_lib.merge_masks(
            ops.shape(query)[1],
            ops.shape(value)[1],
            query_mask=query_mask,
            value_mask=value_mask,
            key_mask=key_mask,
            attention_mask=attention_mask,
            use_causal_mask=use_causal_mask,
            sliding_window=self._sliding_window,
            offset=0 if query_offset is None else query_offset,
        )

    def _compute_causal_mask(self, query, value=None, query_offset=None):
        """`(1, T, S)` causal mask for `query` `(B, T, ...)`, `value` `(B, S, ...)`."""
        key_length = ops.shape(query if value is None else value)[1]
        offset = 0 if query_offset is None else query_offset
        return masks_lib.causal_mask(ops.shape(query)[1], key_length, offset)

    def _masked_softmax(self, attention_scores, attention_mask=None):
        """Softmax over the key axes (float32 inside), masked as the built-in does."""
        mask = masks_lib.expand_to_scores(
            masks_lib.as_bool(attention_mask),
            len(attention_scores.shape),
            len(self._attention_axes),
        )
        axes = tuple(range(-len(self._attention_axes), 0))
        weights = kernels.masked_softmax(attention_scores, mask, axes)
        return ops.cast(weights, attention_scores.dtype)

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
        query_offset=None,
    ):
        """Attention over projected heads: the documented override point.

        Args:
            query: `(B, T, N, key_dim)` projected query.
            key: `(B, S, N, key_dim)` projected key.
            value: `(B, S, N, value_dim)` projected value.
            attention_mask: boolean, broadcastable to `(B, T, S)`, or `None`.
            training: Whether dropout applies.
            return_attention_scores: Whether to compute and return the scores.
            use_causal_mask: AND a causal mask (applied inside the kernel).
            query_offset: position of the first query among the keys (KV-cache
                decoding) for the causal mask; `None` means 0.

        Returns:
            `(attention_output, attention_scores)`: `(B, T, N, value_dim)` and
            `(B, N, T, S)`, or `None` for the scores when not requested.
        """
        num_axes = len(self._attention_axes)
        projected_rank = len(query.shape)
        dropout_active = self._dropout > 0.0 and bool(training)
        implementation = kernels.choose_implementation(
            self._implementation or ("fused" if self._flash_attention else None),
            need_weights=return_attention_scores,
            dropout_active=dropout_active,
            projected_rank=projected_rank,
            same_head_dims=key.shape[-1] == value.shape[-1],
            query_length=query.shape[1],
            key_length=key.shape[1],
        )
        scores_rank = projected_rank if num_axes == 1 else projected_rank - 1 + num_axes
        mask = masks_lib.expand_to_scores(masks_lib.as_bool(attention_mask), scores_rank, num_axes)
        if implementation == "chunked":
            output = kernels.chunked_attention(
                query,
                key,
                value,
                scale=self._inverse_sqrt_key_dim,
                mask=mask,
                is_causal=use_causal_mask,
                causal_offset=0 if query_offset is None else query_offset,
                chunk_size=self._chunk_size,
            )
            return output, None
        if implementation == "fused":
            # The backend's `is_causal` knows no offset: decoding builds the mask.
            causal_only = use_causal_mask and mask is None and query_offset is None
            if use_causal_mask and not causal_only:
                causal = ops.expand_dims(self._compute_causal_mask(query, key, query_offset), 1)
                mask = causal if mask is None else ops.logical_and(mask, causal)
            output = kernels.fused_attention(
                query,
                key,
                value,
                scale=self._inverse_sqrt_key_dim,
                mask=mask,
                is_causal=causal_only,
                flash=self._flash_attention,
            )
            return output, None
        if use_causal_mask:
            causal = masks_lib.expand_to_scores(
                self._compute_causal_mask(query, key, query_offset), scores_rank, num_axes
            )
            mask = causal if mask is None else ops.logical_and(mask, causal)
        return kernels.explicit_attention(
            query,
            key,
            value,
            scale=self._inverse_sqrt_key_dim,
            dot_product_equation=self._dot_product_equation,
            combine_equation=self._combine_equation,
            num_attention_axes=num_axes,
            mask=mask,
            dropout=(
                (lambda w: self._dropout_layer(w, training=training)) if dropout_active else None
            ),
        )

    # ---------------------------------------------------------------------- shapes
    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        query_shape, _, _ = checks.input_shapes(query_shape, value_shape, key_shape)
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
    ):
        key_shape = None if key is None else key.shape
        output = keras.KerasTensor(
            self.compute_output_shape(query.shape, value.shape, key_shape),
            dtype=self.compute_dtype,
        )
        cache_spec = () if cache is None else (keras.KerasTensor(cache.shape, cache.dtype),)
        if not self._wants_scores(return_attention_scores):
            return (output, *cache_spec) if cache_spec else output
        rank = len(query.shape)
        axes = checks.attention_axes_for_rank(self._attention_axes, rank)
        heads = (self._num_heads, self._key_dim)
        key_positions = tuple((value if key is None else key).shape[:-1])
        if cache is not None:
            key_positions = (query.shape[0], cache.shape[2])
        scores = equations.scores_shape(
            tuple(query.shape[:-1]) + heads, key_positions + heads, axes
        )
        return (output, keras.KerasTensor(scores, dtype=self.compute_dtype), *cache_spec)
