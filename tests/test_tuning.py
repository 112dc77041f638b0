"""The autotuner's CPU side: search spaces, the configuration cache, the CLI's plan, and one
real study in the simulator whose winner the next call uses."""

import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
import warnings

import numpy as np
import optuna
import pytest
from support import random_qkv, xp

import numflash
from numflash import cache
from numflash.config import PortableConfig, TensorCoreConfig, knob_choices
from numflash.device import DeviceInfo
from numflash.families import wgmma_forward
from numflash.kernels.jit import SIMULATOR
from tuning import space

H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 232448, 1024)
A100 = DeviceInfo("NVIDIA A100", (8, 0), 108, 166912, 1024)
KEY = cache.ProblemKey("tensor-core", "float16", 128, "causal", 4096)
CFG = TensorCoreConfig(128, 64, 4, 3, False)


@pytest.fixture
def cache_dirs(tmp_path, monkeypatch):
    """An empty user cache and an empty shipped directory, both private to the test."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setenv("NUMFLASH_CACHE_DIR", str(user))
    monkeypatch.setattr(cache, "SHIPPED_DIR", shipped)
    cache.reload()
    yield user, shipped
    cache.reload()


def entry(cfg, time_ms=1.0):
    return {
        "config": cfg.to_dict(),
        "time_ms": time_ms,
        "default_ms": 2.0,
        "default_config": TensorCoreConfig().to_dict(),
        "trials": 3,
        "date": "2026-11-29",
    }


# -- search space ------------------------------------------------------------------------------


def test_space_is_derived_from_the_config_fields():
    params = space.params(TensorCoreConfig)
    assert set(params) == {
        "block_m_log2",
        "block_n_log2",
        "num_warps_log2",
        "stages",
        "q_in_registers",
    }
    assert params["block_n_log2"] == ("log2", (4, 5, 6, 7))
    assert params["q_in_registers"] == ("categorical", (True, False))
    sizes = [len(c) for c in knob_choices(TensorCoreConfig).values()]
    assert len(list(space.all_points(TensorCoreConfig))) == int(np.prod(sizes))


@pytest.mark.parametrize("cfg", [CFG, TensorCoreConfig(), PortableConfig(16, 8)])
def test_suggest_and_as_params_round_trip(cfg):
    trial = optuna.trial.FixedTrial(space.as_params(cfg))
    assert space.suggest(trial, type(cfg)) == cfg


def test_the_defaults_neighbours_change_one_knob_each_nearest_first():
    """space.neighbours: every feasible configuration one knob away from the default, each
    knob's nearest values before any knob's farther ones; the Hopper forward's 128-key tiles
    (which fit seqlen 1024) among the first of its head_dim 64 default (192 keys)."""
    from numflash.config import WgmmaForwardConfig
    from numflash.selection import default_config

    head_dim, default = default_config("wgmma-forward", 64, H200)
    found = space.neighbours(default, head_dim, H200)
    names = list(knob_choices(WgmmaForwardConfig))
    changed = [[n for n in names if getattr(c, n) != getattr(default, n)] for c in found]
    assert all(len(c) == 1 for c in changed) and len(set(found)) == len(found)
    assert not any(c.problems(head_dim, H200) for c in found)
    everything = [c for c in space.feasible_points(WgmmaForwardConfig, head_dim, H200)
                  if sum(getattr(c, n) != getattr(default, n) for n in names) == 1]  # fmt: skip
    assert set(found) == set(everything)

    def distance(c, name):
        choices = knob_choices(WgmmaForwardConfig)[name]
        return abs(choices.index(getattr(c, name)) - choices.index(getattr(default, name)))

    ranks = [distance(c, n[0]) for c, n in zip(found, changed)]
    assert ranks == sorted(ranks)
    assert found.index(dataclasses.replace(default, block_n=128)) < 16


def test_the_first_points_of_every_study_are_compiled_once_each(monkeypatch):
    """tuning.precompile.points: each new study's first configurations (the default of its
    bucket and mask, then neighbours: what tune_key enqueues), once for keys whose kernels
    are the same (two seqlen buckets of one default); none compiled ahead with one job or
    without the kernel cache (the simulator)."""
    from tuning import precompile
    from tuning.study import first_points

    keys = [cache.ProblemKey("wgmma-backward", dt, 128, mask, s) for dt in ("float16", "bfloat16")
            for mask in ("full", "causal") for s in (4096, 16384)]  # fmt: skip
    first = first_points(keys[0], H200, 8)
    head_dim, default = numflash.selection.default_config("wgmma-backward", 128, H200)
    assert first == [default] + space.neighbours(default, head_dim, H200)[:7]
    assert 1 < len(first) <= 8 and len(set(first)) == len(first)
    found = precompile.points(keys, H200, 8)
    assert len(found) == 4 * len(first)  # the buckets share their points
    assert {(k.dtype, k.mask) for k, _ in found} == {(k.dtype, k.mask) for k in keys}
    assert all(cfg in first_points(key, H200, 8) for key, cfg in found)
    assert precompile.run(keys, H200, 8, jobs=1, out=sys.stdout) == 0.0
    assert precompile.run(keys, H200, 8, jobs=8, out=sys.stdout) == 0.0  # no kernel cache


def test_infeasible_points_are_pruned_before_compiling():
    feasible = space.feasible_points(TensorCoreConfig, 128, H200)
    assert CFG in feasible
    assert TensorCoreConfig(16, 64, 4, 2, True) not in feasible  # block_m < 16 * num_warps
    assert all(not c.problems(128, H200) for c in feasible)
    small = DeviceInfo("small", (8, 6), 84, 101376, 1024)  # sm_86: 99 KiB per block
    assert len(space.feasible_points(TensorCoreConfig, 256, small)) < len(
        space.feasible_points(TensorCoreConfig, 256, H200)
    )


# -- cache -------------------------------------------------------------------------------------


def test_keys_and_buckets():
    assert cache.seqlen_bucket(1) == cache.MIN_BUCKET
    assert cache.seqlen_bucket(4096) == 4096 and cache.seqlen_bucket(4097) == 8192
    assert cache.ProblemKey.parse(str(KEY)) == KEY
    assert cache.ProblemKey.of("tensor-core", "float16", 128, 3000, 4000, -1, 0) == KEY
    assert cache.ProblemKey.of("portable", "float32", 8, 5, 5, -1, -1).mask == "full"
    assert cache.ProblemKey.of("portable", "float32", 8, 5, 5, 4, 0).mask == "window"


def test_kv_cache_keys_carry_a_grid_class():
    key = cache.ProblemKey("tensor-core-decode", "float16", 128, "full", 4096, "few")
    assert str(key) == "tensor-core-decode/float16/hd128/full/s4096/gfew"
    assert cache.ProblemKey.parse(str(key)) == key
    assert cache.ProblemKey.of("tensor-core-decode", "float16", 128, 1, 3000, -1, -1, "few") == key
    for text in (
        "tensor-core-decode/float16/hd128/full/s4096",  # a KV-cache key without its class
        "tensor-core-decode/float16/hd128/full/s4096/gsome",  # an unknown class
        "tensor-core/float16/hd128/full/s4096/gfew",  # a class on a forward key
    ):
        with pytest.raises(ValueError):
            cache.ProblemKey.parse(text)


def test_a_tuned_kv_cache_entry_serves_its_grid_class_only(cache_dirs):
    """An entry tuned for calls of few thread blocks is not taken by one of many, which keeps
    the heuristic of its class (and the other way round)."""
    from numflash import selection, validation
    from numflash.config import TensorCoreDecodeConfig

    def problem(batch):  # caches of 16 keys: bucket 128, the entry's nearest
        q = xp.zeros((batch, 1, 32, 128), np.float16)
        k = xp.zeros((batch, 16, 8, 128), np.float16)
        args = (q, k, k, None, None, 16, None, None, False, None, (-1, -1), 0)
        return validation.kvcache_problem(*args)[-1]

    few, many = problem(8), problem(64)  # 64 and 512 blocks of 16 rows on 132 SMs
    assert selection.decode_grid(few, H200) == "few"
    assert selection.decode_grid(many, H200) == "many"
    tuned = TensorCoreDecodeConfig(32, 4, 2)
    key = cache.ProblemKey("tensor-core-decode", "float16", 128, "full", 4096, "few")
    cache.record(H200, {key: entry(tuned)})
    chosen, _ = selection.decode(few, H200)
    assert chosen.config == tuned and chosen.source.startswith("user cache")
    chosen, _ = selection.decode(many, H200)
    assert chosen == (TensorCoreDecodeConfig(16, 4, 3), "heuristic")


def test_record_then_lookup(cache_dirs):
    path = cache.record(H200, {KEY: entry(CFG)})
    data = json.loads(path.read_text())
    assert data["arch"] == "sm_90" and data["kernel_revisions"] == {KEY.family: CFG.REVISION}
    assert data["entries"][str(KEY)]["kernel_revision"] == CFG.REVISION
    assert data["device"] == "NVIDIA H200" and data["numflash_version"] == numflash.__version__
    cfg, source, time_ms = cache.lookup("sm_90", KEY)
    assert cfg == CFG and source.startswith("user cache") and time_ms == entry(CFG)["time_ms"]


def test_record_keeps_the_files_own_notes_and_each_entrys_command(cache_dirs):
    """A field record() does not write (a note on entries taken out by hand) survives a merge,
    and each entry keeps what it was recorded with, so a file tuned by several commands says
    which made which entry."""
    first = dict(entry(CFG), command="numflash autotune --seqlens 1024")
    path = cache.record(H200, {KEY: first}, header_extra={"command": first["command"]})
    data = json.loads(path.read_text())
    data["removed"] = "entries taken out by hand"
    path.write_text(json.dumps(data))
    other = KEY._replace(seqlen=65536)
    second = dict(entry(CFG), command="numflash autotune --seqlens 65536")
    cache.record(H200, {other: second}, header_extra={"command": second["command"]})
    data = json.loads(path.read_text())
    assert data["removed"] == "entries taken out by hand"
    assert data["command"] == second["command"]
    assert data["entries"][str(KEY)]["command"] == first["command"]
    assert data["entries"][str(other)]["command"] == second["command"]


def test_each_entry_names_the_device_it_was_measured_on(cache_dirs):
    """One file serves every device of its compute capability: entries tuned on an H100 and
    merged into a file an H200 wrote keep their own device's name, and the header names the
    last writer."""
    h100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 1024)
    cache.record(H200, {KEY: entry(CFG)})
    other = KEY._replace(seqlen=65536)
    path = cache.record(h100, {other: entry(CFG)})
    data = json.loads(path.read_text())
    assert data["entries"][str(KEY)]["device"] == "NVIDIA H200"
    assert data["entries"][str(other)]["device"] == h100.name == data["device"]
    assert cache.lookup("sm_90", other)[0] == CFG


def test_nearest_sequence_bucket(cache_dirs):
    cache.record(
        H200,
        {
            KEY._replace(seqlen=1024): entry(TensorCoreConfig(64, 64, 4, 3, True)),
            KEY._replace(seqlen=16384): entry(CFG),
        },
    )
    assert cache.lookup("sm_90", KEY._replace(seqlen=8192))[0] == CFG
    assert cache.lookup("sm_90", KEY._replace(seqlen=2048))[0].block_m == 64
    assert cache.lookup("sm_90", KEY._replace(dtype="bfloat16")) is None


def test_an_entry_that_kept_its_default_serves_its_own_bucket_only(cache_dirs):
    """Where the default won at 16384, a call at 8192 gets its own bucket's heuristic (None
    here), not 16384's default; the nearest entry that beat its default still serves."""
    kept = {**entry(CFG), "default_config": CFG.to_dict()}
    cache.record(H200, {KEY._replace(seqlen=16384): kept})
    assert cache.lookup("sm_90", KEY._replace(seqlen=16384))[0] == CFG
    assert cache.lookup("sm_90", KEY._replace(seqlen=8192)) is None
    other = TensorCoreConfig(64, 64, 4, 3, True)  # entry(): the default was (64, 64, 4, 2)
    cache.record(H200, {KEY._replace(seqlen=1024): entry(other)})
    cache.reload()
    assert cache.lookup("sm_90", KEY._replace(seqlen=8192))[0] == other


