"""Compiled kernels kept on disk: a new process loads what an earlier one compiled.

Numba compiles each kernel on its first launch in a process, about 2 s apiece (typing, NVVM,
ptxas); a training or serving process that meets ten kernels waited that long at every start.
Each compiled kernel is now also written to ``cache_dir()/kernels/<fingerprint>/sm_XY/`` as
Numba's own serialised kernel with only its cubin kept (the LLVM IR and PTX dropped), and a
later process with the same fingerprint loads the cubin instead of compiling.

Nothing is ever loaded that this source did not compile:

- the fingerprint hashes every source file of the numflash package, the compiler packages'
  versions (numba, numba-cuda, NVVM, nvJitLink, llvmlite), Numba's NUMBA_* settings and
  whether line information is compiled in, so an upgrade, an edit of any kernel or another
  optimisation level starts an empty directory;
- a file's name hashes the launcher's key (family, head dim, dtype, configuration, variant
  flags: what :func:`numflash.launch.launcher` keys compiled kernels by within a process) and
  the argument types it was compiled for;
- kernels holding a user's functions (score_mod, mask_mod) are never kept: their code is the
  user's, not this package's, and compiles in each process;
- a file that cannot be read or unpickled is compiled again and written anew.

The files are pickles, loaded from the user's own cache directory, as Numba's and Triton's
kernel caches are. Only the KEEP_FINGERPRINTS most recently used fingerprint folders are kept.
``NUMFLASH_KERNEL_CACHE=0`` turns the cache off; deleting the directory (``numflash info``
prints it) is safe at any time.
"""

import functools
import hashlib
import logging
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path

from .kernels.jit import LINEINFO, SIMULATOR

_log = logging.getLogger("numflash")

#: Suffix of a kept kernel's file.
SUFFIX = ".nbk"


def enabled():
    """Whether compiled kernels are read from and written to disk: on the GPU, unless
    ``NUMFLASH_KERNEL_CACHE`` is 0 (or empty)."""
    return not SIMULATOR and os.environ.get("NUMFLASH_KERNEL_CACHE", "1") not in ("", "0")


#: Distributions whose versions decide the code: the compiler and its NVVM, PTX linker.
COMPILER_PACKAGES = ("numba", "numba-cuda", "nvidia-nvvm", "nvidia-nvjitlink", "llvmlite")


@functools.lru_cache(maxsize=1)
def fingerprint():
    """Hex digest of what decides the code a key compiles to besides the key: every ``.py``
    file of the package (path and bytes), the compiler packages' versions, Numba's settings
    from the environment (NUMBA_*: optimisation level, debug information), the line
    information switch and Python's version (pickles of Numba's types)."""
    from importlib import metadata

    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    versions = []
    for name in COMPILER_PACKAGES:
        try:
            versions.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:  # a toolkit from the system, say
            versions.append((name, None))
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("NUMBA_"))
    digest.update(repr((versions, settings, LINEINFO, sys.version_info[:2])).encode())
    return digest.hexdigest()[:20]


def directory():
    """The directory of this source's kept kernels (each compute capability a subfolder)."""
    from .cache import cache_dir

    return cache_dir() / "kernels" / fingerprint()


def storable(key):
    """Whether a launcher key may name a file: not None (a launcher made outside
    :func:`numflash.launch.launcher`), and not when it holds a user's functions (a ("mods",
    ...) part) or anything whose repr is an object's address (not the same in the next
    process)."""
    if key is None:
        return False
    for part in key:
        if isinstance(part, tuple) and part[:1] == ("mods",):
            return False
    return " at 0x" not in repr(key)


def path(key, argtypes, cc):
    """The file of a launcher ``key`` compiled for ``argtypes`` on compute capability ``cc``
    (Numba's (major, minor, suffix)), or None where the key is not :func:`storable`."""
    if not storable(key):
        return None
    name = hashlib.sha256(repr((key, tuple(argtypes))).encode()).hexdigest()[:32]
    return directory() / f"sm_{cc[0]}{cc[1]}{cc[2] if len(cc) > 2 else ''}" / (name + SUFFIX)


def current_cc():
    """The current device's compute capability as Numba's code library keys its cubins
    (sm_90 and later with the "a" suffix of their architecture-specific features)."""
    from numba import cuda

    cc = cuda.get_current_device().compute_capability
    return (cc[0], cc[1], "a" if cc >= (9, 0) else "")


