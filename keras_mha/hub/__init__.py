"""keras-hub's own attention classes on keras_mha: the one place that knows them.

- `table.ADAPTERS`: the keras-hub attention classes that move, one small entry each;
  `table.OUT_OF_SCOPE`: those that do not, with the reason.
- `adapter.HubAttention`: the layer that takes such a class's place in its model.
- `patch()` / `unpatch()`: while patched (inside `keras_mha.swapped()`), constructing
  one of those classes constructs a `HubAttention` for it.
"""

import importlib
import sys

from keras_mha.hub.adapter import HubAttention, adapter_class, constructor_arguments
from keras_mha.hub.table import ADAPTERS, OUT_OF_SCOPE

__all__ = [
    "ADAPTERS",
    "OUT_OF_SCOPE",
    "HubAttention",
    "patch",
    "unpatch",
    "hub_classes",
    "out_of_scope",
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
