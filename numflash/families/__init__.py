"""Kernel families with a module of their own: each declares its configuration, default, rule
and launch builders there (numflash/families/wgmma_forward.py is the model), and is registered
by importing it below, one line a family. numflash imports this package last, once the
generic layers (config, selection, launch) are loaded."""

from . import wgmma_backward, wgmma_forward  # noqa: F401