def test_lookup_order_user_then_shipped_then_same_major(cache_dirs):
    user, shipped = cache_dirs
    sm80 = DeviceInfo("A100", (8, 0), 108, 166912, 1024)
    cache.record(
        sm80, {KEY: entry(TensorCoreConfig(64, 32, 4, 2, False))}, path=shipped / "sm_80.json"
    )
    # sm_86 has no file of its own: the nearest shipped file of major 8 answers.
    cfg, source, _ = cache.lookup("sm_86", KEY)
    assert cfg.block_m == 64 and "nearest of the same major" in source
    cache.record(
        H200, {KEY: entry(TensorCoreConfig(64, 64, 4, 2, True))}, path=shipped / "sm_90.json"
    )
    assert cache.lookup("sm_90", KEY)[1].startswith("shipped")
    cache.record(H200, {KEY: entry(CFG)})
    assert cache.lookup("sm_90", KEY)[:2] == (CFG, f"user cache {user / 'sm_90.json'}")
    # A tuned configuration that cannot run here is passed over.
    assert cache.lookup("sm_90", KEY._replace(head_dim=120), feasible=lambda c: False) is None


def test_corrupt_file_warns_once_and_falls_back(cache_dirs):
    user, _ = cache_dirs
    user.mkdir()
    (user / "sm_90.json").write_text("{ not json")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert cache.lookup("sm_90", KEY) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.lookup("sm_90", KEY._replace(seqlen=1024)) is None  # no second warning
    cache.record(H200, {KEY: entry(CFG)})  # a corrupt file is replaced, not fatal
    assert cache.lookup("sm_90", KEY)[0] == CFG


