"""One autotuning trial: propose a configuration, prove it right, time it.

A point the device cannot run (shared memory, threads, registers: the configuration's own
feasibility check) is pruned before anything compiles. A configuration that fails to compile or
launch is pruned with the error recorded. A configuration whose result misses the reference bar
is rejected (pruned, with the errors recorded) and can never win; so is one whose kernels use
local memory (spilled registers: how much depends on the ptxas version, so a winner that
spills under one toolchain may spill more under the next; the portable families keep their
rows in local memory by design and are exempt). Everything else is timed with
numflash.timing.time_gpu, the same method as the benchmarks.
"""

from dataclasses import dataclass

import optuna

import numflash
from numflash import cache, launch, reference
from numflash.arrays import from_float
from numflash.config import CONFIG_TYPES, families
from numflash.selection import default_config
from numflash.timing import attention_flops, time_gpu

from . import space

#: The shapes of the timed call: batch x seqlen = TOKENS, nheads x head_dim = MODEL_DIM, as in
#: the benchmarks (benchmarks/bench_forward.py).
TOKENS = 32768
MODEL_DIM = 2048


DECODE_FAMILIES = cache.GRID_FAMILIES  # the KV-cache families
BACKWARD_FAMILIES = tuple(c.family for c in families("backward"))

#: KV-cache keys: the timed decoding step has one query row a sequence, 32 query heads and 8 KV
#: heads at head_dim 128 (Llama 3 8B's GQA ratio, as benchmarks/bench_decode.py measures) and a
#: cache of the key's bucket; its batch puts the call in the key's grid class on the tuning GPU
#: (numflash.selection.grid_class): DECODE_BLOCKS_PER_SM thread blocks a multiprocessor without
#: splits (the H200's 132: batch 8 "few", as the benchmark's batch 8; batch 66 "many", as its
#: batch 64), at most DECODE_MAX_TOKENS cached tokens in all (16 GiB at head_dim 128).
DECODE_GQA = 4
DECODE_BLOCKS_PER_SM = {"few": 0.5, "many": 4}
DECODE_MAX_TOKENS = 1 << 22