def load(file):
    """The kernel kept in ``file``, or None where there is none or it cannot be read."""
    try:
        data = file.read_bytes()
    except OSError:
        return None
    try:
        kernel = pickle.loads(data)
        kernel._codelibrary  # noqa: B018 - a kernel, not something else pickled there
    except Exception as exc:  # a truncated or foreign file: compiled again and replaced
        _log.warning("ignoring unreadable kernel cache file %s (%s)", file, exc)
        return None
    return kernel


def _slim(kernel, cc):
    """A copy of compiled ``kernel`` (Numba's _Kernel) holding only its cubin for ``cc``."""
    library = kernel._codelibrary
    cubin = library.get_cubin(cc)
    # the library's state as its _reduce_states gives it, without the LLVM IR it would print
    # (hundreds of milliseconds for a large kernel) and the PTX: the cubin is all a launch reads
    slim = type(library)._rebuild(
        codegen=None,
        name=library.name,
        entry_name=library._entry_name,
        llvm_strs=[],
        ptx_cache={},
        cubin_cache={cc: cubin},
        linkerinfo_cache={},
        max_registers=library._max_registers,
        nvvm_options=library._nvvm_options,
        needs_cudadevrt=False,  # linked into the cubin already
        nrt=False,
        use_cooperative=library.use_cooperative,
        lto=library._lto,
    )
    state = kernel._reduce_states()
    state["codelibrary"] = slim
    return type(kernel)._rebuild(**state)


def store(file, kernel, cc):
    """Write compiled ``kernel``'s cubin for ``cc`` to ``file`` (atomically: a reader sees the
    whole file or none). A failure (no space, no permission) is logged once and ignored."""
    try:
        data = pickle.dumps(_slim(kernel, cc), protocol=pickle.HIGHEST_PROTOCOL)
        file.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as f:
                f.write(data)
            os.replace(temporary, file)
        except BaseException:
            os.unlink(temporary)
            raise
    except Exception as exc:
        if not getattr(store, "warned", False):
            store.warned = True
            _log.warning("cannot keep compiled kernels in %s (%s)", file.parent, exc)


#: Fingerprint folders kept: the one in use and the most recently used others (another
#: virtual environment's numflash, the version before an upgrade); older ones are deleted.
KEEP_FINGERPRINTS = 4
_tended = set()  # the folders this process has marked as used (and pruned beside)


def _tend(folder):
    """Once a process for each fingerprint ``folder``: mark it used now (its time is what
    pruning ranks by) and delete all but the KEEP_FINGERPRINTS most recently used of its
    siblings, so upgrades and edits do not pile up compiled kernels. A folder another
    process is reading may go: that process then compiles what it misses and writes it
    again."""
    if folder in _tended:
        return
    _tended.add(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.utime(folder)
        others = [f for f in folder.parent.iterdir() if f.is_dir() and f != folder]
        others.sort(key=lambda f: f.stat().st_mtime, reverse=True)
        for old in others[KEEP_FINGERPRINTS - 1 :]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError:  # an unwritable cache: store() says so
        pass


def compiled(key, dispatcher, argtypes):
    """Numba's compiled kernel of ``dispatcher`` for ``argtypes`` on the current device: the
    one kept under ``key`` where there is one, else compiled now and kept."""
    if not enabled():
        return dispatcher.compile(argtypes)
    cc = current_cc()
    file = path(key, argtypes, cc)
    if file is not None:
        _tend(directory())
        kernel = load(file)
        if kernel is not None:
            try:  # into this context now, as its first launch would: a refused cubin compiles
                kernel._codelibrary.get_cufunc()
            except Exception as exc:
                _log.warning("compiling again: the kept kernel %s did not load (%s)", file, exc)
            else:
                _log.debug("loaded %s", file)
                return kernel
    kernel = dispatcher.compile(argtypes)
    if file is not None:
        store(file, kernel, cc)
    return kernel


def summary():
    """(directory, kernels kept, bytes) of this source's kept kernels."""
    folder = directory()
    files = list(folder.rglob("*" + SUFFIX)) if folder.is_dir() else []
    return folder, len(files), sum(f.stat().st_size for f in files)
