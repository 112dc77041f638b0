"""The Hopper backward's family: the mma.sync backward's dK/dV and dQ kernels with every
product on warpgroup MMAs (the kernels: numflash/kernels/backward_sm90.py).

Everything that declares the family is here: its configuration (the tuning space is its
fields, ``problems`` its feasibility), its heuristic default, its rule (when a call without
``config=`` may run it: numflash.selection applies the rules) and its launch builder
(numflash.launch's tensor-core backward with these kernels). numflash/families/__init__.py
registers it in one line.
"""

import functools
from dataclasses import dataclass
from typing import ClassVar

from .. import config, launch, selection
from ..kernels import backward, backward_sm90, ptx_tma

# -- configuration ------------------------------------------------------------------------------


@config.register
@dataclass(frozen=True)
class WgmmaBackwardConfig(config._WarpRowsBackward):
    """The Hopper backward kernels (:mod:`numflash.kernels.backward_sm90`): the mma.sync
    backward's dK/dV and dQ kernels with every product on warpgroup MMAs.

    - ``num_warps``: 4 or 8, one or two warpgroups of 64 keys (dK/dV kernel) or 64 query rows
      (dQ kernel) a block.
    - ``stages``: shared-memory buffers for the streaming 64-row tiles (1 or 2; 3 with
      ``ring``).
    - ``ring``: the streaming tiles go through a ring of three slots handed over by mbarriers
      (each thread's copies arrive when they land, each thread releases a slot when its
      products have read it) instead of a block barrier a tile, so that the two warpgroups
      may drift apart and one's softmax step run beside the other's products; each
      warpgroup keeps its own LSE and D. Without ``dq_separate`` only with ``pingpong`` and
      ``dq_bulk``. Alone: on an H100 1-2% faster at head_dim 128, 6-8% slower at 64
      (docs/performance.md).
    - ``pingpong`` (with ``ring`` and ``num_warps=8``): the two warpgroups take turns issuing
      their products (named barriers, as the Hopper forward's pingpong), so that the tensor
      cores run one's products while the other's softmax step runs, where without it both
      issue at once and both wait. With the ring, the default: on an H100 at head_dim 128
      1.5-4% faster than the ring alone, 1.02-1.08x the two-stage configuration
      (docs/performance.md). With ``dq_separate=False`` dQ takes a third turn a query block,
      from two dS tiles the turns keep apart (kernels/backward_sm90.ring_query_block_step):
      on an H100 1.04-1.09x the two-stage configuration with 16384 keys, 0.96-1.02x with
      4096; not repeatable bit for bit, so not a default.
    - ``tma`` (with ``ring``): the streaming tiles (Q and dO; K and V in the dQ kernel) come
      into the ring's slots by the tensor memory accelerator, one thread issuing a tile's
      boxes over tensor maps each block publishes, instead of every thread's cp.async; rows
      past the end are zero-filled by the copy. In the dK/dV kernel the same thread copies
      the block's LSE and D in bulk beside them, from padded buffers the D kernel writes
      (one copy for both warpgroups, no fetch or warpgroup barrier a block). Dense calls
      whose arrays tensor maps can describe (16-byte aligned, strides multiples of 16
      bytes); packed batches and other calls keep cp.async. The default: on an H100
      1.01-1.04x the cp.async ring's speed at head_dim 128, level with it at 64 with 64-row
      tiles, 1.03-1.05x with 128-row ones (docs/performance.md).
    - ``pack_first``: the products whose A comes from registers (dV, dK; dQ) take it rounded
      to 16 bits before the wgmma fence (kernels/backward_sm90.build_kernels), where ptxas
      otherwise waits for the warpgroup before each such product but the first (remark
      C7519); off by default: 2.4-5.7% slower on the H200 (docs/performance.md).
    - ``dq_separate``: dQ from its own kernel, S and dP computed again, each element summed
      in a fixed order (deterministic; seven products per tile pair); False: the dK/dV
      kernel adds dQ += dS K up on wgmma into an fp32 buffer by atomics, in no fixed order
      (five products). True by default: the fused mode ran 1.02-1.05x at head_dim 64 and
      0.95-1.01x at 128 on the H200 (docs/performance.md), not worth a default that does
      not repeat bit for bit.
    - ``dq_bulk`` (with ``dq_separate=False``; ignored without): each warp stores its rows
      of dQ into shared memory and one lane adds them to the fp32 buffer by an asynchronous
      bulk reduction through the TMA unit (FlashAttention-3's route, 4 KB at a time at
      head_dim 128), so the warps issue no atomics; False: 16 ``red.global.add.v2.f32`` a
      thread per query block. Timed on the H200 with the call's first un-swizzle (a gather
      costing about 2.6 ms a call), whose removal should leave it level with the atomics
      (docs/performance.md "dQ by bulk reductions").

    - ``block_m``: rows of the streaming tiles (query rows in the dK/dV kernel, keys in the
      dQ kernel), 64 or 128; 128 halves the fixed costs of a tile (the ring's waits, the
      turns, the products' waits, the LSE and D copies) against its products, and takes 64
      registers a thread for each of S^T and dP^T: head_dim 64 only, with ``dq_separate``,
      and with ``ring`` and two warpgroups (the others spill 8-20 bytes a thread under ptxas
      13.0). The default at head_dim 64: on an H100 1.17-1.21x the two-stage kernels, where
      64-row tiles through the same ring gained 1.01-1.03x (docs/performance.md).

    Fixed by the design: 64 keys (query rows in the dQ kernel) a warpgroup, the whole
    head_dim in one block. Compute capability 9.x; head_dim 64 or 128 (as padded).
    """

    num_warps: int = config.knob(8, backward_sm90.NUM_WARPS)
    stages: int = config.knob(2, (1, 2, 3))
    pack_first: bool = config.knob(False, (False, True))
    dq_separate: bool = config.knob(True, (True, False))
    dq_bulk: bool = config.knob(True, (True, False))
    ring: bool = config.knob(False, (False, True))
    pingpong: bool = config.knob(False, (False, True))
    tma: bool = config.knob(False, (False, True))
    block_m: int = config.knob(backward_sm90.BLOCK_M, backward_sm90.BLOCK_MS)

    family: ClassVar[str] = "wgmma-backward"
    USER_MODS: ClassVar[bool] = True  # backward.user_element_function
    ROLE: ClassVar[str] = "backward"
    HARDWARE: ClassVar[str] = "wgmma"
    # 2: dQ by bulk reductions; 3: the leaner tile loader; 4: gradients written a 32-bit pair
    # at a time, the ring's slots filled through one function (TMA or cp.async); 5: with tma,
    # LSE and D copied in bulk with the tiles; 6: no mask tests in warps that see every pair
    REVISION: ClassVar[int] = 6
    head_split: ClassVar[int] = 1

    def shared_memory_bytes(self, head_dim):
        """The swizzled K, V, stage (and dS) tiles (kernels/backward_sm90.py), alignment
        included."""
        return backward_sm90.shared_memory_layout(
            head_dim, self.num_warps, self.stages, self.dq_separate, self.dq_bulk, self.ring,
            self.tma, self.block_m,
        )[-1]  # fmt: skip

    def dq_planes(self, head_dim):
        """One plane of dQ's columns a warpgroup, with ``ring`` one per 32 columns
        (kernels/backward_sm90.bulk_dq)."""
        if self.dq_separate or not self.dq_bulk:
            return 0
        return backward_sm90.dq_planes(head_dim, self.num_warps, self.ring)

    def problems(self, head_dim, device):
        out = config._out_of_choices(self)
        if out:
            return out
        if device is not None and not device.has_wgmma:
            out.append(
                f"the wgmma backward needs compute capability 9.x; {device.name} is {device.arch}"
            )
        if head_dim not in backward_sm90.HEAD_DIMS:
            dims = " or ".join(map(str, backward_sm90.HEAD_DIMS))
            out.append(f"the wgmma backward takes head_dim {dims} (as padded), not {head_dim}")
        if self.ring != (self.stages == 3):
            out.append("ring=True takes stages=3, and stages=3 needs ring=True")
        if self.pingpong and not (self.ring and self.num_warps == 8):
            out.append("pingpong=True needs ring=True and num_warps=8 (two warpgroups)")
        if self.tma and not self.ring:
            out.append("tma=True needs ring=True (the ring's slots are what TMA fills)")
        if self.ring and not self.dq_separate and not (self.pingpong and self.dq_bulk):
            # the dS tiles both warpgroups' dQ products read are rewritten every other query
            # block: only the pingpong turns order that (backward_sm90.ring_query_block_step)
            out.append("ring=True with dq_separate=False needs pingpong=True and dq_bulk=True")
        if self.block_m != backward_sm90.BLOCK_M and not (
            head_dim == 64 and self.dq_separate and self.ring and self.num_warps == 8
        ):
            # S^T and dP^T of 128 queries take 128 registers a thread beside dK and dV (the
            # block-barrier kernels and one warpgroup's ring spill); dQ's products in the
            # dK/dV kernel cover 64 query rows
            out.append(
                "block_m=128 needs head_dim 64 (as padded), dq_separate=True, ring=True and "
                "num_warps=8"
            )
        if head_dim == 128 and self.num_warps == 4 and not self.dq_separate:
            # one warpgroup holds dQ's 128 columns beside dK and dV: ptxas spills 148 bytes
            out.append("dq_separate=False at head_dim 128 needs num_warps=8 (registers)")
        if not out:
            # the static LSE and D tiles (a copy a warpgroup with ring; with tma one, of
            # 4 rows more a stage, 16-byte aligned) and ring's mbarriers
            copies = self.num_warps // 4 if self.ring and not self.tma else 1
            rows = self.block_m + (backward.STAT_COPY_EXTRA if self.tma else 0)
            smem = self.shared_memory_bytes(head_dim) + 8 * self.stages * rows * copies
            smem += 32 if self.tma else 0
            smem += 16 * self.stages if self.ring else 0
            out += config._dynamic_shared_problems(smem, device)
        return out


