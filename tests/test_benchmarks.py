"""The benchmark scripts, the lab tools and the examples parse their arguments and import what they need:
each one's --help, in a subprocess (CI runs none of them, and a broken import or option would
otherwise surface only on the GPU machine); the one tool that needs no GPU runs."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted(
    str(p.relative_to(ROOT))
    for folder in ("benchmarks", "tools", "examples")
    for p in (ROOT / folder).glob("*.py")
    if p.name != "peers.py"
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help(script):
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run(
        [sys.executable, str(ROOT / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


def test_the_replay_cost_tool_runs_without_a_gpu_and_every_repeat_replays():
    """tools/replay_cost.py times numflash's own replay path on stand-ins: it must keep
    matching numflash.api's internals (it exits non-zero when a repeated call did not replay)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "replay_cost.py"), "--runs", "1", "--calls", "10"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=path),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert {"attention_us", "attention_backward_us", "attention_with_kvcache_us"} <= set(
        json.loads(done.stdout)
    )


def test_the_full_path_cost_tool_runs_without_a_gpu():
    """tools/full_path_cost.py times the full path's parts on stand-ins: it must keep matching
    numflash.validation's and numflash.launch's internals."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, str(ROOT / "tools" / "full_path_cost.py"), "--runs", "1"]
    done = subprocess.run(
        [*command, "--calls", "10"], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    assert {"validation_us", "selection_us", "launch[WgmmaForwardConfig]_us"} <= set(results)


def test_the_ncu_source_tool_sums_a_source_page(tmp_path):
    """tools/ncu_source.py reads ncu's source page as ``--csv --print-source sass`` writes it
    (the kernel's name on a line of its own, then the header, then an instruction a row)."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "# Samples",
              "stall_barrier", "stall_wait", "stall_barrier (Not Issued)"]  # fmt: skip
    rows = [["Kernel Name", "dkdv(...)"], header,
            ["0x0", "  LDC R1, c[0x0][0x28]", "10", "10", "0", "10", "0"],
            ["0x10", "  WARPGROUP.DEPBAR.LE gsb0, 0x0", "30", "30", "30", "0", "25"],
            ["0x20", "  EXIT", "60", "60", "20", "40", "0"]]  # fmt: skip
    page = tmp_path / "page.csv"
    page.write_text("\n".join(",".join(f'"{cell}"' for cell in row) for row in rows) + "\n")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "ncu_source.py"), str(page), "--ranges", "0-2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "3 instructions, 100 samples"
    assert lines[1] == "by reason: barrier 50.0%, wait 50.0%"
    assert lines[-1].startswith("[0, 2)  40.0%")
