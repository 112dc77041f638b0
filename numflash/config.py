"""Kernel configurations: frozen dataclasses and their feasibility on a device. No policy.

A configuration names a kernel family by its type and holds the compile-time tile sizes of that
family. The same feasibility check (``problems``) serves the dispatcher (a clear error for a
forced configuration) and the autotuner (prune a point before compiling it). Which
configuration a call runs with is decided in :mod:`numflash.selection`.

Each family carries ``REVISION``: the version of its kernels' code that tuned timings hold for.
Tuned entries record it and are ignored once it changes (:mod:`numflash.cache`). It goes up
with a change that can move the kernels' timings; tests/test_fingerprints.py fails on any
change to a kernel's PTX until it is recorded, so none goes unnoticed.
"""

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

import numpy as np

from .kernels import backward_mma, decode, forward

#: Head dimensions the kernels accept. The tensor-core kernel needs multiples of 8 (16-byte
#: rows for cp.async); the API zero-pads other head dims up to the next multiple of 8.
MAX_HEAD_DIM = 256

#: Static shared memory a kernel may use without opting in (all CUDA GPUs).
STATIC_SHARED_LIMIT = 48 * 1024


def round_up(x, multiple):
    return (x + multiple - 1) // multiple * multiple


def knob(default, choices):
    """A tunable field: its default and the values the autotuner may try (tuning/space.py)."""
    return field(default=default, metadata={"choices": tuple(choices)})


def knob_choices(config_type):
    """{field name: allowed values} of a configuration dataclass."""
    return {f.name: f.metadata["choices"] for f in fields(config_type)}


def _is_choice(value, choices):
    """``value`` is one of ``choices`` with the same type: 64.0 is not 64, True is not 1."""
    return any(type(value) is type(c) and value == c for c in choices)


def _out_of_choices(cfg):
    return [
        f"{name}={getattr(cfg, name)!r} is not one of {', '.join(map(repr, choices))}"
        for name, choices in knob_choices(type(cfg)).items()
        if not _is_choice(getattr(cfg, name), choices)
    ]


class _Config:
    """What every configuration dataclass shares: its dict form, family included, and NumPy
    scalars taken as the Python numbers they hold (``block_m=np.int64(64)`` is 64).

    A configuration type is its kernel family's declaration: ``family`` (its name), ``ROLE``
    (what the kernels compute: one of ROLES), ``HARDWARE`` (the instructions they need: one of
    HARDWARE, which :meth:`numflash.device.DeviceInfo.runs` checks), ``REVISION``. A family is
    registered by :func:`register`; its launcher (numflash.launch) and its heuristic default
    and selection rule (numflash.selection) are registered where they are defined: a family
    with a module of its own (numflash/families/) defines them all there."""

    family: ClassVar[str]
    ROLE: ClassVar[str]
    HARDWARE: ClassVar[str]

    #: The family's forward also serves KV-cache calls with many new rows (chunked prefill):
    #: it reads the caches in place and registers a launcher for them (numflash.launch).
    READS_KV_CACHE: ClassVar[bool] = False

    #: The kernels keep per-thread rows in local memory by design (the portable families): local
    #: memory there is no sign of spilled registers, which the autotuner refuses elsewhere.
    LOCAL_ROWS: ClassVar[bool] = False

    #: The kernels take a user's score_mod and mask_mod (kernels/mods.py): calls with them
    #: run only such families (numflash.selection).
    USER_MODS: ClassVar[bool] = False

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.bool_):
                object.__setattr__(self, f.name, bool(value))
            elif isinstance(value, np.integer):
                object.__setattr__(self, f.name, int(value))

    def to_dict(self):
        return {"family": self.family, **asdict(self)}


