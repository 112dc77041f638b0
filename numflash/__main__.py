"""``python -m numflash ...``: the same as the ``numflash`` command."""

from .cli import main

raise SystemExit(main())
