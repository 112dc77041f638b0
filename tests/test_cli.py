"""The numflash command."""

import subprocess
import sys


def test_info_exits_zero_and_names_the_device_or_its_absence():
    proc = subprocess.run(
        [sys.executable, "-m", "numflash", "info"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("numflash ")
    assert "GPU:" in proc.stdout
    assert "configuration cache:" in proc.stdout


def test_unknown_command_is_an_error():
    proc = subprocess.run(
        [sys.executable, "-m", "numflash.cli", "frobnicate"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_info_names_the_kernels_a_hopper_gpu_runs(monkeypatch):
    """The GPU branch of ``numflash info``, on a stand-in H200: each kind of call's kernels."""
    import io

    import numflash.device
    import numflash.kernels.jit
    from numflash import cli

    h200 = numflash.device.DeviceInfo("NVIDIA H200", (9, 0), 132, 232448, 1024)
    monkeypatch.setattr(numflash.kernels.jit, "SIMULATOR", False)
    monkeypatch.setattr(numflash.device, "gpu_available", lambda: True)
    monkeypatch.setattr(numflash.device, "current_device", lambda: h200)
    monkeypatch.setattr(cli, "_cuda_versions", lambda: ("13.0", "13.0"))
    out = io.StringIO()
    assert cli.info(out) == 0
    text = out.getvalue()
    assert "GPU: NVIDIA H200, compute capability 9.0" in text
    assert "kernel paths: wgmma with TMA loads at head_dim 64, 128, 256" in text
    assert (
        "KV-cache kernels: the wgmma forward past 16 new rows (48 over pages read by cp.async)"
    ) in text
