"""A kernel whose generated code changes must say so: its family's REVISION (numflash/config.py)
goes up, which retires the tuned configurations measured on the old code (numflash/cache.py).

tools/ptx_fingerprint.py compiles representative kernels of every family and fingerprints their
normalised PTX; tests/ptx_fingerprints.json holds the fingerprints of the current revisions.
After an intended change: bump the family's REVISION, run
``python tools/ptx_fingerprint.py --record``, and commit both.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from numflash.config import CONFIG_TYPES

ROOT = Path(__file__).resolve().parent.parent
RECORD = json.loads((ROOT / "tests" / "ptx_fingerprints.json").read_text())


@pytest.fixture(scope="module")
def current():
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "ptx_fingerprint.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_every_family_is_fingerprinted():
    assert set(RECORD["families"]) == set(CONFIG_TYPES)


def test_changed_kernels_bump_their_family_revision(current):
    if current["toolchain"] != RECORD["toolchain"]:
        pytest.skip(
            f"PTX recorded with {RECORD['toolchain']}, this toolchain is {current['toolchain']}"
        )
    for family, recorded in RECORD["families"].items():
        now = current["families"][family]
        revision = CONFIG_TYPES[family].REVISION
        if now["kernels"] != recorded["kernels"]:
            changed = sorted(
                k for k in now["kernels"] if now["kernels"][k] != recorded["kernels"].get(k)
            )
            assert revision > recorded["revision"], (
                f"the {family} kernels' PTX changed ({', '.join(changed)}) but REVISION is still "
                f"{revision}: bump it in numflash/config.py and run tools/ptx_fingerprint.py --record"
            )
        else:
            assert revision == recorded["revision"], (
                f"{family}: REVISION {revision} but the recorded fingerprints are of revision "
                f"{recorded['revision']}: run tools/ptx_fingerprint.py --record"
            )
