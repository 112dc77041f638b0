"""Inputs a careless or hostile user gave, each once fatal or silently wrong."""

import json

import numpy as np
import pytest
from support import random_qkv

import numflash
from numflash import cache
from numflash.device import current_device


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMFLASH_CACHE_DIR", str(tmp_path))
    cache.reload()
    yield tmp_path / f"{current_device().arch}.json"  # the file this device's calls read
    cache.reload()


def _write(path, entries):
    path.write_text(json.dumps({"format": cache.FORMAT, "arch": path.stem, "entries": entries}))
    cache.reload()


def _entry(config, family_revision=numflash.PortableConfig.REVISION):
    """A cache entry under a portable key, of the portable kernels' current revision (so that
    what the test exercises is the entry itself, not a stale revision)."""
    return {"config": config, "time_ms": 1.0, "kernel_revision": family_revision}


@pytest.mark.simulator
@pytest.mark.parametrize(
    "entries",
    [
        [1, 2],  # a list, not an object
        {"portable/float16/hd16/full/s0": _entry({"family": "portable"})},  # bucket 0
        {"portable/float16/hd16/full/s128": _entry({"family": "portable-backward"})},
        {"portable/float16/hd16/full/s128": _entry({"family": "portable", "block_m": 64.0})},
        {"portable/float16/hd16/full/s128": "not an object"},
    ],
)
def test_a_bad_cache_file_warns_and_never_breaks_a_call(user_cache, entries):
    _write(user_cache, entries)
    q, k, v = random_qkv(1, 5, 5, 1, 1, 16, "float16")
    with pytest.warns(RuntimeWarning):
        out = numflash.attention(q, k, v)
    assert not np.isnan(out.astype(np.float32)).any()
    assert numflash.selected_config(q, k, v).source == "heuristic"


def test_float_configuration_fields_are_refused_by_name():
    q, k, v = random_qkv(1, 5, 5, 1, 1, 16, "float16")
    with pytest.raises(ValueError, match="block_m=64.0 is not one of"):
        numflash.attention(q, k, v, config=numflash.PortableConfig(block_m=64.0))


@pytest.mark.parametrize("scale", [1e300, 10**400, -1e39])
def test_a_scale_beyond_float32_is_refused(scale):
    q, k, v = random_qkv(1, 5, 5, 1, 1, 16, "float16")
    with pytest.raises(ValueError, match="softmax_scale must be finite in float32"):
        numflash.attention(q, k, v, softmax_scale=scale)


@pytest.mark.simulator
def test_read_only_inputs_work_and_a_read_only_out_is_refused():
    q, k, v = random_qkv(1, 5, 5, 1, 1, 16, "float16")
    k_ro = np.broadcast_to(k, k.shape)
    assert not k_ro.flags.writeable
    expected = numflash.attention(q, k, v)
    assert (numflash.attention(q, k_ro, v).view(np.uint16) == expected.view(np.uint16)).all()
    out = np.empty_like(q)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        numflash.attention(q, k, v, out=out)


def test_out_overlapping_the_inputs_is_refused():
    q, k, v = random_qkv(1, 6, 6, 1, 1, 16, "float16")
    with pytest.raises(ValueError, match="out overlaps k"):
        numflash.attention(q, k, v, out=k)
    with pytest.raises(ValueError, match="out overlaps q"):
        numflash.attention(q, k, v, out=q)


@pytest.mark.parametrize(
    "flag, value",
    [("--head-dims", "0"), ("--head-dims", "300"), ("--trials", "0"), ("--seqlens", "-4096")]
    + [("--timeout-per-key", "-1"), ("--budget", "-5")],
)
def test_autotune_flags_out_of_range_are_refused_by_name(flag, value, capsys):
    from numflash.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["autotune", "--dry-run", flag, value])
    assert stop.value.code == 2
    assert flag in capsys.readouterr().err


def test_info_lists_an_entry_without_a_time():
    from numflash.cli import _ms

    assert _ms(None) == "-" and _ms("x") == "-" and _ms(1.5) == "1.500 ms"


@pytest.mark.simulator
def test_autotune_reports_a_cache_dir_that_is_a_file(tmp_path):
    import os
    import subprocess
    import sys

    blocker = tmp_path / "file"
    blocker.write_text("")
    env = dict(os.environ, NUMFLASH_CACHE_DIR=str(blocker), NUMBA_ENABLE_CUDASIM="1")
    args = [
        "autotune",
        "--family",
        "portable",
        "--head-dims",
        "16",
        "--dtypes",
        "float32",
        "--masks",
        "full",
        "--seqlens",
        "64",
        "--trials",
        "1",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "numflash", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot write the configuration cache" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "forward_config, backward_config",
    [
        (None, None),
        (
            numflash.TensorCoreConfig(block_m=16, block_n=16, num_warps=1),
            numflash.TensorCoreBackwardConfig(block_m=16, num_warps=1),
        ),
    ],
    ids=["default", "tensor-core"],
)
@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_in_a_key_reaches_every_row_that_sees_it(forward_config, backward_config, causal):
    """A NaN key makes the scores of every row that sees it NaN: those rows' outputs, their
    lse and every gradient they touch are NaN (the exact result), never the 0 and -inf of a
    row that sees no key."""
    from support import random_array, to_numpy

    q, k, v = random_qkv(1, 6, 6, 1, 1, 16, "float16")
    k[0, 2, 0, 3] = np.nan
    out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True, config=forward_config)
    sees = np.arange(6) >= 2 if causal else np.ones(6, bool)  # query rows that see key 2
    out64, lse64 = to_numpy(out).astype(np.float32), to_numpy(lse)
    assert np.isnan(out64[0, sees]).all() and np.isnan(lse64[0, 0, sees]).all()
    assert np.isfinite(out64[0, ~sees]).all() and np.isfinite(lse64[0, 0, ~sees]).all()
    dout = random_array(q.shape, "float16")
    dq, dk, dv = numflash.attention_backward(
        dout, q, k, v, out, lse, causal=causal, config=backward_config
    )
    dv64 = to_numpy(dv).astype(np.float32)
    # every key is seen by some row that sees key 2 (rows 2-5 under the causal mask)
    assert np.isnan(dv64).all(), "a NaN score must reach every dv row it weighs"
    assert np.isnan(to_numpy(dq).astype(np.float32)[0, sees]).all()


def test_info_lists_cache_entries_that_lack_a_time(user_cache):
    """An entry without time_ms (or with a string there) is listed with '-', not a KeyError."""
    import io

    from numflash.cli import _print_entries
    from numflash.device import current_device

    key = "portable/float16/hd16/full/s128"
    config = {"family": "portable", "block_m": 64, "block_n": 32}
    revision = numflash.PortableConfig.REVISION
    _write(user_cache, {key: {"config": config, "kernel_revision": revision, "default_ms": "?"}})
    out = io.StringIO()
    _print_entries(current_device(), out)
    assert f"{key}: block_m=64, block_n=32  (-; default -)" in out.getvalue()
