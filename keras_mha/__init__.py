"""keras-mha: a backend-agnostic Keras 3 MultiHeadAttention."""

from keras_mha.layer import MultiHeadAttention

__version__ = "0.1.0"
__all__ = ["MultiHeadAttention", "__version__"]
