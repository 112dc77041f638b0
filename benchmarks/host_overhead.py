"""What a numflash call costs the host, on the GPU machine.

    python benchmarks/host_overhead.py [--json PATH]

Measures, in one process:
- ``attention()``, ``attention_backward()`` and ``attention_with_kvcache()`` (a paged
  decoding step with an append) per call on tiny problems, the host's time in bursts of 20
  calls (``per_call_us``), and the GPU's time per call of the same calls back to back
  (``[GPU]``; a loop of calls whose kernels take longer than their host side runs at that
  rate): a repeated call replays its plan (numflash.plans); SDPA's figure beside them, both
  ways (and SDPA's backward through autograd on a kept graph beside ``attention_backward``).
  Each loop drops its outputs, as a
  model's layers do, so a replay hands its last output out again; the ``[outputs kept]``
  figures hold the last two calls' outputs, so that every call allocates, and ``[out given]``
  passes one output buffer to every call, as a serving loop with static buffers does;
- the full path of ``attention`` and of ``attention_backward`` (what a call without a plan
  runs: validation, the configuration lookup, outputs, the launches prepared per geometry);
- the configuration lookup alone (``numflash.selected_config``);
- whether a call blocks: how long ``attention()`` takes to return on a problem whose kernel
  runs for milliseconds, beside the kernel's time;
- with ``--profile``, cProfile's view of where a call's host time goes, and the parts of a
  repeated KV-cache call timed alone (its plan's run, its matcher, its key, the capture
  check, the output, the replay, the launch).
"""

import argparse
import collections
import json
import os
import statistics
import sys
import time

import cupy
import numpy as np
from numba import cuda, float32

import numflash
from numflash import arrays
from numflash.device import current_device

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import random_qkv  # noqa: E402


def per_call_us(fn, bursts=500, calls=20):
    """Host time of one call: the median over ``bursts`` bursts of the mean time of ``calls``
    back-to-back calls, the GPU drained between bursts (the defaults: 10,000 calls). A burst
    this short never fills the GPU's queue, so a kernel slower than its call's host side
    cannot make the host wait: this is the time the host spends issuing the call."""
    stream = cupy.cuda.get_current_stream()
    fn()
    stream.synchronize()
    means = []
    for _ in range(bursts):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls * 1e6)
        stream.synchronize()
    return statistics.median(means)


def gpu_per_call_us(fn, calls=2000):
    """GPU time per call of ``calls`` calls back to back (CUDA events around the loop): what a
    loop of these calls is bound by when it exceeds their host time."""
    stream = cupy.cuda.get_current_stream()
    fn()
    stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(calls):
        fn()
    stop.record(stream)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls


def warm_up(seconds=1.0):
    """Calls for ``seconds`` before anything is timed, so that the first figure is taken as the
    later ones are, after the process's first launches and allocations."""
    q, k, v = random_qkv(1, 128, 1, 64, "float16")
    stream = cupy.cuda.get_current_stream()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            numflash.attention(q, k, v)
        stream.synchronize()


