"""A small matrix of attention calls over every kernel family, for compute-sanitizer on a GPU.

    NUMFLASH_LINEINFO=1 compute-sanitizer --tool memcheck --report-api-errors no \\
        python tests/sanitizer_cases.py
    NUMFLASH_LINEINFO=1 compute-sanitizer --tool racecheck --report-api-errors no \\
        python tests/sanitizer_cases.py

Each case runs a forward and a backward with the configurations it names (None: numflash's
choice) and checks both against the reference. Families: tensor-core and portable forward;
mma.sync (atomic dQ and the dQ kernel, head_dim split over two blocks), wgmma (where the GPU
has it) and portable backward; tensor-core and portable KV-cache kernels over paged and
contiguous caches with appends; the packed (varlen) kernels, forward and backward (portable,
mma.sync and wgmma), also over device offsets that lie; the Hopper forward in each schedule,
and over KV caches (chunked prefill, hostile lengths and pages included); a user's score_mod
and mask_mod. ``--family NAME`` runs the cases of one family (``varlen`` for the packed ones,
``persistent`` for the Hopper forward's listed work orders, ``mods`` for the user functions);
``--match TEXT`` only the listed cases whose repr holds TEXT (nothing else);
``--kvcache-only`` only its KV-cache cases (for the Hopper forward: chunked prefill, hostile
lengths and pages included).

CuPy's memory pool would hide small overruns inside pooled blocks, so it is switched off: every
array is its own allocation.
"""

import sys
import types
from typing import NamedTuple

import cupy

cupy.cuda.set_allocator(None)

import numpy as np  # noqa: E402

import numflash  # noqa: E402
from numflash import launch  # noqa: E402
from numflash.device import current_device  # noqa: E402
from numflash.families import wgmma_forward  # noqa: E402
from numflash.reference import Variants  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import test_kvcache  # noqa: E402
import test_varlen  # noqa: E402
from support import (  # noqa: E402
    assert_gradients_match,
    assert_matches_reference,
    packed_qkv,
    poisoned_like,
    random_array,
    random_qkv,
)
from test_kvcache import Case as KVCase  # noqa: E402
from test_kvcache import run_and_check  # noqa: E402


class Case(NamedTuple):
    dtype: str
    shape: tuple  # batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim
    mask: dict
    forward: object = None  # a forward configuration, or None
    backward: object = None  # a backward configuration, or None
    blocks: int = 0  # > 0: a persistent Hopper forward of this many blocks, over a listed order
    softcap: float = 0.0

    @property
    def family(self):
        return (self.backward or self.forward or numflash.TensorCoreConfig).family


