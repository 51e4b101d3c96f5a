"""`HubAttention`: one of keras-hub's own attention layers, run by our layer.

keras-hub's language models (Llama, Mistral, Gemma, Qwen, ...) hold attention classes of
their own, constructed by their decoder blocks with their own arguments and called with
their own protocol (`hidden_states, attention_mask, cache, cache_update_index`). While
`keras_mha.swapped()` is active, constructing one of the classes named in
`keras_mha.hub.table.ADAPTERS` constructs a `HubAttention` in its place: a layer holding
a `keras_mha.MultiHeadAttention` (`attention`), configured and called as the table's entry
for that class says. Its weights come from the keras-hub layer it replaces through the
entry's `weights` (`port`), one named variable at a time.
"""

import dataclasses
import functools
import inspect

import keras

from keras_mha import _keras_private
from keras_mha import layer as layer_lib


@dataclasses.dataclass(frozen=True)
class Entry:
    """How one keras-hub attention class runs on `keras_mha.MultiHeadAttention`.

    Attributes:
        options: `(config, dim) -> dict`: our layer's constructor arguments from the
            keras-hub constructor's arguments (`config`, by name, defaults filled in)
            and the width of the hidden states (`dim`, known when the layer builds).
        call: `(attention, *args, **kwargs) -> outputs`: runs our layer (`attention`)
            with the keras-hub class's call arguments; returns what that class returns.
        weights: `(hub_layer) -> {our sublayer: values}`: the keras-hub layer's
            variables for each of our sublayers (`"query_dense"`, ...), each a list
            of arrays in our sublayer's variable order.
        decoder_mask: `None`; `(decoder, **arguments) -> mask`, which replaces the
            `_compute_self_attention_mask` of the decoder block holding the layer in a
            swapped model (`keras_mha.hub.describe_masks`), so that the block passes
            `call` its mask described (`common.DecoderMask`) instead of dense; or a
            `common.DescribedDecoder` naming the block's mask method (Gemma's
            `_compute_attention_mask`), the block classes it applies to, and what
            other sublayers get (the MoE router's loss).
        notes: Where keras-hub's class and ours differ, one line each (the guide's
            table, `swap`'s report).
        attributes: `None`, or `(config) -> dict`: attributes of the keras-hub layer
            that its model reads (SmolLM3's decoder reads `self_attn.head_dim`),
            set on the layer that takes its place.
        layers: `None`, or `(config) -> {name: layer}`: layers of the keras-hub class's
            own that our layer has no place for (T5's relative position bias table),
            built beside `attention` and set as attributes of the `HubAttention`
            (`weights` may name them).
        with_layer: Whether `call` receives the `HubAttention` (its `attention`,
            `corrected` and `layers`) instead of our layer.
        value_shape: `None` (keys and values from the hidden states), or `(config,
            input_shape) -> shape`: the shape of the inputs our key and value
            projections build for, from the shapes the layer is built with
            (T5Gemma's cross-attention: `[hidden_states, encoder_hidden_states]`).
    """

    options: callable
    call: callable
    weights: callable
    decoder_mask: callable = None
    notes: tuple = ()
    attributes: callable = None
    layers: callable = None
    with_layer: bool = False
    value_shape: callable = None