def _static_shared_problems(cfg, head_dim):
    """Why a configuration of the portable kernels (static shared memory) cannot run."""
    out = _out_of_choices(cfg)
    if out:
        return out
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        out.append(f"head_dim={head_dim} is not in [1, {MAX_HEAD_DIM}]")
    smem = cfg.shared_memory_bytes(head_dim)
    if smem > STATIC_SHARED_LIMIT:
        out.append(
            f"needs {smem} bytes of static shared memory at head_dim={head_dim}; "
            f"the limit is {STATIC_SHARED_LIMIT}"
        )
    return out


def _dynamic_shared_problems(smem, device):
    if device is not None and smem > device.max_shared_per_block:
        return [
            f"needs {smem} bytes of shared memory per block; {device.name} allows "
            f"{device.max_shared_per_block}"
        ]
    return []


def _tensor_core_problems(cfg, head_dim, device, static_shared=0):
    """Why a tensor-core forward or decode configuration (whose tiles are valid) cannot run
    ``head_dim`` on ``device``: the GPU, shared memory (``static_shared`` bytes besides the
    dynamic ones), threads, and fragment registers a thread would hold."""
    out = []
    if device is not None and not device.runs(cfg.HARDWARE):
        out.append(
            f"{device.name} (compute capability {device.compute_capability}) has no "
            "mma.sync/ldmatrix/cp.async; the tensor-core kernels need 8.0 or newer"
        )
    if static_shared > STATIC_SHARED_LIMIT:
        out.append(f"needs {static_shared} bytes of static shared memory at head_dim={head_dim}")
    out += _dynamic_shared_problems(cfg.shared_memory_bytes(head_dim) + static_shared, device)
    if device is not None and cfg.threads > device.max_threads_per_block:
        out.append(f"needs {cfg.threads} threads per block")
    regs = cfg.fragment_registers(head_dim)
    if regs > cfg.MAX_FRAGMENT_REGISTERS:
        out.append(
            f"holds {regs} fragment registers per thread at head_dim={head_dim} "
            f"(at most {cfg.MAX_FRAGMENT_REGISTERS} fit without spilling)"
        )
    return out


@dataclass(frozen=True)
class TensorCoreConfig(_Config):
    """Tiles of the tensor-core forward kernel (:mod:`numflash.kernels.forward`).

    - ``block_m``: query rows per thread block, ``16 * m_tiles * num_warps``, where each warp owns
      ``m_tiles`` (1 or 2) tiles of 16 rows.
    - ``block_n``: keys per shared-memory tile, a multiple of 16.
    - ``num_warps``: warps per block; they share every key/value tile.
    - ``stages``: key/value tiles in the cp.async ring (2 = double buffering).
    - ``q_in_registers``: keep the query fragments in registers for the whole key loop instead
      of reloading them from shared memory with ldmatrix in every iteration.
    """

    block_m: int = knob(64, (16, 32, 64, 128, 256))
    block_n: int = knob(64, (16, 32, 64, 128))
    num_warps: int = knob(4, (1, 2, 4, 8))
    stages: int = knob(2, (2, 3, 4))
    q_in_registers: bool = knob(True, (True, False))

    family: ClassVar[str] = "tensor-core"
    USER_MODS: ClassVar[bool] = True  # forward.mod_scores
    ROLE: ClassVar[str] = "forward"
    HARDWARE: ClassVar[str] = "mma.sync"
    REVISION: ClassVar[int] = 1
    #: Fragment registers a thread may hold (accumulators, scores, query fragments) before the
    #: rest of the kernel (addresses, softmax state) no longer fits in the 255-register limit.
    #: A coarse bound that prunes hopeless points; ptxas' spill report is the real judge.
    MAX_FRAGMENT_REGISTERS: ClassVar[int] = 200

    @property
    def m_tiles(self):
        return self.block_m // (16 * self.num_warps)

    @property
    def threads(self):
        return 32 * self.num_warps

    def kernel_head_dim(self, head_dim):
        """The head_dim the kernel runs at: zero-padded to a multiple of 8."""
        return round_up(head_dim, 8)

    def shared_memory_bytes(self, head_dim):
        """Q tile plus ``stages`` K and V tiles, rows padded by 16 bytes against bank conflicts."""
        *_, elements = forward.shared_memory_layout(
            head_dim, self.block_m, self.block_n, self.stages
        )
        return 2 * elements

    def fragment_registers(self, head_dim):
        hd = round_up(head_dim, 16)
        acc = self.m_tiles * hd // 2
        scores = self.m_tiles * self.block_n // 2
        query = self.m_tiles * hd // 4 if self.q_in_registers else 4
        return acc + scores + query

    def problems(self, head_dim, device):
        """Why this configuration cannot run ``head_dim`` on ``device``; empty when it can."""
        out = _out_of_choices(self)
        if _is_choice(self.num_warps, knob_choices(TensorCoreConfig)["num_warps"]) and (
            self.block_m % (16 * self.num_warps) or self.m_tiles not in (1, 2)
        ):
            out.append(
                f"block_m={self.block_m} must be 16 * num_warps * (1 or 2) "
                f"= {16 * self.num_warps} or {32 * self.num_warps}"
            )
        if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
            out.append(f"head_dim={head_dim} is not a multiple of 8 in [8, {MAX_HEAD_DIM}]")
        if out:
            return out
        return _tensor_core_problems(self, head_dim, device)


