"""Tuned configurations: where they live, how they are keyed, looked up and written.

One JSON file per compute capability (``sm_90.json``) in ``$NUMFLASH_CACHE_DIR``, else the
platform's user cache directory (``~/.cache/numflash`` on Linux); numflash also ships files of
the same format in ``numflash/configs/``. A file carries a header (compute capability, the
name of the device that wrote it last, numflash version, the revision of each kernel family)
and, per problem key, the winning configuration with its measured time, the default's, the
revision of the family's kernels it was measured on and the device it was measured on (one
file serves every device of its compute capability, an H100 and an H200 alike)::

    {"format": 3, "arch": "sm_90", "compute_capability": [9, 0], "device": "NVIDIA H200",
     "numflash_version": "0.1.0", "kernel_revisions": {"tensor-core": 1},
     "entries": {"tensor-core/float16/hd128/causal/s4096":
                 {"config": {...}, "time_ms": 1.91, "default_ms": 2.04, "default_config": {...},
                  "trials": 30, "date": "2026-11-29", "kernel_revision": 1,
                  "device": "NVIDIA H200"}}}

The KV-cache families' keys name one more thing, the grid class (``.../s4096/gfew``): whether
the call's thread blocks without splits (batch x kv heads x blocks of query rows) fill fewer or
more than two per multiprocessor (numflash.selection.decode_grid). The best tiles depend on it
more than on the cache length (one block of 8 warps a multiprocessor, or two of 4 that overlap
each other's start and end: docs/performance.md, "Decode tiles").

Lookup order for a call: the user's cache, then the shipped file for the same architecture,
then the nearest shipped file of the same major version, then the caller's heuristic; within a
file the exact key first, then the same key at the nearest sequence-length bucket whose entry is
not the default there (an entry that kept the default stands for its own bucket). Entries
measured on another revision of their family's kernels (``REVISION`` of the family's
configuration class, numflash/config.py) are ignored with one warning: the kernels' code
changed, so their timings no longer hold, while other families' entries stay valid. A corrupt
or foreign file, or a malformed entry, warns once and is skipped, never fatal.
Writes take a file lock and replace the file atomically, so concurrent tuners lose nothing.
"""

import datetime
import json
import math
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

from .config import CONFIG_TYPES, config_from_dict, families

FORMAT = 3
SHIPPED_DIR = Path(__file__).parent / "configs"
MASKS = ("full", "causal", "window")
#: Grid classes of the KV-cache families' keys (numflash.selection.decode_grid).
GRIDS = ("few", "many")
#: The families whose keys carry a grid class: the KV-cache ones.
GRID_FAMILIES = tuple(c.family for c in families("decode"))

#: Sequence-length buckets are powers of two within these bounds.
MIN_BUCKET, MAX_BUCKET = 128, 1 << 20


