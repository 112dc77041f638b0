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
