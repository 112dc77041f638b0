"""The Hopper forward (numflash/kernels/forward_sm90.py) against the float64 reference, in every
schedule: every thread loading, a producer warpgroup loading by cp.async or by TMA, two consumer
warpgroups taking turns.

In the simulator ptx_sm90's Python wgmma, mbarriers and named barriers run the kernel's own
source (small shapes: every thread is a Python thread); on a GPU of compute capability 9.x the
same cases and the awkward sizes, head dims and masks below; elsewhere these skip.
"""

import numpy as np
import pytest
from support import (
    assert_matches_reference,
    packed_qkv,
    poisoned_like,
    random_qkv,
    to_numpy,
    xp,
)

import numflash
from numflash import selection
from numflash.config import WgmmaForwardConfig
from numflash.device import SIMULATED_DEVICE, DeviceInfo, current_device
from numflash.families import wgmma_forward
from numflash.kernels.jit import SIMULATOR

W = WgmmaForwardConfig
MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(37, 5))}

#: (dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask, config)
CASES = [
    ("float16", 1, 70, 150, 2, 1, 64, "causal", W(1, 64, 2, False, False, tma=False)),
    ("bfloat16", 1, 40, 200, 1, 1, 40, "window", W(1, 64, 2, producer=True, pingpong=False)),
    ("float16", 1, 130, 97, 1, 1, 64, "causal", W(2, 64, 3, producer=True, pingpong=True)),
    ("bfloat16", 1, 50, 90, 2, 1, 64, "none", W(1, 64, 2, pingpong=False, tma=False)),
    # a tile of 112 keys (shipped in numflash/configs/sm_90.json): tiles that 16-key steps
    # fill unevenly against 64-row blocks, the last one partial
    ("bfloat16", 1, 60, 250, 1, 1, 64, "causal", W(1, 112, 2, pingpong=False)),
]
if not SIMULATOR:
    CASES += [
        (dtype, 2, sq, sk, 4, hk, hd, mask, cfg)
        for dtype, (sq, sk), hk, hd, mask, cfg in [
            ("float16", (113, 1023), 2, 128, "causal", W()),
            ("bfloat16", (1023, 203), 1, 128, "causal", W(2, 64, 4)),
            ("float16", (1, 777), 4, 64, "none", W(2, 128, 4)),
            ("bfloat16", (777, 777), 2, 64, "window", W(2, 128, 2, pingpong=False)),
            ("float16", (300, 1000), 2, 256, "causal", W(2, 64, 2, False, False, False)),
            ("float16", (203, 203), 4, 96, "none", W(2, 128, 3, False, False, False)),
            ("bfloat16", (64, 300), 2, 32, "window", W(1, 128, 3, pingpong=False)),
            ("float16", (500, 500), 2, 192, "causal", W(2, 64, 2, False, False, False)),
            ("float16", (129, 4097), 1, 128, "causal", W(2, 128, 3)),
            ("bfloat16", (1000, 1000), 2, 128, "none", W(2, 128, 2, tma=False)),
            ("float16", (257, 1500), 4, 96, "window", W(2, 128, 2)),
            ("bfloat16", (700, 333), 1, 64, "causal", W(3, 64, 2, pingpong=False)),
            ("bfloat16", (1000, 3001), 2, 128, "none", W(2, 112, 2)),  # sm_90.json's
            # sm_90.json's head_dim 64 entries at seqlen 4096 (160-key tiles, the last of
            # 3001 keys partial) and its head_dim 256 entry with part of the exp2 on FMA units
            ("float16", (1000, 3001), 2, 64, "none", W(2, 160, 2, pingpong=False)),
            ("bfloat16", (999, 3001), 1, 64, "causal", W(2, 160, 2, pingpong=False)),
            ("float16", (700, 1500), 2, 256, "causal", W(2, 64, 2, pingpong=False, fma_exp2=1)),
        ]
    ]


def _wgmma_or_skip(cfg, head_dim):
    device = current_device()
    if not device.has_wgmma:
        pytest.skip("the Hopper forward needs compute capability 9.x")
    problems = cfg.problems(head_dim, device)
    assert not problems, problems  # the cases are meant to run


