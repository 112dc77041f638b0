"""A run's first configurations compiled in parallel processes before any study times them.

Compiling is most of a trial: about 2 s a kernel (a backward configuration is three), one
kernel at a time in a process. But the points each new study tries first are known before it
starts (:func:`tuning.study.first_points`: the default of the key's bucket and mask, then its
neighbours), and a kernel compiled in one process is kept on disk for the next
(numflash/kernel_cache.py). So ``jobs`` worker processes run each of those points' small
checked call once, and the studies then load the kernels instead of compiling them. Nothing is
timed meanwhile: the workers' launches would disturb the timings, so the studies wait for them.
A point whose call fails here is left to its trial, which prunes it with the error as before.
"""

import concurrent.futures
import multiprocessing
import os
import time

from numflash import kernel_cache

#: Worker processes by default: each holds a CUDA context and compiles one kernel at a time.
DEFAULT_JOBS = 8


def default_jobs():
    return max(1, min(DEFAULT_JOBS, (os.cpu_count() or 2) - 1))


def points(keys, device, trials):
    """[(key, configuration)] of the first points of every key's study, each kernel once: keys
    that differ only in their seqlen bucket compile the same kernels for the same point."""
    from .study import first_points

    found, seen = [], set()
    for key in keys:
        for cfg in first_points(key, device, trials):
            kernels = (key.family, key.dtype, key.head_dim, key.mask, key.grid, cfg)
            if kernels not in seen:
                seen.add(kernels)
                found.append((key, cfg))
    return found


def _compile(key, cfg):
    """Run ``cfg``'s checked call for ``key`` on a small workload (in a worker process): its
    kernels compile and are kept. Returns an error's text, or None."""
    import dataclasses

    import cupy

    from numflash.device import current_device

    from .objective import Objective, Workload
    from .study import DTYPES

    try:
        device = current_device()
        workload = Workload.for_key(key, device)
        small = dataclasses.replace(workload, batch=1, seqlen=workload.check_seqlen)
        objective = Objective(key, device, small, cupy, DTYPES[key.dtype])
        objective.check(cfg, seed=0)
    except Exception as exc:  # the trial meets it again, and prunes the point with it
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def run(keys, device, trials, jobs, out):
    """Compile the first points of ``keys``' studies in ``jobs`` processes; returns the
    seconds it took (0 where there is nothing to do: one job, or no kernel cache to fill)."""
    if jobs <= 1 or not kernel_cache.enabled():
        return 0.0
    todo = points(keys, device, trials)
    if not todo:
        return 0.0
    jobs = min(jobs, len(todo))
    print(f"compiling the first {len(todo)} configurations in {jobs} processes", file=out,
          flush=True)  # fmt: skip
    start = time.monotonic()
    failed = 0
    context = multiprocessing.get_context("spawn")  # a CUDA context does not survive fork
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = [pool.submit(_compile, key, cfg) for key, cfg in todo]
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            failed += future.result() is not None
            if done % max(1, len(todo) // 5) == 0 or done == len(todo):
                print(f"  {done}/{len(todo)} compiled ({time.monotonic() - start:.0f} s)",
                      file=out, flush=True)  # fmt: skip
    seconds = time.monotonic() - start
    note = f"; {failed} failed, left to their trials" if failed else ""
    print(f"compiled in {seconds:.0f} s{note}", file=out, flush=True)
    return seconds
