"""What a work tile of the forward costs besides its key tiles, against the peers.

Problems of one block of 128 query rows a head (batch 1, seqlen_q 128) over 132 x ``waves``
heads and ``seqlen_k`` keys are timed with numflash's choice (or ``--configs``, as
tools/hopper_forward.py writes them) and SDPA's cuDNN and FlashAttention-2 backends, and the
times fitted as ``launch + waves * (fixed + tiles * per_tile)``, tiles = seqlen_k / 128: the
``fixed`` cost a tile pays once (its Q, its pipeline's start and end, its output) against what
each further 128 keys cost.

    python tools/forward_fixed_cost.py --head-dims 128 64
"""

import argparse
import json
import os
import sys

import numpy as np

import numflash
from numflash.device import current_device
from numflash.timing import time_gpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hopper_forward import parse_config, peers  # noqa: E402

WAVES = (1, 2, 4)
SEQLENS_K = (128, 512, 1024, 2048, 4096)


def measure(head_dim, dtype, configs, multiprocessors):
    """{(waves, seqlen_k): {name: ms}} of every run."""
    found = {}
    for waves in WAVES:
        for seqlen_k in SEQLENS_K:
            heads = multiprocessors * waves
            q = peers.random_qkv(1, 128, heads, head_dim, dtype, seed=seqlen_k)[0]
            k, v = peers.random_qkv(1, seqlen_k, heads, head_dim, dtype, seed=seqlen_k + 1)[1:]
            runs = {
                name: (lambda cfg=cfg: numflash.attention(q, k, v, config=cfg))
                for name, cfg in configs.items()
            }
            if peers.torch_available():
                runs.update((peer, peers.sdpa_forward(q, k, v, False, peer)) for peer in
                            ("cudnn", "flash"))  # fmt: skip
            found[waves, seqlen_k] = {
                name: time_gpu(fn, runs=30).median_ms for name, fn in runs.items()
            }
            print(head_dim, waves, seqlen_k, found[waves, seqlen_k], flush=True)
    return found


def fit(found, name):
    """(fixed us a tile, us a 128-key tile, launch us) by least squares."""
    rows = [(w, w * s / 128, 1.0) for (w, s) in found]
    times = [found[key][name] * 1e3 for key in found]
    solution, *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    return tuple(float(x) for x in solution)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--configs", nargs="*", default=[], help="as tools/hopper_forward.py")
    ap.add_argument("--out", default=None, help="write the fits as JSON here")
    args = ap.parse_args()
    dev = current_device()
    configs = {"numflash": None} | {c: parse_config(c) for c in args.configs}
    fits = {}
    for hd in args.head_dims:
        found = measure(hd, args.dtype, configs, dev.multiprocessors)
        for name in next(iter(found.values())):
            fixed, per_tile, launch = fit(found, name)
            fits[f"{name} d{hd}"] = {
                "fixed_us": fixed,
                "per_tile_us": per_tile,
                "launch_us": launch,
            }
            print(f"{dev.name} head_dim {hd} {name}: {fixed:.1f} us a work tile besides its "
                  f"key tiles, {per_tile:.2f} us a 128-key tile, {launch:.1f} us a launch")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": dev.name, "dtype": args.dtype, "fits": fits}, f, indent=1)


if __name__ == "__main__":
    main()