@dataclass(frozen=True)
class Workload:
    """The calls one key is tuned on: a timed call and a smaller checked one. For the KV-cache
    families ``seqlen`` is the cache length and the query has one row a sequence."""

    batch: int
    nheads: int
    seqlen: int
    check_seqlen: int
    check_nheads: int = 2
    nheads_k: int = 0  # KV heads (KV-cache families); 0: nheads
    check_nheads_k: int = 0

    @classmethod
    def for_key(cls, key, device):
        """The key's workload on ``device``: a KV-cache key's batch follows its grid class
        (ValueError where that batch would exceed DECODE_MAX_TOKENS)."""
        seqlen = key.seqlen
        if key.family in DECODE_FAMILIES:
            nheads = max(DECODE_GQA, 4096 // key.head_dim)
            nheads_k = nheads // DECODE_GQA
            per_sm = DECODE_BLOCKS_PER_SM[key.grid]
            batch = max(1, round(per_sm * device.multiprocessors / nheads_k))
            if batch * seqlen > DECODE_MAX_TOKENS:
                raise ValueError(
                    f"a batch of {batch} caches of {seqlen} keys (the grid class's) exceeds "
                    f"the {DECODE_MAX_TOKENS} cached tokens a tuning run allocates"
                )
            return cls(
                batch=batch,
                nheads=nheads,
                nheads_k=nheads_k,
                seqlen=seqlen,
                check_seqlen=min(seqlen, 777),
                check_nheads=DECODE_GQA,
                check_nheads_k=1,
            )
        return cls(
            batch=max(1, TOKENS // seqlen),
            nheads=max(1, MODEL_DIM // key.head_dim),
            seqlen=seqlen,
            check_seqlen=min(seqlen, 777),
        )


def mask_kwargs(mask, seqlen):
    """attention() arguments for a key's mask kind ("window": a quarter of the sequence back)."""
    if mask == "causal":
        return {"causal": True}
    if mask == "window":
        return {"window_size": (max(1, seqlen // 4), 0)}
    return {}


def random_inputs(xp, batch, seqlen, nheads, head_dim, dtype, seed):
    rng = xp.random.default_rng(seed)
    shape = (batch, seqlen, nheads, head_dim)
    return [from_float(rng.standard_normal(shape, dtype=xp.float32), dtype) for _ in range(3)]


class Objective:
    """Callable for ``study.optimize``: returns the median time (ms) of a correct configuration.

    Forward families time ``attention``; backward families time ``attention_backward`` from
    saved forward outputs, and check all three gradients against the float64 reference; the
    KV-cache families time a decoding step (``attention_with_kvcache``, one query row a
    sequence, the whole cache seen) and check it against the reference over the cache.
    """

    def __init__(self, key, device, workload, xp, dtype, warmup=3, runs=15, max_ms=2000):
        self.key = key
        self.device = device
        self.workload = workload
        self.xp = xp
        self.dtype = dtype
        self.config_type = CONFIG_TYPES[key.family]
        self.head_dim = default_config(key.family, key.head_dim, device)[0]
        self.backward = key.family in BACKWARD_FAMILIES
        self.decode = key.family in DECODE_FAMILIES
        self.mask = mask_kwargs(key.mask, workload.seqlen)
        w = workload
        if self.decode:
            self.timed = self.decode_inputs(w.batch, w.seqlen, w.nheads, w.nheads_k, seed=0)
            self.flops = attention_flops(w.batch, w.nheads, 1, w.seqlen, key.head_dim, False, "fwd")
            self.timing = dict(warmup=warmup, runs=runs, max_total_ms=max_ms)
            return
        self.timed = random_inputs(xp, w.batch, w.seqlen, w.nheads, key.head_dim, dtype, seed=0)
        if self.backward:
            q, k, v = self.timed
            out, lse = numflash.attention(q, k, v, return_lse=True, **self.mask)
            dout = random_inputs(xp, w.batch, w.seqlen, w.nheads, key.head_dim, dtype, 1)[0]
            self.saved = (dout, out, lse)
        self.flops = attention_flops(
            w.batch,
            w.nheads,
            w.seqlen,
            w.seqlen,
            key.head_dim,
            key.mask == "causal",
            "bwd" if self.backward else "fwd",
        )
        self.timing = dict(warmup=warmup, runs=runs, max_total_ms=max_ms)

    def __call__(self, trial):
        try:
            return self._evaluate(trial)
        except optuna.TrialPruned:
            raise
        except Exception as exc:  # the study catches it and marks the trial failed
            trial.set_user_attr("failed", f"{type(exc).__name__}: {exc}"[:500])
            raise

    def _evaluate(self, trial):
        cfg = space.suggest(trial, self.config_type)
        trial.set_user_attr("config", cfg.to_dict())
        for other in trial.study.get_trials(deepcopy=False):
            if other.number != trial.number and other.params == trial.params:
                # TPE may propose a point again: timing it twice would only measure noise.
                trial.set_user_attr("pruned", f"duplicate of trial {other.number}")
                raise optuna.TrialPruned()
        reasons = cfg.problems(self.head_dim, self.device)
        if reasons:
            trial.set_user_attr("pruned", "infeasible: " + "; ".join(reasons))
            raise optuna.TrialPruned()
        try:
            result = self.check(cfg, seed=1000 + trial.number)
        except Exception as exc:  # compile or launch failure: prune, keep studying
            trial.set_user_attr("pruned", f"{type(exc).__name__}: {exc}"[:500])
            raise optuna.TrialPruned() from None
        spilled = launch.local_memory_bytes(cfg)
        if spilled and not cfg.LOCAL_ROWS:
            # a shipped or cached winner must not depend on how one ptxas version spills
            trial.set_user_attr("pruned", f"uses {spilled} bytes of local memory a thread")
            raise optuna.TrialPruned()
        trial.set_user_attr("err", max(r.err for r in result))
        trial.set_user_attr("bar", min(r.bar for r in result))
        if not all(r.ok for r in result):
            trial.set_user_attr("rejected", f"wrong result: {[r for r in result if not r.ok]}")
            raise optuna.TrialPruned()
        t = time_gpu(self.call(cfg), **self.timing)
        trial.set_user_attr("tflops", t.tflops(self.flops))
        return t.median_ms

    def decode_inputs(self, batch, length, nheads, nheads_k, seed):
        """(q with one row a sequence, k cache, v cache) of ``length`` cached keys each."""
        hd = self.key.head_dim
        q = random_inputs(self.xp, batch, 1, nheads, hd, self.dtype, seed)[0]
        k, v = random_inputs(self.xp, batch, length, nheads_k, hd, self.dtype, seed + 1)[:2]
        return q, k, v

    def call(self, cfg):
        """The timed call with ``cfg``."""
        q, k, v = self.timed
        if self.decode:
            length = self.workload.seqlen
            return lambda: numflash.attention_with_kvcache(
                q, k, v, cache_seqlens=length, config=cfg, **self.mask
            )
        if self.backward:
            dout, out, lse = self.saved
            return lambda: numflash.attention_backward(
                dout, q, k, v, out, lse, config=cfg, **self.mask
            )
        return lambda: numflash.attention(q, k, v, config=cfg, **self.mask)

    def check(self, cfg, seed):
        """The configuration's results on fresh random inputs against the float64 reference:
        a list of checks (the output, or the three gradients), each with ``ok``."""
        w = self.workload
        mask = mask_kwargs(self.key.mask, w.check_seqlen)
        if self.decode:
            q, k, v = self.decode_inputs(2, w.check_seqlen, w.check_nheads, w.check_nheads_k, seed)
            out, lse = numflash.attention_with_kvcache(
                q, k, v, cache_seqlens=w.check_seqlen, config=cfg, return_lse=True, **mask
            )
            return [reference.check(q, k, v, out, lse, **mask)]
        q, k, v = random_inputs(
            self.xp, 1, w.check_seqlen, w.check_nheads, self.key.head_dim, self.dtype, seed
        )
        if self.backward:
            out, lse = numflash.attention(q, k, v, return_lse=True, **mask)
            dout = random_inputs(
                self.xp, 1, w.check_seqlen, w.check_nheads, self.key.head_dim, self.dtype, seed + 1
            )[0]
            grads = numflash.attention_backward(dout, q, k, v, out, lse, config=cfg, **mask)
            return list(reference.check_backward(dout, q, k, v, *grads, **mask))
        out, lse = numflash.attention(q, k, v, config=cfg, return_lse=True, **mask)
        return [reference.check(q, k, v, out, lse, **mask)]
