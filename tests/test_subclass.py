"""Subclasses written for `keras.layers.MultiHeadAttention` work unchanged on ours.

Each subclass is written once against a base-class parameter and instantiated with
both bases; with copied weights the two give identical results.
"""

import keras
import numpy as np
import pytest
from helpers import random_inputs, to_numpy

import keras_mha

ops = keras.ops
ATOL = 1e-5
BASES = {"builtin": keras.layers.MultiHeadAttention, "ours": keras_mha.MultiHeadAttention}


def cached_attention_class(base):
    """keras-hub's `CachedMultiHeadAttention`, reproduced faithfully, on `base`.

    The cache is `(B, 2, S, N, H)`: projected keys and values; `cache_update_index`
    is where this call's keys and values are written before attending.
    """

    class CachedMultiHeadAttention(base):
        def call(
            self,
            query,
            value,
            key=None,
            attention_mask=None,
            cache=None,
            cache_update_index=None,
            training=None,
        ):
            if key is None:
                key = value

            query = self._query_dense(query)

            if cache is not None:
                key_cache = cache[:, 0, ...]
                value_cache = cache[:, 1, ...]
                if cache_update_index is None:
                    key = key_cache
                    value = value_cache
                else:
                    key_update = self._key_dense(key)
                    value_update = self._value_dense(value)
                    start = [0, cache_update_index, 0, 0]
                    key = ops.slice_update(key_cache, start, key_update)
                    value = ops.slice_update(value_cache, start, value_update)
                    cache = ops.stack((key, value), axis=1)
            else:
                if cache_update_index is not None:
                    raise ValueError(
                        "`cache_update_index` should not be set if `cache` is "
                        f"`None`. Received: cache={cache}, "
                        f"cache_update_index={cache_update_index}"
                    )
                key = self._key_dense(key)
                value = self._value_dense(value)

            attention_output, attention_scores = self._compute_attention(
                query=query,
                key=key,
                value=value,
                attention_mask=attention_mask,
                training=training,
            )

            attention_output = self._output_dense(attention_output)

            if cache is not None:
                return attention_output, cache
            return attention_output

    return CachedMultiHeadAttention


def recording_attention_class(base):
    """Overrides `_compute_attention` with the built-in's documented (old) signature."""

    class RecordingMultiHeadAttention(base):
        def _compute_attention(
            self,
            query,
            key,
            value,
            attention_mask=None,
            training=None,
            return_attention_scores=False,
        ):
            self.received_mask = attention_mask
            return super()._compute_attention(
                query, key, value, attention_mask, training, return_attention_scores
            )

    return RecordingMultiHeadAttention


def _pair(make_class, shape, **config):
    """One instance per base, built for `shape`, with the built-in's weights copied."""
    layers = {}
    for name, base in BASES.items():
        keras.utils.set_random_seed(0)
        layer = make_class(base)(**config)
        layer.build(shape, shape)
        layers[name] = layer
    layers["ours"].set_weights(layers["builtin"].get_weights())
    return layers


def test_subclasses_really_have_both_bases():
    for name, base in BASES.items():
        assert issubclass(cached_attention_class(base), base), name
    assert not issubclass(keras_mha.MultiHeadAttention, keras.layers.MultiHeadAttention)


def test_cached_attention_full_sequence(rng):
    batch, length, dim = 2, 6, 8
    layers = _pair(cached_attention_class, (batch, length, dim), num_heads=2, key_dim=4)
    (x,) = random_inputs(rng, (batch, length, dim))
    mask = ops.convert_to_tensor(np.tril(np.ones((1, length, length), bool)))
    outputs = {n: to_numpy(layer(x, x, attention_mask=mask)) for n, layer in layers.items()}
    np.testing.assert_allclose(outputs["ours"], outputs["builtin"], atol=ATOL)
    # And equal to the plain layer with a causal mask, through the standard call.
    plain = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
    plain.build(x.shape, x.shape)
    plain.set_weights(layers["ours"].get_weights())
    expected = to_numpy(plain(x, x, use_causal_mask=True))
    np.testing.assert_allclose(outputs["ours"], expected, atol=ATOL)


