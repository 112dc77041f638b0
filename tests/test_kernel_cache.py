"""Compiled kernels kept on disk (numflash/kernel_cache.py): which kernels are kept, under what
names, and that a kept kernel is loaded instead of compiled, on CPU stand-ins (a dispatcher
that counts its compiles, a picklable kernel); and on the GPU, a second process that loads
every kernel the first compiled, compiles none and returns the same bits."""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from numflash import kernel_cache
from numflash.config import WgmmaForwardConfig

CC = (9, 0, "a")
KEY = (WgmmaForwardConfig, 128, "float16", WgmmaForwardConfig(), "dense", True, 1, False)


class _Library:
    """Stands in for Numba's code library: loads into a context unless ``refused``."""

    def __init__(self, refused=False):
        self.refused = refused

    def get_cufunc(self):
        if self.refused:
            raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")


class _Kernel:
    """Stands in for Numba's compiled kernel: picklable, with a code library."""

    def __init__(self, label, refused=False):
        self.label = label
        self._codelibrary = _Library(refused)


class _Dispatcher:
    def __init__(self, label="k"):
        self.label, self.compiles = label, 0

    def compile(self, argtypes):
        self.compiles += 1
        return _Kernel(self.label)


@pytest.fixture
def on_disk(monkeypatch, tmp_path):
    """The cache switched on as on a GPU, in a temporary directory, with the stand-in kernel
    written whole (Numba's slimming needs a real cubin)."""
    monkeypatch.setenv("NUMFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NUMFLASH_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(kernel_cache, "SIMULATOR", False)
    monkeypatch.setattr(kernel_cache, "current_cc", lambda: CC)
    monkeypatch.setattr(kernel_cache, "_slim", lambda kernel, cc: kernel)
    monkeypatch.setattr(kernel_cache, "_tended", set())
    return tmp_path


def test_a_kept_kernel_is_loaded_instead_of_compiled(on_disk):
    first = _Dispatcher()
    kernel = kernel_cache.compiled(KEY, first, ("argtypes",))
    assert first.compiles == 1 and kernel.label == "k"
    files = list(on_disk.rglob("*" + kernel_cache.SUFFIX))
    assert len(files) == 1
    assert files[0].parent.name == "sm_90a"
    assert files[0].parent.parent == kernel_cache.directory()
    again = _Dispatcher("other")  # a new process's dispatcher: nothing compiled
    loaded = kernel_cache.compiled(KEY, again, ("argtypes",))
    assert again.compiles == 0 and loaded.label == "k"
    # other argument types, another key or another architecture: compiled, kept apart
    for key, argtypes in ((KEY, ("other",)), (KEY[:-1] + (True,), ("argtypes",))):
        d = _Dispatcher()
        kernel_cache.compiled(key, d, argtypes)
        assert d.compiles == 1
    assert len(list(on_disk.rglob("*" + kernel_cache.SUFFIX))) == 3
    assert kernel_cache.summary()[1] == 3


def test_user_functions_and_unnamed_launchers_are_never_kept(on_disk):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score

    for key in (KEY + (("mods", score_mod),), None, (object(),)):
        assert not kernel_cache.storable(key)
        assert kernel_cache.path(key, ("argtypes",), CC) is None
        for _ in range(2):
            d = _Dispatcher()
            kernel_cache.compiled(key, d, ("argtypes",))
            assert d.compiles == 1
    assert not list(on_disk.rglob("*" + kernel_cache.SUFFIX))
    assert kernel_cache.storable(KEY + (("softcap", 30.0), ("sinks",)))


def test_names_follow_the_key_argument_types_and_architecture(on_disk):
    name = kernel_cache.path(KEY, ("a",), CC)
    assert name == kernel_cache.path(KEY, ("a",), CC)
    others = {
        kernel_cache.path(KEY, ("b",), CC),
        kernel_cache.path(KEY[:1] + (64,) + KEY[2:], ("a",), CC),
        kernel_cache.path(KEY, ("a",), (8, 0, "")).with_name(name.name),
    }
    assert name not in others and len(others) == 3
    assert kernel_cache.path(KEY, ("a",), (8, 0, "")).parent.name == "sm_80"
    fingerprint = kernel_cache.fingerprint()
    assert len(fingerprint) == 20 and int(fingerprint, 16) >= 0


def test_an_unreadable_file_is_compiled_again_and_replaced(on_disk, caplog):
    file = kernel_cache.path(KEY, ("argtypes",), CC)
    file.parent.mkdir(parents=True)
    file.write_bytes(b"\x80\x05 not a whole pickle")
    d = _Dispatcher()
    with caplog.at_level(logging.WARNING, logger="numflash"):
        kernel = kernel_cache.compiled(KEY, d, ("argtypes",))
    assert d.compiles == 1 and kernel.label == "k"
    assert any("unreadable kernel cache file" in r.getMessage() for r in caplog.records)
    again = _Dispatcher()
    assert kernel_cache.compiled(KEY, again, ("argtypes",)).label == "k" and again.compiles == 0


def test_a_kept_kernel_the_driver_refuses_is_compiled_again(on_disk, caplog):
    file = kernel_cache.path(KEY, ("argtypes",), CC)
    kernel_cache.store(file, _Kernel("refused", refused=True), CC)
    assert file.is_file()
    d = _Dispatcher()
    with caplog.at_level(logging.WARNING, logger="numflash"):
        assert kernel_cache.compiled(KEY, d, ("argtypes",)).label == "k" and d.compiles == 1
    assert any("did not load" in r.getMessage() for r in caplog.records)
    again = _Dispatcher("other")  # the compiled one replaced it
    assert kernel_cache.compiled(KEY, again, ("argtypes",)).label == "k" and again.compiles == 0


def test_only_the_most_recently_used_fingerprints_are_kept(on_disk):
    """Folders of other fingerprints (older versions, edited sources) beyond the most recently
    used KEEP_FINGERPRINTS - 1 are deleted when a process first uses the cache."""
    root = kernel_cache.directory().parent
    for age, name in enumerate(["newest", "newer", "new", "old", "older"], 1):
        folder = root / name / "sm_90a"
        folder.mkdir(parents=True)
        (folder / ("x" + kernel_cache.SUFFIX)).write_bytes(b"kept by another version")
        os.utime(root / name, (1e9 - age * 3600, 1e9 - age * 3600))
    kernel_cache.compiled(KEY, _Dispatcher(), ("argtypes",))
    kept = {f.name for f in root.iterdir()}
    assert kept == {kernel_cache.fingerprint(), "newest", "newer", "new"}
    assert kernel_cache.KEEP_FINGERPRINTS == 4


def test_switched_off_or_unwritable_it_compiles_and_says_so_once(on_disk, monkeypatch, caplog):
    monkeypatch.setenv("NUMFLASH_KERNEL_CACHE", "0")
    d = _Dispatcher()
    kernel_cache.compiled(KEY, d, ("argtypes",))
    kernel_cache.compiled(KEY, d, ("argtypes",))
    assert d.compiles == 2 and not list(on_disk.rglob("*" + kernel_cache.SUFFIX))
    monkeypatch.delenv("NUMFLASH_KERNEL_CACHE")
    blocked = on_disk / "blocked"
    blocked.write_text("a file where the directory would be")
    monkeypatch.setenv("NUMFLASH_CACHE_DIR", str(blocked))
    monkeypatch.setattr(kernel_cache.store, "warned", False, raising=False)
    with caplog.at_level(logging.WARNING, logger="numflash"):
        for label in ("a", "b"):
            assert kernel_cache.compiled(KEY, _Dispatcher(label), (label,)).label == label
    said = [r.getMessage() for r in caplog.records if "cannot keep" in r.getMessage()]
    assert len(said) == 1


_SLIM = textwrap.dedent(
    """
    import json, pickle
    from numba.core import types
    from numba.cuda.codegen import CUDACodeLibrary
    from numba.cuda.dispatcher import _Kernel
    from numflash import kernel_cache

    cc = (9, 0, "a")
    library = CUDACodeLibrary(None, "k", entry_name="entry", max_registers=168)
    library._llvm_strs = ["; the IR, left behind"]
    library._ptx_cache[cc] = "// the PTX, left behind"
    library._cubin_cache[cc] = b"the cubin"
    library._finalized = True
    kernel = _Kernel._rebuild(
        cooperative=False, name="entry", signature=types.void(types.int32),
        codelibrary=library, debug=False, lineinfo=False, call_helper=None, extensions=[],
    )
    back = pickle.loads(pickle.dumps(kernel_cache._slim(kernel, cc)))
    lib = back._codelibrary
    print(json.dumps({
        "cubin": lib.get_cubin(cc).decode(), "llvm": lib.llvm_strs, "ptx": len(lib._ptx_cache),
        "entry": back.entry_name, "args": str(back.signature.args), "regs": lib._max_registers,
    }))
    """
)


def _python(source, *argv, timeout=600, **env):
    """The last line ``python -c source argv...`` prints, as JSON, run without the simulator
    (Numba's real compiler types) and with the repository first on the path."""
    root = Path(__file__).resolve().parent.parent
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, **env)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.pop("NUMFLASH_KERNEL_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-c", source, *argv], capture_output=True, text=True, env=env,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_numbas_kernel_is_kept_with_its_cubin_alone():
    """Numba's own compiled-kernel classes (no GPU needed to build them): what a kept file
    holds comes back with the cubin and the entry point, without the LLVM IR and PTX."""
    got = _python(_SLIM)
    assert got == {"cubin": "the cubin", "llvm": [], "ptx": 0, "entry": "entry",
                   "args": "(int32,)", "regs": 168}  # fmt: skip


