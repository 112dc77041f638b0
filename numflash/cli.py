"""The ``numflash`` command.

- ``numflash info``: versions, the GPU and its kernel paths, the cache and its entries.
- ``numflash autotune``: tune the kernels on this GPU (the ``tuning`` package, imported only
  for this command).
"""

import argparse
import platform
import sys


def _version(*distributions):
    """The installed version of the first of ``distributions`` that is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "not installed"


def _cuda_versions():
    import cupy

    def fmt(v):
        return f"{v // 1000}.{v % 1000 // 10}"

    return fmt(cupy.cuda.runtime.driverGetVersion()), fmt(cupy.cuda.runtime.runtimeGetVersion())


def info(out=sys.stdout):
    """Print what numflash runs with and where; returns the exit status (always 0)."""
    import numflash
    from numflash.cache import cache_dir
    from numflash.device import current_device, gpu_available
    from numflash.kernels.jit import SIMULATOR

    print(f"numflash {numflash.__version__} (Python {platform.python_version()})", file=out)
    print(
        f"numba {_version('numba')}, numba-cuda {_version('numba-cuda')}, "
        f"CuPy {_version('cupy-cuda13x', 'cupy-cuda12x', 'cupy')}, "
        f"numpy {_version('numpy')}, optuna {_version('optuna')}",
        file=out,
    )
    if SIMULATOR:
        print("GPU: none; running in the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1)", file=out)
        print("  kernel paths: portable (default), tensor-core (with an explicit config)", file=out)
    elif not gpu_available():
        print("GPU: none found (no CUDA driver or no device).", file=out)
        print(
            "  numflash needs an NVIDIA GPU; without one its API runs in Numba's CUDA simulator "
            "on NumPy arrays: set NUMBA_ENABLE_CUDASIM=1.",
            file=out,
        )
    else:
        driver, runtime = _cuda_versions()
        dev = current_device()
        print(f"CUDA driver {driver}, runtime {runtime}", file=out)
        print(
            f"GPU: {dev.name}, compute capability {dev.compute_capability[0]}."
            f"{dev.compute_capability[1]} ({dev.arch}), {dev.multiprocessors} SMs, "
            f"{dev.max_shared_per_block // 1024} KiB shared memory per block",
            file=out,
        )
        if dev.runs("mma.sync"):
            paths = "tensor-core (float16, bfloat16); portable (float32)"
            backward = "tensor-core (float16, bfloat16); portable (float32)"
            kvcache = "split-KV tensor-core kernel (float16, bfloat16); portable (float32)"
            if dev.has_wgmma:
                from numflash.families.wgmma_forward import HEAD_DIMS as WGMMA_FORWARD_HEAD_DIMS
                from numflash.selection import LARGE_PAGE, PREFILL_ROWS

                dims = ", ".join(map(str, WGMMA_FORWARD_HEAD_DIMS))
                paths = f"wgmma with TMA loads at head_dim {dims}, else " + paths
                backward = "wgmma at head_dim 64 and 128, else " + backward
                rows = PREFILL_ROWS
                small_pages = (
                    f"{rows['small pages']} over pages below {LARGE_PAGE} rows, "
                    if rows["small pages"] != rows["contiguous"]
                    else ""
                )
                kvcache = (
                    f"the wgmma forward past {rows['contiguous']} new rows ({small_pages}"
                    f"{rows['paged by cp.async']} over pages read by cp.async) at its "
                    "head dims, else " + kvcache
                )
        else:
            paths = "portable (float16, bfloat16, float32); no tensor-core path before sm_80"
            backward = "portable (every dtype)"
            kvcache = "portable (every dtype)"
        print(f"  kernel paths: {paths}", file=out)
        print(f"  backward kernels: {backward}", file=out)
        print(f"  KV-cache kernels: {kvcache}", file=out)
    print(f"configuration cache: {cache_dir()}", file=out)
    if not SIMULATOR and gpu_available():
        _print_entries(current_device(), out)
    _print_kernel_cache(out)
    return 0


def _print_kernel_cache(out):
    from numflash import kernel_cache

    if not kernel_cache.enabled():
        why = "the simulator" if kernel_cache.SIMULATOR else "NUMFLASH_KERNEL_CACHE=0"
        print(f"compiled-kernel cache: off ({why})", file=out)
        return
    folder, count, size = kernel_cache.summary()
    print(f"compiled-kernel cache: {folder} ({count} kernels, {size / 2**20:.1f} MiB)", file=out)


def _print_entries(device, out):
    from numflash.cache import SHIPPED_DIR, shipped_entries, user_entries

    shipped = shipped_entries(device.arch)
    if shipped:
        print(
            f"  shipped tuned configurations for {device.arch}: {len(shipped)} "
            f"({SHIPPED_DIR / (device.arch + '.json')})",
            file=out,
        )
    entries = user_entries(device.arch)
    if not entries:
        print(
            f"  no tuned configurations for {device.arch} yet (run `numflash autotune`)", file=out
        )
        return
    print(f"  tuned configurations for {device.arch}:", file=out)
    for key, entry in sorted(entries.items(), key=lambda kv: str(kv[0])):
        cfg = ", ".join(f"{k}={v}" for k, v in entry["config"].items() if k != "family")
        print(
            f"    {key}: {cfg}  ({_ms(entry.get('time_ms'))}; default "
            f"{_ms(entry.get('default_ms'))})",
            file=out,
        )


def _ms(value):
    """A time from a cache entry, which may lack it or hold something else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.3f} ms"
    return "-"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="numflash", description="FlashAttention for CuPy")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, the GPU and its kernel paths, the cache and its entries")
    tune = sub.add_parser(
        "autotune", help="tune the kernels on this GPU (Optuna), cache the winners"
    )
    from tuning.run import add_arguments

    add_arguments(tune)
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "autotune":
        from tuning.run import main as autotune

        try:
            return autotune(args)
        except OSError as exc:  # the cache directory cannot be made or written
            print(
                f"numflash autotune: cannot write the configuration cache: {exc}", file=sys.stderr
            )
            return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