def cache_dir():
    override = os.environ.get("NUMFLASH_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("numflash", appauthor=False))


def kernel_revision(family):
    """The revision of a family's kernels that tuned timings are valid for."""
    return CONFIG_TYPES[family].REVISION


def seqlen_bucket(seqlen):
    """The power of two at or above ``seqlen``, clamped to [MIN_BUCKET, MAX_BUCKET]."""
    bucket = 1 << max(0, math.ceil(math.log2(max(seqlen, 1))))
    return min(max(bucket, MIN_BUCKET), MAX_BUCKET)


class ProblemKey(NamedTuple):
    """What changes the best configuration: family, dtype, head_dim, mask, seqlen bucket, and
    for the KV-cache families the grid class (one of GRIDS; "" for the others)."""

    family: str
    dtype: str
    head_dim: int
    mask: str  # "full", "causal" or "window"
    seqlen: int  # bucket of max(seqlen_q, seqlen_k)
    grid: str = ""

    def __str__(self):
        text = f"{self.family}/{self.dtype}/hd{self.head_dim}/{self.mask}/s{self.seqlen}"
        return text + f"/g{self.grid}" if self.grid else text

    @classmethod
    def parse(cls, text):
        """The key written as ``str(key)``; ValueError for anything else (an unknown family,
        mask or grid class, a head_dim or bucket that is not a positive power of two where one
        is needed, a grid class missing from a KV-cache key or given to another)."""
        parts = text.split("/")
        if len(parts) not in (5, 6) or not (parts[2].startswith("hd") and parts[4].startswith("s")):
            raise ValueError(f"not a problem key: {text!r}")
        family, dtype, hd, mask, seqlen = parts[:5]
        head_dim, bucket = int(hd[2:]), int(seqlen[1:])
        if family not in CONFIG_TYPES or mask not in MASKS:
            raise ValueError(f"unknown family or mask in problem key {text!r}")
        if head_dim < 1 or bucket < 1 or bucket & (bucket - 1):
            raise ValueError(f"head_dim and seqlen bucket must be positive in {text!r}")
        grid = parts[5][1:] if len(parts) == 6 and parts[5].startswith("g") else None
        if len(parts) == 6 and grid not in GRIDS:
            raise ValueError(f"unknown grid class in problem key {text!r}")
        if (grid is not None) != (family in GRID_FAMILIES):
            needs = "needs a" if grid is None else "takes no"
            raise ValueError(f"a {family} key {needs} grid class: {text!r}")
        return cls(family, dtype, head_dim, mask, bucket, grid or "")

    @classmethod
    def of(cls, family, dtype, head_dim, seqlen_q, seqlen_k, window_left, window_right, grid=""):
        if window_left < 0 and window_right < 0:
            mask = "full"
        elif window_left < 0 and window_right == 0:
            mask = "causal"
        else:
            mask = "window"
        bucket = seqlen_bucket(max(seqlen_q, seqlen_k))
        return cls(family, dtype, head_dim, mask, bucket, grid)


class Selection(NamedTuple):
    config: object
    source: str  # "user cache <path>", "shipped <file>", "heuristic" or "forced"


class Hit(NamedTuple):
    """A tuned configuration found for a key: where from, and its measured time."""

    config: object
    source: str
    time_ms: float  # inf where the entry does not say


def _entry_time(entry):
    time_ms = entry.get("time_ms")
    if isinstance(time_ms, (int, float)) and not isinstance(time_ms, bool) and time_ms > 0:
        return float(time_ms)
    return float("inf")


_warned = set()
_lock = threading.Lock()


def _warn_once(path, message):
    if (str(path), message) not in _warned:
        _warned.add((str(path), message))
        warnings.warn(f"numflash cache {path}: {message}", RuntimeWarning, stacklevel=4)


def _read(path, arch):
    """{key: entry} of a cache file; {} (with one warning) when missing, corrupt or foreign."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        _warn_once(path, f"unreadable ({exc}); ignoring it")
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        _warn_once(path, "not a numflash configuration file of this format; ignoring it")
        return {}
    if data.get("arch") != arch:
        _warn_once(path, f"holds configurations for {data.get('arch')}, not {arch}; ignoring it")
        return {}
    raw = data.get("entries", {})
    if not isinstance(raw, dict):
        _warn_once(path, "its entries are not an object; ignoring them")
        return {}
    entries = {}
    stale = set()
    for key, entry in raw.items():
        try:
            parsed = ProblemKey.parse(key)
            if not isinstance(entry, dict):
                raise ValueError("not an object")
            if entry.get("kernel_revision") != kernel_revision(parsed.family):
                stale.add(parsed.family)
                continue
            cfg = config_from_dict(entry["config"])
            if cfg.family != parsed.family:
                raise ValueError(f"a {cfg.family} configuration under a {parsed.family} key")
            entries[parsed] = (cfg, entry)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            _warn_once(path, f"entry {key!r} is malformed ({exc}); skipping it")
    for family in sorted(stale):
        _warn_once(
            path,
            f"its {family} entries were tuned for another revision of those kernels (numflash "
            f"{data.get('numflash_version')}) and are ignored: run `numflash autotune` again",
        )
    return entries


def _nearest(entries, key):
    """The entry for ``key``, else the same problem (its grid class too) at the nearest seqlen
    bucket (ties: larger) among the entries whose configuration is not their bucket's default:
    one where the default won says nothing of other buckets, whose own default (the
    heuristic's, which may differ by bucket) stands."""
    if key in entries:
        return entries[key]
    same = [
        k
        for k, (_, entry) in entries.items()
        if k._replace(seqlen=key.seqlen) == key and entry["config"] != entry.get("default_config")
    ]
    if not same:
        return None
    best = min(same, key=lambda k: (abs(math.log2(k.seqlen) - math.log2(key.seqlen)), -k.seqlen))
    return entries[best]


def _sources(arch):
    """(label, path, arch the file must hold) in lookup order for ``arch`` ("sm_90")."""
    yield "user cache", cache_dir() / f"{arch}.json", arch
    yield "shipped", SHIPPED_DIR / f"{arch}.json", arch
    major, minor = int(arch[3:-1]), int(arch[-1])
    same_major = []
    for path in SHIPPED_DIR.glob(f"sm_{major}?.json"):
        other = path.stem
        if other != arch and other[-1].isdigit():
            same_major.append((abs(int(other[-1]) - minor), other, path))
    for _, other, path in sorted(same_major):
        yield "shipped (nearest of the same major)", path, other


_files = {}  # (path, arch) -> entries
_memo = {}  # (arch, key) -> (config, entry, label) or None
#: Bumped whenever what was read is forgotten; memos built on lookups (numflash.selection)
#: compare it to know they are stale.
generation = 0


def _entries(path, arch):
    found = _files.get((path, arch))
    if found is None:
        found = _files[(path, arch)] = _read(path, arch)
    return found


def lookup(arch, key, feasible=lambda cfg: True):
    """The :class:`Hit` of the best cached configuration for ``key`` on ``arch``, or None.

    ``feasible`` filters out configurations that cannot run the call at hand (a file of a
    sibling architecture may hold tiles too large for this one). Memoised: a repeated lookup
    costs a dictionary access.
    """
    memo_key = (arch, key)
    hit = _memo.get(memo_key, _memo)
    if hit is _memo:
        with _lock:
            hit = None
            for label, path, file_arch in _sources(arch):
                found = _nearest(_entries(path, file_arch), key)
                if found is not None and feasible(found[0]):
                    hit = Hit(found[0], f"{label} {path}", _entry_time(found[1]))
                    break
            _memo[memo_key] = hit
    return hit


def reload():
    """Forget what was read: the next lookup reads the files again."""
    global generation
    with _lock:
        _files.clear()
        _memo.clear()
        generation += 1


def user_entries(arch):
    """{key: entry dict} of the user's cache file for ``arch`` (valid entries only)."""
    return {k: e for k, (_, e) in _read(cache_dir() / f"{arch}.json", arch).items()}


def shipped_entries(arch):
    """{key: entry dict} of the configurations shipped with numflash for ``arch``."""
    return {k: e for k, (_, e) in _read(SHIPPED_DIR / f"{arch}.json", arch).items()}


#: The header fields record() writes itself; any others in a file (a note on entries taken
#: out by hand, say) are kept.
_HEADER = ("format", "arch", "compute_capability", "device", "numflash_version")
_HEADER += ("kernel_revisions", "written", "command", "entries")


def _notes(path):
    """The header fields of the file at ``path`` that record() does not write itself."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if k not in _HEADER} if isinstance(data, dict) else {}


def record(device, results, header_extra=None, path=None):
    """Merge ``results`` ({ProblemKey: entry dict}) into the cache file of ``device``.

    The file is read, merged and replaced under a file lock, and written to a temporary file
    that is renamed over it, so a reader never sees half a file and two writers lose nothing.
    Entries from other kernel sources, or a corrupt file, are replaced.
    """
    from filelock import FileLock

    path = Path(path) if path is not None else cache_dir() / f"{device.arch}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        current = {str(k): e for k, (_, e) in _read(path, device.arch).items()}
        notes = _notes(path)
        current.update(
            {
                str(k): {**e, "kernel_revision": kernel_revision(k.family), "device": device.name}
                for k, e in results.items()
            }
        )
        from . import __version__

        data = {
            "format": FORMAT,
            "arch": device.arch,
            "compute_capability": list(device.compute_capability),
            "device": device.name,
            "numflash_version": __version__,
            "kernel_revisions": {
                f: kernel_revision(f) for f in sorted({k.split("/")[0] for k in current})
            },
            "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **notes,
            **(header_extra or {}),
            "entries": dict(sorted(current.items())),
        }
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    reload()
    return path