@pytest.mark.parametrize(
    "dtype,batch,seqlen_q,seqlen_k,nheads,nheads_k,head_dim,mask,cfg",
    [
        pytest.param(*c, id=f"{c[0]}-q{c[2]}-k{c[3]}-d{c[6]}-{c[7]}-{i}")
        for i, c in enumerate(CASES)
    ],
)
def test_hopper_forward_matches_reference(
    dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask, cfg
):
    _wgmma_or_skip(cfg, head_dim)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    out = poisoned_like(q)
    res, lse = numflash.attention(q, k, v, out=out, return_lse=True, config=cfg, **MASKS[mask])
    assert res is out
    assert_matches_reference(q, k, v, out, lse, **MASKS[mask])


def test_hopper_forward_over_a_packed_batch_matches_each_sequence():
    """attention_varlen with the Hopper kernel: empty, one-row and longer sequences (one
    consumer warpgroup in the simulator, whose threads are Python threads)."""
    cfg = W(1, 64, 2, pingpong=False) if SIMULATOR else W(2, 64, 2)
    _wgmma_or_skip(cfg, 64)
    lengths = [37, 0, 70, 1] if SIMULATOR else [37, 0, 900, 1, 1023, 64]
    heads, kv_heads = (2, 1) if SIMULATOR else (4, 2)
    q, k, v, offsets, _ = packed_qkv(lengths, lengths, heads, kv_heads, 64, "float16")
    cu = to_numpy(offsets)
    out, lse = numflash.attention_varlen(
        q, k, v, offsets, offsets, max(lengths), max(lengths), causal=True, return_lse=True,
        out=poisoned_like(q), config=cfg,
    )  # fmt: skip
    for i, n in enumerate(lengths):
        if n:
            s = slice(int(cu[i]), int(cu[i + 1]))
            assert_matches_reference(
                q[None, s], k[None, s], v[None, s], out[None, s], lse[None, :, s], causal=True
            )


@pytest.mark.parametrize("tma", [True, False])
def test_a_packed_sequence_never_sees_the_next_one_s_rows(tma):
    """NaN in every row of the second sequence's V: the first sequence's outputs stay finite
    and exact, though its last key tile reaches into the second's rows (by TMA: a box over the
    packed rows)."""
    cfg = W(1, 64, 2, pingpong=False, tma=tma)
    _wgmma_or_skip(cfg, 64)
    lengths = [37, 70]
    q, k, v, offsets, _ = packed_qkv(lengths, lengths, 2, 2, 64, "bfloat16")
    v_host = to_numpy(v)
    v_host[37:] = np.nan
    v = xp.asarray(v_host)
    out, lse = numflash.attention_varlen(
        q, k, v, offsets, offsets, 70, 70, return_lse=True, out=poisoned_like(q), config=cfg
    )
    s = slice(0, 37)
    assert np.isfinite(to_numpy(out[s]).astype(np.float32)).all()
    assert_matches_reference(q[None, s], k[None, s], v[None, s], out[None, s], lse[None, :, s])


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="the simulator runs the blocks one after another")
def test_hopper_forward_repeats_bitwise():
    """Each output element is summed by one thread in key order: twenty runs, one result."""
    cfg = W()
    _wgmma_or_skip(cfg, 128)
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, 128, "bfloat16")
    first = numflash.attention(q, k, v, causal=True, config=cfg)
    for _ in range(20):
        again = numflash.attention(q, k, v, causal=True, config=cfg)
        assert bool((again.view(np.uint16) == first.view(np.uint16)).all())


H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 232448, 1024)
A100 = DeviceInfo("NVIDIA A100", (8, 0), 108, 166912, 1024)


def _problem(head_dim, dtype="float16"):
    q, k, v = random_qkv(1, 8, 8, 1, 1, head_dim, dtype)
    return numflash.validation.problem(q, k, v, False, None, (-1, -1))[-1]


