"""Keras's own attention test files, taken from the installed keras, run on our class.

`load(stem)` imports `keras/src/layers/attention/<stem>.py` from the installed keras
package (so it follows the pinned version) as a fresh module and swaps the `layers`
namespace its tests look up at run time: `layers.MultiHeadAttention` is
`keras_mha.MultiHeadAttention` and `layers.GroupedQueryAttention` is
`GroupedQueryAttention` below, our class configured with `num_key_value_heads`.
Everything else in `layers` (Input, Embedding, ...) stays Keras's.
"""

import importlib.util
import types
from pathlib import Path

import keras

import keras_mha

UPSTREAM_DIR = Path(keras.__file__).resolve().parent / "src" / "layers" / "attention"


@keras.saving.register_keras_serializable(package="keras_mha_upstream_tests")
class GroupedQueryAttention(keras_mha.MultiHeadAttention):
    """`keras.layers.GroupedQueryAttention`'s constructor over our class.

    `head_dim` is our `key_dim`, `num_query_heads` our `num_heads`; the output
    projects back to the query's last dimension, as the built-in does. The config
    round-trips through the built-in's argument names. The built-in GQA leaves the
    Keras masks of the tensors passed in (MultiHeadAttention removes them):
    `keep_input_masks=True`.
    """

    def __init__(self, head_dim, num_query_heads, num_key_value_heads, **kwargs):
        kwargs.setdefault("keep_input_masks", True)
        super().__init__(
            num_heads=num_query_heads,
            key_dim=head_dim,
            num_key_value_heads=num_key_value_heads,
            **kwargs,
        )

    @property
    def head_dim(self):
        return self.key_dim

    @property
    def num_query_heads(self):
        return self.num_heads

    @property
    def sliding_window(self):
        return self._sliding_window

    def get_config(self):
        config = super().get_config()
        config["head_dim"] = config.pop("key_dim")
        config["num_query_heads"] = config.pop("num_heads")
        for name in ("value_dim", "output_shape", "attention_axes"):
            config.pop(name)
        return config


def swapped_layers():
    """`keras.layers` with the two attention layers replaced by ours."""
    namespace = types.SimpleNamespace(**{n: getattr(keras.layers, n) for n in dir(keras.layers)})
    namespace.MultiHeadAttention = keras_mha.MultiHeadAttention
    namespace.GroupedQueryAttention = GroupedQueryAttention
    return namespace


def load(stem):
    """The installed keras's `layers/attention/<stem>.py`, with our classes swapped in."""
    path = UPSTREAM_DIR / f"{stem}.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"Keras's own test file {path} is missing from the installed keras "
            f"{keras.__version__}: the upstream suite cannot run."
        )
    spec = importlib.util.spec_from_file_location(f"keras_upstream.{stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "layers"):
        raise AttributeError(f"{path} no longer imports `layers`: the class swap needs updating")
    module.layers = swapped_layers()
    return module
