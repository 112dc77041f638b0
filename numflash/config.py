"""Kernel configurations: frozen dataclasses, their feasibility on a device, and the defaults.

A configuration names a kernel family by its type (:class:`TensorCoreConfig` or
:class:`PortableConfig`) and the compile-time tile sizes of that family. The same feasibility
check serves the dispatcher (a clear error for a forced configuration) and the autotuner (prune a
point before compiling it).
"""

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from . import cache
from .device import PORTABLE, PORTABLE_BACKWARD, TENSOR_CORE, TENSOR_CORE_BACKWARD

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


def _out_of_choices(cfg):
    return [
        f"{name}={getattr(cfg, name)!r} is not one of {', '.join(map(str, choices))}"
        for name, choices in knob_choices(type(cfg)).items()
        if getattr(cfg, name) not in choices
    ]


class _Config:
    """What every configuration dataclass shares: its dict form, family included."""

    def to_dict(self):
        return {"family": self.family, **asdict(self)}


def _static_shared_problems(cfg, head_dim):
    """Why a configuration of the portable kernels (static shared memory) cannot run."""
    out = _out_of_choices(cfg)
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        out.append(f"head_dim={head_dim} is not in [1, {MAX_HEAD_DIM}]")
    smem = cfg.shared_memory_bytes(head_dim)
    if smem > STATIC_SHARED_LIMIT:
        out.append(
            f"needs {smem} bytes of static shared memory at head_dim={head_dim}; "
            f"the limit is {STATIC_SHARED_LIMIT}"
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

    family: ClassVar[str] = TENSOR_CORE
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

    def shared_memory_bytes(self, head_dim):
        """Q tile plus ``stages`` K and V tiles, rows padded by 16 bytes against bank conflicts."""
        from .kernels.forward import shared_memory_layout

        *_, elements = shared_memory_layout(head_dim, self.block_m, self.block_n, self.stages)
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
        if self.num_warps in knob_choices(TensorCoreConfig)["num_warps"] and (
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
        if not device.supports(self.family):
            out.append(
                f"{device.name} (compute capability {device.compute_capability}) has no "
                "mma.sync/ldmatrix/cp.async; the tensor-core kernel needs 8.0 or newer"
            )
        smem = self.shared_memory_bytes(head_dim)
        if smem > device.max_shared_per_block:
            out.append(
                f"needs {smem} bytes of shared memory per block; {device.name} allows "
                f"{device.max_shared_per_block}"
            )
        if self.threads > device.max_threads_per_block:
            out.append(f"needs {self.threads} threads per block")
        regs = self.fragment_registers(head_dim)
        if regs > self.MAX_FRAGMENT_REGISTERS:
            out.append(
                f"holds {regs} fragment registers per thread at head_dim={head_dim} "
                f"(at most {self.MAX_FRAGMENT_REGISTERS} fit without spilling)"
            )
        return out

@dataclass(frozen=True)
class PortableConfig(_Config):
    """Tiles of the portable forward kernel (:mod:`numflash.kernels.forward_portable`).

    One thread per query row (``block_m`` threads per block); keys and values stream through
    shared memory ``block_n`` rows at a time, converted to fp32.
    """

    block_m: int = knob(64, (16, 32, 64, 128, 256))
    block_n: int = knob(32, (8, 16, 32, 64))

    family: ClassVar[str] = PORTABLE

    @property
    def threads(self):
        return self.block_m

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

    family: ClassVar[str] = PORTABLE_BACKWARD

    def shared_memory_bytes(self, head_dim):
        """The larger of the two kernels' static shared memory: q and dO tiles with their LSE
        and D (dK/dV), or k and v tiles (dQ), all fp32."""
        return max(2 * self.block_m * (head_dim + 1) * 4, 2 * self.block_n * head_dim * 4)

    def problems(self, head_dim, device):
        return _static_shared_problems(self, head_dim)

@dataclass(frozen=True)
class TensorCoreBackwardConfig(_Config):
    """Tiles of the tensor-core backward kernel (:mod:`numflash.kernels.backward`).

    - ``block_m``: query rows per shared-memory block.
    - ``num_warps``: warps per block; each owns 16 keys, so a block holds ``16 * num_warps``.
      The warps share each block's dQ += dS K by 16-row tiles, split by columns where there
      are more warps than tiles: the split must come out even (see ``problems``).
    - ``stages``: shared-memory buffers for the Q and dO blocks: 2 loads the next block while
      the current one is computed; 1 waits for each block's loads (less shared memory).
    - ``dq_separate``: dQ from a second kernel (one block per ``16 * num_warps`` query rows,
      tiles of ``block_m`` keys, S and dP computed again) that sums each element in a fixed
      order, instead of fp32 atomics from the dK/dV kernel. Deterministic; costs the
      recomputation, saves the atomics and the dS round trip through shared memory. On the
      H200 it was the faster of the two (2026-11-30, head_dim 128, seqlen 4096, fp16,
      ``benchmarks/backward_variants.py``: 14.0 vs 14.9 ms non-causal, 8.1 vs 8.8 ms causal
      at 64 x 128), so it is the default.
    - ``head_split``: blocks that share each key (or query) block, each accumulating
      ``head_dim / head_split`` output columns while computing the scores over all of
      head_dim. 2 is needed above head_dim 128 (the accumulators must fit in registers); at
      128 and below it trades the scores computed twice for half the accumulator registers.
    - ``wgmma``: the Hopper kernels (:mod:`numflash.kernels.backward_sm90`) instead of the
      mma.sync ones: warpgroup MMAs, 64 keys (dK/dV kernel) or query rows (dQ kernel) per
      warpgroup (``num_warps`` 4 or 8), tiles of ``block_m`` = 64 streaming through
      ``stages`` buffers. Compute capability 9.x, head_dim 64 or 128 (as padded),
      ``dq_separate`` and ``head_split`` 1.
    """

    block_m: int = knob(64, (16, 32, 64, 128))
    num_warps: int = knob(8, (1, 2, 4, 8))
    stages: int = knob(2, (1, 2))
    dq_separate: bool = knob(True, (True, False))
    head_split: int = knob(1, (1, 2))
    wgmma: bool = knob(False, (False, True))

    family: ClassVar[str] = TENSOR_CORE_BACKWARD
    MAX_HEAD_DIM: ClassVar[int] = 256  # 128 output columns per block at most

    @property
    def block_n(self):
        return 16 * self.num_warps

    @property
    def threads(self):
        return 32 * self.num_warps

    def shared_memory_bytes(self, head_dim):
        """Dynamic: K, V, the Q and dO stages (rows padded by 16 bytes) and dS; with ``wgmma``,
        the Hopper kernels' swizzled tiles (kernels/backward_sm90.py)."""
        from .kernels import backward_sm90
        from .kernels.backward import shared_memory_layout

        if self.wgmma and head_dim in backward_sm90.HEAD_DIMS:
            return backward_sm90.shared_memory_layout(head_dim, self.num_warps, self.stages)[-1]
        return 2 * shared_memory_layout(head_dim, self.block_m, self.block_n, self.stages,
                                        with_ds=not self.dq_separate)[-1]  # fmt: skip

    def wgmma_problems(self, head_dim, device):
        """Why the wgmma kernels cannot run this configuration (part of ``problems``)."""
        from .kernels import backward_sm90

        out = []
        if device is not None and not device.has_wgmma:
            out.append(f"wgmma=True needs compute capability 9.x; {device.name} is "
                       f"{device.arch}")  # fmt: skip
        if head_dim not in backward_sm90.HEAD_DIMS:
            dims = " or ".join(map(str, backward_sm90.HEAD_DIMS))
            out.append(f"wgmma=True takes head_dim {dims} (as padded), not {head_dim}")
        if self.block_m != backward_sm90.BLOCK_M or self.num_warps not in backward_sm90.NUM_WARPS:
            out.append(f"wgmma=True takes block_m={backward_sm90.BLOCK_M} and num_warps 4 or 8")
        if not self.dq_separate or self.head_split != 1:
            out.append("wgmma=True takes dq_separate=True and head_split=1")
        return out

    def problems(self, head_dim, device):
        from .kernels.backward import dq_split

        out = _out_of_choices(self)
        part = head_dim // self.head_split
        if head_dim % (16 * self.head_split) or not 16 <= part <= 128:
            out.append(f"head_dim={head_dim} with head_split={self.head_split}: each block's "
                       f"{head_dim}/{self.head_split} columns must be a multiple of 16 in "
                       "[16, 128]")  # fmt: skip
        elif not self.dq_separate and dq_split(part, self.block_m, self.num_warps) is None:
            out.append(f"{self.num_warps} warps cannot share dQ's {self.block_m // 16} row tiles "
                       f"x {part // 8} column tiles evenly (pairs of column tiles)")  # fmt: skip
        if self.wgmma:
            out += self.wgmma_problems(head_dim, device)
        if not out:
            smem = self.shared_memory_bytes(head_dim) + 8 * self.stages * self.block_m
            if device is not None and smem > device.max_shared_per_block:
                out.append(f"needs {smem} bytes of shared memory; the device allows "
                           f"{device.max_shared_per_block}")  # fmt: skip
        return out

def default_portable_backward_config(head_dim):
    """Two fp32 tiles of 32 rows (64 at head_dim <= 64, 16 above 128) fit the 48 KiB of static
    shared memory; untuned: these kernels are the correctness path, not the fast one."""
    if head_dim <= 64:
        return PortableBackwardConfig(block_m=64, block_n=64)
    if head_dim <= 128:
        return PortableBackwardConfig(block_m=32, block_n=32)
    return PortableBackwardConfig(block_m=16, block_n=16)


CONFIG_TYPES = {TENSOR_CORE: TensorCoreConfig, PORTABLE: PortableConfig,
                PORTABLE_BACKWARD: PortableBackwardConfig,
                TENSOR_CORE_BACKWARD: TensorCoreBackwardConfig}  # fmt: skip


def config_from_dict(entry):
    """Inverse of ``to_dict``; raises ValueError on an unknown family or field."""
    entry = dict(entry)
    family = entry.pop("family", None)
    if family not in CONFIG_TYPES:
        raise ValueError(f"unknown kernel family {family!r}; known: {sorted(CONFIG_TYPES)}")
    try:
        return CONFIG_TYPES[family](**entry)
    except TypeError as exc:
        raise ValueError(f"bad {family} configuration {entry}: {exc}") from None


def default_portable_config(head_dim):
    # Two fp32 tiles of block_n x head_dim must fit in 48 KiB of static shared memory.
    return PortableConfig(block_m=64, block_n=32 if head_dim <= 128 else 16)


def default_tensor_core_config(head_dim, device):
    """The heuristic used when no tuned configuration is cached.

    Chosen on the H200 (sm_90), 2026-11-29, among configurations whose ptxas report shows no
    spill (tests/test_compile.py keeps it so), by benchmarks/variants.py --grid no-spill, fp16
    and bf16, seqlen 4096 and 16384, causal and not (benchmarks/results/dev/):

    - head_dim <= 64: 128 x 64 tiles, two 16-row tiles per warp, 3 stages: 0.88-1.02x SDPA's
      FlashAttention-2. Two row tiles per warp halve the ldmatrix traffic per mma.
    - head_dim <= 128: 128 x 32, Q re-read from shared memory: 0.78-0.91x. Keeping Q in
      registers or 64-key tiles does not fit in 255 registers without spilling.
    - larger: 64 x 32, Q from shared memory: 0.67-0.81x at head_dim 256.

    The same choices are used on other GPUs until they are tuned there (sm_80/86/89 have less
    shared memory per block; the largest of these, head_dim 256, takes 99 KiB, sm_86's limit).
    """
    if head_dim <= 64:
        return TensorCoreConfig(block_m=128, block_n=64, num_warps=4, stages=3,
                                q_in_registers=False)  # fmt: skip
    if head_dim <= 128:
        return TensorCoreConfig(block_m=128, block_n=32, num_warps=4, stages=2,
                                q_in_registers=False)  # fmt: skip
    return TensorCoreConfig(block_m=64, block_n=32, num_warps=4, stages=2, q_in_registers=False)


def tensor_core_backward_head_dim(head_dim):
    """The head_dim the tensor-core backward runs at: zero-padded to a multiple of 16, or of 32
    above 128 (where two blocks split the columns)."""
    return round_up(head_dim, 16 if head_dim <= 128 else 32)


def default_tensor_core_backward_config(head_dim, device=None):
    """The tensor-core backward's heuristic (head_dim as tensor_core_backward_head_dim gives):
    the first of a short list that fits ``device`` (any device when None).

    dQ from its own kernel (``dq_separate``) everywhere: faster than the atomics on the H200,
    and deterministic.

    Up to head_dim 128: 64 query rows x 128 keys (8 warps), two stages. On the H200
    (2026-11-30, benchmarks/backward_variants.py, head_dim 128, seqlen 4096, fp16) 64 x 128
    was the fastest tiling non-causal (14.0 ms; 64 x 64: 14.1, 32 x 64: 15.0, 128 x 128: 15.3)
    and within 2% of the fastest causal (8.07 vs 7.90 ms at 64 x 64).

    Above head_dim 128 the columns are split over two blocks (the accumulators must fit in
    registers): 32 x 128 (8 warps), 2 stages. On the H200 (same day and script, head_dim
    256, seqlen 4096, fp16) it took 24.6 ms non-causal and 13.3 causal, against 30.1 and
    15.9 for 32 x 64 and 28.8 and 15.3 for 64 x 64.

    The rest of each list is for GPUs with less shared memory per block (sm_80: 163 KiB,
    sm_86/89: 99 KiB), not measured there: 32 x 64 in two stages, then one stage of 16 rows.

    On Hopper (compute capability 9.x) at head_dim 64 and 128, the wgmma kernels
    (kernels/backward_sm90.py) with two warpgroups and two stages come first. On the H200
    (2026-11-30, ``benchmarks/backward_variants.py --kernel-variants --wgmma 0 1``, 32k tokens
    x 2048, fp16 and bf16, seqlen 4096 and 16384, causal and not) they took 0.60-0.66x the
    time of the mma.sync kernels at head_dim 128 (fp16 non-causal 4096: 8.76 against 13.24
    ms) and 0.67-0.70x at 64; one warpgroup (64 x 4) was 3% slower non-causal, 1% faster
    causal (head_dim 128, fp16, 4096). Not on a device of another kind, nor in the simulator
    (whose tensor-core defaults are not used untuned).
    """
    if head_dim > 128:
        candidates = [TensorCoreBackwardConfig(32, 8, 2, head_split=2),
                      TensorCoreBackwardConfig(32, 4, 2, head_split=2),
                      TensorCoreBackwardConfig(16, 4, 1, head_split=2)]  # fmt: skip
    else:
        candidates = [TensorCoreBackwardConfig(64, 8, 2), TensorCoreBackwardConfig(32, 4, 2),
                      TensorCoreBackwardConfig(16, 4, 1)]  # fmt: skip
        if device is not None and device.has_wgmma and not device.simulated:
            candidates.insert(0, TensorCoreBackwardConfig(64, 8, 2, wgmma=True))
    for cfg in candidates:
        if device is None or not cfg.problems(head_dim, device):
            return cfg
    return candidates[-1]


_choices = {}


def choose_config(family, problem, device):
    """The configuration a call without ``config=`` runs with, as a ``cache.Selection``.

    A tuned one when the cache has one for this problem on this GPU (numflash/cache.py gives
    the order), else the heuristic default. Memoised per (problem key, device): every call
    goes through here, and the lookup must cost a few microseconds at most.
    """
    seqlen = max(problem.seqlen_q, problem.seqlen_k)
    memo_key = (cache.generation, family, problem.dtype, problem.head_dim,
                problem.window_left < 0, problem.window_right, (seqlen - 1).bit_length(),
                device)  # fmt: skip
    choice = _choices.get(memo_key)
    if choice is None:
        choice = _choices[memo_key] = _choose(family, problem, device)
    return choice


def default_config(family, head_dim, device):
    """(head_dim the kernel runs at, heuristic default) for a family: the tensor-core forward
    runs head dims padded to a multiple of 8, the tensor-core backward to a multiple of 16."""
    if family == PORTABLE:
        return head_dim, default_portable_config(head_dim)
    if family == PORTABLE_BACKWARD:
        return head_dim, default_portable_backward_config(head_dim)
    if family == TENSOR_CORE_BACKWARD:
        head_dim = tensor_core_backward_head_dim(head_dim)
        return head_dim, default_tensor_core_backward_config(head_dim, device)
    if family != TENSOR_CORE:
        raise ValueError(f"unknown kernel family {family!r}; known: {sorted(CONFIG_TYPES)}")
    head_dim = round_up(head_dim, 8)
    return head_dim, default_tensor_core_config(head_dim, device)


def _choose(family, problem, device):
    head_dim, default = default_config(family, problem.head_dim, device)
    key = cache.ProblemKey.of(family, problem.dtype, head_dim, problem.seqlen_q,
                              problem.seqlen_k, problem.window_left, problem.window_right)  # fmt: skip
    hit = cache.lookup(device.arch, key, feasible=lambda cfg: not cfg.problems(head_dim, device))
    if hit is not None:
        return cache.Selection(*hit)
    return cache.Selection(default, "heuristic")
