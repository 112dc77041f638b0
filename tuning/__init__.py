"""The Optuna autotuner behind ``numflash autotune``.

- :mod:`tuning.space`: search spaces derived from the configuration dataclasses' knobs;
  infeasible points are pruned before anything compiles.
- :mod:`tuning.objective`: one trial = build the kernel, check it against the float64
  reference on fresh inputs (a wrong result is rejected and recorded), time it.
- :mod:`tuning.study`: one Optuna study per problem key in SQLite beside the cache (resumable),
  the default configuration enqueued first, winners written to numflash's cache.

``import numflash`` never imports this package (nor Optuna).
"""