TC = numflash.TensorCoreBackwardConfig
CASES = [
    # numflash's choices
    Case("float16", (1, 77, 130, 2, 1, 64), dict(causal=True)),
    Case("bfloat16", (2, 130, 77, 2, 2, 128), dict()),
    Case("float16", (1, 65, 65, 4, 2, 40), dict(window_size=(16, 8))),
    Case("bfloat16", (1, 33, 200, 2, 1, 256), dict(causal=True)),
    # forced forward tiles
    Case("float16", (1, 100, 100, 2, 1, 64), dict(), forward=numflash.TensorCoreConfig(128, 64, 4, 3, True)),
    Case(
        "float16",
        (1, 100, 100, 2, 1, 128),
        dict(causal=True),
        forward=numflash.TensorCoreConfig(128, 32, 4, 2, False),
    ),
    # portable forward and backward
    Case(
        "float32",
        (1, 70, 45, 2, 1, 96),
        dict(causal=True),
        numflash.PortableConfig(),
        numflash.PortableBackwardConfig(),
    ),
    # mma.sync backward: atomic dQ (two stages, one stage, split by columns), the dQ kernel,
    # head_dim split over two blocks, a left window alone (key blocks from the last)
    Case("float16", (1, 77, 130, 2, 1, 64), dict(causal=True), backward=TC(64, 8, 2, False)),
    Case("bfloat16", (2, 130, 77, 2, 2, 128), dict(), backward=TC(64, 8, 2, False)),
    Case("float16", (1, 65, 65, 4, 2, 40), dict(window_size=(16, 8)), backward=TC(16, 1, 1, False)),
    Case("bfloat16", (1, 200, 150, 2, 1, 96), dict(causal=True), backward=TC(32, 4, 2, False)),
    Case("float16", (2, 150, 201, 4, 2, 128), dict(causal=True), backward=TC(64, 8, 2, True)),
    Case("bfloat16", (1, 90, 70, 2, 1, 64), dict(window_size=(9, 4)), backward=TC(32, 2, 1, True)),
    Case("bfloat16", (1, 100, 180, 2, 1, 256), dict(causal=True), backward=TC(32, 4, 2, False, 2)),
    Case("float16", (1, 70, 90, 2, 2, 160), dict(), backward=TC(32, 4, 2, True, 2)),
    Case(
        "float16", (1, 90, 120, 2, 1, 64), dict(window_size=(20, -1)), backward=TC(32, 2, 2, True)
    ),
    # the Hopper backward: two warpgroups and one, both stage counts, head_dim 128 and 64
    Case(
        "float16", (2, 150, 201, 4, 2, 128), dict(causal=True), backward=numflash.WgmmaBackwardConfig(8, 2)
    ),
    Case(
        "bfloat16",
        (1, 90, 70, 2, 1, 64),
        dict(window_size=(9, 4)),
        backward=numflash.WgmmaBackwardConfig(4, 1),
    ),
    Case(
        "float16",
        (1, 90, 200, 2, 1, 128),
        dict(window_size=(20, -1)),
        backward=numflash.WgmmaBackwardConfig(8, 1),
    ),
    # the Hopper forward: every thread loading, a producer with cp.async, with TMA, with TMA
    # and pingpong; head_dim 64, 128, 256 and one padded to whole atoms
    Case("float16", (1, 150, 300, 4, 2, 128), dict(causal=True),
         forward=numflash.WgmmaForwardConfig(2, 128, 3, producer=False, pingpong=False, tma=False)),
    Case("bfloat16", (1, 200, 130, 2, 1, 64), dict(window_size=(40, 7)),
         forward=numflash.WgmmaForwardConfig(2, 128, 3, producer=True, pingpong=False, tma=False)),
    Case("float16", (2, 130, 260, 2, 2, 128), dict(),
         forward=numflash.WgmmaForwardConfig(2, 128, 2, producer=True, pingpong=True)),
    Case("float16", (1, 100, 180, 2, 1, 256), dict(causal=True),
         forward=numflash.WgmmaForwardConfig(2, 64, 2, producer=False, pingpong=False, tma=False)),
    Case("bfloat16", (1, 70, 90, 2, 1, 40), dict(),
         forward=numflash.WgmmaForwardConfig(1, 64, 2, producer=True, pingpong=False)),
    # a persistent launch of 5 blocks over 32 work tiles in a listed order (as
    # families.wgmma_forward.work_order makes where it pays), and the backward's A fragments
    # rounded before the wgmma fence
    Case("float16", (2, 500, 500, 4, 2, 256), dict(causal=True),
         forward=numflash.WgmmaForwardConfig(2, 64, 2, pingpong=False), blocks=5),
    Case("bfloat16", (2, 150, 201, 4, 2, 128), dict(causal=True),
         backward=numflash.WgmmaBackwardConfig(8, 2, pack_first=True)),
    # dQ added up by the dK/dV kernel (bulk reductions of dS K from shared memory, and
    # red.global.add), both head dims; and the Hopper forward with half its exponentials on
    # the FMA units under a softcap
    Case("float16", (2, 150, 201, 4, 2, 128), dict(causal=True),
         backward=numflash.WgmmaBackwardConfig(8, 2, dq_separate=False)),
    Case("bfloat16", (1, 200, 130, 2, 1, 64), dict(window_size=(40, 7)),
         backward=numflash.WgmmaBackwardConfig(8, 2, dq_separate=False)),
    Case("bfloat16", (1, 200, 130, 2, 1, 64), dict(window_size=(40, 7)),
         backward=numflash.WgmmaBackwardConfig(8, 2, dq_separate=False, dq_bulk=False)),
    Case("bfloat16", (1, 150, 300, 4, 2, 128), dict(causal=True),
         forward=numflash.WgmmaForwardConfig(fma_exp2=2), softcap=2.0),
    # the Hopper backward's tiles through an mbarrier ring: seven query blocks and six key
    # tiles go round three slots, the warpgroups unsynchronised (racecheck's case)
    Case("bfloat16", (1, 400, 350, 4, 2, 128), dict(causal=True),
         backward=numflash.WgmmaBackwardConfig(8, 3, ring=True)),
    Case("float16", (2, 333, 400, 2, 1, 64), dict(window_size=(100, 30)),
         backward=numflash.WgmmaBackwardConfig(8, 3, ring=True)),
    # ... the warpgroups taking turns with their products (pingpong)
    Case("bfloat16", (1, 400, 350, 4, 2, 128), dict(causal=True),
         backward=numflash.WgmmaBackwardConfig(8, 3, ring=True, pingpong=True)),
    # ... adding dQ up in the dK/dV kernel through two dS tiles
    Case("bfloat16", (1, 400, 350, 4, 2, 128), dict(causal=True),
         backward=numflash.WgmmaBackwardConfig(8, 3, dq_separate=False, ring=True, pingpong=True)),
    Case("float16", (2, 333, 400, 2, 1, 64), dict(window_size=(100, 30)),
         backward=numflash.WgmmaBackwardConfig(8, 3, dq_separate=False, ring=True, pingpong=True)),
    # ... the ring's tiles by TMA (one thread's boxes; rows past the end zero-filled)
    Case("bfloat16", (1, 400, 350, 4, 2, 128), dict(causal=True),
         backward=numflash.WgmmaBackwardConfig(8, 3, ring=True, pingpong=True, tma=True)),
    Case("float16", (2, 333, 400, 2, 1, 64), dict(window_size=(100, 30)),
         backward=numflash.WgmmaBackwardConfig(8, 3, dq_separate=False, ring=True, pingpong=True,
                                               tma=True)),
    # ... 128-row tiles at head_dim 64 (TMA boxes of 128 rows, LSE and D runs of 132)
    Case("float16", (2, 333, 400, 2, 1, 64), dict(window_size=(100, 30)),
         backward=numflash.WgmmaBackwardConfig(8, 3, ring=True, pingpong=True, tma=True,
                                               block_m=128)),
    Case("bfloat16", (1, 400, 350, 4, 2, 64), dict(causal=True),
         backward=numflash.WgmmaBackwardConfig(8, 3, ring=True, pingpong=True, block_m=128)),
    # ... at head_dim 128: dQ's two planes through each warp's one staging slot
    Case("bfloat16", (1, 400, 350, 4, 2, 128), dict(causal=True),
         backward=numflash.WgmmaBackwardConfig(8, 3, dq_separate=False, ring=True, pingpong=True,
                                               tma=True)),
]  # fmt: skip