@pytest.mark.parametrize("head_dim", [64, 128, 256, 60, 124])
def test_hopper_forward_is_chosen_on_hopper_at_its_head_dims(head_dim):
    """fp16/bf16 on compute capability 9.x at head dims 64, 128 and 256 (as padded to 8):
    the wgmma family and its default; elsewhere the mma.sync kernel."""
    p = _problem(head_dim)
    assert selection.forward_family(p, H200) == WgmmaForwardConfig.family
    cfg = selection.forward(p, H200).config
    assert isinstance(cfg, WgmmaForwardConfig)
    assert not cfg.problems(cfg.kernel_head_dim(head_dim), H200)


@pytest.mark.parametrize(
    "device,head_dim,dtype,chosen",
    [
        (H200, 96, "float16", numflash.TensorCoreConfig),
        (H200, 32, "bfloat16", numflash.TensorCoreConfig),
        (H200, 128, "float32", numflash.PortableConfig),
        (A100, 128, "float16", numflash.TensorCoreConfig),
    ],
)
def test_other_forward_calls_keep_their_family(device, head_dim, dtype, chosen):
    cfg = selection.forward(_problem(head_dim, dtype), device).config
    assert isinstance(cfg, chosen)


def test_the_simulator_runs_the_hopper_forward_only_when_asked():
    p = _problem(128)
    assert selection.forward_family(p, SIMULATED_DEVICE) != WgmmaForwardConfig.family


@pytest.mark.parametrize(
    "cfg,message",
    [
        (W(consumers=1, pingpong=True), "pingpong=True takes consumers=2 and producer=True"),
        (W(producer=False), "pingpong=True takes consumers=2 and producer=True"),
        (W(consumers=3, block_n=128, pingpong=False), "fragment registers"),
        (W(block_n=192, stages=5), "shared memory"),
    ],
)
def test_impossible_schedules_are_refused_by_name(cfg, message):
    assert any(message in p for p in cfg.problems(128, H200))


def test_the_hopper_forward_is_refused_before_hopper():
    problems = W().problems(128, A100)
    assert any("compute capability 9.x" in p for p in problems)
    q, k, v = random_qkv(1, 8, 8, 1, 1, 128, "float16")
    if not current_device().has_wgmma:
        with pytest.raises(ValueError, match="compute capability 9.x"):
            numflash.attention(q, k, v, config=W())


def test_tensor_maps_are_made_once_per_geometry_and_refused_where_strides_do_not_fit():
    """The Hopper forward's TMA templates (numflash.launch): one set per (dtype, tiles, shapes,
    strides), holding the tiles' boxes; arrays whose strides are not multiples of 16 bytes get
    none (the kernel then loads by cp.async). Only the launch builder's inputs reach here, and
    it copies arrays with such strides first: the refusal is the guard behind that copy."""
    from numflash import validation
    from numflash.kernels import ptx_tma

    q = xp.zeros((2, 40, 4, 64), np.float16)
    k = xp.zeros((2, 70, 2, 64), np.float16)
    p = validation.problem(q, k, k, False, None, (-1, -1))[-1]
    cfg = W(2, 128, 2)
    buffer, templates = wgmma_forward._tensor_maps(cfg, p, q, k, k)
    assert buffer.shape == (3 * ptx_tma.MAP_WORDS,) and len(templates) == 3
    assert wgmma_forward._tensor_maps(cfg, p, q.copy(), k.copy(), k.copy())[1] is templates
    if SIMULATOR:  # the simulator's own encoding: rank, dims (5), outer strides (4), box (5)
        assert templates[0][:15] == (4, 64, 40, 4, 2, 1, 256, 64, 10240, 0, 64, 128, 1, 1, 1)
        assert templates[1][11:12] == (128,)
    wide = xp.zeros((2, 70, 2, 68), np.float16)[..., :64]  # rows 136 bytes apart
    assert wgmma_forward._tensor_maps(cfg, p, q, wide, wide) is None