@dataclass(frozen=True)
class PortableConfig(_Config):
    """Tiles of the portable forward kernel (:mod:`numflash.kernels.forward_portable`).

    One thread per query row (``block_m`` threads per block); keys and values stream through
    shared memory ``block_n`` rows at a time, converted to fp32.
    """

    block_m: int = knob(64, (16, 32, 64, 128, 256))
    block_n: int = knob(32, (8, 16, 32, 64))

    family: ClassVar[str] = "portable"
    USER_MODS: ClassVar[bool] = True
    ROLE: ClassVar[str] = "forward"
    HARDWARE: ClassVar[str] = "portable"
    LOCAL_ROWS: ClassVar[bool] = True
    REVISION: ClassVar[int] = 2  # 2: the rows of one sequence in a device function (varlen)

    @property
    def threads(self):
        return self.block_m

    def kernel_head_dim(self, head_dim):
        return head_dim

    def shared_memory_bytes(self, head_dim):
        return 2 * self.block_n * head_dim * 4

    def problems(self, head_dim, device):
        return _static_shared_problems(self, head_dim)


@dataclass(frozen=True)
class PortableBackwardConfig(_Config):
    """Tiles of the portable backward kernels (:mod:`numflash.kernels.backward_portable`).

    - ``block_m``: query rows per block of the dQ kernel (one thread each), and query rows per
      shared-memory tile of the dK/dV kernel.
    - ``block_n``: keys per block of the dK/dV kernel (one thread each), and keys per
      shared-memory tile of the dQ kernel.
    """

    block_m: int = knob(32, (16, 32, 64, 128))
    block_n: int = knob(32, (16, 32, 64, 128))

    family: ClassVar[str] = "portable-backward"
    USER_MODS: ClassVar[bool] = True
    ROLE: ClassVar[str] = "backward"
    HARDWARE: ClassVar[str] = "portable"
    LOCAL_ROWS: ClassVar[bool] = True
    REVISION: ClassVar[int] = 3  # 3: one sequence's keys or rows in a device function (varlen)

    def kernel_head_dim(self, head_dim):
        return head_dim

    def shared_memory_bytes(self, head_dim):
        """The larger of the two kernels' static shared memory: q and dO tiles with their LSE
        and D (dK/dV), or k and v tiles (dQ), all fp32."""
        return max(2 * self.block_m * (head_dim + 1) * 4, 2 * self.block_n * head_dim * 4)

    def problems(self, head_dim, device):
        return _static_shared_problems(self, head_dim)