# -- selection: default and rule -------------------------------------------------------------


@selection.default_for(WgmmaBackwardConfig)
def default_wgmma_backward_config(head_dim):
    """Two warpgroups taking turns (pingpong), the streaming tiles through the ring filled by
    TMA (docs/performance.md, "The ring's slots filled by TMA": the same bits, 1.04-1.11x the
    two-stage kernels at head_dim 128 on an H100). At head_dim 64 (as padded) 128-row tiles:
    the same bits, 1.17-1.21x the two-stage kernels on an H100, where 64-row ones gained
    0.99-1.02x (docs/performance.md, "128-row tiles at head_dim 64")."""
    if head_dim == 64:
        return WgmmaBackwardConfig(8, 3, ring=True, pingpong=True, tma=True, block_m=128)
    return WgmmaBackwardConfig(num_warps=8, stages=3, ring=True, pingpong=True, tma=True)


#: fits() by (head_dim as padded, device).
_fits = {}


@selection.backward_rule(WgmmaBackwardConfig)
def fits(problem, device):
    """Whether the Hopper backward's default tiles run ``problem``'s head_dim on ``device``
    (worked out once per pair: a configuration's construction and feasibility check cost a
    fifth of a backward call's Python on stand-ins, tools/full_path_cost.py)."""
    head_dim = config.tensor_core_backward_head_dim(problem.head_dim)
    found = _fits.get((head_dim, device))
    if found is None:
        found = device.has_wgmma and not WgmmaBackwardConfig().problems(head_dim, device)
        _fits[head_dim, device] = found
    return found


