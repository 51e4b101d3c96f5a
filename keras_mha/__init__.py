"""keras-mha: a backend-agnostic Keras 3 MultiHeadAttention."""

from keras_mha import interop  # torch is imported lazily, inside its functions
from keras_mha.layer import MultiHeadAttention

__version__ = "0.1.0"
__all__ = ["MultiHeadAttention", "interop", "__version__"]
