"""One Optuna study per problem key, kept in SQLite beside the cache, winners to the cache.

A study is named by its problem key and the hash of the kernel sources, so a run that was
stopped continues where it was (same kernels, same key), and changed kernels start afresh. The
heuristic default configuration is enqueued as the first trial, so the winner is never slower
than the default by more than the timing noise: the default is one of the candidates.
"""

import datetime
from dataclasses import dataclass

import numpy as np
import optuna

from numflash import cache, config as configs
from numflash.arrays import BFLOAT16
from numflash.kernels.jit import SIMULATOR

from . import space
from .objective import Objective, Workload

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "float32": np.dtype(np.float32)}
SEED = 0


@dataclass
class KeyResult:
    key: cache.ProblemKey
    default_config: object
    default_ms: float | None
    best_config: object | None
    best_ms: float | None
    complete: int
    pruned: int
    rejected: int
    failed: int

    @property
    def speedup(self):
        if self.default_ms and self.best_ms:
            return self.default_ms / self.best_ms
        return None

    def entry(self):
        """The cache entry for this key (numflash/cache.py's format)."""
        return {
            "config": self.best_config.to_dict(),
            "time_ms": self.best_ms,
            "default_ms": self.default_ms,
            "default_config": self.default_config.to_dict(),
            "trials": self.complete + self.pruned + self.failed,
            "date": datetime.date.today().isoformat(),
        }


def storage_url(device):
    """SQLite file of the studies for ``device``'s architecture, beside the cache."""
    path = cache.cache_dir() / f"studies-{device.arch}.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def study_name(key):
    return f"{key}|kernels-{cache.kernel_hash(key.family)}"


def tune_key(key, device, *, trials, timeout_s=None, storage=None, fresh=False, progress=False,
             workload=None, timing=None):  # fmt: skip
    """Run (or resume) the study of ``key`` until it holds ``trials`` finished trials."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = storage or storage_url(device)
    name = study_name(key)
    if fresh:
        try:
            optuna.delete_study(study_name=name, storage=storage)
        except KeyError:
            pass
    study = optuna.create_study(study_name=name, storage=storage, direction="minimize",
                                sampler=optuna.samplers.TPESampler(seed=SEED),
                                load_if_exists=True)  # fmt: skip
    _, default = configs.default_config(key.family, key.head_dim, device)
    if not study.trials:
        study.enqueue_trial(space.as_params(default), user_attrs={"default": True})
    finished = [t for t in study.trials if t.state.is_finished()]
    remaining = trials - len(finished)
    if remaining > 0:
        if SIMULATOR:
            import numpy as xp
        else:
            import cupy as xp
        objective = Objective(key, device, workload or Workload.for_key(key), xp,
                              DTYPES[key.dtype], **(timing or {}))  # fmt: skip
        # Failures inside a trial are pruned by the objective; anything else that escapes
        # (a launch error while timing, say) fails that trial only.
        study.optimize(objective, n_trials=remaining, timeout=timeout_s,
                       show_progress_bar=progress, catch=(Exception,))  # fmt: skip
    return summarise(key, study, default)


def summarise(key, study, default):
    states = optuna.trial.TrialState
    complete = [t for t in study.trials if t.state == states.COMPLETE]
    pruned = [t for t in study.trials if t.state == states.PRUNED]
    rejected = [t for t in pruned if "rejected" in t.user_attrs]
    default_ms = next((t.value for t in complete if t.user_attrs.get("default")), None)
    best = min(complete, key=lambda t: t.value) if complete else None
    return KeyResult(
        key=key,
        default_config=default,
        default_ms=default_ms,
        best_config=configs.config_from_dict(best.user_attrs["config"]) if best else None,
        best_ms=best.value if best else None,
        complete=len(complete),
        pruned=len(pruned) - len(rejected),
        rejected=len(rejected),
        failed=sum(t.state == states.FAIL for t in study.trials),
    )