# -- launch -------------------------------------------------------------------------------------


@launch.launches(WgmmaBackwardConfig)
def _wgmma_backward(cfg, p, *tensors, offsets=None, variant=()):
    def kernels(head_dim, varlen, tma):
        def build(tma=False):
            return backward_sm90.build_kernels(
                head_dim, p.dtype, cfg.num_warps, cfg.stages, softcap=p.softcap, alibi=p.alibi,
                pack_first=cfg.pack_first, dq_separate=cfg.dq_separate, mods=p.mods,
                dq_bulk=cfg.dq_bulk, ring=cfg.ring, pingpong=cfg.pingpong, tma=tma,
                block_m=cfg.block_m,
            )  # fmt: skip

        return launch._tensor_core_launchers(
            WgmmaBackwardConfig, build, head_dim, p, cfg, varlen, tma
        )

    maps = functools.partial(_tensor_maps, p, cfg.block_m) if cfg.tma else None
    launch.tensor_core_backward(
        cfg, kernels, p, *tensors, offsets=offsets, variant=variant, maps=maps
    )


def _tensor_maps(p, rows, q, k, v, do):
    """((Q's, dO's), (K's, V's)) tensor-map templates, boxes of ``rows`` (block_m) rows by 64
    columns (the ring's tiles: launch.tensor_core_backward), or None where the arrays'
    addresses or strides rule tensor maps out (the kernels then load by cp.async)."""
    templates = ptx_tma.templates(p.dtype, (q, do, k, v), (rows,) * 4)
    return None if templates is None else (templates[:2], templates[2:])