_PROCESS = textwrap.dedent(
    """
    import json, sys, time
    import cupy, numpy as np
    import numflash
    from numba.cuda.dispatcher import CUDADispatcher
    from numflash import kernel_cache

    if sys.argv[1] == "load":  # every kernel must come from disk
        def refuse(self, sig):
            raise AssertionError(f"compiled {self} although it was kept")
        CUDADispatcher.compile = refuse
    rng = np.random.default_rng(7)
    def arr(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(cupy.float16)
    q, k, v = arr(2, 300, 4, 64), arr(2, 300, 2, 64), arr(2, 300, 2, 64)
    start = time.perf_counter()
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = numflash.attention_backward(arr(*q.shape), q, k, v, out, lse, causal=True)
    cupy.cuda.get_current_stream().synchronize()
    seconds = time.perf_counter() - start
    bits = [int((x.view(cupy.uint16).astype(cupy.uint64) * 2654435761).sum())
            for x in (out, dq, dk, dv)]
    print(json.dumps({"bits": bits, "seconds": seconds, "kept": kernel_cache.summary()[1]}))
    """
)


@pytest.mark.gpu
def test_a_second_process_loads_every_kernel_the_first_compiled(tmp_path):
    runs = {m: _python(_PROCESS, m, NUMFLASH_CACHE_DIR=str(tmp_path)) for m in ("compile", "load")}
    print("first calls, s:", {m: round(r["seconds"], 3) for m, r in runs.items()})  # for -s
    assert runs["compile"]["kept"] >= 3  # the forward, and the backward's kernels
    assert runs["load"]["kept"] == runs["compile"]["kept"]
    assert runs["load"]["bits"] == runs["compile"]["bits"]
    assert runs["load"]["seconds"] < runs["compile"]["seconds"] / 2, runs