def test_cached_attention_token_by_token_decoding(rng):
    batch, length, dim, heads, key_dim = 2, 5, 8, 2, 4
    layers = _pair(cached_attention_class, (batch, length, dim), num_heads=heads, key_dim=key_dim)
    (x,) = random_inputs(rng, (batch, length, dim))
    causal = np.tril(np.ones((1, length, length), bool))
    full = to_numpy(layers["ours"](x, x, attention_mask=ops.convert_to_tensor(causal)))

    decoded = {}
    for name, layer in layers.items():
        cache = ops.zeros((batch, 2, length, heads, key_dim))
        steps = []
        for index in range(length):
            token = x[:, index : index + 1]
            step_mask = ops.convert_to_tensor(causal[:, index : index + 1])
            output, cache = layer(
                token, token, attention_mask=step_mask, cache=cache, cache_update_index=index
            )
            steps.append(to_numpy(output))
        decoded[name] = np.concatenate(steps, axis=1)
        # The final cache holds every projected key and value.
        keys = to_numpy(layer._key_dense(x))
        np.testing.assert_allclose(to_numpy(cache)[:, 0], keys, atol=ATOL)

    np.testing.assert_allclose(decoded["ours"], decoded["builtin"], atol=ATOL)
    np.testing.assert_allclose(decoded["ours"], full, atol=ATOL)

    # A cache without an update index attends to the cache as it is.
    cache = ops.stack((layers["ours"]._key_dense(x), layers["ours"]._value_dense(x)), axis=1)
    for name, layer in layers.items():
        output, _ = layer(x[:, -1:], x[:, -1:], cache=cache)
        np.testing.assert_allclose(to_numpy(output)[:, 0], full[:, -1], atol=ATOL, err_msg=name)


def test_cached_attention_rejects_index_without_cache(rng):
    layers = _pair(cached_attention_class, (1, 3, 8), num_heads=2, key_dim=4)
    (x,) = random_inputs(rng, (1, 3, 8))
    for layer in layers.values():
        with pytest.raises(ValueError, match="cache_update_index"):
            layer(x, x, cache_update_index=0)


def test_protected_attributes_match():
    layers = _pair(cached_attention_class, (1, 3, 8), num_heads=2, key_dim=4, value_dim=3)
    for attribute in ("_num_heads", "_key_dim", "_value_dim"):
        assert getattr(layers["ours"], attribute) == getattr(layers["builtin"], attribute)
    for attribute in ("_query_dense", "_key_dense", "_value_dense", "_output_dense"):
        ours, builtin = (getattr(layers[n], attribute) for n in ("ours", "builtin"))
        assert isinstance(ours, keras.layers.EinsumDense)
        assert ours.name == builtin.name
        assert tuple(ours.kernel.shape) == tuple(builtin.kernel.shape)


@pytest.mark.parametrize("implicit", [False, True], ids=["causal_only", "causal_and_padding"])
def test_compute_attention_override_receives_merged_causal_mask(implicit, rng):
    batch, length, dim = 2, 4, 8
    layers = _pair(recording_attention_class, (batch, length, dim), num_heads=2, key_dim=4)
    (x,) = random_inputs(rng, (batch, length, dim))
    expected = np.tril(np.ones((length, length), bool))[None]
    if implicit:
        x[1, -1] = 0.0
        valid = np.abs(x).sum(-1) > 0
        expected = expected & valid[:, :, None] & valid[:, None, :]
    outputs, masks = {}, {}
    for name, layer in layers.items():
        if implicit:
            inputs = keras.Input((length, dim))
            masked = keras.layers.Masking(0.0)(inputs)
            model = keras.Model(inputs, layer(masked, masked, use_causal_mask=True))
            outputs[name] = to_numpy(model(x))
        else:
            outputs[name] = to_numpy(layer(x, x, use_causal_mask=True))
        assert layer.received_mask is not None, name
        masks[name] = to_numpy(layer.received_mask)
    # Padded query rows have no key: the built-in's fused path differs there (fix 5).
    rows = np.broadcast_to(expected, (batch, length, length)).any(-1)
    np.testing.assert_allclose(outputs["ours"][rows], outputs["builtin"][rows], atol=ATOL)
    for name, mask in masks.items():
        assert mask.dtype == bool, name
        np.testing.assert_array_equal(np.broadcast_to(mask, expected.shape), expected)