def tensor_core_backward_head_dim(head_dim):
    """The head_dim the tensor-core backward runs at: zero-padded to a multiple of 16, or of 32
    above 128 (where two blocks split the columns)."""
    return round_up(head_dim, 16 if head_dim <= 128 else 32)


class _WarpRowsBackward(_Config):
    """What both tensor-core backward families share: 16 rows (keys, or query rows of the dQ
    kernel) per warp, head dims padded as tensor_core_backward_head_dim says."""

    @property
    def block_n(self):
        return 16 * self.num_warps

    @property
    def threads(self):
        return 32 * self.num_warps

    def kernel_head_dim(self, head_dim):
        return tensor_core_backward_head_dim(head_dim)

    def dq_planes(self, head_dim):
        """Planes of dQ's fp32 buffer where the dK/dV kernel adds dQ up by bulk reductions
        (launch.bulk_dq_buffer); 0 where it adds it up in dQ's own layout, or not at all."""
        return 0


@dataclass(frozen=True)
class TensorCoreBackwardConfig(_WarpRowsBackward):
    """Tiles of the mma.sync backward kernels (:mod:`numflash.kernels.backward_mma`).

    - ``block_m``: query rows per shared-memory block.
    - ``num_warps``: warps per block; each owns 16 keys, so a block holds ``16 * num_warps``.
      The warps share each block's dQ += dS K by 16-row tiles, split by columns where there
      are more warps than tiles: the split must come out even (see ``problems``).
    - ``stages``: shared-memory buffers for the Q and dO blocks: 2 loads the next block while
      the current one is computed; 1 waits for each block's loads (less shared memory).
    - ``dq_separate``: dQ from a second kernel (one block per ``16 * num_warps`` query rows,
      tiles of ``block_m`` keys, S and dP computed again) that sums each element in a fixed
      order, instead of fp32 atomics from the dK/dV kernel. Deterministic, and the faster of
      the two on the H200 (docs/performance.md), so it is the default.
    - ``head_split``: blocks that share each key (or query) block, each accumulating
      ``head_dim / head_split`` output columns while computing the scores over all of
      head_dim. 2 is needed above head_dim 128 (the accumulators must fit in registers); at
      128 and below it trades the scores computed twice for half the accumulator registers.
    """

    block_m: int = knob(64, (16, 32, 64, 128))
    num_warps: int = knob(8, (1, 2, 4, 8))
    stages: int = knob(2, (1, 2))
    dq_separate: bool = knob(True, (True, False))
    head_split: int = knob(1, (1, 2))

    family: ClassVar[str] = "tensor-core-backward"
    USER_MODS: ClassVar[bool] = True  # backward.user_element_function
    ROLE: ClassVar[str] = "backward"
    HARDWARE: ClassVar[str] = "mma.sync"
    REVISION: ClassVar[int] = 2  # 2: dK, dV and dQ written a 32-bit pair at a time

    def shared_memory_bytes(self, head_dim):
        """Dynamic: K, V, the Q and dO stages (rows padded by 16 bytes) and dS."""
        layout = backward_mma.shared_memory_layout(
            head_dim, self.block_m, self.block_n, self.stages, with_ds=not self.dq_separate
        )
        return 2 * layout[-1]

    def problems(self, head_dim, device):
        out = _out_of_choices(self)
        if out:
            return out
        part = head_dim // self.head_split
        if head_dim % (16 * self.head_split) or not 16 <= part <= 128:
            out.append(
                f"head_dim={head_dim} with head_split={self.head_split}: each block's "
                f"{head_dim}/{self.head_split} columns must be a multiple of 16 in [16, 128]"
            )
        elif (
            not self.dq_separate
            and backward_mma.dq_split(part, self.block_m, self.num_warps) is None
        ):
            out.append(
                f"{self.num_warps} warps cannot share dQ's {self.block_m // 16} row tiles "
                f"x {part // 8} column tiles evenly (pairs of column tiles)"
            )
        if device is not None and not device.runs(self.HARDWARE):
            out.append(
                f"{device.name} (compute capability {device.compute_capability}) has no "
                "mma.sync; the tensor-core backward needs 8.0 or newer"
            )
        if not out:
            # the shared LSE and D tiles are static: 8 bytes a query row and stage
            smem = self.shared_memory_bytes(head_dim) + 8 * self.stages * self.block_m
            out += _dynamic_shared_problems(smem, device)
        return out


