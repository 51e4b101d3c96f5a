"""The built-in layer's subclass hooks, with the built-in's meaning.

`keras.layers.MultiHeadAttention` has no public extension API: subclasses (keras-hub's
`CachedMultiHeadAttention`, `WhisperCachedMultiHeadAttention`,
`MoonshineMultiHeadAttention`, XLNet's `TwoStreamRelativeAttention`, users' own) build
on its protected methods and attributes. `BuiltinHooks` provides them on
`keras_mha.MultiHeadAttention`, so such a subclass runs unchanged on ours
(`keras_mha.swap` rebuilds it there):

- `_get_common_kwargs_for_sublayer()`: the projections' initializers (fresh
  instances), regularizers, constraints and dtype policy.
- `_make_output_dense(query_shape, common_kwargs, name)`: the output projection.
- `_build_attention(rank)`: normalises `_attention_axes` and sets
  `_dot_product_equation`, `_combine_equation`, `_softmax` and `_dropout_layer`.
- `_masked_softmax(scores, mask)`, `_compute_attention_mask(...)`,
  `_compute_causal_mask(query, value)`, `_compute_sliding_window_mask(query, value)`.
- `_explicit_attention(...)`: the built-in's explicit `_compute_attention` (scores
  einsum, `_masked_softmax`, `_dropout_layer`, combine einsum), which `_compute_attention`
  runs instead of our kernels when a subclass overrides `_masked_softmax`.

The attributes the built-in sets in `__init__` and `build` (`_num_heads`, `_key_dim`,
`_value_dim`, `_dropout`, `_use_bias`, `_output_shape`, `_attention_axes`,
`_inverse_sqrt_key_dim`, `_query_dense`, `_key_dense`, `_value_dense`,
`_output_dense`, ...) are set by `MultiHeadAttention` itself, under the same names.
The overrides our layer calls where the built-in does are listed in
`keras_mha.swapping.PROTECTED_OVERRIDES`.
"""

from keras import ops
from keras.layers import Dropout, Softmax

from keras_mha import checks, equations, kernels, projections
from keras_mha import masks as masks_lib