#: KV-cache calls (tests/test_kvcache.py's cases): paged and contiguous, with appends, on the
#: tensor-core kernel (split and not) and the portable one.
KVCACHE_CASES = [
    (KVCase("float16", (0, 1, 7, 113, 300), seqlen_q=1, seqlen_new=1, nheads=8, nheads_k=2,
            head_dim=128, page_size=16), numflash.TensorCoreDecodeConfig()),
    (KVCase("bfloat16", (5, 200), seqlen_q=4, seqlen_new=4, nheads=8, nheads_k=1,
            head_dim=64, page_size=3, mask=dict(causal=True), num_splits=3),
     numflash.TensorCoreDecodeConfig(32, 2, 2)),
    (KVCase("float16", (40, 517), seqlen_q=2, seqlen_new=1, nheads=4, nheads_k=4,
            head_dim=256, page_size=1, mask=dict(window_size=(30, 0)), num_splits=2),
     numflash.TensorCoreDecodeConfig(16, 4, 2)),
    (KVCase("float16", (9, 70), seqlen_q=3, seqlen_new=2, nheads=4, nheads_k=2, head_dim=40,
            permute=True), numflash.TensorCoreDecodeConfig(16, 1, 4)),
    (KVCase("float16", (700, 1000), seqlen_q=1, seqlen_new=1, nheads=8, nheads_k=2,
            head_dim=128, page_size=5), numflash.TensorCoreDecodeConfig(16, 8, 3)),
    (KVCase("bfloat16", (33, 2), seqlen_q=1, seqlen_new=1, nheads=4, nheads_k=1, head_dim=64,
            page_size=16), numflash.PortableDecodeConfig()),
    # chunked prefill on the Hopper forward: paged (pages of 16 and 3), contiguous (permuted,
    # by TMA and by cp.async), and the schedule without a producer
    (KVCase("bfloat16", (70, 300), seqlen_q=130, seqlen_new=130, nheads=8, nheads_k=2,
            head_dim=128, page_size=16, mask=dict(causal=True)),
     numflash.WgmmaForwardConfig(2, 128, 2, pingpong=True, tma=False)),
    (KVCase("float16", (0, 517), seqlen_q=90, seqlen_new=40, nheads=4, nheads_k=1,
            head_dim=64, page_size=3, mask=dict(window_size=(100, 0))),
     numflash.WgmmaForwardConfig(2, 128, 2, pingpong=False)),
    (KVCase("float16", (40, 250), seqlen_q=70, seqlen_new=70, nheads=4, nheads_k=2,
            head_dim=256, permute=True), numflash.WgmmaForwardConfig(2, 64, 2, pingpong=False)),
    (KVCase("bfloat16", (3, 190), seqlen_q=100, seqlen_new=20, nheads=4, nheads_k=4,
            head_dim=128, mask=dict(causal=True)),
     numflash.WgmmaForwardConfig(2, 128, 2, pingpong=True, tma=False)),
    (KVCase("bfloat16", (33, 200), seqlen_q=65, seqlen_new=65, nheads=2, nheads_k=1,
            head_dim=64, page_size=5),
     numflash.WgmmaForwardConfig(1, 64, 3, producer=False, pingpong=False, tma=False)),
    # paged by TMA: pages of 16 in a tile of 128 keys (a box of every atom a page: grouped),
    # and pages of 256 holding two tiles
    (KVCase("float16", (70, 300), seqlen_q=130, seqlen_new=130, nheads=8, nheads_k=2,
            head_dim=128, page_size=16, mask=dict(causal=True)),
     numflash.WgmmaForwardConfig(2, 128, 2, pingpong=True)),
    (KVCase("bfloat16", (5, 400), seqlen_q=50, seqlen_new=10, nheads=4, nheads_k=2,
            head_dim=64, page_size=256, mask=dict(window_size=(60, 0))),
     numflash.WgmmaForwardConfig(2, 128, 2, pingpong=False)),
]  # fmt: skip