@dataclass(frozen=True)
class PortableDecodeConfig(_Config):
    """Tiles of the portable KV-cache kernels (:mod:`numflash.kernels.decode_portable`).

    - ``block_m``: (query head, position) rows per block, one thread each; a block serves one
      kv head's GQA group, so each K/V tile it loads is read once for the group.
    - ``block_n``: cached keys per shared-memory tile (fp32).
    """

    block_m: int = knob(64, (32, 64, 128))
    block_n: int = knob(32, (8, 16, 32, 64))

    family: ClassVar[str] = "portable-decode"
    USER_MODS: ClassVar[bool] = True
    ROLE: ClassVar[str] = "decode"
    HARDWARE: ClassVar[str] = "portable"
    LOCAL_ROWS: ClassVar[bool] = True
    REVISION: ClassVar[int] = 3  # 2: the combine kernel takes one block per row; 3: a warp an
    # appended row (decode_portable.APPEND_THREADS)

    @property
    def threads(self):
        return self.block_m

    def kernel_head_dim(self, head_dim):
        return head_dim

    def shared_memory_bytes(self, head_dim):
        return 2 * self.block_n * head_dim * 4 + 4 * self.block_n

    def problems(self, head_dim, device):
        return _static_shared_problems(self, head_dim)


@dataclass(frozen=True)
class TensorCoreDecodeConfig(_Config):
    """Tiles of the tensor-core KV-cache kernel (:mod:`numflash.kernels.decode`).

    - ``block_n``: keys each warp takes from a shared-memory slot (a multiple of 16);
    - ``num_warps``: warps per block; a slot holds ``num_warps * block_n`` keys and each warp
      runs its own keys, the warps' rows merged at the end;
    - ``stages``: slots in the cp.async ring (``stages - 1`` slots load while one is computed).

    A block computes 16 query rows (a GQA group's heads times the query positions).
    """

    block_n: int = knob(16, (16, 32, 64))
    num_warps: int = knob(8, (1, 2, 4, 8))
    stages: int = knob(2, (2, 3, 4, 5, 6))

    family: ClassVar[str] = "tensor-core-decode"
    USER_MODS: ClassVar[bool] = True  # decode.mod_scores
    ROLE: ClassVar[str] = "decode"
    HARDWARE: ClassVar[str] = "mma.sync"
    #: 2: the append and the combine in the kernel; 3: the warps merged at once, masks only
    #: where a tile needs one, a paged tile's row places found a tile ahead; 4: the Q tile's and
    #: the ring's rows swizzled (head dims padded to a multiple of 64); 5: every slot of the ring
    #: in flight while one is waited for, the index loads and the Q copies issued together, one
    #: row a thread in the merge and a one-pass combine
    REVISION: ClassVar[int] = 5
    #: As TensorCoreConfig's: accumulators, scores and query fragments a thread holds.
    MAX_FRAGMENT_REGISTERS: ClassVar[int] = 200

    @property
    def threads(self):
        return 32 * self.num_warps

    def kernel_head_dim(self, head_dim):
        """Cache rows are read in place, in 16-byte chunks: head_dim must be a multiple of 8."""
        return head_dim

    def shared_memory_bytes(self, head_dim):
        """Dynamic shared memory: the Q tile and ``stages`` K and V slots (then the fp32 merge
        buffer, in the same memory)."""
        *_, elements = decode.shared_memory_layout(
            head_dim, self.block_n, self.num_warps, self.stages
        )
        return 2 * elements

    def static_shared_memory_bytes(self, head_dim):
        """Each slot's and slot row's absent flags, every warp's rows' running max and sum for
        the merge, and two key tiles' row addresses (paged caches; reserved for both)."""
        keys = self.num_warps * self.block_n
        flags = self.stages * (keys + 1)
        return 4 * flags + 8 * decode.ROWS * self.num_warps + 32 * keys

    def fragment_registers(self, head_dim):
        hd = round_up(head_dim, 16)
        return hd // 2 + self.block_n // 2 + hd // 4

    def problems(self, head_dim, device):
        """Why this configuration cannot run ``head_dim`` on ``device``; empty when it can."""
        out = _out_of_choices(self)
        if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
            out.append(f"head_dim={head_dim} is not a multiple of 8 in [8, {MAX_HEAD_DIM}]")
        if out:
            return out
        return _tensor_core_problems(
            self, head_dim, device, self.static_shared_memory_bytes(head_dim)
        )


