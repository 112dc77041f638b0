"""numflash: FlashAttention for CuPy arrays, written in Numba, tuned by Optuna."""

from . import families  # noqa: F401  (registers the families with a module of their own)
from .api import (
    attention,
    attention_backward,
    attention_varlen,
    attention_varlen_backward,
    attention_with_kvcache,
    block_mask,
    selected_backward_config,
    selected_config,
    selected_kvcache_config,
)
from .block_masks import BlockMask
from .config import (
    PortableBackwardConfig,
    PortableConfig,
    PortableDecodeConfig,
    TensorCoreBackwardConfig,
    TensorCoreConfig,
    TensorCoreDecodeConfig,
    WgmmaBackwardConfig,
    WgmmaForwardConfig,
)

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "block_mask",
    "BlockMask",
    "selected_config",
    "selected_backward_config",
    "selected_kvcache_config",
    "TensorCoreConfig",
    "PortableConfig",
    "PortableDecodeConfig",
    "TensorCoreDecodeConfig",
    "PortableBackwardConfig",
    "TensorCoreBackwardConfig",
    "WgmmaBackwardConfig",
    "WgmmaForwardConfig",
    "__version__",
]