def listed(p, block_m, block_n, section, blocks):
    """A work order (families.wgmma_forward.work_order's list) that deals the tiles to the
    blocks unevenly, out of rank order within a round."""
    tiles = -(-p.seqlen_q // block_m) * p.nheads * p.batch
    return wgmma_forward.listed_order((np.arange(tiles) * 3 + tiles // 2) % blocks, blocks)


def forward(case, q, k, v, out):
    if not case.blocks:
        return numflash.attention(q, k, v, out=out, return_lse=True, config=case.forward,
                                  softcap=case.softcap, **case.mask)  # fmt: skip
    saved = launch._multiprocessors, wgmma_forward.work_order
    launch._multiprocessors, wgmma_forward.work_order = (lambda: case.blocks), listed
    try:
        return numflash.attention(q, k, v, out=out, return_lse=True, config=case.forward,
                                  softcap=case.softcap, **case.mask)  # fmt: skip
    finally:
        launch._multiprocessors, wgmma_forward.work_order = saved


def run(case):
    q, k, v = random_qkv(*case.shape, case.dtype)
    out = poisoned_like(q)
    _, lse = forward(case, q, k, v, out)
    cupy.cuda.Device().synchronize()
    variants = Variants(softcap=case.softcap)
    assert_matches_reference(q, k, v, out, lse, variants=variants, **case.mask)
    dout = random_array(q.shape, case.dtype)
    grads = numflash.attention_backward(dout, q, k, v, out, lse, config=case.backward,
                                        softcap=case.softcap, **case.mask)  # fmt: skip
    cupy.cuda.Device().synchronize()
    assert_gradients_match(dout, q, k, v, *grads, variants=variants, **case.mask)


def run_user_functions():
    """A document mask and a relative bias through the user functions' kernels (numflash's
    choice), GQA, causal, fewer queries than keys; mod_args read at every visible (row, key);
    then tests/test_mods.py's packed-batch and KV-cache calls with user functions, on each
    kernel they name (the decode kernels, the Hopper prefill, the mma.sync and wgmma
    backwards)."""
    import test_mods

    q, k, v = random_qkv(2, 70, 131, 4, 2, 64, "float16")
    slopes = cupy.asarray([0.05, -0.1, 0.2, 0.0], dtype=cupy.float32)
    document = test_mods._documents(131, (50, 60, 21))
    mods = (test_mods.relative_bias, test_mods.same_document, (slopes, document))
    variants = test_mods.Variants(score_mod=test_mods.relative_bias,
                                  score_mod_derivative=test_mods.relative_bias_derivative,
                                  mask_mod=test_mods.same_document, mod_args=mods[2])  # fmt: skip
    test_mods._run(q, k, v, "float16", dict(causal=True), mods, variants,
                   derivative=test_mods.relative_bias_derivative)  # fmt: skip
    cupy.cuda.Device().synchronize()
    print("ok a dense call with a score_mod, mask_mod and mod_args", flush=True)
    # packed batches and KV-cache calls with user functions, on each kernel that takes them
    import pytest

    calls = [(test_mods.test_a_packed_batch_calls_the_user_functions_per_sequence, case)
             for case in test_mods.PACKED]  # fmt: skip
    calls += [(test_mods.test_a_kv_cache_call_calls_the_user_functions_per_sequence, (c, kernel))
              for c in test_mods.KV_CASES for kernel in test_mods.KV_KERNELS]  # fmt: skip
    for test, arguments in calls:
        try:
            test(*arguments)
        except pytest.skip.Exception:
            continue
        cupy.cuda.Device().synchronize()
        print(f"ok {test.__name__} {arguments}", flush=True)


def run_block_masks():
    """A block mask's evaluation and the forwards and backward that read it: documents of
    one sequence and row blocks without keys (tests/test_block_masks.py's mask), the Hopper
    forward's tiles over two blocks (head_dim 64) and the portable forward's."""
    import test_block_masks as tbm

    document = tbm._documents((300, 3, 400, 97))
    q, k, v = random_qkv(2, 700, 800, 4, 2, 64, "float16")
    bm = numflash.block_mask(tbm.document_of_head, 2, 4, 700, 800, mod_args=(document,))
    variants = tbm.Variants(mask_mod=tbm.document_of_head, mod_args=(document,))
    for config in (None, numflash.PortableConfig(block_m=64, block_n=32)):
        out, lse = numflash.attention(q, k, v, causal=True, return_lse=True, config=config,
                                      block_mask=bm)  # fmt: skip
        tbm.assert_matches_reference(q, k, v, out, lse, causal=True, variants=variants)
    dout = tbm.random_array(q.shape, "float16")
    numflash.attention_backward(dout, q, k, v, out, lse, causal=True, block_mask=bm)
    cupy.cuda.Device().synchronize()


def main(argv):
    family = argv[argv.index("--family") + 1] if "--family" in argv else None
    kvcache_only = "--kvcache-only" in argv
    match = argv[argv.index("--match") + 1] if "--match" in argv else None
    for case in CASES:
        if match is not None and match not in repr(case):
            continue
        if family == "persistent":  # the listed work orders alone
            if not case.blocks:
                continue
        elif kvcache_only or family is not None and case.family != family:
            continue
        hopper = (numflash.WgmmaBackwardConfig, numflash.WgmmaForwardConfig)
        if isinstance(case.backward or case.forward, hopper) and not current_device().has_wgmma:
            print(f"skipped (no wgmma here): {case}", flush=True)
            continue
        run(case)
        print(f"ok {case}", flush=True)
    if match is not None:  # those cases alone
        return
    if family in (None, "mods") and not kvcache_only:
        run_user_functions()
        print("ok score_mod, mask_mod and mod_args", flush=True)
        run_block_masks()
        print("ok block masks", flush=True)
    for case, config in KVCACHE_CASES:
        if family is not None and config.family != family:
            continue
        run_and_check(case, config)
        cupy.cuda.Device().synchronize()
        print(f"ok {case} {config}", flush=True)
    if family in (
        None,
        numflash.WgmmaForwardConfig.family,
    ):  # bad pages and lengths in chunked prefill
        test_kvcache.test_hostile_device_lengths_and_pages_stay_inside_the_arrays("hopper")
        for page in (4, 16):
            test_kvcache.test_keys_behind_a_page_outside_the_cache_are_absent("hopper", page)
        for paged in (False, True):
            test_kvcache.test_what_a_cache_holds_past_a_sequence_never_reaches_its_output(
                "hopper", paged
            )
        # pages of 8 rows copied a box of every atom at once, one page absent, NaN past the end,
        # by one producer warp and by two (K's and V's)
        for warps in (2, 1):
            test_kvcache.test_the_hopper_forward_copies_a_page_of_every_atom_at_once(
                types.SimpleNamespace(setattr=setattr), warps
            )
        # short chunks whose new rows the kernel appends itself, and hostile lengths then
        for warps in (2, 1):
            for case in test_kvcache.APPEND_CASES:
                test_kvcache.test_the_hopper_forward_appends_a_short_chunk_itself(
                    types.SimpleNamespace(setattr=setattr), case, warps
                )
        for page in (0, 16):
            test_kvcache.test_hostile_lengths_stay_inside_the_arrays_when_the_hopper_forward_appends(
                page, types.SimpleNamespace(setattr=setattr)
            )
        cupy.cuda.Device().synchronize()
        print("ok chunked prefill over hostile lengths and pages", flush=True)
    if family in (None, "varlen") and not kvcache_only:
        test_varlen.REPEATS = 1  # the bitwise repeats are pytest's; here one run of each kernel
        for case in test_varlen.SMALL_CASES:
            test_varlen.test_varlen_matches_the_reference_per_sequence(case)
            test_varlen.test_varlen_gradients_match_the_reference_and_repeat_bitwise(case)
            cupy.cuda.Device().synchronize()
            print(f"ok varlen {case}", flush=True)
        for name, configs in test_varlen.LYING_CONFIGS.items():
            test_varlen.test_device_offsets_that_lie_stay_inside_the_arrays(*configs)
            print(f"ok varlen offsets that lie ({name})", flush=True)
        if current_device().has_wgmma:
            run_packed_device_order()
            print("ok packed batches through the work order made on the device", flush=True)


def run_packed_device_order():
    """The Hopper forward's packed persistent launch through the order kernels/work_order.py
    makes (on for every mask and any number of rounds here): six sequences of 1-1500 rows,
    one empty, 4 heads over 2; causal, full and a window; each sequence against the
    reference."""
    saved = {name: getattr(wgmma_forward, name) for name in (
        "DEVICE_PACKED_ORDER", "DEVICE_PACKED_ORDER_MASKED", "PACKED_ORDER_ROUNDS")}  # fmt: skip
    wgmma_forward.DEVICE_PACKED_ORDER = wgmma_forward.DEVICE_PACKED_ORDER_MASKED = True
    wgmma_forward.PACKED_ORDER_ROUNDS = 0
    try:
        for head_dim, dtype, mask in ((64, "float16", dict(causal=True)),
                                      (128, "bfloat16", dict(causal=False)),
                                      (64, "bfloat16", dict(window_size=(200, 0)))):  # fmt: skip
            lengths = [int(n) for n in np.random.default_rng(head_dim).integers(1, 1501, 6)]
            lengths[2] = 0
            q, k, v, offsets, _ = packed_qkv(lengths, lengths, 4, 2, head_dim, dtype)
            out, lse = numflash.attention_varlen(q, k, v, offsets, offsets, max(lengths),
                                                 max(lengths), return_lse=True,
                                                 out=poisoned_like(q), **mask)  # fmt: skip
            cu = offsets.get()
            for i, n in enumerate(lengths):
                if n:
                    s = slice(int(cu[i]), int(cu[i + 1]))
                    assert_matches_reference(q[None, s], k[None, s], v[None, s], out[None, s],
                                             lse[None, :, s], **mask)  # fmt: skip
    finally:
        for name, value in saved.items():
            setattr(wgmma_forward, name, value)


if __name__ == "__main__":
    main(sys.argv[1:])
