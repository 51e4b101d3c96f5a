"""The only place keras_mha uses Keras API that is not public.

Keras 3 keeps a tensor's implicit mask (from `Embedding(mask_zero=True)`, `Masking`,
...) as an attribute of the tensor, read and written with these two helpers; no
public API exposes them. `tests/test_keras_private.py` fails loudly if a new Keras
moves or changes them.
"""

from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

__all__ = ["get_keras_mask", "set_keras_mask"]
