"""keras-mha: a backend-agnostic Keras 3 MultiHeadAttention.

Importing `keras_mha` imports no backend. The public names load on first use, and our
Keras classes are registered as soon as Keras itself is imported (at once, when it
already is), so that after `import keras_mha`, `keras.saving.load_model` finds them
whichever of `keras` and `keras_mha` is imported first. The command line
(`keras-mha`, `python -m keras_mha`) therefore starts without Keras, finds the
installed backends and runs each one's work in its own process.
"""

import importlib
import sys
from typing import TYPE_CHECKING

import wrapt

if TYPE_CHECKING:  # what the lazy names are, for type checkers and the API docs
    from keras_mha import block_mask, interop, packing, score_mod  # noqa: F401
    from keras_mha.functional import attention  # noqa: F401
    from keras_mha.layer import MultiHeadAttention  # noqa: F401
    from keras_mha.swapping import save_swapped, swap, swapped  # noqa: F401

__version__ = "0.2.0"

# Public name -> (module, attribute in it; None: the module itself).
_PUBLIC = {
    "MultiHeadAttention": ("keras_mha.layer", "MultiHeadAttention"),
    "swap": ("keras_mha.swapping", "swap"),
    "swapped": ("keras_mha.swapping", "swapped"),
    "save_swapped": ("keras_mha.swapping", "save_swapped"),
    "interop": ("keras_mha.interop", None),
    "block_mask": ("keras_mha.block_mask", None),
    "packing": ("keras_mha.packing", None),
    "attention": ("keras_mha.functional", "attention"),
    "score_mod": ("keras_mha.score_mod", None),
}
# Modules whose import registers Keras classes (`register_keras_serializable`).
_REGISTERING = ("keras_mha.layer", "keras_mha.swapping")

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'keras_mha' has no attribute '{name}'")
    module_name, attribute = _PUBLIC[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


def _register(_keras):
    # A module already in `sys.modules` is loaded or loading: it registers itself.
    for module_name in _REGISTERING:
        if module_name not in sys.modules:
            importlib.import_module(module_name)


wrapt.register_post_import_hook(_register, "keras")