class BuiltinHooks:
    """Mixin of `keras_mha.MultiHeadAttention`: the built-in's protected API."""

    # ----------------------------------------------------------------------- build
    def _get_common_kwargs_for_sublayer(self):
        """Keyword arguments of every projection: fresh initializer instances (a
        shared stateless initializer would give every kernel the same values), the
        regularizers, constraints and the layer's dtype policy."""

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

    def _make_output_dense(self, query_shape, common_kwargs, name=None):
        """The output projection `(B, T, N, value_dim) -> (B, T) + output_shape`
        (`output_shape` `None`: the query's last dimension), unbuilt.

        Args:
            query_shape: `(B, T, dim)` or `(B, ..., dim)`.
            common_kwargs: What `_get_common_kwargs_for_sublayer()` returns.
            name: The sublayer's name.
        """
        output_dims = self._output_shape or (query_shape[-1],)
        equation, bias_axes, output_rank = equations.projection_equation(
            len(query_shape) - 1, bound_dims=2, output_dims=len(output_dims)
        )
        return projections.Projection(
            equation,
            output_shape=equations.projection_output_shape(output_rank, output_dims),
            bias_axes=bias_axes if self._output_bias else None,
            name=name,
            **common_kwargs,
        )

    def _build_attention(self, rank):
        """Sets what attention over projected heads needs.

        Args:
            rank: Rank of the projected query, key and value, `(B, ..., N, H)`.
        """
        self._attention_axes = checks.attention_axes_for_rank(self._attention_axes, rank - 1)
        (
            self._dot_product_equation,
            self._combine_equation,
            scores_rank,
        ) = equations.attention_equations(rank, self._attention_axes)
        num_axes = len(self._attention_axes)
        self._softmax = Softmax(
            axis=tuple(range(scores_rank - num_axes, scores_rank)), dtype=self.dtype_policy
        )
        self._dropout_layer = Dropout(rate=self._dropout, dtype=self.dtype_policy, seed=self.seed)

    # ----------------------------------------------------------------------- masks
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
        """Merges the Keras masks, `attention_mask`, causal and window masks into the
        built-in's dense form (what overrides of `_compute_attention` expect).

        Overrides of `_compute_causal_mask` and `_compute_sliding_window_mask` make
        those parts, as in the built-in.

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
        window = self._sliding_window
        hooked = []
        if use_causal_mask and overridden(self, "_compute_causal_mask"):
            hooked.append(self._compute_causal_mask(query, value))
            use_causal_mask = False
        if window is not None and overridden(self, "_compute_sliding_window_mask"):
            hooked.append(self._compute_sliding_window_mask(query, value))
            window = None
        if hooked:
            attention_mask = masks_lib.logical_and(
                masks_lib.as_bool(attention_mask), *(masks_lib.as_bool(m) for m in hooked)
            )
        return masks_lib.merge_masks(
            ops.shape(query)[1],
            ops.shape(value)[1],
            query_mask=query_mask,
            value_mask=value_mask,
            key_mask=key_mask,
            attention_mask=attention_mask,
            use_causal_mask=use_causal_mask,
            sliding_window=window,
            offset=0 if query_offset is None else query_offset,
        )

    def _compute_causal_mask(self, query, value=None, query_offset=None):
        """`(1, T, S)` causal mask for `query` `(B, T, ...)`, `value` `(B, S, ...)`."""
        key_length = ops.shape(query if value is None else value)[1]
        offset = 0 if query_offset is None else query_offset
        return masks_lib.causal_mask(ops.shape(query)[1], key_length, offset)

    def _compute_sliding_window_mask(self, query, value=None):
        """`(1, T, S)` band: query `t` sees keys `s` with `|t - s| < sliding_window`
        (or, for a `(left, right)` pair, `t - left <= s <= t + right`)."""
        key_length = ops.shape(query if value is None else value)[1]
        return masks_lib.sliding_window_mask(ops.shape(query)[1], key_length, self._sliding_window)

    # ------------------------------------------------------------------- attention
    def _masked_softmax(self, attention_scores, attention_mask=None):
        """Softmax over the key axes (float32 inside), masked as the built-in does
        (a mask missing the heads axis gets it); key-less rows get zero weights.

        Args:
            attention_scores: `(B, N, T, S)` logits (N-d: `(B, ..., N, <T axes>,
                <S axes>)`).
            attention_mask: bool or 0/1 mask broadcastable to them as the built-in
                broadcasts it, `(B, T, S)` or `(B, N, T, S)`, or `None`.
        """
        mask = masks_lib.expand_to_scores(
            masks_lib.as_bool(attention_mask),
            len(attention_scores.shape),
            len(self._attention_axes),
        )
        axes = tuple(range(-len(self._attention_axes), 0))
        weights = kernels.logits.softmax(ops.cast(attention_scores, "float32"), mask, axes)
        return ops.cast(weights, attention_scores.dtype)

    def _explicit_attention(
        self, query, key, value, attention_mask=None, training=None, return_attention_scores=False
    ):
        """The built-in's explicit path, through the hooks a subclass may override.

        Args:
            query: `(B, T, N, key_dim)`; key: `(B, S, N, key_dim)`; value:
                `(B, S, N, value_dim)` (N-d: more axes before `N`).
            attention_mask: dense bool mask broadcastable to `(B, T, S)`, or `None`.
            training: Whether dropout applies.
            return_attention_scores: Whether the scores are returned.

        Returns:
            `(attention_output, attention_scores or None)`.
        """
        query = ops.multiply(query, ops.cast(self._inverse_sqrt_key_dim, query.dtype))
        scores = ops.einsum(self._dot_product_equation, key, query)
        scores = self._masked_softmax(scores, attention_mask)
        weights = scores
        if self._drops_weights:
            weights = self._dropout_layer(scores, training=training)
        output = ops.einsum(self._combine_equation, weights, value)
        return output, (scores if return_attention_scores else None)


# Hooks whose overrides expect the built-in's dense mask from `call`.
DENSE_MASK_HOOKS = (
    "_compute_attention_mask",
    "_compute_causal_mask",
    "_compute_sliding_window_mask",
    "_masked_softmax",
)


def overridden(layer, name):
    """Whether `layer`'s class overrides hook `name` of `BuiltinHooks`."""
    return getattr(type(layer), name) is not getattr(BuiltinHooks, name)


def overrides_mask_hooks(layer):
    """Whether `layer`'s class overrides a hook of `DENSE_MASK_HOOKS`: `call` then
    passes the built-in's dense mask to `_compute_attention`."""
    return any(overridden(layer, name) for name in DENSE_MASK_HOOKS)
