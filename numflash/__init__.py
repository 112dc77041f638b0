"""numflash: FlashAttention for CuPy arrays, written in Numba, tuned by Optuna."""

from .api import attention
from .config import PortableConfig, TensorCoreConfig

__version__ = "0.1.0"

__all__ = ["attention", "TensorCoreConfig", "PortableConfig", "__version__"]