def test_grouped_tensor_maps_describe_only_pages_page_size_rows_apart():
    """A paged cache's 5-D maps whose boxes copy a page's rows of every atom (the tiles in
    8-row groups: forward_sm90.grouped_pages): made where head_dim is whole atoms and the
    pages are page_size rows apart (8-row groups numbered across pages); None for a cache
    whose pages lie further apart (every other page of a larger array), a head_dim of part of
    an atom, or pages of rows not a multiple of 8 (those keep a box a page and atom)."""
    from numflash.kernels import forward_sm90, ptx_tma

    pages = xp.zeros((6, 16, 2, 128), np.float16)
    (k_map,) = ptx_tma.grouped_templates("float16", (pages,), 16)
    if SIMULATOR:  # 64 columns, 8 rows, 2 atoms, 2 heads, 12 groups; box (64, 8, 2, 1, 2)
        assert k_map[:15] == (5, 64, 8, 2, 2, 12, 256, 64, 128, 2048, 64, 8, 2, 1, 2)
    apart = xp.zeros((6, 32, 2, 128), np.float16)[:, :16]
    assert ptx_tma.grouped_templates("float16", (pages, apart), 16) is None
    assert ptx_tma.grouped_templates("float16", (pages[..., :96],), 16) is None
    assert (
        ptx_tma.grouped_templates("float16", (xp.zeros((6, 12, 2, 128), np.float16),), 12) is None
    )
    assert not forward_sm90.grouped_pages(64, 16, 128)  # one atom: the layouts are the same
    assert forward_sm90.grouped_pages(128, 16, 128) and not forward_sm90.grouped_pages(96, 16, 128)


def _dense_problem(batch, seqlen_q, seqlen_k, nheads, head_dim, window=(-1, -1), causal=False):
    return numflash.validation.Problem(
        batch, seqlen_q, seqlen_k, nheads, nheads, head_dim, "float16", 1.0,
        *numflash.validation.check_window(window, causal),
    )  # fmt: skip


