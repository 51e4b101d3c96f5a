"""keras-hub's own attention classes on keras_mha: the one place that knows them.

- `table.ADAPTERS`: the keras-hub attention classes that move, one small entry each;
  `table.OUT_OF_SCOPE`: those that do not, with the reason.
- `adapter.HubAttention`: the layer that takes such a class's place in its model.
- `patch()` / `unpatch()`: while patched (inside `keras_mha.swapped()`), constructing
  one of those classes constructs a `HubAttention` for it.
- `carry_config_gaps(original, result)`: what a keras-hub class's `get_config` drops
  (`table.CONFIG_GAPS`), from a layer to its rebuilt copy.
- `task_forward(model)`: what a check calls in place of a keras-hub task whose call is
  not the function of its weights (`table.TASK_FORWARD`: Gemma 3n's causal LM).
- `describe_masks(model)`: the decoder blocks of a swapped model pass their masks to
  our layer described, not dense (`swap` and `save_swapped` files do it).
"""

import functools
import importlib
import inspect
import sys

from keras_mha.hub import common
from keras_mha.hub.adapter import HubAttention, adapter_class, constructor_arguments
from keras_mha.hub.table import ADAPTERS, CONFIG_GAPS, OUT_OF_SCOPE, TASK_FORWARD

__all__ = [
    "ADAPTERS",
    "CONFIG_GAPS",
    "HubAttention",
    "OUT_OF_SCOPE",
    "carry_config_gaps",
    "common",
    "describe_masks",
    "hub_classes",
    "out_of_scope",
    "patch",
    "set_packed",
    "task_forward",
    "unpatch",
]

_saved = {}  # class -> its own `__new__` (or None) while patched


def hub_classes(keys=ADAPTERS):
    """`{class: key}` for the table's classes (or `keys`'), when keras-hub is imported
    (else `{}`)."""
    if "keras_hub" not in sys.modules:
        return {}
    found = {}
    for key in keys:
        module_name, _, class_name = key.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # another keras-hub version: the guard test names what moved
        found[cls] = key
    return found


def is_hub_attention(layer):
    """Whether `layer` is one of the table's keras-hub attention classes."""
    return type(layer) in hub_classes()


def out_of_scope(layer):
    """Why `layer`'s keras-hub attention class does not move (`OUT_OF_SCOPE`), or `None`."""
    key = hub_classes(OUT_OF_SCOPE).get(type(layer))
    return None if key is None else OUT_OF_SCOPE[key]


def task_forward(model):
    """`(fn, note)` for a keras-hub task whose call is not the function of its weights
    (`TASK_FORWARD`): `fn(model, inputs)` computes its outputs from its current
    weights, `note` says so in one line; `None` for any other model."""
    key = hub_classes(TASK_FORWARD).get(type(model))
    return None if key is None else TASK_FORWARD[key]


def carry_config_gaps(original, result):
    """Sets on `result` (a layer rebuilt from `original`'s config) the attributes that
    `original`'s keras-hub class leaves out of its config (`CONFIG_GAPS`)."""
    key = hub_classes(CONFIG_GAPS).get(type(original))
    if key is None or type(result) is not type(original):
        return
    for name in CONFIG_GAPS[key]:
        setattr(result, name, getattr(original, name))


def patch():
    """Makes the table's classes construct `HubAttention` (idempotent)."""
    for cls, key in hub_classes().items():
        if cls in _saved:
            continue
        _saved[cls] = cls.__dict__.get("__new__")
        cls.__new__ = staticmethod(_constructor(cls, key))


def unpatch():
    for cls, new in list(_saved.items()):
        if new is None:
            del cls.__new__
        else:
            cls.__new__ = new
        del _saved[cls]


def _constructor(hub_cls, key):
    def new(cls, *args, **kwargs):
        if cls is not hub_cls:  # a subclass of a moved class is left as it is
            return super(hub_cls, cls).__new__(cls, *args, **kwargs)
        config, layer_kwargs = constructor_arguments(hub_cls, args, kwargs)
        return adapter_class(hub_cls)(key, config, **layer_kwargs)

    return new