def report(results, path=None):
    """Print ``results`` as JSON, and write them to ``path`` if given."""
    text = json.dumps(results, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def kept(fn):
    """``fn`` with the outputs of its last two calls held, so that no plan can reuse them."""
    held = collections.deque(maxlen=2)
    return lambda: held.append(fn())


def blocking(seqlen=32768):
    """(host ms for attention() to return, kernel ms) on a long problem."""
    q, k, v = random_qkv(1, seqlen, 16, 128, "float16", seed=1)
    numflash.attention(q, k, v, causal=True)  # compile, warm up
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    t0 = time.perf_counter()
    numflash.attention(q, k, v, causal=True)
    host_ms = (time.perf_counter() - t0) * 1e3
    stop.record(stream)
    done_at_return = stop.done
    stop.synchronize()
    return host_ms, cupy.cuda.get_elapsed_time(start, stop), done_at_return


def kvcache_parts(call, args):
    """{part: us} of a repeated attention_with_kvcache ``call`` (made once already), each part
    timed alone as the repeated-call path in numflash/api.py runs it. ``args``: the call's
    arguments in its signature's order (numflash.api._KVCACHE)."""
    from numflash import api

    plan, pointers, key = api._find(api._KVCACHE, args)  # the plan ``call`` made, by its key
    match = api._KVCACHE.matcher(key, one_device=cupy.cuda.runtime.getDeviceCount() == 1)
    stream = cupy.cuda.get_current_stream().ptr
    q = args[0]
    out = cupy.empty(q.shape, q.dtype)
    launched = list(pointers)
    launched[8] = out.data.ptr  # the launch alone writes into out
    return {
        "launches": len(plan.launches),
        "matched": match(*args) is not None,
        "whole_call_us": per_call_us(call),
        # the plan's run (its matcher and its replay in one function), as a repeat runs it
        "run_us": per_call_us(lambda: plan.run(*args)),
        "matcher_us": per_call_us(lambda: match(*args)),
        "key_us": per_call_us(lambda: api._KVCACHE.key(*args)),
        "key_and_lookup_us": per_call_us(lambda: api._plans.get(api._KVCACHE.key(*args)[0])),
        "capture_check_us": per_call_us(lambda: api._Cupy.stream_is_capturing(stream)),
        "output_allocated_us": per_call_us(lambda: cupy.ndarray(q.shape, q.dtype)),
        "output_reused_us": per_call_us(lambda: plan.output(0, cupy.ndarray)),
        "overlap_check_us": per_call_us(lambda: plan.disjoint(pointers)),
        # the replay after a key lookup (the overlap check, the output, the launch)
        "replay_us": per_call_us(lambda: plan.replay(pointers, None)),
        "launch_alone_us": per_call_us(lambda: plan.launches[0].launch(stream, launched)),
    }


@cuda.jit(device=True)
def _relative_bias(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * (float32(q_idx) - float32(kv_idx))


def call_patterns():
    """{pattern: host us a call} for the call patterns of a training or serving loop, each
    repeated (bursts, as :func:`per_call_us`); and the host time of the first call of a new
    shape whose kernel is compiled already (median over shapes never seen before)."""
    found = {}

    def timed(fn):
        return per_call_us(fn, bursts=150)

    q, k, v = random_qkv(2, 128, 4, 64, "float16")
    found["attention, distinct q k v"] = timed(lambda: numflash.attention(q, k, v))
    qkv = random_qkv(2, 128, 12, 64, "float16")[0].reshape(2, 128, 3, 4, 64)
    fq, fk, fv = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    found["attention, views of a fused qkv"] = timed(lambda: numflash.attention(fq, fk, fv))
    qs = random_qkv(2, 96, 4, 64, "float16", seed=4)[0]  # a signature no call made before
    found["attention(q, q, q)"] = timed(lambda: numflash.attention(qs, qs, qs))
    # decoding over a contiguous cache: one new row appended per step
    qd = random_qkv(4, 1, 8, 64, "float16", seed=5)[0]
    k_cache, v_cache = random_qkv(4, 4096, 2, 64, "float16", seed=6)[:2]
    k_new, v_new = random_qkv(4, 1, 2, 64, "float16", seed=7)[:2]
    lengths = cupy.full((4,), 100, dtype=cupy.int32)

    def decode(kn, vn, seqlens):
        return numflash.attention_with_kvcache(
            qd, k_cache, v_cache, kn, vn, cache_seqlens=seqlens, causal=True
        )

    found["kvcache decode, device lengths"] = timed(lambda: decode(k_new, v_new, lengths))
    step = iter(range(10**9))
    found["kvcache decode, int cache_seqlens advancing"] = timed(
        lambda: decode(k_new, v_new, 100 + next(step) % 3000)
    )
    found["kvcache decode, one array as new k and v"] = timed(lambda: decode(k_new, k_new, lengths))
    sinks = cupy.zeros((8,), dtype=cupy.float32)  # gpt-oss: a sink logit a head, a window

    def decode_with_sinks():
        return numflash.attention_with_kvcache(
            qd, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True,
            window_size=(127, 0), sinks=sinks,
        )  # fmt: skip

    found["kvcache decode with sinks and a window (gpt-oss)"] = timed(decode_with_sinks)
    slopes = cupy.full((4,), 0.1, dtype=cupy.float32)  # a score_mod with its mod_args
    found["attention with a score_mod (relative bias)"] = timed(
        lambda: numflash.attention(q, k, v, score_mod=_relative_bias, mod_args=(slopes,))
    )
    # packed batches: 8 sequences, 1024 rows in all
    total, nseq = 1024, 8
    pq, pk, pv = (x[0] for x in random_qkv(1, total, 4, 64, "float16", seed=8))
    rng = np.random.default_rng(0)
    offsets = []
    for _ in range(64):
        cuts = np.sort(rng.choice(np.arange(1, total), nseq - 1, replace=False))
        cu = np.concatenate([[0], cuts, [total]]).astype(np.int32)
        offsets.append((cupy.asarray(cu), int(np.diff(cu).max())))
    cu0, max0 = offsets[0]
    found["varlen, same offsets"] = timed(
        lambda: numflash.attention_varlen(pq, pk, pv, cu0, cu0, max0, max0, causal=True)
    )
    turn = iter(range(10**9))

    def varlen_new_offsets():
        cu, longest = offsets[next(turn) % len(offsets)]
        return numflash.attention_varlen(pq, pk, pv, cu, cu, longest, longest, causal=True)

    found["varlen, new offsets and max_seqlen each step"] = timed(varlen_new_offsets)
    try:  # PyTorch tensors, taken as CuPy arrays through DLPack every call
        import torch

        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
        found["attention, PyTorch tensors"] = timed(lambda: numflash.attention(tq, tk, tv))
    except ImportError:
        pass
    # a plan-less call: the full path alone
    found["attention, full path (no plan)"] = timed(
        lambda: numflash.api._attention(q, k, v, False, None, (-1, -1), False, None, None)
    )
    found["first call of a new shape, us"] = first_call_us()
    return found


def first_call_us(shapes=40):
    """Median host time of the first call of each of ``shapes`` new shapes (seqlens 257..),
    their kernel compiled by an earlier call of the same configuration."""
    stream = cupy.cuda.get_current_stream()
    q, k, v = random_qkv(1, 256, 4, 64, "float16", seed=9)
    numflash.attention(q, k, v, causal=True)
    stream.synchronize()
    times = []
    for seqlen in range(257, 257 + shapes):
        q, k, v = random_qkv(1, seqlen, 4, 64, "float16", seed=seqlen)
        stream.synchronize()
        start = time.perf_counter()
        numflash.attention(q, k, v, causal=True)
        times.append((time.perf_counter() - start) * 1e6)
        stream.synchronize()
    return statistics.median(times)


def full_path_profile(calls=2000):
    """cProfile's top entries (by own time) of ``calls`` plan-less calls of the full path."""
    import cProfile
    import io
    import pstats

    q, k, v = random_qkv(2, 128, 4, 64, "float16")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        numflash.api._attention(q, k, v, False, None, (-1, -1), False, None, None)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(45)
    return text.getvalue().splitlines()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    results = {"device": current_device().name}
    warm_up()
    for dtype in ("float16", "bfloat16"):
        q, k, v = random_qkv(1, 128, 1, 64, dtype)
        results[f"attention_us[{dtype}]"] = per_call_us(lambda: numflash.attention(q, k, v))
        results[f"attention_us[{dtype}, GPU]"] = gpu_per_call_us(
            lambda: numflash.attention(q, k, v)
        )
    q, k, v = random_qkv(1, 128, 1, 64, "float16")
    results["attention_us[float16, outputs kept]"] = per_call_us(
        kept(lambda: numflash.attention(q, k, v))
    )
    # the full path a call without a plan takes (its first call, or out= given)
    results["attention_full_path_us[float16]"] = per_call_us(
        lambda: numflash.api._attention(q, k, v, False, None, (-1, -1), False, None, None)
    )
    out, lse = numflash.attention(q, k, v, return_lse=True)
    dout = random_qkv(1, 128, 1, 64, "float16", seed=1)[0]

    def backward():
        return numflash.attention_backward(dout, q, k, v, out, lse)

    results["attention_backward_us[float16]"] = per_call_us(backward)
    results["attention_backward_us[float16, GPU]"] = gpu_per_call_us(backward)
    results["attention_backward_us[float16, outputs kept]"] = per_call_us(kept(backward))
    # the backward's full path, without a plan (three launches: row sums, dK/dV, dQ)
    results["attention_backward_full_path_us[float16]"] = per_call_us(
        lambda: numflash.api._attention_backward(
            dout, q, k, v, out, lse, False, None, (-1, -1), False, None
        )
    )
    # a decoding step: one query row over a paged cache, new k and v appended, the lengths on
    # the device (as a server keeps them)
    qd = random_qkv(4, 1, 8, 64, "float16", seed=2)[0]
    k_cache, v_cache = random_qkv(64, 16, 2, 64, "float16", seed=3)[:2]
    k_new, v_new = random_qkv(4, 1, 2, 64, "float16", seed=4)[:2]
    table = cupy.arange(64, dtype=cupy.int32).reshape(4, 16)
    lengths = cupy.full((4,), 100, dtype=cupy.int32)

    def decode_step():
        return numflash.attention_with_kvcache(
            qd, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table
        )

    results["attention_with_kvcache_us[float16]"] = per_call_us(decode_step)
    results["attention_with_kvcache_us[float16, GPU]"] = gpu_per_call_us(decode_step)
    results["attention_with_kvcache_us[float16, outputs kept]"] = per_call_us(kept(decode_step))
    out_d = cupy.empty_like(qd)
    results["attention_with_kvcache_us[float16, out given]"] = per_call_us(
        lambda: numflash.attention_with_kvcache(
            qd, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table, out=out_d
        )
    )
    if args.profile:
        step = (qd, k_cache, v_cache, k_new, v_new, lengths, None, table, False, None)
        step += (numflash.api._DEFAULT_WINDOW, 0, False, None, None, 0.0, None, None)
        if len(step) != len(numflash.api._KVCACHE.parameters):
            raise SystemExit("host_overhead: the KV-cache signature changed; update the step")
        results["attention_with_kvcache_parts"] = kvcache_parts(decode_step, step)
    results["patterns"] = call_patterns()
    if args.profile:
        results["full_path_profile"] = full_path_profile()
    results["selected_config_us"] = per_call_us(lambda: numflash.selected_config(q, k, v))
    results["current_device_us"] = per_call_us(current_device)
    views = [q, k, v]
    results["kernel_view_x4_us"] = per_call_us(lambda: [arrays.kernel_view(x) for x in views + [q]])
    results["empty_out_and_lse_us"] = per_call_us(
        lambda: (cupy.empty(q.shape, q.dtype), cupy.empty((1, 1, 128), np.float32))
    )
    host_ms, kernel_ms, done = blocking()
    results["long_call"] = {
        "host_return_ms": host_ms,
        "kernel_ms": kernel_ms,
        "finished_when_call_returned": done,
    }
    try:
        import torch
        import torch.nn.functional as F

        qt, kt, vt = (
            torch.from_dlpack(x).transpose(1, 2) for x in random_qkv(1, 128, 1, 64, "float16")
        )
        results["sdpa_us"] = per_call_us(lambda: F.scaled_dot_product_attention(qt, kt, vt))
        results["sdpa_us[GPU]"] = gpu_per_call_us(
            lambda: F.scaled_dot_product_attention(qt, kt, vt)
        )
        # SDPA's backward on a kept graph: autograd's dispatch of the gradients' kernels, what
        # attention_backward's host time compares with
        leaves = [t.detach().clone().requires_grad_() for t in (qt, kt, vt)]
        graph = F.scaled_dot_product_attention(*leaves)
        grad = torch.randn_like(graph)
        results["sdpa_backward_us"] = per_call_us(
            lambda: torch.autograd.grad(graph, leaves, grad, retain_graph=True)
        )
    except ImportError:
        pass
    if args.profile:
        import cProfile
        import pstats

        q, k, v = random_qkv(1, 128, 1, 64, "float16")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            numflash.attention(q, k, v)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            backward()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    report(results, args.json)


if __name__ == "__main__":
    main()
