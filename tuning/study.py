"""One Optuna study per problem key, kept in SQLite beside the cache, winners to the cache.

A study is named by its problem key and the hash of the kernel sources, so a run that was
stopped continues where it was (same kernels, same key), and changed kernels start afresh. The
heuristic default configuration is enqueued as the first trial, so the winner is never slower
than the default by more than the timing noise: the default is one of the candidates. Its
neighbours along each knob follow (space.neighbours, as many as the trials leave room for),
then the sampler's proposals. A study's winner other than the default then meets the default
in a runoff (:func:`runoff`): both timed again in alternating rounds, and the winner is
written only where it stays MIN_GAIN faster; otherwise the default is.
"""

import dataclasses
import datetime
import time
from dataclasses import dataclass, field

import numpy as np
import optuna

from numflash import cache, selection
from numflash.arrays import BFLOAT16
from numflash.config import config_from_dict
from numflash.kernels.jit import SIMULATOR
from numflash.timing import time_gpu

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
    pruned: int  # compile or launch failures
    rejected: int  # wrong results
    failed: int
    skipped: int = 0  # duplicates and infeasible points: nothing compiled or ran
    runoff: dict | None = None  # the winner timed again beside the default (:func:`runoff`)
    #: why configurations failed or gave wrong results: (trial number, config dict, reason)
    problems: list = field(default_factory=list)

    @property
    def speedup(self):
        if self.default_ms and self.best_ms:
            return self.default_ms / self.best_ms
        return None

    def entry(self):
        """The cache entry for this key (numflash/cache.py's format)."""
        entry = {
            "config": self.best_config.to_dict(),
            "time_ms": self.best_ms,
            "default_ms": self.default_ms,
            "default_config": self.default_config.to_dict(),
            "trials": self.complete + self.pruned + self.rejected + self.failed,
            "date": datetime.date.today().isoformat(),
        }
        if self.runoff is not None:
            entry["runoff"] = self.runoff
        return entry


def storage_url(device):
    """SQLite file of the studies for ``device``'s architecture, beside the cache."""
    path = cache.cache_dir() / f"studies-{device.arch}.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def study_name(key):
    return f"{key}|revision-{cache.kernel_revision(key.family)}"


#: A study times each configuration once (a median of ``runs`` calls), and between rounds of
#: one process the same configuration's time moved up to 3.4% on the H200
#: (docs/performance.md, "A work order"): a winner a few percent ahead of the default may be
#: noise. So the two are timed again, RUNOFF_ROUNDS rounds taken in turn, each keeping its
#: fastest round, and the winner is written only if it is at least MIN_GAIN faster.
RUNOFF_ROUNDS = 3
MIN_GAIN = 0.02

#: Proposals skipped without compiling (duplicates, infeasible points) cost nothing, but a
#: study stops proposing after this many per requested trial, whatever it found.
MAX_PROPOSALS_PER_TRIAL = 25


def _skipped(trial):
    """Whether a finished trial was skipped without compiling: a duplicate or infeasible point."""
    return trial.user_attrs.get("pruned", "").startswith(("duplicate", "infeasible"))


def _evaluated(study):
    """Trials that compiled and ran a configuration (timed, rejected as wrong, or failed)."""
    return [t for t in study.trials if t.state.is_finished() and not _skipped(t)]


