"""The Hopper forward's family: S = QK^T and O += PV on wgmma, K and V brought in by TMA or
cp.async through an mbarrier pipeline (the kernels: numflash/kernels/forward_sm90.py).

Everything that declares the family is here: its configuration (the tuning space is its
fields, ``problems`` its feasibility), its heuristic default and its rule (which calls without
``config=`` run it: numflash.selection applies the rules), and its launch builders, for
``attention`` and ``attention_varlen`` and for chunked prefill in ``attention_with_kvcache``
(numflash.launch calls them). numflash/families/__init__.py registers it in one line.
"""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import arrays, config, launch, selection
from ..kernels import forward_sm90, ptx_tma
from ..kernels import work_order as device_order

# -- configuration ------------------------------------------------------------------------------


@config.register
@dataclass(frozen=True)
class WgmmaForwardConfig(config._Config):
    """Tiles and schedule of the Hopper forward (:mod:`numflash.kernels.forward_sm90`).

    - ``consumers``: warpgroups of 64 query rows each that compute, so a block holds
      ``block_m = 64 * consumers`` rows.
    - ``block_n``: keys per shared-memory tile, the N of S = Q K^T's wgmma (a multiple of 16).
    - ``stages``: key/value tiles in the shared-memory ring.
    - ``producer``: a warpgroup of its own loads the tiles, handing them over through mbarriers
      (warp specialisation, registers moved to the consumers by setmaxnreg); else every thread
      loads, the tiles ``stages - 2`` ahead of their use, between block-wide barriers.
    - ``pingpong``: the two consumer warpgroups take turns issuing their products, so one's
      softmax runs while the other's products do (needs ``producer`` and two consumers).
    - ``tma``: the producer loads each tile with TMA copies through tensor maps (needs
      ``producer``); else with cp.async. A paged KV cache, and arrays whose strides a tensor
      map cannot describe (not multiples of 16 bytes), load with cp.async either way.
    - ``fma_exp2``: of every 4 probabilities a consumer thread computes, how many are exp2 by
      a cubic on the FMA units (kernels/ptx.exp2_fma, 9 SASS instructions) rather than one
      ex2 on the special-function unit. With a softcap that unit does two operations a score
      (tanh and ex2), which take as long as a score's products on the tensor cores at
      head_dim 128 on sm_90; 0 by default: on the H200 each k made the kernel slower, with
      the softcap and without (the unit is not the bound there; docs/performance.md).
    """

    consumers: int = config.knob(2, (1, 2, 3))
    block_n: int = config.knob(128, (64, 80, 96, 112, 128, 144, 160, 176, 192))
    stages: int = config.knob(2, (2, 3, 4, 5))
    producer: bool = config.knob(True, (True, False))
    pingpong: bool = config.knob(True, (True, False))
    tma: bool = config.knob(True, (True, False))
    fma_exp2: int = config.knob(0, (0, 1, 2))

    family: ClassVar[str] = "wgmma-forward"
    ROLE: ClassVar[str] = "forward"
    HARDWARE: ClassVar[str] = "wgmma"
    READS_KV_CACHE: ClassVar[bool] = True
    USER_MODS: ClassVar[bool] = True  # dense and packed calls (forward_sm90.mod_scores)
    REVISION: ClassVar[int] = 11  # 2: TMA; 3: packed by TMA; 4: persistent; 5: paged softmax;
    # 6: a dense persistent launch's work order made on the host; 7: a paged tile's absent-key
    # flags written by the producer warp; 8: paged tiles in 8-row groups of every atom
    # (forward_sm90.grouped_pages); 9: the paged producer reads a tile's block-table entries
    # one tile ahead (forward_sm90.table_entry); 10: a paged cache's K and V copied by a
    # producer warp each (forward_sm90.PAGED_PRODUCER_WARPS); 11: a short chunk's new rows
    # appended by the chunked-prefill kernel itself (appends_in_kernel). (A packed batch's
    # work order made on the device changed only the packed kernels, which no tuned entry
    # was measured on: kept at 11.)
    #: Registers a consumer thread takes beside its fragments (addresses, loop and softmax
    #: state): a coarse bound that prunes hopeless points; ptxas' report is the judge.
    REGISTERS_BESIDES_FRAGMENTS: ClassVar[int] = 48

    @property
    def block_m(self):
        return 64 * self.consumers

    @property
    def threads(self):
        return 128 * (self.consumers + int(self.producer))

    @property
    def num_warps(self):
        return self.threads // 32

    def kernel_head_dim(self, head_dim):
        """The head_dim the kernel runs at: zero-padded to a multiple of 8 (16-byte rows)."""
        return config.round_up(head_dim, 8)

    def shared_memory_bytes(self, head_dim, paged=False):
        """Q tile, ``stages`` K and V tiles in swizzled 64-column atoms, the mbarriers and
        the alignment; over a ``paged`` KV cache, its absent-key flags too."""
        layout = forward_sm90.shared_memory_layout(
            head_dim, self.block_m, self.block_n, self.stages, paged
        )
        return layout[-1]

    def paged_cache_problems(self, head_dim, device):
        """Why this configuration cannot run chunked prefill over a paged cache (the flags'
        shared memory beside the rest) on ``device``; empty when it can."""
        return config._dynamic_shared_problems(
            self.shared_memory_bytes(head_dim, paged=True), device
        )

    def fragment_registers(self, head_dim):
        """The accumulator, S and P (16-bit pairs) a consumer thread holds."""
        return forward_sm90.padded_head_dim(head_dim) // 2 + self.block_n // 2 + self.block_n // 4

    def consumer_registers(self):
        """Registers a consumer thread may use: its share of the 65536 (at most 255), or what
        setmaxnreg gives it beside a producer."""
        split = forward_sm90.REGISTER_SPLIT
        if self.producer and self.consumers in split:
            return split[self.consumers][1]
        return min(255, 65536 // self.threads // 8 * 8)

    def problems(self, head_dim, device):
        out = config._out_of_choices(self)
        if head_dim % 8 or not 8 <= head_dim <= config.MAX_HEAD_DIM:
            out.append(f"head_dim={head_dim} is not a multiple of 8 in [8, {config.MAX_HEAD_DIM}]")
        if config._is_choice(self.pingpong, (True,)) and (self.consumers != 2 or not self.producer):
            out.append("pingpong=True takes consumers=2 and producer=True")
        if config._is_choice(self.tma, (True,)) and not self.producer:
            out.append("tma=True takes producer=True")
        if out:
            return out
        if device is not None and not device.has_wgmma:
            out.append(
                f"the wgmma forward needs compute capability 9.x; {device.name} is {device.arch}"
            )
        out += config._dynamic_shared_problems(self.shared_memory_bytes(head_dim), device)
        usable = self.consumer_registers() - self.REGISTERS_BESIDES_FRAGMENTS
        regs = self.fragment_registers(head_dim)
        if regs > usable:
            out.append(
                f"holds {regs} fragment registers per thread at head_dim={head_dim} (at most "
                f"{usable} fit beside the rest in a consumer's {self.consumer_registers()})"
            )
        return out

    def for_kv_cache(self, problem):
        """This configuration as chunked prefill runs it over ``problem``'s cache: a paged
        cache's copies find each row's page, and past 128-key tiles at head_dim 64 that spilled
        the producer's registers (sm_90a, CUDA 13: tests/compile_targets.py), so its tiles keep
        at most 128 keys; and where 128-key tiles read the pages by TMA and this
        configuration's would not (a tuned 112-key tile over pages of 64), 128 keys, not the
        cp.async copies (docs/performance.md, "Chunked prefill")."""
        if not problem.paged:
            return self
        page = problem.page_size
        if self.block_n > 128 or (
            forward_sm90.paged_tma(page, 128) and not forward_sm90.paged_tma(page, self.block_n)
        ):
            return dataclasses.replace(self, block_n=128)
        return self


# -- selection: default and rule -------------------------------------------------------------

#: Head dims (as padded to a multiple of 8) the Hopper forward takes by default: those it was
#: measured faster at than the mma.sync forward on the H200 (docs/performance.md, "Hopper
#: forward"). Others pad to whole 64-column atoms and were not faster (96, causal: 1.01x).
HEAD_DIMS = (64, 128, 256)


#: The longest seqlen bucket (cache.seqlen_bucket) at which head_dim 64 takes tiles of 128 keys
#: and head_dim 128 runs without pingpong by default: at 1024, H200, head_dim 64's 192-key tiles
#: (six over 1024 keys, the last a third empty) ran 0.767x / 0.708x cuDNN non-causal / causal,
#: 128-key ones 0.837x (2 stages) / 0.812x (4); head_dim 128 with pingpong 0.80x / 0.81-0.82x,
#: without it 0.82-0.83x / 0.83-0.84x (docs/performance.md).
SHORT_BUCKET = 1024


@selection.default_for(WgmmaForwardConfig)
def default_wgmma_forward_config(head_dim, *, key=None):
    """The Hopper forward's schedule where nothing is tuned, the fastest measured on the H200
    (fp16 and bf16, seqlen 4096 and 16384, causal and not; tools/hopper_forward.py,
    docs/performance.md "Hopper forward"): a producer warpgroup loading by TMA everywhere
    (1.4x cp.async at head_dim 128); at 64 key tiles of 192 (2-4% over 128), without pingpong
    (1-3% faster), except for a call's ``key`` (cache.ProblemKey) of at most SHORT_BUCKET
    keys: tiles of 128, two stages, four causal; at 128 pingpong (2-10% over 3 stages
    without), except at most SHORT_BUCKET keys (2-3% slower there); at 256 tiles of 64 keys,
    the most the accumulators leave registers for, without pingpong (0-4% faster)."""
    short = key is not None and key.seqlen <= SHORT_BUCKET
    if head_dim <= 64:
        if short:
            stages = 4 if key.mask == "causal" else 2
            return WgmmaForwardConfig(consumers=2, block_n=128, stages=stages, pingpong=False)
        return WgmmaForwardConfig(consumers=2, block_n=192, stages=2, pingpong=False)
    if head_dim <= 128:
        return WgmmaForwardConfig(consumers=2, block_n=128, stages=2, pingpong=not short)
    return WgmmaForwardConfig(consumers=2, block_n=64, stages=2, pingpong=False)


#: The Hopper forward's defaults, for the head_dim it would run a call at (made once: a
#: configuration's construction costs microseconds every call would pay).
_DEFAULT = WgmmaForwardConfig()


@selection.forward_rule(WgmmaForwardConfig)
def takes(problem, device):
    """Whether a call without ``config=`` on tensor cores runs the Hopper forward: compute
    capability 9.x, at the head dims it is faster at than the mma.sync forward."""
    return device.has_wgmma and _DEFAULT.kernel_head_dim(problem.head_dim) in HEAD_DIMS


# -- launch -------------------------------------------------------------------------------------

#: The Hopper forward's work tiles, (row blocks,) heads and batch, which its blocks go
#: through, (batch, head) pairs a section of them (_wgmma_work), and the Q, K and V tensor maps'
#: templates (kernels/ptx_tma.py).
_WGMMA_TAIL = (
    ("nheads", "int32"),
    ("batch", "int32"),
    ("section", "int32"),
    ("q_map", "map"),
    ("k_map", "map"),
    ("v_map", "map"),
)
#: The Hopper forward, dense or packed: launch.FORWARD_VARLEN's parameters, the buffer its blocks
#: publish tensor maps into, a persistent launch's work order (work_order, a packed batch's
#: made on the device: _packed_work_order; unread otherwise), and _WGMMA_TAIL.
WGMMA_FORWARD = launch.KernelSpec(
    arrays=launch.FORWARD_VARLEN.arrays + (("maps", "int64"), ("order", "int32")),
    strided=launch.FORWARD_VARLEN.strided,
    scalars=launch.FORWARD_VARLEN.scalars + _WGMMA_TAIL,
    variant=(),
)


#: The template the Hopper forward is handed for a tensor map it does not use (cp.async).
_NO_MAP = (0,) * ptx_tma.MAP_WORDS


def _tensor_maps(cfg, p, q, k, v, kv_rows=None):
    """(the buffer the blocks publish Q, K and V's tensor maps into, their templates), or None
    where a tensor map cannot describe one of the arrays: boxes of 64 columns by the block's
    rows (Q) or a tile's (K, V) (ptx_tma.templates). ``kv_rows``: the rows of a K or V box
    where not a tile's (a paged cache's: a page's)."""
    rows = (cfg.block_m, kv_rows or cfg.block_n, kv_rows or cfg.block_n)
    templates = ptx_tma.templates(p.dtype, (q, k, v), rows)
    if templates is None:
        return None
    return arrays.empty((len(templates) * ptx_tma.MAP_WORDS,), np.int64, like=q), templates


def _grouped_maps(cfg, p, q, k, v, rows):
    """:func:`_tensor_maps` of a paged cache whose tiles are read in 8-row groups of every
    atom (forward_sm90.grouped_pages; a box of ``rows`` rows a page's copy of every atom), or
    None where such maps cannot describe K and V (ptx_tma.grouped_templates)."""
    kv = ptx_tma.grouped_templates(p.dtype, (k, v), rows)
    q_map = ptx_tma.templates(p.dtype, (q,), (cfg.block_m,))
    if kv is None or q_map is None:
        return None
    templates = q_map + kv
    return arrays.empty((len(templates) * ptx_tma.MAP_WORDS,), np.int64, like=q), templates


def _maps_or_none(maps, xp):
    """(whether the kernel loads by TMA, what it is handed for the maps): :func:`_tensor_maps`'
    result, or where that is None a buffer and templates it never reads."""
    if maps is None:
        return False, (launch._unread_array(xp, xp.int64), (_NO_MAP,) * 3)
    return True, maps


def _variant_flags(p):
    """forward_sm90.build's variant arguments for problem ``p``."""
    return dict(softcap=p.softcap, sinks=p.sinks, alibi=p.alibi, mods=p.mods)


@launch.launches(WgmmaForwardConfig)
def _wgmma_forward(cfg, p, q, k, v, out, lse, offsets=None, variant=()):
    """The Hopper forward: dense, or a packed batch with ``offsets`` = (cu_q, cu_k). Both
    kernels take WGMMA_FORWARD's parameters: a dense call hands it offsets it never reads, a
    call without TMA a map buffer and templates it never reads."""
    q, k, v, scale, head_dim = launch._tensor_core_inputs(cfg, p, q, k, v)
    varlen = offsets is not None
    xp = arrays.array_module(q)
    maps = None
    if cfg.tma:  # a packed batch's maps are over all its rows: one batch of total rows
        maps = _tensor_maps(cfg, p, *((x[None] for x in (q, k, v)) if varlen else (q, k, v)))
    tma, maps = _maps_or_none(maps, xp)
    schedule = forward_sm90.schedule(cfg, varlen, tma)
    work, grid = _wgmma_work(p, head_dim), _wgmma_grid(cfg, p)
    if forward_sm90.ordered(cfg.producer, varlen):
        if varlen:
            order = _packed_work_order(cfg, p, offsets, work, grid[0], q, k, xp)
        else:
            order = _work_order_array(p, cfg, work, grid[0], xp)
    else:
        order = launch._unread_array(xp, xp.int32)
    views = {"maps": arrays.kernel_view(maps[0]), "order": arrays.kernel_view(order)}
    launch._launch_forward(
        lambda: forward_sm90.build(head_dim, p.dtype, *schedule, **_variant_flags(p)),
        (WgmmaForwardConfig, head_dim, p.dtype, cfg, tma, varlen) + launch.variant_key(p),
        cfg,
        p,
        (q, k, v, out, lse),
        head_dim,
        scale * launch.LOG2E,
        cfg.shared_memory_bytes(head_dim),
        offsets if varlen else launch._absent_offsets(xp),
        (WGMMA_FORWARD, views, work + maps[1]),
        grid,
        variant,
    )


def _wgmma_grid(cfg, p, cache=None):
    """The Hopper forward's blocks: one a work tile (a row block of a head and batch), or one
    a multiprocessor where the launch is persistent (forward_sm90.persistent)."""
    tiles = launch._ceil_div(p.seqlen_q, cfg.block_m) * p.nheads * p.batch
    if tiles >= 2**31:
        raise ValueError(f"{tiles} tiles of {cfg.block_m} query rows: more than 2^31 - 1")
    if forward_sm90.persistent(cfg.producer, cache):
        tiles = min(tiles, launch._multiprocessors())
    return (tiles, 1, 1)


#: What a work tile costs beside its key tiles, in key tiles: its start and end (the first S
#: alone, the output's stores), 4.4 us against 2.12 us a 128-key tile at head_dim 128 and 2.4
#: against 1.40 at 64 (H200; docs/performance.md, "A persistent launch").
TILE_OVERHEAD = 2.0
#: The least gain in the model for which work_order leaves the alternating rounds: where the
#: model saw none the least-loaded rounds measured 5-9% slower (H200, fp16: head_dim 128 at
#: 4096 keys and at 16384 causal, 64 at 4096), where it saw 2-49% they measured 2-44% faster
#: (tools/work_order.py; docs/performance.md, "A work order").
MODEL_GAIN = 1.02


def tile_costs(p, block_m, block_n, section):
    """Each work tile's cost in the model work_order balances, by rank (forward_sm90.tile_of's
    order: sections of (batch, head) pairs, each its row blocks last first): the key tiles its
    rows see under the mask (kernels/mask.py, aligned bottom-right) plus TILE_OVERHEAD."""
    m_blocks = launch._ceil_div(p.seqlen_q, block_m)
    pairs = p.nheads * p.batch
    first = np.arange(m_blocks, dtype=np.int64) * block_m
    last = np.minimum(first + block_m, p.seqlen_q) - 1
    offset = p.seqlen_k - p.seqlen_q
    hi = np.full(m_blocks, p.seqlen_k, dtype=np.int64)
    if p.window_right >= 0:
        hi = np.minimum(hi, last + offset + p.window_right + 1)
    lo = np.zeros(m_blocks, dtype=np.int64)
    if p.window_left >= 0:
        lo = np.maximum(lo, first + offset - p.window_left)
    seen = np.where(hi > lo, -(-hi // block_n) - lo // block_n, 0)
    rank = np.arange(m_blocks * pairs)
    sec = rank // (section * m_blocks)
    width = np.minimum(section, pairs - sec * section)
    step = (rank - sec * section * m_blocks) // width
    return seen[m_blocks - 1 - step] + TILE_OVERHEAD


def _alternating(tiles, blocks):
    """Each tile's block when the rounds of ``blocks`` tiles alternate in direction (the order
    of a launch without a work order: forward_sm90.ranked)."""
    rank = np.arange(tiles)
    round_, within = np.divmod(rank, blocks)
    return np.where(round_ % 2 == 1, blocks - 1 - within, within)


def _least_loaded(cost, blocks):
    """Each tile's block when each round of ``blocks`` tiles (in rank order) hands its
    costliest tiles to the blocks with the least work so far."""
    load = np.zeros(blocks)
    owner = np.empty(len(cost), dtype=np.int64)
    for start in range(0, len(cost), blocks):
        costs = cost[start : start + blocks]
        takers = np.argsort(load, kind="stable")[: len(costs)]
        by_cost = np.argsort(-costs, kind="stable")
        owner[start + by_cost] = takers
        load[takers] += costs[by_cost]
    return owner


#: work_order's array for the rounds alternating in direction, which the kernel works out
#: itself (no load from the order a tile).
ALTERNATING = np.array([-1], dtype=np.int32)


def work_order(p, block_m, block_n, section, blocks):
    """Which work tiles each block of a persistent dense launch goes through, as an int32
    array: ``blocks + 1`` offsets, then the tiles' ranks (forward_sm90.tile_of's order), block
    x's from ``order[x]`` to ``order[x + 1]`` after the offsets, in rank order; or
    ALTERNATING (the rounds alternating in direction, a tile a block). A block takes a tile a
    round of ``blocks`` tiles in rank order, so the tiles in flight together share their keys
    in L2 as before; which one of its round, tile_costs' model decides: each round's
    costliest tiles to the blocks with the least work so far where that finishes at least
    MODEL_GAIN sooner than the alternation, else the alternation. The alternation ran up to
    1.53x the balanced share in the model (head_dim 256, 16384 keys, causal: sections of one
    (batch, head) pair, 128 tiles a section over 132 blocks, so the costs fall and rise again
    within a round); this stays within 1.07x of it on bench_forward's grid."""
    tiles = launch._ceil_div(p.seqlen_q, block_m) * p.nheads * p.batch
    if tiles <= blocks:  # a tile a block
        return ALTERNATING
    cost = tile_costs(p, block_m, block_n, section)
    alternating = np.bincount(_alternating(tiles, blocks), weights=cost, minlength=blocks).max()
    if max(cost.sum() / blocks, cost.max()) * MODEL_GAIN >= alternating:
        return ALTERNATING  # no order finishes sooner than that bound: the rounds' loop unrun
    owner = _least_loaded(cost, blocks)
    if np.bincount(owner, weights=cost, minlength=blocks).max() * MODEL_GAIN >= alternating:
        return ALTERNATING
    return listed_order(owner, blocks)


def listed_order(owner, blocks):
    """work_order's list from each tile's block (``owner``, by rank): the blocks' offsets,
    then each block's tiles in rank order."""
    ranks = np.argsort(owner, kind="stable")
    offsets = np.searchsorted(owner[ranks], np.arange(blocks + 1))
    return np.concatenate([offsets, ranks]).astype(np.int32)


#: Device copies of work_order's arrays by device and geometry (a prepared launch or a plan
#: holds its own reference, so dropping them all at the bound frees none in use).
_orders = {}
#: ALTERNATING on each device.
_alternating_arrays = {}


def _work_order_array(p, cfg, work, blocks, xp):
    """work_order's array for a persistent dense launch of ``blocks`` blocks, on the current
    device, made once per geometry."""
    device = 0 if launch.SIMULATOR else xp.cuda.runtime.getDevice()
    key = (device, p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.window_left, p.window_right)
    key += (cfg.block_m, cfg.block_n, work, blocks)
    found = _orders.get(key)
    if found is None:
        if len(_orders) >= 256:
            _orders.clear()
        order = work_order(p, cfg.block_m, cfg.block_n, work[-1], blocks)
        if order is ALTERNATING:  # the common answer: one copy a device, no upload a geometry
            found = _alternating_array(xp)
        else:
            found = xp.asarray(order)
        _orders[key] = found
    return found


#: Whether a packed batch's persistent launch without a causal mask or window takes a work
#: order made on the device (kernels/work_order.py) rather than the alternating rounds over
#: every slot: 1.10-1.13x at head_dim 64 and 128, fp16 and bf16 (H100, 30 sequences of
#: 65536 tokens; docs/performance.md, "A packed batch's work order").
DEVICE_PACKED_ORDER = True
#: ... and with a causal mask or a window: off, as the order that keeps a sequence's tiles
#: together is not yet timed (the one before it, sorted by each row block's own cost, ran
#: 0.77x the alternating rounds at head_dim 128 causal on that H100).
DEVICE_PACKED_ORDER_MASKED = False
#: ... and only where the tiles with rows may fill this many rounds of the launch's blocks:
#: a guess, not timed apart (the batch above fills 66-131 such rounds): below it the order's
#: own launch (one block sorting the slots) may cost more than the balanced rounds save.
PACKED_ORDER_ROUNDS = 16
#: A packed batch's work order is made on the device where its (sequence, row block) slots
#: number at most this: one block sorts them in shared memory, 8 bytes a slot (32 KiB, under
#: the 48 KiB a block gets without opting in).
PACKED_ORDER_SLOTS = 4096
#: ... and its tiles at most this: the order's 512 KiB of ranks stay under the 1 MiB a
#: prepared launch keeps of buffers its call made (launch.MAX_KEPT_BYTES).
PACKED_ORDER_TILES = 1 << 17
#: The order kernel's parameters (kernels/work_order.build).
WORK_ORDER = launch.KernelSpec(
    arrays=(("cu_q", "int32"), ("cu_k", "int32"), ("order", "int32")),
    strided=(),
    scalars=tuple((name, "int32") for name in (
        "batch", "m_blocks", "nheads", "section", "blocks", "total_q", "total_k", "max_q",
        "max_k", "block_m", "block_n", "window_left", "window_right", "overhead")),
)  # fmt: skip


def device_order_pays(p, slots, tiles, busy, blocks):
    """Whether a packed batch's launch of ``blocks`` blocks over ``slots`` (sequence, row
    block) slots and ``tiles`` work tiles, at most ``busy`` of them holding rows, takes a
    work order made on the device: as DEVICE_PACKED_ORDER (DEVICE_PACKED_ORDER_MASKED under a
    causal mask or a window) says, where the tiles with rows may fill PACKED_ORDER_ROUNDS
    rounds and the tiles more than one, and the slots and tiles stay within
    PACKED_ORDER_SLOTS and PACKED_ORDER_TILES."""
    if slots > PACKED_ORDER_SLOTS or tiles > PACKED_ORDER_TILES:
        return False
    if tiles <= blocks or busy < PACKED_ORDER_ROUNDS * blocks:
        return False
    if p.window_left >= 0 or p.window_right >= 0:
        return DEVICE_PACKED_ORDER_MASKED
    return DEVICE_PACKED_ORDER


def _packed_work_order(cfg, p, offsets, work, blocks, q, k, xp):
    """The work order of a packed batch's persistent launch of ``blocks`` blocks: made on the
    device from ``offsets`` (cu_q, cu_k) just before the launch, on its stream (the tiles with
    rows, a sequence's together, the costliest sequences first, in rounds of alternating
    direction: kernels/work_order.py); the alternating rounds over every (row block, head,
    sequence) where :func:`device_order_pays` says no."""
    m_blocks = launch._ceil_div(p.seqlen_q, cfg.block_m)
    slots = m_blocks * p.batch
    tiles = slots * p.nheads
    # the tiles with rows, at most: the packed rows' blocks and a partial one a sequence
    busy = min(tiles, (launch._ceil_div(q.shape[0], cfg.block_m) + p.batch) * p.nheads)
    if not device_order_pays(p, slots, tiles, busy, blocks):
        return _alternating_array(xp)
    size = 64  # the sort's slots, a power of two: a kernel a size
    while size < slots:
        size *= 2
    # a thread for every 4 slots of the sort, at least 4 warps (each slot's heads are written
    # by its thread), at most 512 (8 keys a thread at PACKED_ORDER_SLOTS; not timed apart)
    threads = min(512, max(128, size // 4))
    order = arrays.empty((blocks + 1 + tiles,), np.int32, like=q)
    views, totals = launch._packed_offsets(offsets, q, k)
    views["order"] = arrays.kernel_view(order)
    scalars = (p.batch, m_blocks, p.nheads, work[-1], blocks, *totals, p.seqlen_q, p.seqlen_k,
               cfg.block_m, cfg.block_n, p.window_left, p.window_right, int(TILE_OVERHEAD))  # fmt: skip
    run = launch.launcher(("packed-work-order", size, threads),
                          lambda: device_order.build(size, threads), WORK_ORDER, p.dtype)  # fmt: skip
    run((1, 1, 1), threads, arrays.current_stream(), 0, WORK_ORDER.args(views, scalars))
    return order


def _alternating_array(xp):
    """ALTERNATING on the current device, one copy a device."""
    device = 0 if launch.SIMULATOR else xp.cuda.runtime.getDevice()
    found = _alternating_arrays.get(device)
    if found is None:
        found = _alternating_arrays[device] = xp.asarray(ALTERNATING)
    return found


def _wgmma_work(p, head_dim):
    """(heads, batch, pairs a section): the Hopper forward goes through its work tiles by
    sections of (batch, head) pairs whose key and value rows (16-bit, p.seqlen_k of them) take
    half the L2 cache together, so the blocks working at once share them."""
    pair_bytes = 2 * max(p.seqlen_k, 1) * head_dim * 2 // p.heads_per_kv
    section = min(max(launch._device_attribute("L2CacheSize") // 2 // max(pair_bytes, 1), 1),
                  p.nheads * p.batch)  # fmt: skip
    return (p.nheads, p.batch, section)


#: The Hopper forward over a KV cache (forward_sm90.build's ``cache``): the arrays, the
#: tensor-map buffer, the new rows (read where the kernel appends them), the strides, the
#: KV-cache scalars and the map templates (unread with cp.async).
WGMMA_KVCACHE = launch.KernelSpec(
    arrays=(("q", "elem"), ("k_cache", "elem"), ("v_cache", "elem"), ("o", "elem"),
            ("lse", "float32"), ("seqlens", "int32"), ("batch_idx", "int32"),
            ("block_table", "int32"), ("maps", "int64"), ("k", "elem"), ("v", "elem")),
    strided=("q", "k_cache", "v_cache", "o", "k", "v"),
    scalars=launch.SPLIT_ATTENTION.scalars[:6] + launch.SPLIT_ATTENTION.scalars[6:10] + _WGMMA_TAIL,
    variant=(),
)  # fmt: skip


#: Chunked prefill's kernel appends the new rows itself (forward_sm90.build's ``append``)
#: where the call has at most this many query rows and new rows: each work tile writes the
#: new rows its key tiles hold, so a sequence's new rows are written once a query head of
#: its kv head; a block of rows a head keeps that to the GQA group's size. Over a contiguous
#: cache 1.03-1.14x the call with an append launch (H100; docs/performance.md, "Chunked
#: prefill").
APPEND_ROWS = 128
#: ... and over a paged cache too: off, as over pages of 16 and 64 a cold cache's chunk runs
#: 0.80-0.83x the call with an append launch, a warm one 1.03-1.06x (H100, 2026-12-07:
#: tools/paged_prefill.py --append-ab), and the host cannot tell them apart.
PAGED_APPEND = False


def appends_in_kernel(cfg, p, tma, views):
    """Whether the Hopper forward over a KV cache appends the call's new rows itself: new rows
    given, TMA copies (the producer's other warps write), a contiguous cache (or
    PAGED_APPEND), no block mask, short chunks (APPEND_ROWS) and new rows the kernel can copy
    16 bytes at a time."""
    if "k" not in views or not p.seqlen_new or not tma or (p.paged and not PAGED_APPEND):
        return False
    if p.mods is not None and p.mods.block_mask:
        return False
    if max(p.seqlen_q, p.seqlen_new) > min(APPEND_ROWS, cfg.block_m) or p.head_dim % 8:
        return False
    return arrays.view_aligned(views["k"], 8) and arrays.view_aligned(views["v"], 8)


@launch.launches(WgmmaForwardConfig, launch.PREFILL_LAUNCHERS)
def _wgmma_kvcache(cfg, p, q, k_cache, v_cache, views, geometry, stream):
    """Chunked prefill: the Hopper forward over each sequence's keys in the caches, the new
    rows appended by the kernel (appends_in_kernel) or by a launch before it: the tiles by
    TMA where ``cfg`` asks for it and tensor maps describe the arrays (a paged cache's pages:
    forward_sm90.paged_tma), else by cp.async."""
    d, dtype = p.head_dim, p.dtype
    xp = arrays.array_module(q)
    q, scale = launch._positive_scale(q, p.scale)
    q = launch._kernel_input(q, alignment_elements=8)
    views["q"] = arrays.kernel_view(q)
    views["o"] = views["out"]
    cache = "paged" if p.paged else "contiguous"
    maps = None
    if cfg.tma and not p.paged:
        maps = _tensor_maps(cfg, p, q, k_cache, v_cache)
    elif cfg.tma and forward_sm90.paged_tma(p.page_size, cfg.block_n):  # boxes of a page
        rows = min(p.page_size, cfg.block_n)
        if forward_sm90.grouped_pages(d, p.page_size, cfg.block_n):
            maps = _grouped_maps(cfg, p, q, k_cache, v_cache, rows)
            cache = "paged" if maps is None else "grouped"
        if maps is None:
            maps = _tensor_maps(cfg, p, q, k_cache, v_cache, rows)
    tma, maps = _maps_or_none(maps, xp)
    views["maps"] = arrays.kernel_view(maps[0])
    append = appends_in_kernel(cfg, p, tma, views)
    if "k" not in views:  # no new rows: never read
        views["k"] = views["v"] = views["q"]
    elif not append:
        launch.append_new_rows(p, views, geometry, stream)
    schedule = forward_sm90.schedule(cfg, tma=tma, cache=cache)
    spec = WGMMA_KVCACHE.for_problem(p)
    kernel = launch.launcher(
        (WgmmaForwardConfig, d, dtype, cfg, cache, tma, schedule[-1], append)
        + launch.variant_key(p),
        lambda: forward_sm90.build(d, dtype, *schedule, **_variant_flags(p), append=append),
        spec,
        dtype,
    )
    scalars = (p.seqlen_q, p.seqlen_new, p.heads_per_kv, np.float32(scale * launch.LOG2E))
    scalars += (p.window_left, p.window_right, *geometry)
    scalars += _wgmma_work(p, d) + tuple(maps[1])
    shared = forward_sm90.shared_memory_layout(d, cfg.block_m, cfg.block_n, cfg.stages, p.paged)
    grid = _wgmma_grid(cfg, p, cache)
    kernel(grid, cfg.threads, stream, shared[-1], spec.args(views, scalars))
