"""A kernel whose generated code changes must say so before it lands.

tools/ptx_fingerprint.py compiles representative kernels of every family and fingerprints their
normalised PTX; tests/ptx_fingerprints.json holds the fingerprints and each family's REVISION
(numflash/config.py) they were recorded at. After an intended change, either:

- bump the family's REVISION when the change can move its timings (a new loop, other tiles):
  that retires the tuned configurations measured on the old code (numflash/cache.py); or
- keep it when the change cannot (docs/performance.md says how that was measured);

then run ``python tools/ptx_fingerprint.py --record`` and commit the record with the change.
"""

import json
from pathlib import Path

import pytest
from support import json_from_subprocess

from numflash.config import CONFIG_TYPES

ROOT = Path(__file__).resolve().parent.parent
RECORD = json.loads((ROOT / "tests" / "ptx_fingerprints.json").read_text())


@pytest.fixture(scope="module")
def current(tmp_path_factory, worker_id):
    script = ROOT / "tools" / "ptx_fingerprint.py"
    return json_from_subprocess(
        [script, "--compact"], "ptx-fingerprints", tmp_path_factory, worker_id
    )


def test_every_family_is_fingerprinted():
    assert set(RECORD["families"]) == set(CONFIG_TYPES)


def test_kernel_code_changes_are_recorded(current):
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
            raise AssertionError(
                f"the {family} kernels' PTX changed ({', '.join(changed)}) since the record: "
                "bump REVISION in numflash/config.py if the change can move their timings, then "
                "run tools/ptx_fingerprint.py --record (this module's docstring)"
            )
        else:
            assert revision == recorded["revision"], (
                f"{family}: REVISION {revision} but the recorded fingerprints are of revision "
                f"{recorded['revision']}: run tools/ptx_fingerprint.py --record"
            )


def test_no_kernel_computes_in_float64(current):
    """No fingerprinted kernel has a float64 instruction: Numba compares an unsigned 64-bit
    integer with a signed one in float64 (a conversion and a double-precision compare), which
    once cost the Hopper backward's dQ kernel 4% of its time in its ring's loop
    (docs/performance.md, "Where a query block's time goes")."""
    assert current["float64"] == []