def test_entries_of_another_kernel_revision_are_ignored(cache_dirs):
    portable_key = cache.ProblemKey("portable", "float32", 64, "full", 4096)
    portable = PortableConfig(32, 32)
    path = cache.record(H200, {KEY: entry(CFG), portable_key: entry(portable)})
    data = json.loads(path.read_text())
    data["entries"][str(KEY)]["kernel_revision"] = CFG.REVISION - 1
    data["numflash_version"] = "0.0.1"
    path.write_text(json.dumps(data))
    cache.reload()
    with pytest.warns(RuntimeWarning, match="tensor-core entries were tuned for another revision"):
        assert cache.lookup("sm_90", KEY) is None
    # Only the family whose kernels changed loses its entries.
    assert cache.lookup("sm_90", portable_key)[0] == portable


def test_file_of_another_architecture_is_ignored(cache_dirs):
    user, _ = cache_dirs
    path = cache.record(H200, {KEY: entry(CFG)})
    os.replace(path, user / "sm_89.json")
    with pytest.warns(RuntimeWarning, match="for sm_90, not sm_89"):
        assert cache.lookup("sm_89", KEY) is None


def _write_keys(directory, offset, count, start):
    os.environ["NUMFLASH_CACHE_DIR"] = directory
    start.wait()  # all writers begin together, after their imports
    for i in range(count):
        cache.record(H200, {KEY._replace(head_dim=8 * (offset + i + 1)): entry(CFG, i)})