def tune_key(
    key,
    device,
    *,
    trials,
    timeout_s=None,
    storage=None,
    fresh=False,
    progress=False,
    workload=None,
    timing=None,
    runoff_rounds=RUNOFF_ROUNDS,
):
    """Run (or resume) the study of ``key`` until it has evaluated ``trials`` configurations
    (or every feasible one, when there are fewer), or ``timeout_s`` has passed, then hold the
    winner's runoff against the default (``runoff_rounds`` rounds; 0: none).

    Duplicate and infeasible proposals are pruned before compiling and do not count: the
    budget buys measured configurations."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = storage or storage_url(device)
    name = study_name(key)
    if fresh:
        try:
            optuna.delete_study(study_name=name, storage=storage)
        except KeyError:
            pass
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=SEED),
        load_if_exists=True,
    )
    default, *neighbours = first_points(key, device, trials)
    head_dim = selection.default_config(key.family, key.head_dim, device)[0]
    target = min(trials, len(space.feasible_points(type(default), head_dim, device)))
    if not study.trials:
        study.enqueue_trial(space.as_params(default), user_attrs={"default": True})
        for cfg in neighbours:
            study.enqueue_trial(space.as_params(cfg), user_attrs={"neighbour": True})
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    objective = None
    proposals = 0
    bar = _ProgressBar(study, target) if progress else None
    while len(_evaluated(study)) < target and proposals < MAX_PROPOSALS_PER_TRIAL * trials:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        if objective is None:
            objective = _objective(key, device, workload, timing)
        n = target - len(_evaluated(study))
        proposals += n
        # Failures inside a trial are pruned by the objective; anything else that escapes
        # (a launch error while timing, say) fails that trial only.
        study.optimize(
            objective,
            n_trials=n,
            timeout=left,
            catch=(Exception,),
            callbacks=[bar] if bar else None,
        )
    if bar:
        bar.close()
    result = summarise(key, study, default)
    if runoff_rounds and _contested(result):
        objective = objective or _objective(key, device, workload, timing)
        result = runoff(result, objective, runoff_rounds)
    return result


def first_points(key, device, trials):
    """The configurations a new study of ``key`` tries first, before its sampler proposes any:
    the default of the key's bucket and mask, then its nearest feasible neighbours
    (:func:`tuning.space.neighbours`), ``trials`` in all at most."""
    head_dim, default = selection.default_config(
        key.family, key.head_dim, device, key.grid or "few", key
    )
    return [default] + space.neighbours(default, head_dim, device)[: max(0, trials - 1)]


def _objective(key, device, workload, timing):
    if SIMULATOR:
        import numpy as xp
    else:
        import cupy as xp
    return Objective(
        key, device, workload or Workload.for_key(key, device), xp, DTYPES[key.dtype],
        **(timing or {}),
    )  # fmt: skip


def _contested(result):
    """Whether a study's winner is not the default, and the default was timed."""
    best = result.best_config
    return best is not None and result.default_ms is not None and best != result.default_config


def runoff(result, objective, rounds=RUNOFF_ROUNDS, min_gain=MIN_GAIN):
    """``result`` after its winner and the default are timed again through ``objective``,
    ``rounds`` rounds taken in turn, each keeping its fastest round: the winner with those
    times if it is at least ``min_gain`` faster, else the default as the key's configuration.
    Either way the result's ``runoff`` says what the study had picked and how the two ran."""
    if not _contested(result):
        return result
    best, default = result.best_config, result.default_config
    calls = (objective.call(best), objective.call(default))
    times = ([], [])
    for _ in range(rounds):
        for fn, found in zip(calls, times):
            found.append(time_gpu(fn, **objective.timing).median_ms)
    best_ms, default_ms = min(times[0]), min(times[1])
    kept = best_ms <= default_ms * (1 - min_gain)
    record = {
        "rounds": rounds,
        "min_gain": min_gain,
        "study_winner": best.to_dict(),
        "winner_ms": best_ms,
        "default_ms": default_ms,
        "kept": kept,
    }
    if not kept:
        best, best_ms = default, default_ms
    return dataclasses.replace(
        result, best_config=best, best_ms=best_ms, default_ms=default_ms, runoff=record
    )


class _ProgressBar:
    """One bar per key over the configurations measured (skipped proposals do not move it),
    with the best time so far; an Optuna callback."""

    def __init__(self, study, target):
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=target, initial=min(len(_evaluated(study)), target), unit="cfg", leave=True
        )
        self._show_best(study)

    def _show_best(self, study):
        done = [t.value for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if done:
            self.bar.set_postfix_str(f"best {min(done):.3f} ms", refresh=False)

    def __call__(self, study, trial):
        if trial.state.is_finished() and not _skipped(trial):
            self._show_best(study)
            self.bar.update(1)

    def close(self):
        self.bar.close()


def summarise(key, study, default):
    states = optuna.trial.TrialState
    complete = [t for t in study.trials if t.state == states.COMPLETE]
    pruned = [t for t in study.trials if t.state == states.PRUNED and not _skipped(t)]
    rejected = [t for t in pruned if "rejected" in t.user_attrs]
    default_ms = next((t.value for t in complete if t.user_attrs.get("default")), None)
    best = min(complete, key=lambda t: t.value) if complete else None
    problems = [
        (t.number, t.user_attrs.get("config", t.params), _why(t))
        for t in study.trials
        if t.state == states.FAIL or (t.state == states.PRUNED and not _skipped(t))
    ]
    return KeyResult(
        key=key,
        default_config=default,
        default_ms=default_ms,
        best_config=config_from_dict(best.user_attrs["config"]) if best else None,
        best_ms=best.value if best else None,
        complete=len(complete),
        pruned=len(pruned) - len(rejected),
        rejected=len(rejected),
        failed=sum(t.state == states.FAIL for t in study.trials),
        skipped=sum(t.state == states.PRUNED and _skipped(t) for t in study.trials),
        problems=problems,
    )


def _why(trial):
    """What a trial that failed or was rejected recorded of why (tuning.objective)."""
    attrs = trial.user_attrs
    return attrs.get("rejected") or attrs.get("pruned") or attrs.get("failed") or "not recorded"
