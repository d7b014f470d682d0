"""The code base passes its own ruff configuration (pyproject.toml, [tool.ruff])."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> str | None:
    beside = Path(sys.executable).parent / "ruff"  # the one installed with this interpreter (pip install -e .[dev])
    if beside.is_file():
        return str(beside)
    return shutil.which("ruff")


def test_ruff_check_passes():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install 'ruff>=0.6', or the project's [dev] extra)")
    proc = subprocess.run([ruff, "check", "src", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"ruff check failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