@keras.saving.register_keras_serializable(package="keras_mha")
class HubAttention(keras.layers.Layer):
    """A keras-hub attention layer's place in its model, run by our layer.

    It is called with the keras-hub class's own call arguments (the table's entry maps
    them to ours) and returns what that class returns.

    Args:
        hub_class: The keras-hub class it stands for, `"module.ClassName"` (a key of
            `keras_mha.hub.table.ADAPTERS`).
        config: The arguments that class was constructed with, by name.
        corrected: Where keras-hub's class is wrong (the entry's `notes` say where:
            e.g. GPT-NeoX's cached decoding), `False` (the default) keeps what it
            computes, so a swap keeps the model's outputs; `True` computes the
            correct result instead. It may be set on the layer before its first call.
        **kwargs: Base `Layer` arguments (`name`, `dtype`, ...).

    Returns:
        What the keras-hub class returns (an output, or `(output, cache)`).
    """

    def __init__(self, hub_class, config, corrected=False, **kwargs):
        from keras_mha.hub import table  # the table imports this module

        super().__init__(**kwargs)
        if hub_class not in table.ADAPTERS:
            raise ValueError(
                "Received an invalid value for argument `hub_class`, expected one of the "
                f"keras-hub attention classes keras_mha moves ({', '.join(table.ADAPTERS)}). "
                f"Received: hub_class={hub_class}"
            )
        self.hub_class = hub_class
        self.entry = table.ADAPTERS[hub_class]
        self.config = dict(config)
        self.corrected = bool(corrected)
        self.supports_masking = True
        # Some blocks pass their (described) mask positionally (Gemma 3n's).
        _keras_private.allow_non_tensor_positional_args(self)
        if self.entry.attributes is not None:
            for name, value in self.entry.attributes(self.config).items():
                setattr(self, name, value)

    def build(self, input_shape, *args, **kwargs):
        shapes = input_shape
        if input_shape and isinstance(input_shape[0], (list, tuple)):
            # Built from a list of shapes, the hidden states' first (SmolLM3).
            input_shape = input_shape[0]
        input_shape = tuple(input_shape)
        if len(input_shape) == 2:
            # Built from `(B, dim)` (Gemma 3n's decoder drops a dimension): a sequence.
            input_shape = (None, None, input_shape[-1])
        value_shape = input_shape
        if self.entry.value_shape is not None:
            value_shape = tuple(self.entry.value_shape(self.config, shapes))
        options = self.entry.options(self.config, input_shape[-1])
        self.attention = layer_lib.MultiHeadAttention(
            **options, dtype=self.dtype_policy, name="attention"
        )
        self.attention.build(input_shape, value_shape)
        if self.entry.layers is not None:
            for name, sublayer in self.entry.layers(self.config).items():
                sublayer.build(input_shape)
                setattr(self, name, sublayer)

    def call(self, *args, **kwargs):
        return _run(self, *args, **kwargs)

    def port(self, hub_layer):
        """Sets our layer's weights from `hub_layer` (the keras-hub layer replaced)."""
        for variable, value in self.ported(hub_layer):
            variable.assign(value)

    def ported(self, hub_layer):
        """`[(our variable, value)]`: `hub_layer`'s variables laid out as ours (the
        entry's `weights`: reshapes, transposes and splits, so a gradient maps the same
        way: `keras_mha.compare.model` pairs the two models' weight gradients so)."""
        pairs = []
        for sublayer, values in self.entry.weights(hub_layer).items():
            owner = self.attention if hasattr(self.attention, sublayer) else self
            target = getattr(owner, sublayer)
            variables = target.weights
            if len(variables) != len(values):
                raise ValueError(
                    f"{self.hub_class} -> keras_mha: {sublayer} has {len(variables)} "
                    f"weights, the keras-hub layer gives {len(values)}."
                )
            for variable, value in zip(variables, values):
                value = keras.ops.convert_to_numpy(value)
                if tuple(variable.shape) != tuple(value.shape):
                    raise ValueError(
                        f"{self.hub_class} -> keras_mha: {variable.path} has shape "
                        f"{tuple(variable.shape)}, the keras-hub layer gives "
                        f"{tuple(value.shape)}."
                    )
                pairs.append((variable, value))
        return pairs

    def get_config(self):
        config = {
            key: keras.saving.serialize_keras_object(value)
            if isinstance(value, keras.initializers.Initializer)
            else value
            for key, value in self.config.items()
        }
        return {
            **super().get_config(),
            "hub_class": self.hub_class,
            "config": config,
            "corrected": self.corrected,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        hub = {
            key: keras.saving.deserialize_keras_object(value)
            if isinstance(value, dict) and "class_name" in value
            else value
            for key, value in config.pop("config").items()
        }
        return cls(config=hub, **config)


def _run(layer, *args, **kwargs):
    entry = layer.entry
    return entry.call(layer if entry.with_layer else layer.attention, *args, **kwargs)


@functools.cache
def adapter_class(hub_cls):
    """`HubAttention` with `hub_cls.call`'s signature: Keras binds a layer's call
    arguments by its `call` signature (tensors and flags apart, `training` filled in),
    so each keras-hub class gets its own; and `hub_cls.compute_output_shape` where it
    has one of its own."""

    def call(self, *args, **kwargs):
        return _run(self, *args, **kwargs)

    call.__signature__ = inspect.signature(hub_cls.call)
    methods = {"call": call}
    # A decoder block may ask its attention for its output shape (Gemma 2's post-norm).
    shape = getattr(hub_cls, "compute_output_shape", None)
    if shape is not None and shape is not keras.layers.Layer.compute_output_shape:
        methods["compute_output_shape"] = shape
    return type(f"HubAttention[{hub_cls.__name__}]", (HubAttention,), methods)


def constructor_arguments(cls, args, kwargs):
    """`(config, layer_kwargs)`: the arguments of keras-hub class `cls`'s constructor
    by name, defaults filled in, and the base `Layer` arguments (`name`, `dtype`, ...)
    it passed on through `**kwargs`. A subclass's `**kwargs` are its keras-hub parent
    constructor's arguments first (ESM's `EsmSelfAttention` on `RoformerAttention`)."""
    signature = inspect.signature(cls.__init__)
    bound = signature.bind(None, *args, **kwargs)
    bound.apply_defaults()
    config = dict(bound.arguments)
    config.pop(next(iter(signature.parameters)))  # self
    layer_kwargs = {}
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            layer_kwargs = config.pop(name)
    if "dtype" in config:  # named by the class (T5Gemma's), still a base argument
        dtype = config.pop("dtype")
        if dtype is not None:
            layer_kwargs = {**layer_kwargs, "dtype": dtype}
    parent = next(c for c in cls.__mro__[1:] if "__init__" in vars(c))
    if parent.__module__.startswith("keras_hub.") and layer_kwargs:
        try:
            inherited, layer_kwargs = constructor_arguments(parent, (), layer_kwargs)
        except TypeError:  # `**kwargs` are base arguments: the class passes its parent its own
            return config, layer_kwargs
        config = {**inherited, **config}
    return config, layer_kwargs