# ------------------------------------------------------------ the built-in's hooks
def own_build_class(base):
    """Builds its own projections through the built-in's hooks, as keras-hub's
    `WhisperCachedMultiHeadAttention` does: no key bias."""

    class OwnBuildAttention(base):
        def build(self, query_shape, value_shape, key_shape=None):
            key_shape = value_shape if key_shape is None else key_shape
            shapes = {"query": (query_shape, self._key_dim, "abc,cde->abde")}
            shapes["key"] = (key_shape, self._key_dim, "abc,cde->abde")
            shapes["value"] = (value_shape, self._value_dim, "abc,cde->abde")
            for name, (shape, size, equation) in shapes.items():
                dense = keras.layers.EinsumDense(
                    equation,
                    output_shape=(None, self._num_heads, size),
                    bias_axes=None if name == "key" else "de",
                    name=name,
                    **self._get_common_kwargs_for_sublayer(),
                )
                dense.build(shape)
                setattr(self, f"_{name}_dense", dense)
            self._build_attention(4)
            self._output_dense = self._make_output_dense(
                query_shape, self._get_common_kwargs_for_sublayer(), "attention_output"
            )
            self._output_dense.build(tuple(query_shape[:-1]) + (self._num_heads, self._value_dim))

        def call(self, query, value, attention_mask=None, training=None):
            query, key = self._query_dense(query), self._key_dense(value)
            output, _ = self._compute_attention(
                query, key, self._value_dense(value), attention_mask, training
            )
            return self._output_dense(output)

    return OwnBuildAttention


def softmax_hook_class(base):
    """Overrides `_masked_softmax` (a temperature of 2), which the built-in's explicit
    path calls."""

    class TemperatureAttention(base):
        def _masked_softmax(self, attention_scores, attention_mask=None):
            return super()._masked_softmax(attention_scores / 2.0, attention_mask)

    return TemperatureAttention


def test_subclass_building_its_own_projections_through_the_hooks(rng):
    batch, length, dim = 2, 5, 8
    layers = _pair(own_build_class, (batch, length, dim), num_heads=2, key_dim=4)
    assert [w.path.split("/")[-2:] for w in layers["ours"].weights] == [
        w.path.split("/")[-2:] for w in layers["builtin"].weights
    ]
    assert layers["ours"]._key_dense.bias is None
    (x,) = random_inputs(rng, (batch, length, dim))
    mask = ops.convert_to_tensor(np.tril(np.ones((1, length, length), bool)))
    outputs = {n: to_numpy(layer(x, x, attention_mask=mask)) for n, layer in layers.items()}
    np.testing.assert_allclose(outputs["ours"], outputs["builtin"], atol=ATOL)


@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["no_dropout", "dropout"])
def test_masked_softmax_override_is_called_where_the_builtin_calls_it(dropout, rng):
    batch, length, dim = 2, 4, 8
    layers = _pair(
        softmax_hook_class, (batch, length, dim), num_heads=2, key_dim=4, dropout=dropout
    )
    (x,) = random_inputs(rng, (batch, length, dim))
    mask = np.ones((batch, length), bool)
    mask[1, -1] = False  # a padded key: the override sees the merged mask
    outputs, scores = {}, {}
    for name, layer in layers.items():
        outputs[name], scores[name] = to_numpy(
            layer(x, x, value_mask=mask, return_attention_scores=True)
        )
    np.testing.assert_allclose(scores["ours"], scores["builtin"], atol=ATOL)
    np.testing.assert_allclose(outputs["ours"], outputs["builtin"], atol=ATOL)
    plain = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
    plain.build(x.shape, x.shape)
    plain.set_weights(layers["ours"].get_weights())
    _, plain_scores = plain(x, x, value_mask=mask, return_attention_scores=True)
    assert not np.allclose(to_numpy(plain_scores), scores["ours"])  # the temperature ran