def describe_masks(model, packed=False):
    """Makes each decoder block of `model` that holds a `HubAttention` whose entry has
    a `decoder_mask` pass its self-attention mask described (`common.DecoderMask`):
    the block's own mask method (`_compute_self_attention_mask`, or the one the entry's
    `common.DescribedDecoder` names) is replaced on that instance only, and so is the
    `call` of any sublayer that reads the mask too (a MoE router's load-balancing
    loss). With `packed`, the blocks read the model's `padding_mask` as document ids
    (see `set_packed`). Returns the number of blocks changed."""
    changed = 0
    for layer in model._flatten_layers(include_self=True, recursive=True):
        children = layer._flatten_layers(include_self=False, recursive=False)
        entries = {c.entry for c in children if isinstance(c, HubAttention)}
        describe = {e.decoder_mask for e in entries}
        if len(describe) != 1 or None in describe:
            continue
        spec = describe.pop()
        if not isinstance(spec, common.DescribedDecoder):
            spec = common.DescribedDecoder(spec)
        if not spec.applies_to(layer):
            continue
        method = functools.partial(_described, spec, layer, packed)
        object.__setattr__(layer, spec.method, method)
        for name, reduce in spec.sublayers:
            sublayer = getattr(layer, name, None)
            if sublayer is not None and _takes(sublayer, "attention_mask"):
                own = type(sublayer).call.__get__(sublayer)  # never wraps a wrapper
                object.__setattr__(sublayer, "call", functools.partial(_reduced, own, reduce))
        changed += 1
    return changed


def _takes(layer, argument):
    """Whether `layer`'s `call` takes `argument`."""
    return argument in inspect.signature(type(layer).call).parameters


def _described(spec, layer, packed, *args, **kwargs):
    mask = spec(layer, *args, **kwargs)
    if not packed:
        return mask
    if spec.not_packed:
        raise ValueError(
            "Received an invalid value for argument `padding_mask`, expected a padding "
            f"mask: decoder block {layer.name} cannot take packed rows ({spec.not_packed}). "
            "Received: padding_mask=<document ids>"
        )
    if not isinstance(mask, common.DecoderMask):
        raise ValueError(
            "Received an invalid value for argument `padding_mask`, expected document "
            f"ids that decoder block {layer.name} can apply (packed rows), but its mask "
            "for this call can only be keras-hub's dense one (a `vision_mask` given, or "
            "bidirectional attention). Received: padding_mask=<document ids>"
        )
    return mask.packed()


def _reduced(call, reduce, *args, **kwargs):
    """A sublayer's `call` given what it reads of a described mask."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, common.DecoderMask):
        kwargs["attention_mask"] = reduce(mask, args[0] if args else kwargs.get("hidden_states"))
    return call(*args, **kwargs)


def set_packed(model, packed=True):
    """Makes a swapped keras-hub language model train on packed rows, in place.

    Its decoder blocks then read the `padding_mask` input as `(B, T)` document ids
    (1, 2, ... per document, 0 = padding; `keras_mha.packing.pack`'s `segment_ids`):
    each token attends only to the earlier tokens of its own document, and RoPE
    positions restart at 0 at each document. Feed `fit()` `{"token_ids": ...,
    "padding_mask": segment_ids}`, the targets, and the loss mask as sample weights.
    `set_packed(model, False)` restores the usual reading (nonzero = a token). A
    `.keras` file of the model loads unpacked.

    Args:
        model: a model returned by `keras_mha.swap` (or loaded from `save_swapped`)
            whose attention classes describe their decoder masks.
        packed: whether `padding_mask` holds document ids.

    Returns:
        `model`.

    Raises:
        ValueError: no decoder block of `model` can read document ids.
    """
    if not describe_masks(model, packed=bool(packed)):
        raise ValueError(
            "Received an invalid value for argument `model`, expected a keras-hub "
            "language model swapped by `keras_mha.swap` whose decoder blocks describe "
            f"their masks. Received: model={model.name}"
        )
    return model