def _alternating_order(tiles, blocks):
    """work_order's format for the rounds of ``blocks`` tiles alternating in direction, worked
    out here as forward_sm90.ranked does: block x takes tile x, then 2 blocks - 1 - x, ..."""
    mine = [[] for _ in range(blocks)]
    for start in range(0, tiles, blocks):
        for x in range(blocks):
            rank = start + (blocks - 1 - x if (start // blocks) % 2 else x)
            if rank < tiles:
                mine[x].append(rank)
    offsets = np.cumsum([0] + [len(m) for m in mine])
    return np.concatenate([offsets, *mine]).astype(np.int32)


def _makespan(order, cost, blocks):
    """The most work a block of ``order`` gets, each tile costing ``cost[rank]``."""
    offsets, ranks = order[: blocks + 1], order[blocks + 1 :]
    return max(cost[ranks[offsets[x] : offsets[x + 1]]].sum() for x in range(blocks))


@pytest.mark.parametrize(
    "batch,seqlen,nheads,head_dim,block_n,causal,window",
    [
        (2, 16384, 8, 256, 64, True, (-1, -1)),  # sections of one pair: 128 tiles, 132 blocks
        (32, 1024, 8, 256, 64, True, (-1, -1)),
        (8, 4096, 16, 128, 128, False, (-1, -1)),
        (8, 4096, 32, 64, 192, False, (255, 0)),
        (1, 300, 3, 64, 128, True, (-1, -1)),  # fewer tiles than blocks: a tile a block
    ],
)
def test_the_work_order_gives_every_tile_once_and_balances_the_blocks(
    batch, seqlen, nheads, head_dim, block_n, causal, window
):
    """work_order: each tile's rank exactly once, a block's in rank order (the rounds'
    order, which keeps the tiles in flight together in L2), and no block's model cost
    (key tiles under the mask, plus TILE_OVERHEAD) above 1.07x the balanced share where the
    static alternation it replaced reached 1.53x (head_dim 256, 16384 keys, causal)."""
    p = _dense_problem(batch, seqlen, seqlen, nheads, head_dim, window, causal)
    # H200: half of its 50 MiB of L2 over a (batch, head) pair's keys and values
    section = max(1, min(25 * 2**20 // (4 * seqlen * head_dim), batch * nheads))
    m_blocks = -(-seqlen // 128)
    tiles = m_blocks * batch * nheads
    blocks = min(132, tiles)
    order = wgmma_forward.work_order(p, 128, block_n, section, blocks)
    if order is wgmma_forward.ALTERNATING:  # the kernel's own rounds: as a list, to check
        order = _alternating_order(tiles, blocks)
    assert order.dtype == np.int32 and order.shape == (blocks + 1 + tiles,)
    offsets, ranks = order[: blocks + 1], order[blocks + 1 :]
    assert offsets[0] == 0 and offsets[-1] == tiles and (np.diff(offsets) >= 0).all()
    assert sorted(ranks) == list(range(tiles))
    for x in range(blocks):
        mine = ranks[offsets[x] : offsets[x + 1]]
        assert (np.diff(mine) > 0).all()
    # the model's costs, worked out here row by row
    rank = np.arange(tiles)
    sec = rank // (section * m_blocks)
    width = np.minimum(section, batch * nheads - sec * section)
    m_block = m_blocks - 1 - (rank - sec * section * m_blocks) // width
    seen = []  # key tiles a row block sees: the rows' keys [lo, hi) (mask.py) slide together
    for mb in range(m_blocks):
        first, last = seqlen, 0
        for row in range(mb * 128, min(mb * 128 + 128, seqlen)):
            lo = max(row - p.window_left, 0) if p.window_left >= 0 else 0
            hi = min(row + p.window_right + 1, seqlen) if p.window_right >= 0 else seqlen
            if hi > lo:
                first, last = min(first, lo // block_n), max(last, -(-hi // block_n))
        seen.append(max(last - first, 0))
    cost = np.array(seen)[m_block] + wgmma_forward.TILE_OVERHEAD
    if tiles > blocks:
        np.testing.assert_array_equal(wgmma_forward.tile_costs(p, 128, block_n, section), cost)
    ideal = max(cost.sum() / blocks, cost.max())
    span = _makespan(order, cost, blocks)
    assert span <= 1.07 * ideal
    assert span <= _makespan(_alternating_order(tiles, blocks), cost, blocks)


def test_a_persistent_launch_over_several_blocks_follows_its_work_order(monkeypatch):
    """Four blocks of a persistent dense launch (a multiprocessor each) over 12 causal work
    tiles, each block going through the tiles a listed work order gives it, in an uneven
    split that no rounds would make (work_order's own choice hangs on the GPU's L2, through
    the section): the result is the reference's."""
    from numflash import launch

    monkeypatch.setattr(launch, "_multiprocessors", lambda: 4)
    owner = np.array([3, 1, 0, 2, 2, 0, 1, 3, 0, 0, 2, 1])  # block of each tile, by rank
    listed = wgmma_forward.listed_order(owner, 4)
    monkeypatch.setattr(wgmma_forward, "work_order", lambda *args: listed)
    cfg = W(1, 64, 2, pingpong=False)
    _wgmma_or_skip(cfg, 64)
    q, k, v = random_qkv(2, 150, 150, 2, 1, 64, "float16")
    out = poisoned_like(q)
    wgmma_forward._orders.clear()
    res, lse = numflash.attention(q, k, v, out=out, return_lse=True, config=cfg, causal=True)
    assert res is out
    assert_matches_reference(q, k, v, out, lse, causal=True)
    (order,) = wgmma_forward._orders.values()  # the launch's: 12 tiles over 4 blocks
    np.testing.assert_array_equal(to_numpy(order), listed)
    wgmma_forward._orders.clear()


def test_the_kernel_s_own_rounds_where_the_order_gains_too_little():
    """A tile a block, and rounds whose costs are alike (no mask): ALTERNATING, for which the
    kernel works out its tiles itself."""
    for batch, causal, seqlen in ((2, True, 300), (8, False, 4096)):
        p = _dense_problem(batch, seqlen, seqlen, 16, 128, causal=causal)
        order = wgmma_forward.work_order(p, 128, 128, 12, 132)
        assert order is wgmma_forward.ALTERNATING


def _packed_order_model(cu_q, cu_k, m_blocks, nheads, section, blocks, max_q, max_k, block_m,
                        block_n, window):  # fmt: skip
    """kernels/work_order.py's order, worked out here: the (sequence, row block) slots with
    rows, a sequence's together, the sequences costliest first (key tiles their last row
    block sees plus TILE_OVERHEAD; then by sequence), each sequence's row blocks last first,
    each slot's heads next to each other, dealt in rounds of ``blocks`` whose direction
    alternates; as the kernel writes it (the blocks' list starts, then each block's tiles)."""
    batch, (left, right) = len(cu_q) - 1, window
    slots = []
    for b in range(batch):
        q0 = min(max(cu_q[b], 0), cu_q[-1])
        rows = min(min(max(cu_q[b + 1], q0), cu_q[-1]) - q0, max_q)
        k0 = min(max(cu_k[b], 0), cu_k[-1])
        keys = min(min(max(cu_k[b + 1], k0), cu_k[-1]) - k0, max_k)
        if rows <= 0:
            continue
        m = (rows - 1) // block_m  # the last row block: the sequence's sort key
        first, last, shift = m * block_m, min(m * block_m + block_m, rows) - 1, keys - rows
        hi = keys if right < 0 else min(keys, last + shift + right + 1)
        lo = 0 if left < 0 else max(0, first + shift - left)
        seen = -(-hi // block_n) - lo // block_n if hi > lo else 0
        cost = seen + int(wgmma_forward.TILE_OVERHEAD)
        slots += [(-cost, b, -m) for m in range(m + 1)]
    lists = [[] for _ in range(blocks)]
    pairs = nheads * batch
    for j, (_, b, m) in enumerate((s for s in sorted(slots) for _ in range(nheads))):
        m = -m
        pair = b * nheads + j % nheads
        sec = pair // section
        width = min(section, pairs - sec * section)
        rank = sec * section * m_blocks + (m_blocks - 1 - m) * width + pair - sec * section
        turn, within = divmod(j, blocks)
        lists[within if turn % 2 == 0 else blocks - 1 - within].append(rank)
    starts = np.cumsum([0] + [len(x) for x in lists])
    return np.concatenate([starts, *lists]).astype(np.int32)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (40, 0), (30, 20)])
def test_a_packed_batch_s_device_work_order_follows_the_model(window):
    """kernels/work_order.py against its model: the tiles with rows, each once, a sequence's
    together, the costliest sequences first, dealt to the blocks in alternating rounds; empty
    sequences, a longer key side, sections of several pairs; nothing written past the order."""
    from numflash.families.wgmma_forward import WORK_ORDER
    from numflash.kernels import work_order

    rng = np.random.default_rng(sum(window) + 7)
    for blocks, section in ((1, 1), (3, 2), (5, 4)):
        rows = rng.integers(0, 300, 5)
        rows[1] = 0
        keys = rows + rng.integers(0, 60, 5)
        cu_q = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(keys)]).astype(np.int32)
        block_m, block_n, nheads = 64, 48, 3
        max_q, max_k = int(rows.max()), int(keys.max())
        m_blocks = -(-max_q // block_m)
        expected = _packed_order_model(cu_q, cu_k, m_blocks, nheads, section, blocks, max_q,
                                       max_k, block_m, block_n, window)  # fmt: skip
        order = xp.full((blocks + 1 + 5 * m_blocks * nheads,), -7, dtype=np.int32)
        scalars = (5, m_blocks, nheads, section, blocks, int(cu_q[-1]), int(cu_k[-1]), max_q,
                   max_k, block_m, block_n, *window, int(wgmma_forward.TILE_OVERHEAD))  # fmt: skip
        views = {"cu_q": (xp.asarray(cu_q),), "cu_k": (xp.asarray(cu_k),), "order": (order,)}
        work_order.build(64, 16)[1, 16](*WORK_ORDER.args(views, scalars))
        got = to_numpy(order)
        np.testing.assert_array_equal(got[: len(expected)], expected)
        assert (got[len(expected) :] == -7).all()


def test_a_packed_batch_takes_the_device_order_where_it_was_timed_to_pay():
    """The device order by default: for a batch without a mask or window whose tiles with
    rows may fill PACKED_ORDER_ROUNDS rounds of the launch's blocks; not under a causal mask
    or a window (not yet timed), nor for fewer rounds, nor past the sort's slots or the
    order's tiles."""
    from types import SimpleNamespace

    pays = wgmma_forward.device_order_pays
    full, causal = (
        SimpleNamespace(window_left=-1, window_right=-1),
        SimpleNamespace(window_left=-1, window_right=0),
    )
    window = SimpleNamespace(window_left=128, window_right=-1)
    busy = 132 * wgmma_forward.PACKED_ORDER_ROUNDS
    assert pays(full, 960, 15360, busy, 132)
    assert not pays(full, 960, 15360, busy - 1, 132)  # the tiles with rows too few
    assert not pays(causal, 960, 15360, busy, 132) and not pays(window, 960, 15360, busy, 132)
    assert not pays(full, wgmma_forward.PACKED_ORDER_SLOTS + 1, 15360, busy, 132)
    assert not pays(full, 960, wgmma_forward.PACKED_ORDER_TILES + 1, busy, 132)


def _device_order_on(monkeypatch, blocks):
    """A persistent launch of ``blocks`` blocks (a multiprocessor each) with the packed
    batch's device order on; the list each of its calls' orders is appended to."""
    from numflash import launch

    monkeypatch.setattr(launch, "_multiprocessors", lambda: blocks)
    monkeypatch.setattr(wgmma_forward, "DEVICE_PACKED_ORDER", True)
    monkeypatch.setattr(wgmma_forward, "DEVICE_PACKED_ORDER_MASKED", True)
    monkeypatch.setattr(wgmma_forward, "PACKED_ORDER_ROUNDS", 1)
    made, making = [], wgmma_forward._packed_work_order
    monkeypatch.setattr(wgmma_forward, "_packed_work_order",
                        lambda *args: made.append(making(*args)) or made[-1])  # fmt: skip
    return made


def test_a_packed_persistent_launch_over_several_blocks_takes_its_device_order(monkeypatch):
    """Three blocks of a persistent launch over a packed batch (a multiprocessor each) go
    through the order the device made; with too many slots for that order, through the
    alternating rounds over every slot: both the reference's."""
    from numflash import launch, plans

    made = _device_order_on(monkeypatch, 3)
    cfg = W(1, 64, 2, pingpong=False)
    _wgmma_or_skip(cfg, 64)
    lengths = [70, 0, 130, 5] if SIMULATOR else [700, 0, 1300, 5, 4000, 64]
    q, k, v, offsets, _ = packed_qkv(lengths, lengths, 2, 1, 64, "bfloat16")
    cu = to_numpy(offsets)
    for slots in (wgmma_forward.PACKED_ORDER_SLOTS, 2):
        monkeypatch.setattr(wgmma_forward, "PACKED_ORDER_SLOTS", slots)
        monkeypatch.setattr(numflash.api, "_plans", plans.PlanCache())  # no replay of the
        launch._prepared.clear()  # first round's launches: each round builds its own
        out, lse = numflash.attention_varlen(
            q, k, v, offsets, offsets, max(lengths), max(lengths), window_size=(90, 0),
            return_lse=True, out=poisoned_like(q), config=cfg,
        )  # fmt: skip
        for i, n in enumerate(lengths):
            if n:
                s = slice(int(cu[i]), int(cu[i + 1]))
                assert_matches_reference(q[None, s], k[None, s], v[None, s], out[None, s],
                                         lse[None, :, s], window_size=(90, 0))  # fmt: skip
    listed, alternating = made
    assert to_numpy(listed)[0] == 0 and to_numpy(alternating).tolist() == [-1]


def test_blocks_the_device_order_leaves_without_a_tile_just_finish(monkeypatch):
    """More blocks than tiles with rows (the slots past the sequences' ends left out of the
    order): the blocks whose lists are empty finish at once, the others give the reference."""
    made = _device_order_on(monkeypatch, 5)
    cfg = W(1, 64, 2, pingpong=False)
    _wgmma_or_skip(cfg, 64)
    lengths = [130, 0, 0, 0, 0]  # 15 slots of 64 rows, 3 with rows
    q, k, v, offsets, _ = packed_qkv(lengths, lengths, 1, 1, 64, "float16")
    out, lse = numflash.attention_varlen(
        q, k, v, offsets, offsets, 130, 130, causal=True, return_lse=True,
        out=poisoned_like(q), config=cfg,
    )  # fmt: skip
    assert to_numpy(made[0])[:6].tolist() == [0, 1, 2, 3, 3, 3]  # blocks 3 and 4: no tile
    assert_matches_reference(q[None], k[None], v[None], out[None], lse[None], causal=True)
