"""Every kernel family compiles to PTX for every supported target, with the instructions it is
meant to use, and the default tensor-core configurations spill no registers.

Compilation runs in a subprocess with the simulator off, so these tests run on CI without a GPU.
"""

from pathlib import Path

import pytest
from support import json_from_subprocess

from numflash import cache
from numflash.kernels.backward_mma import dq_split
from numflash.selection import default_config

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, worker_id):
    return json_from_subprocess(
        [HERE / "compile_targets.py"], "compile-targets", tmp_path_factory, worker_id
    )


def _entries(compiled, family):
    entries = [e for e in compiled if e["family"] == family]
    assert entries, f"no {family} kernels were compiled"
    return entries


def test_tensor_core_kernels_compile_for_every_target(compiled):
    entries = _entries(compiled, "tensor-core")
    targets = {e["target"] for e in entries}
    assert targets == {"sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120"}
    for e in entries:
        counts = e["counts"]
        for instruction in (
            "mma.sync.aligned.m16n8k16",
            "ldmatrix.sync.aligned",
            "cp.async.cg.shared.global",
            "cp.async.wait_group",
            "ex2.approx",
        ):
            assert counts[instruction] > 0, f"{instruction} missing from {e}"


def test_tensor_core_mma_count_matches_the_tiles(compiled):
    """Fully unrolled on sm_90a, the GPU the tiles were chosen on: S = Q K^T and O += P V each
    take (rows/16) (cols/8) (k/16) mma per tile. Whether NVVM unrolls as fully for other targets
    depends on its version (CUDA 13.0's left loops in some for other targets, the wheels' did
    not): there the products must be present; the counts that differ are listed."""
    rolled = []
    for e in _entries(compiled, "tensor-core"):
        cfg, hd = e["config"], (e["head_dim"] + 15) // 16 * 16
        m_tiles = cfg["block_m"] // (16 * cfg["num_warps"])
        per_tile = m_tiles * (cfg["block_n"] // 8) * (hd // 16)
        per_tile += m_tiles * (hd // 8) * (cfg["block_n"] // 16)
        count = e["counts"]["mma.sync.aligned.m16n8k16"]
        if e["target"] == "sm_90a":
            assert count == per_tile, e
        else:
            assert 0 < count <= per_tile, e
            if count != per_tile:
                rolled.append((e["head_dim"], e["dtype"], e["target"], count, per_tile))
    if rolled:
        print(f"partly rolled products (head_dim, dtype, target, mma, unrolled): {rolled}")


#: (kernel, head_dim) -> bytes the default tiles may spill: the packed forward at head_dim 128
#: keeps one register more than the dense kernel's 255 and was measured faster with that spill
#: than with 64 rows and none (numflash.selection.forward_varlen).
SPILL_ALLOWED = {("varlen", 128): 8}


def test_default_configurations_spill_nothing(compiled):
    reports = [e for e in _entries(compiled, "tensor-core") if "resources" in e]
    assert reports
    for e in reports:
        r = e["resources"]
        allowed = SPILL_ALLOWED.get((e["kernel"], e["head_dim"]), 0)
        assert r["spill_stores"] <= allowed and r["spill_loads"] <= allowed, e
        assert r["stack"] <= allowed, f"a register array went to local memory: {e}"


def test_portable_kernel_compiles_without_tensor_core_instructions(compiled):
    entries = _entries(compiled, "portable")
    assert {"sm_75", "sm_90a", "sm_120"} <= {e["target"] for e in entries}
    for e in entries:
        assert e["counts"]["mma.sync.aligned.m16n8k16"] == 0
        assert e["counts"]["cp.async.cg.shared.global"] == 0
        assert e["counts"]["shfl.sync.bfly"] == 0


def test_tensor_core_decode_compiles_for_every_target(compiled):
    entries = _entries(compiled, "tensor-core-decode")
    targets = {"sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120"}
    assert targets <= {e["target"] for e in entries}
    for e in entries:
        for instruction in (
            "mma.sync.aligned.m16n8k16",
            "ldmatrix.sync.aligned",
            "cp.async.cg.shared.global",
        ):
            assert e["counts"][instruction] > 0, e
        if "resources" in e and e["head_dim"] <= 128:  # head_dim 256 keeps acc in local memory
            r = e["resources"]
            assert r["spill_stores"] == 0 and r["stack"] == 0, e


def test_portable_backward_kernels_compile_for_every_target(compiled):
    entries = _entries(compiled, "portable-backward")
    assert {(e["kernel"], e["target"]) for e in entries} == {
        (kernel, target)
        for kernel in ("preprocess", "dkdv", "dq", "dkdv-varlen", "dq-varlen")
        for target in ("sm_75", "sm_90a", "sm_120")
    }
    for e in entries:
        assert e["counts"]["mma.sync.aligned.m16n8k16"] == 0
        if e["kernel"] != "preprocess":
            assert e["counts"]["ex2.approx"] > 0, e  # p recomputed from the LSE


def test_tensor_core_backward_compiles_for_every_target(compiled):
    entries = _entries(compiled, "tensor-core-backward")
    assert {e["target"] for e in entries} == {
        "sm_80",
        "sm_86",
        "sm_89",
        "sm_90a",
        "sm_100a",
        "sm_120",
    }
    assert {e["kernel"] for e in entries} == {"dkdv", "dq", "dkdv-varlen", "dq-varlen"}
    for e in entries:
        cfg, hd = e["config"], e["head_dim"]
        warps, block_m = cfg["num_warps"], cfg["block_m"]
        part = hd // cfg["head_split"]  # the output columns of one block
        scores = 2 * (hd // 16) * (block_m // 8)  # S and dP (or S^T and dP^T) over all of hd
        if e["kernel"].startswith("dq"):
            # Per warp and key tile: the scores, then dQ ((block_m/16) (part/8))
            assert e["counts"]["mma.sync.aligned.m16n8k16"] == scores + (block_m // 16) * (
                part // 8
            ), e
            assert e["counts"]["ex2.approx"] > 0
            continue
        # Per warp and query block: the scores, dV and dK ((block_m/16) (part/8) each), and
        # with atomic dQ its pieces per warp, each (16 warps / 16) k-steps of its 8-column tiles.
        per_block = scores + 2 * (block_m // 16) * (part // 8)
        if not cfg["dq_separate"]:
            _, tiles, units = dq_split(part, block_m, warps)
            per_block += units * warps * tiles
        assert e["counts"]["mma.sync.aligned.m16n8k16"] == per_block, e
        assert e["counts"]["ldmatrix.sync.aligned"] > 0 and e["counts"]["ex2.approx"] > 0
    assert {e["config"]["dq_separate"] for e in entries} == {True, False}
    # The default tiles (and the atomic 64 x 128) fit in registers at head_dim 64, 128 and 256
    # (ptxas, sm_90a)
    for e in entries:
        if "resources" in e:
            assert e["resources"]["spill_stores"] == 0 and e["resources"]["stack"] == 0, e


def test_shipped_configurations_compile_and_spill_nothing(compiled):
    """Every tuned configuration shipped in numflash/configs compiles for its architecture with
    the tensor-core instructions and, with the toolchain at hand, spills nothing and keeps no
    array in local memory (how much a configuration spills depends on the ptxas version: the
    tuner prunes any that spills, and none may ship)."""
    entries = _entries(compiled, "shipped")
    assert {e["target"] for e in entries} == {"sm_90a"}  # sm_90.json serves Hopper only
    for e in entries:
        for instruction in (
            "mma.sync.aligned.m16n8k16",
            "ldmatrix.sync.aligned",
            "cp.async.cg.shared.global",
        ):
            assert e["counts"][instruction] > 0, f"{instruction} missing from {e}"
        assert e["resources"]["spill_stores"] == 0 and e["resources"]["stack"] == 0, e
    # the Hopper forward's and backward's tuned configurations that are not their default:
    # compiled as their own kernels are, and held to
    # test_wgmma_{forward,backward}_kernels_assemble_for_sm90a's checks
    for family in ("wgmma-forward", "wgmma-backward"):
        tuned = [e for e in compiled if e.get("shipped") and e["family"] == family]
        shipped = {
            (file, key.head_dim, key.dtype, tuple(sorted(entry["config"].items())))
            for file in ("sm_90.json",)
            for key, entry in cache.shipped_entries(file[:-5]).items()
            if key.family == family
            and entry["config"]
            not in [
                default_config(key.family, key.head_dim, None, key=k)[1].to_dict()
                for k in (None, key)
            ]
        }
        assert shipped, family
        assert {
            (e["shipped"], e["head_dim"], e["dtype"], tuple(sorted(e["config"].items())))
            for e in tuned
        } == shipped


def test_wgmma_tiles_assemble_for_sm90a(compiled):
    """The wgmma tiles (numflash/kernels/ptx_sm90.py) through ptxas for sm_90a: one wgmma
    per k16 step (A from shared memory or from registers), its fences and wait, in kernels
    that fit in registers. Whether they compute the right tiles is tests/test_wgmma.py's, on
    a GPU."""
    import wgmma_gemm

    entries = _entries(compiled, "wgmma")
    steps = {
        **{v: k // 16 for v, k in wgmma_gemm.VARIANTS.items()},
        "chain": wgmma_gemm.CHAIN_K // 16 + 4,
    }
    assert {(e["dtype"], e["variant"]) for e in entries} == {
        (dtype, variant) for dtype in ("float16", "bfloat16") for variant in steps
    }
    for e in entries:
        assert e["target"] == "sm_90a"
        assert e["counts"]["wgmma.mma_async"] == steps[e["variant"]], e
        products = 2 if e["variant"] == "chain" else 1
        for instruction in ("wgmma.fence", "wgmma.wait_group"):
            assert e["counts"][instruction] == products, e
        assert e["counts"]["fence.proxy.async"] == 1, e
        assert e["resources"]["spill_stores"] == 0 and e["resources"]["stack"] == 0, e
        # ptxas serialises the wgmma pipeline when the accumulators are touched between the
        # products (remark C7511); one tile's steps must chain. (CUDA 13.0's ptxas also injects
        # a warpgroup.arrive into one of these test tiles, remark C7519, which the wheels' does
        # not: a wait, not a serialisation.)
        remarks = e["resources"]["remarks"]
        assert not [r for r in remarks if "serialized" in r], remarks


def test_wgmma_backward_kernels_assemble_for_sm90a(compiled):
    """The Hopper backward kernels (numflash/kernels/backward_sm90.py) through ptxas for sm_90a:
    their products on wgmma (S^T and dP^T, or S and dP: head_dim / 16 steps each; dV and dK,
    or dQ: block_m / 16 steps each; with dQ added up in the dK/dV kernel, dQ's: one step per
    16 of the block's 128 keys), nothing spilled, and no remark that ptxas serialised the wgmma
    pipeline or waited inside it (a 64-bit division by a run-time value did that once: a call
    to a helper routine, remark C7509)."""
    entries = _entries(compiled, "wgmma-backward")
    kernels = ("dkdv", "dq", "dkdv-varlen", "dq-varlen")
    assert {(e["head_dim"], e["kernel"]) for e in entries} == {
        (hd, kernel) for hd in (64, 128) for kernel in kernels
    }
    assert {e["kernel"] for e in entries if e["softcap"]} == set(kernels)  # Gemma 2's cap too
    assert {e["kernel"] for e in entries if e["pack_first"]} == set(kernels)
    fused = {(e["head_dim"], e["kernel"]) for e in entries if not e["dq_separate"]}
    assert fused == {(hd, k) for hd in (64, 128) for k in ("dkdv", "dkdv-varlen")}
    # dQ by bulk reductions (one a warp and query block; with the ring one per 32 columns of
    # the warpgroup's), or by atomics (16 a thread)
    for e in entries:
        bulk, atomics = e["counts"]["cp.reduce.async.bulk"], e["counts"]["red.global.add"]
        if e["dq_separate"]:
            assert bulk == atomics == 0, e
        elif e["dq_bulk"]:
            assert (bulk, atomics) == (e["head_dim"] // 64 if e["ring"] else 1, 0), e
        else:
            assert (bulk, atomics) == (0, 16 * e["head_dim"] // 128), e
    assert {e["dq_bulk"] for e in entries if not e["dq_separate"] and not e["mods"]} == {
        True,
        False,
    }
    # the ring: each streaming tile waited for and released on mbarriers, every thread's
    # copies arriving there; one wait for the resident tiles (the block barrier schedule's
    # kernels wait for their copies every tile, and use no mbarrier); a packed batch's too
    ring = {e["kernel"] for e in entries if e["ring"]}
    assert ring == set(kernels)
    for e in entries:
        counts = e["counts"]
        if e["tma"]:  # one thread's boxes instead: Q and dO (K and V), an atom each
            assert counts["cp.async.bulk.tensor"] >= 2 * e["head_dim"] // 64, e
            assert counts["mbarrier.try_wait"] >= 2 and counts["cp.async.mbarrier.arrive"] == 0, e
        elif e["ring"]:
            assert counts["mbarrier.try_wait"] >= 2 and counts["cp.async.mbarrier.arrive"] >= 1, e
            assert counts["cp.async.wait_group"] == 2, e  # the resident tiles; the drain
        else:
            assert counts["mbarrier.try_wait"] == counts["cp.async.mbarrier.arrive"] == 0, e
    assert {e["kernel"] for e in entries if e["tma"]} == {"dkdv", "dq"}
    # 128-row streaming tiles (head_dim 64 only): the packed kernels too, and with TMA
    assert {e["kernel"] for e in entries if e["block_m"] == 128} == set(kernels)
    assert {e["head_dim"] for e in entries if e["block_m"] == 128} == {64}
    assert any(e["tma"] for e in entries if e["block_m"] == 128)
    # pingpong: a turn passed after each issue of products (two a tile, three with dQ added
    # up there), and the first one (the plain kernels arrive at no named barrier)
    assert {e["kernel"] for e in entries if e["pingpong"]} == set(kernels)
    assert {e["kernel"] for e in entries if e["pingpong"] and not e["dq_separate"]} == {"dkdv"}
    for e in entries:
        arrivals = e["counts"]["bar.arrive"]
        turns = 3 if e["dq_separate"] else 4
        assert arrivals >= turns if e["pingpong"] else arrivals == 0, e
    # a user's functions (backward.user_element_function), a block mask with them: no spill
    assert {(e["kernel"], e["dq_separate"]) for e in entries if e["mods"]} == {
        ("dkdv", True),
        ("dq", True),
        ("dkdv", False),
    }
    for e in entries:
        assert e["target"] == "sm_90a"
        steps = e["block_m"] // 16  # k16 steps over a streaming tile's rows
        products = {
            "dkdv": 2 * e["head_dim"] // 16 + 2 * steps,
            "dq": 2 * e["head_dim"] // 16 + steps,
        }
        expected = products[e["kernel"].split("-")[0]] + (0 if e["dq_separate"] else 8)
        assert e["counts"]["wgmma.mma_async"] == expected, e
        assert e["counts"]["fence.proxy.async"] >= 1, e
        assert e["resources"]["spill_stores"] == 0 and e["resources"]["stack"] == 0, e
        remarks = e["resources"]["remarks"]
        assert not [r for r in remarks if "wgmma" in r], remarks


def test_tensor_core_forward_with_user_functions_assembles(compiled):
    """The mma.sync forward's default tiles at head_dim 128 with a user's functions and a
    block mask (forward.mod_scores), for sm_90a: it assembles; two 16-row tiles a warp spill
    12-16 bytes with them (docs/performance.md), which is recorded, not held to zero."""
    (e,) = _entries(compiled, "tensor-core-mods")
    assert e["counts"]["mma.sync.aligned.m16n8k16"] > 0 and e["block_mask"]
    assert e["resources"]["registers"] > 0, e


def test_tensor_core_backward_with_user_functions_assembles(compiled):
    """The mma.sync backward with a user's functions and a block mask, for sm_90a: it
    assembles; its dK/dV kernel spills (48 bytes, ptxas 13.0: docs/performance.md), which is
    recorded, not held to zero."""
    entries = _entries(compiled, "tensor-core-backward-mods")
    assert {e["kernel"] for e in entries} == {"dkdv", "dq"}
    for e in entries:
        assert e["counts"]["mma.sync.aligned.m16n8k16"] > 0 and e["counts"]["ex2.approx"] > 0
        assert e["resources"]["registers"] > 0, e


def test_wgmma_forward_kernels_assemble_for_sm90a(compiled):
    """The Hopper forward (numflash/kernels/forward_sm90.py) through ptxas for sm_90a, as Numba
    links it: S = Q K^T and acc += P V on wgmma (each issued from two places: the first tile's
    scores and the main loop; the main loop's and the last tile's values), nothing spilled, no
    remark that ptxas serialised the wgmma pipeline or ignored setmaxnreg (with softcap, and
    with sinks and ALiBi, too); a producer hands
    tiles over through mbarriers and moves registers to the consumers, its copies cp.async or
    one TMA copy per 64 columns of a tile through the three tensor maps it publishes (over a
    KV cache too: chunked prefill, and then appending the new rows itself)."""
    entries = _entries(compiled, "wgmma-forward")
    assert {(e["head_dim"], e["kernel"]) for e in entries} >= {
        (64, "dense"),
        (128, "dense"),
        (256, "dense"),
        (128, "varlen"),
        (128, "kvcache-contiguous"),
        (128, "kvcache-paged"),
        (128, "kvcache-grouped"),
        (128, "kvcache-grouped-1warp"),
        (128, "kvcache-contiguous-append"),
        (128, "kvcache-grouped-append"),
        (128, "kvcache-grouped-1warp-append"),
    }
    for e in entries:  # 16-byte copies of the new rows by the kernel that appends them alone
        copies = e["counts"]["st.global.v4.u32"]
        assert (copies > 0) == e["kernel"].endswith("-append"), e
    assert any(e["softcap"] for e in entries)  # the scores capped (attention's softcap)
    # half the probabilities by ptx.exp2_fma: about half the capped kernel's ex2 left
    capped = {
        e["config"]["fma_exp2"]: e for e in entries if e["softcap"] == 50.0 and e["head_dim"] == 128
    }
    assert capped[2]["counts"]["ex2.approx"] < capped[0]["counts"]["ex2.approx"]
    # a bfloat16 cap of at most BOUNDED_SOFTCAP: no row max shared among a row's lanes
    (bounded,) = [e for e in entries if e["softcap"] == 30.0]
    shuffles = capped[0]["counts"]["shfl.sync.bfly"]
    assert bounded["counts"]["shfl.sync.bfly"] < shuffles, (bounded["counts"], shuffles)
    assert any(e["variants"] for e in entries)  # sinks and ALiBi
    assert any(e["mods"] for e in entries)  # a user's score_mod and mask_mod
    for e in entries:
        cfg, hd = e["config"], e["head_dim"]
        products = 2 * ((hd + 15) // 16) + 2 * (cfg["block_n"] // 16)
        assert e["counts"]["wgmma.mma_async"] == products, e
        r = e["resources"]
        # a user's functions are not yet held to no spill: 52 bytes at head_dim 128 with a
        # relative bias and a document mask (docs/performance.md), still no remark
        if not e["mods"]:
            assert r["spill_stores"] == 0 and r["stack"] == 0, e
        assert not r["remarks"], r["remarks"]
        tma = cfg["tma"]
        if e["kernel"].startswith("kvcache-grouped"):  # a page's box of every atom: 5-D copies
            assert e["counts"]["cp.async.bulk.tensor.5d"] > 0, e
        elif tma:  # a TMA copy per 64-column atom of Q, K and V; the three maps published
            assert e["counts"]["cp.async.bulk.tensor"] >= 3 * ((hd + 63) // 64), e
            assert e["counts"]["tensormap.replace"] == e["counts"]["tensormap.cp_fenceproxy"] == 3
            assert e["counts"]["cp.async.mbarrier.arrive"] == 0, e
        if cfg["producer"]:
            assert tma or e["counts"]["cp.async.mbarrier.arrive"] > 0, e
            assert e["counts"]["mbarrier.try_wait"] and e["counts"]["setmaxnreg"] == (
                2 if cfg["consumers"] > 1 else 0
            ), e
        else:
            assert e["counts"]["mbarrier.try_wait"] == 0 and e["counts"]["fence.proxy.async"] > 0


def test_decode_kernels_with_user_functions_assemble(compiled):
    """The KV-cache kernels with a user's score_mod and mask_mod (decode.mod_scores and the
    portable split kernel's call), paged, head_dim 128, for sm_90a: the tensor-core kernel
    spills nothing (222 registers against 208 without them, ptxas 13.0); the portable split
    kernel keeps its rows in local memory with or without them."""
    entries = {e["kernel"]: e for e in _entries(compiled, "decode-mods")}
    assert set(entries) == {"decode", "split"}
    tensor_core = entries["decode"]
    assert tensor_core["counts"]["mma.sync.aligned.m16n8k16"] > 0
    r = tensor_core["resources"]
    assert r["spill_stores"] == 0 and r["stack"] == 0, r
    assert entries["split"]["counts"]["ex2.approx"] > 0


def test_portable_decode_kernels_compile_for_every_target(compiled):
    """The KV-cache kernels (append, split attention, combine; contiguous and paged) compile
    for the portable targets, without tensor-core instructions."""
    entries = _entries(compiled, "portable-decode")
    assert {(e["kernel"], e["paged"]) for e in entries} == {
        (kernel, paged) for kernel in ("append", "split", "combine") for paged in (False, True)
    }
    assert {e["target"] for e in entries} == {"sm_75", "sm_90a", "sm_120"}
    for e in entries:
        assert e["counts"]["mma.sync.aligned.m16n8k16"] == 0, e
        if e["kernel"] != "append":
            assert e["counts"]["ex2.approx"] > 0, e