def test_concurrent_writers_lose_nothing(cache_dirs):
    user, _ = cache_dirs
    ctx = multiprocessing.get_context("spawn")
    writers, count = 3, 25
    start = ctx.Barrier(writers + 1)
    procs = [
        ctx.Process(target=_write_keys, args=(str(user), w * count, count, start))
        for w in range(writers)
    ]
    for p in procs:
        p.start()
    start.wait(120)
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert len(cache.user_entries("sm_90")) == writers * count


def test_selected_config_uses_the_cache(cache_dirs):
    q, k, v = random_qkv(1, 40, 40, 2, 1, 16, "float32")
    default = numflash.selected_config(q, k, v, causal=True)
    assert default.source == "heuristic"
    key = cache.ProblemKey.of("portable", "float32", 16, 40, 40, -1, 0)
    device = numflash.device.current_device()
    cache.record(device, {key: entry(PortableConfig(16, 8))})
    chosen = numflash.selected_config(q, k, v, causal=True)
    assert chosen.config == PortableConfig(16, 8) and chosen.source.startswith("user cache")
    forced = numflash.selected_config(q, k, v, config=PortableConfig(32, 16))
    assert forced == (PortableConfig(32, 16), "forced")


# -- the CLI and a real study ---------------------------------------------------------------------


