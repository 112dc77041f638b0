"""Kernel families with a module of their own: each declares its configuration, default, rule
and launch builders there (numflash/families/wgmma_forward.py is the model) and is registered
by its line in the import below, one line a family. Importing numflash imports this package;
each family module imports the generic layers it registers into (config, selection, launch)
first."""

from . import (
    wgmma_backward,  # noqa: F401  (the Hopper backward)
    wgmma_forward,  # noqa: F401  (the Hopper forward)
)
