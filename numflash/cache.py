"""Where tuned configurations live.

One JSON file per compute capability (``sm_90.json``) in ``$NUMFLASH_CACHE_DIR``, else the
platform's user cache directory (``~/.cache/numflash`` on Linux).
"""

import os
from pathlib import Path


def cache_dir():
    override = os.environ.get("NUMFLASH_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("numflash", appauthor=False))