#: What a family's kernels compute (``ROLE``): the forward, its gradients, attention over a KV
#: cache (whose tuned entries also carry a grid class).
ROLES = ("forward", "backward", "decode")
#: The instructions a family needs (``HARDWARE``): none beyond Numba's (every GPU, the
#: simulator), mma.sync/ldmatrix/cp.async (sm_80+), wgmma/TMA/setmaxnreg (sm_90a).
HARDWARE = ("portable", "mma.sync", "wgmma")


#: The registry of kernel families: {family name: configuration type}, in registration order.
CONFIG_TYPES = {}


def register(config_type):
    """Register ``config_type`` as its kernel family's declaration (a class decorator): its
    fields are the family's tuning space, ``problems`` its feasibility, ``ROLE`` and
    ``HARDWARE`` what it computes and needs. Families with a module of their own
    (numflash/families/) register there, with their default, rule and launchers."""
    c = config_type
    if c.ROLE not in ROLES or c.HARDWARE not in HARDWARE:
        raise ValueError(f"{c.__name__}: ROLE {c.ROLE!r} or HARDWARE {c.HARDWARE!r} unknown")
    if CONFIG_TYPES.get(c.family, c) is not c:
        raise ValueError(f"{c.__name__}: family {c.family!r} is registered already")
    CONFIG_TYPES[c.family] = c
    return c


for _type in (
    TensorCoreConfig,
    PortableConfig,
    TensorCoreBackwardConfig,
    PortableBackwardConfig,
    TensorCoreDecodeConfig,
    PortableDecodeConfig,
):
    register(_type)


def families(role):
    """The configuration types of the families of ``role``, in registry order."""
    return tuple(c for c in CONFIG_TYPES.values() if c.ROLE == role)


def __getattr__(name):
    """The configuration types of the families with a module of their own, by their names
    here too (``numflash.config.WgmmaForwardConfig``)."""
    for c in CONFIG_TYPES.values():
        if c.__name__ == name:
            return c
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def config_from_dict(entry):
    """Inverse of ``to_dict``; raises ValueError on an unknown family, an unknown field or a
    value that is not one of the field's choices."""
    if not isinstance(entry, dict):
        raise ValueError(f"a configuration must be an object; got {entry!r}")
    entry = dict(entry)
    family = entry.pop("family", None)
    if family not in CONFIG_TYPES:
        raise ValueError(f"unknown kernel family {family!r}; known: {sorted(CONFIG_TYPES)}")
    try:
        cfg = CONFIG_TYPES[family](**entry)
    except TypeError as exc:
        raise ValueError(f"bad {family} configuration {entry}: {exc}") from None
    bad = _out_of_choices(cfg)
    if bad:
        raise ValueError(f"bad {family} configuration {entry}: " + "; ".join(bad))
    return cfg