def _autotune(cache, *flags):
    """``numflash autotune`` with ``flags``, its cache in ``cache``: the finished process."""
    env = dict(os.environ, NUMFLASH_CACHE_DIR=str(cache))
    command = [sys.executable, "-m", "numflash", "autotune", *flags]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_cli_dry_run_prints_the_plan(tmp_path):
    proc = _autotune(tmp_path, "--quick", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "4 keys x 8 trials" in proc.stdout
    assert "tensor-core/float16/hd128/causal/s4096:" in proc.stdout
    assert not any(tmp_path.iterdir()), "a dry run writes nothing"


@pytest.mark.parametrize("winner_ms, kept", [(0.97, True), (0.99, False), (1.05, False)])
def test_a_winner_is_written_only_if_it_stays_ahead_of_the_default_in_the_runoff(
    monkeypatch, winner_ms, kept
):
    """The study's winner and the default timed again in turns (fake clocks: the winner
    ``winner_ms`` a round, the default 1.0 ms, one round of each 10% slower): the winner is
    kept only at least MIN_GAIN faster, else the default becomes the key's entry; either way
    the entry says what the runoff saw."""
    from tuning import study

    default = TensorCoreConfig()
    rounds = {
        "winner": iter([winner_ms * 1.1, winner_ms, winner_ms]),
        "default": iter([1.0, 1.1, 1.0]),
    }
    order = []

    class Objective:
        timing = {"runs": 5}

        def call(self, cfg):
            name = "default" if cfg == default else "winner"
            return lambda: name

    def fake_time(fn, runs):
        order.append(fn())
        return type("T", (), {"median_ms": next(rounds[fn()])})()

    monkeypatch.setattr(study, "time_gpu", fake_time)
    found = study.KeyResult(KEY, default, 1.2, CFG, 0.9, complete=5, pruned=0, rejected=0, failed=0)
    result = study.runoff(found, Objective(), rounds=3)
    assert order == ["winner", "default"] * 3  # taken in turn
    assert result.best_config == (CFG if kept else default)
    assert result.best_ms == (winner_ms if kept else 1.0) and result.default_ms == 1.0
    record = result.entry()["runoff"]
    assert record["kept"] is kept and record["study_winner"] == CFG.to_dict()
    assert (record["winner_ms"], record["default_ms"], record["rounds"]) == (winner_ms, 1.0, 3)
    # nothing to run off: the default won the study, or the default was never timed
    for settled in (
        dataclasses.replace(found, best_config=default),
        dataclasses.replace(found, default_ms=None),
    ):
        assert study.runoff(settled, Objective()) is settled


def test_the_report_says_why_configurations_failed_or_were_rejected():
    """A trial that raised past the objective's own handlers keeps its error, and the run's
    report lists every failed or rejected configuration with its reason; skipped points
    (duplicates, infeasible) are not listed."""
    import io

    from tuning import objective, run, study

    class Failing:
        def _evaluate(self, trial):
            trial.set_user_attr("config", CFG.to_dict())  # as the real one does first
            raise RuntimeError("cudaErrorLaunchOutOfResources")

    trials = optuna.create_study()
    trial = trials.ask()
    with pytest.raises(RuntimeError):
        objective.Objective.__call__(Failing(), trial)
    trials.tell(trial, state=optuna.trial.TrialState.FAIL)
    cfg = CFG.to_dict()
    for attrs, state in [
        ({"pruned": "uses 40 bytes of local memory a thread"}, "PRUNED"),
        ({"rejected": "wrong result: [max error 0.5]"}, "PRUNED"),
        ({"pruned": "duplicate of trial 1"}, "PRUNED"),
        ({"default": True}, "COMPLETE"),
    ]:
        trials.add_trial(
            optuna.trial.create_trial(
                state=getattr(optuna.trial.TrialState, state),
                value=1.0 if state == "COMPLETE" else None,
                user_attrs={"config": cfg, **attrs},
            )
        )
    found = study.summarise(KEY, trials, CFG)
    assert (found.complete, found.rejected, found.pruned, found.failed, found.skipped) == (
        1, 1, 1, 1, 1,
    )  # fmt: skip
    out = io.StringIO()
    run.report([found], out)
    listed = out.getvalue().split("configurations that failed or gave wrong results:")[1]
    lines = listed.strip().splitlines()
    assert len(lines) == 3 and all(str(KEY) in line and "block_m=128" in line for line in lines)
    assert "RuntimeError: cudaErrorLaunchOutOfResources" in lines[0]
    assert "40 bytes of local memory" in lines[1] and "wrong result" in lines[2]


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs real studies through `numflash autotune`")
def test_study_in_the_simulator_picks_a_winner_that_the_next_call_uses(cache_dirs, capsys):
    """The real portable kernel, real Optuna (TPE, SQLite), a tiny problem, three trials."""
    from tuning.objective import Workload
    from tuning.study import storage_url, tune_key

    device = numflash.device.current_device()
    key = cache.ProblemKey("portable", "float32", 16, "causal", 128)
    workload = Workload(batch=1, nheads=1, seqlen=40, check_seqlen=24, check_nheads=1)
    timing = dict(warmup=1, runs=3)
    # the study's own winner (the runoff, tested above, would time it again)
    result = tune_key(
        key, device, trials=3, workload=workload, timing=timing, progress=True, runoff_rounds=0
    )
    assert result.complete >= 1 and result.best_config is not None
    # One progress bar over the measured configurations, ending at 3 of 3 with the best time.
    bar = capsys.readouterr().err.split("\r")
    assert "3/3" in bar[-1] and f"best {result.best_ms:.3f} ms" in bar[-1], bar
    assert "Best trial" not in "".join(bar)  # not Optuna's own bar (one per optimize call)
    # Three configurations were compiled and run; skipped proposals did not use up the budget.
    assert result.complete + result.rejected + result.pruned + result.failed == 3
    assert result.default_ms is not None and result.best_ms <= result.default_ms
    assert storage_url(device).endswith("studies-sm_52.sqlite3")
    # Resuming: asking for 3 trials again runs nothing new.
    # (with a runoff where the study's winner is not the default: the calls run here too)
    again = tune_key(key, device, trials=3, workload=workload, timing=timing, runoff_rounds=1)
    assert again.best_config in (result.best_config, result.default_config)
    assert (again.runoff is not None) == (result.best_config != result.default_config)
    assert (again.complete, again.pruned, again.rejected, again.skipped) == (
        result.complete,
        result.pruned,
        result.rejected,
        result.skipped,
    )
    # The default first, then its neighbours along each knob, then the sampler's proposals.
    import optuna as _optuna

    from tuning.study import study_name

    study = _optuna.load_study(study_name=study_name(key), storage=storage_url(device))
    seeds = [t.user_attrs.get("config") for t in study.trials[:3]]
    default = numflash.config.PortableConfig(**{
        k: v for k, v in seeds[0].items() if k != "family"})  # fmt: skip
    assert seeds[1:] == [c.to_dict() for c in space.neighbours(default, 16, device)[:2]]
    cache.record(device, {key: result.entry()})
    q, k, v = random_qkv(1, 100, 100, 2, 1, 16, "float32")
    chosen = numflash.selected_config(q, k, v, causal=True)
    assert chosen.config == result.best_config and chosen.source.startswith("user cache")


# -- the backward families -------------------------------------------------------------------------


def test_backward_families_have_defaults_and_spaces():
    from numflash.config import (
        PortableBackwardConfig,
        TensorCoreBackwardConfig,
        WgmmaBackwardConfig,
    )
    from numflash.selection import default_config

    assert default_config("portable-backward", 40, H200) == (40, PortableBackwardConfig(64, 64))
    from numflash.kernels.backward_mma import dq_split

    # the dQ kernel (the default) has no dQ split to even out: 8 warps at head_dim 48 too
    assert default_config("tensor-core-backward", 40, H200) == (
        48,
        TensorCoreBackwardConfig(64, 8, 2, dq_separate=True),
    )
    # the Hopper family: its own configuration, feasible on compute capability 9.x at head_dim
    # 64 and 128 (as padded) only
    # (the ring with pingpong turns, filled by TMA; at 64 with 128-row tiles)
    pingpong = WgmmaBackwardConfig(num_warps=8, stages=3, ring=True, pingpong=True, tma=True)
    tiles128 = WgmmaBackwardConfig(8, 3, ring=True, pingpong=True, tma=True, block_m=128)
    for hd, default in ((64, tiles128), (120, pingpong), (128, pingpong)):
        assert default_config("wgmma-backward", hd, H200) == ((hd + 15) // 16 * 16, default)
    wgmma = WgmmaBackwardConfig()
    assert not wgmma.problems(128, H200) and not wgmma.problems(64, H200)
    assert any("compute capability 9.x" in r for r in wgmma.problems(128, A100))
    assert any("head_dim 64 or 128" in r for r in wgmma.problems(96, H200))
    # three stages exactly with the mbarrier ring; pingpong with the ring's two warpgroups
    assert {
        (c.num_warps, c.stages, c.ring, c.pingpong)
        for c in space.feasible_points(WgmmaBackwardConfig, 128, H200)
    } == {
        (4, 1, False, False),
        (4, 2, False, False),
        (8, 1, False, False),
        (8, 2, False, False),
        (4, 3, True, False),
        (8, 3, True, False),
        (8, 3, True, True),
    }
    # dQ added up in the dK/dV kernel: one warpgroup cannot hold its 128 columns at head_dim
    # 128 beside dK and dV (ptxas spills), two can; at 64 either
    fused = {
        (hd, c.num_warps)
        for hd in (64, 128)
        for c in space.feasible_points(WgmmaBackwardConfig, hd, H200)
        if not c.dq_separate
    }
    assert fused == {(64, 4), (64, 8), (128, 8)}
    # ... with the ring only where the warpgroups take turns and send dQ by bulk reductions
    ring_fused = {
        (c.num_warps, c.pingpong, c.dq_bulk)
        for c in space.feasible_points(WgmmaBackwardConfig, 128, H200)
        if c.ring and not c.dq_separate
    }
    assert ring_fused == {(8, True, True)}
    for hd in (64, 128):
        assert default_config("tensor-core-backward", hd, A100) == (
            hd,
            TensorCoreBackwardConfig(64, 8, 2, dq_separate=True),
        )
    feasible = space.feasible_points(TensorCoreBackwardConfig, 128, H200)
    assert TensorCoreBackwardConfig() in feasible
    # head_dim 48's 6 column tiles of dQ cannot go to 8 warps in pairs: atomic dQ is pruned
    assert TensorCoreBackwardConfig(64, 8, 2, dq_separate=False) not in (
        space.feasible_points(TensorCoreBackwardConfig, 48, H200)
    )
    assert all(dq_split(128, cfg.block_m, cfg.num_warps) for cfg in feasible if not cfg.dq_separate)
    # 244 KiB of shared memory with dS; 2 x 8 KiB less without it
    assert TensorCoreBackwardConfig(128, 8, 2, dq_separate=False) not in feasible
    assert default_config("tensor-core-backward", 200, H200) == (
        224,
        TensorCoreBackwardConfig(32, 8, 2, dq_separate=True, head_split=2),
    )
    # less shared memory per block (sm_86/89: 99 KiB): smaller tiles that fit
    small = dataclasses.replace(H200, max_shared_per_block=99 * 1024)
    for hd in (64, 128, 256):
        padded, cfg = default_config("tensor-core-backward", hd, small)
        assert not cfg.problems(padded, small), (hd, cfg)
    assert default_config("tensor-core-backward", 256, small)[1] == TensorCoreBackwardConfig(
        16, 4, 1, head_split=2
    )
    wide = space.feasible_points(TensorCoreBackwardConfig, 256, H200)
    assert wide and all(cfg.head_split == 2 for cfg in wide)  # 128 columns a block at most


def test_cli_dry_run_plans_the_backward(tmp_path):
    flags = ["--family", "tensor-core-backward", "--head-dims", "40", "--dtypes", "bfloat16"]
    proc = _autotune(tmp_path, *flags, "--seqlens", "1000", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "tensor-core-backward/bfloat16/hd48/full/s1024:" in proc.stdout


def test_tuned_tensor_core_backward_is_chosen_with_the_dq_kernel_if_deterministic(cache_dirs):
    from numflash.config import TensorCoreBackwardConfig

    device = numflash.device.current_device()
    q, k, v = random_qkv(1, 100, 100, 2, 1, 64, "float16")
    if device.simulated or not device.runs("mma.sync"):
        expected = "portable-backward"
    else:  # head_dim 64: the Hopper kernels where there is wgmma
        expected = "wgmma-backward" if device.has_wgmma else "tensor-core-backward"
    assert numflash.selected_backward_config(q, k, v).config.family == expected
    tuned = TensorCoreBackwardConfig(32, 2, dq_separate=False)
    key = cache.ProblemKey("tensor-core-backward", "float16", 64, "full", 128)
    cache.record(device, {key: entry(tuned)})
    chosen = numflash.selected_backward_config(q, k, v)
    assert chosen.config == tuned and chosen.source.startswith("user cache")
    chosen = numflash.selected_backward_config(q, k, v, deterministic=True)
    assert chosen.config == TensorCoreBackwardConfig(32, 2, dq_separate=True)
    assert chosen.source.endswith(", dq_separate for deterministic=True")


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs real studies through `numflash autotune`")
def test_backward_study_in_the_simulator_checks_gradients_and_records(cache_dirs):
    """Real Optuna over the portable backward: trials are checked on all three gradients."""
    from tuning.objective import Workload
    from tuning.study import tune_key

    device = numflash.device.current_device()
    key = cache.ProblemKey("portable-backward", "float32", 8, "causal", 128)
    workload = Workload(batch=1, nheads=1, seqlen=24, check_seqlen=20, check_nheads=1)
    result = tune_key(key, device, trials=2, workload=workload, timing=dict(warmup=1, runs=2))
    assert result.complete + result.rejected + result.pruned + result.failed == 2
    assert result.rejected == 0 and result.best_config is not None
    cache.record(device, {key: result.entry()})
    q, k, v = random_qkv(1, 90, 90, 2, 1, 8, "float32")
    chosen = numflash.selected_backward_config(q, k, v, causal=True)
    assert chosen.config == result.best_config and chosen.source.startswith("user cache")


def test_shipped_configurations_match_the_kernels():
    """numflash/configs/*.json must hold entries for the present kernel sources: stale ones
    would be ignored, with a warning at every user's first call. Re-tune after kernel edits."""
    from numflash.config import TensorCoreConfig

    files = sorted(cache.SHIPPED_DIR.glob("sm_*.json"))
    assert files, "no shipped configurations"
    for path in files:
        data = json.loads(path.read_text())
        assert data["format"] == cache.FORMAT and data.get("command", "").startswith(
            "numflash autotune"
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a stale or malformed entry warns: fail here instead
            entries = cache.shipped_entries(path.stem)
        assert len(entries) == len(data["entries"]), path
        for key, e in entries.items():
            cfg = numflash.config.config_from_dict(e["config"])
            if isinstance(cfg, TensorCoreConfig):
                assert not cfg.problems(key.head_dim, H200), (key, cfg)
            assert e["time_ms"] <= e["default_ms"], (key, e)


# -- the KV-cache families -------------------------------------------------------------------------


def test_decode_study_checks_and_records(cache_dirs):
    """Real Optuna over the portable KV-cache kernels: each trial is a decoding step checked
    against the reference over the cache; the winner is what the next call of that size uses.
    On a GPU the kernel's rows live in local memory, which must not prune the trials."""
    from tuning.objective import Workload
    from tuning.study import tune_key

    device = numflash.device.current_device()
    # the checked call's grid: 2 sequences x 1 KV head x 1 block of 16 rows
    grid = numflash.selection.grid_class(2, device)
    key = cache.ProblemKey("portable-decode", "float32", 8, "full", cache.seqlen_bucket(30), grid)
    workload = Workload(
        batch=2, nheads=4, nheads_k=1, seqlen=30, check_seqlen=20, check_nheads=4, check_nheads_k=1
    )
    result = tune_key(key, device, trials=2, workload=workload, timing=dict(warmup=1, runs=2))
    assert result.complete + result.rejected + result.pruned + result.failed == 2
    assert result.rejected == 0 and result.complete >= 1 and result.best_config is not None, result
    cache.record(device, {key: result.entry()})
    q = random_qkv(2, 1, 1, 4, 4, 8, "float32")[0]
    k_cache, v_cache = random_qkv(2, 30, 30, 1, 1, 8, "float32")[1:]
    chosen, _ = numflash.selected_kvcache_config(q, k_cache, v_cache, cache_seqlens=30)
    assert chosen.config == result.best_config and chosen.source.startswith("user cache")


def test_decode_workloads_put_the_grid_in_the_key_s_class():
    from numflash.selection import grid_class
    from tuning.objective import Workload
    from tuning.run import tunable

    def key(grid, seqlen=4096, head_dim=128):
        return cache.ProblemKey("tensor-core-decode", "float16", head_dim, "full", seqlen, grid)

    # the benchmark's batch 8 and (about) its batch 64, 32 query and 8 KV heads
    w = Workload.for_key(key("few"), H200)
    assert (w.batch, w.nheads, w.nheads_k, w.seqlen) == (8, 32, 8, 4096)
    w = Workload.for_key(key("many"), H200)
    assert (w.batch, w.nheads, w.nheads_k, w.seqlen) == (66, 32, 8, 4096)
    for grid in cache.GRIDS:
        for head_dim in (64, 128, 256):
            for device in (H200, A100):
                w = Workload.for_key(key(grid, head_dim=head_dim), device)
                assert grid_class(w.batch * w.nheads_k, device) == grid, (grid, head_dim)
    # 66 caches of 131072 keys would not fit a tuning run: that key is skipped, with why
    kept, skipped = tunable([key("few", 131072), key("many", 131072)], H200)
    assert list(kept) == [key("few", 131072)]
    assert kept[key("few", 131072)] == Workload.for_key(key("few", 131072), H200)
    assert [k for k, _ in skipped] == [key("many", 131072)] and "66" in skipped[0][1]


def test_packed_forward_takes_the_dense_choice(cache_dirs):
    """attention_varlen's configuration: a tuned entry of the max lengths' bucket, as for a dense
    call; where nothing is tuned, the dense heuristic (the Hopper kernel's on compute capability
    9.x at head_dim 64, 128 and 256)."""
    from numflash import selection, validation
    from numflash.config import WgmmaForwardConfig

    def packed_problem(head_dim, causal):
        q = xp.zeros((8, 16, head_dim), np.float16)
        cu = xp.asarray(np.array([0, 8], np.int32))
        return validation.varlen_problem(q, q, q, cu, cu, 4096, 4096, causal, None, (-1, -1))[-1]

    chosen = selection.forward_varlen(packed_problem(128, True), H200)
    assert chosen.source == "heuristic"
    assert chosen.config == wgmma_forward.default_wgmma_forward_config(128)
    assert not chosen.config.problems(128, H200)
    chosen = selection.forward_varlen(packed_problem(64, False), A100)
    assert chosen.config == selection.default_tensor_core_config(64)  # the dense tiles
    cache.record(A100, {KEY: entry(CFG)})  # tuned: tensor-core fp16 hd128 causal s4096
    chosen = selection.forward_varlen(packed_problem(128, True), A100)
    assert chosen.config == CFG and chosen.source.startswith("user cache")
    tuned = WgmmaForwardConfig(2, 64, 4)
    hopper_key = cache.ProblemKey("wgmma-forward", "float16", 128, "causal", 4096)
    cache.record(H200, {hopper_key: entry(tuned)})
    chosen = selection.forward_varlen(packed_problem(128, True), H200)
    assert chosen.config == tuned and chosen.source.startswith("user cache")


def test_decode_defaults_fit_every_head_dim_and_follow_the_grid():
    from numflash.config import TensorCoreDecodeConfig
    from numflash.selection import default_config, default_tensor_core_decode_config, grid_class

    # one block per SM (8 warps, 3 slots) for a grid that does not fill two per SM; two blocks
    # per SM (4 warps) for one that does (the H200's 132 SMs: 264 blocks)
    assert grid_class(263, H200) == "few" and grid_class(264, H200) == "many"
    assert default_tensor_core_decode_config(128, H200, "few") == TensorCoreDecodeConfig(16, 8, 3)
    assert default_tensor_core_decode_config(128, H200, "many") == TensorCoreDecodeConfig(16, 4, 3)
    small = dataclasses.replace(H200, max_shared_per_block=99 * 1024)
    for device in (H200, A100, small):
        for hd in (8, 64, 96, 128, 192, 256):
            for grid in cache.GRIDS:
                cfg = default_tensor_core_decode_config(hd, device, grid)
                assert not cfg.problems(hd, device), (device.name, hd, grid, cfg)
    # 8 warps of 128-key slots do not fit at head_dim 256 on the H200: fewer warps do
    assert default_config("tensor-core-decode", 256, H200)[1] == TensorCoreDecodeConfig(16, 4, 3)
