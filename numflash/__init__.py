"""numflash: FlashAttention for CuPy arrays, written in Numba, tuned by Optuna."""

from .api import attention, selected_config
from .config import PortableConfig, TensorCoreConfig

__version__ = "0.1.0"

__all__ = ["attention", "selected_config", "TensorCoreConfig", "PortableConfig", "__version__"]
