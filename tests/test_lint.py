"""`ruff check` and `ruff format --check` over the repository, with pyproject.toml's settings:
a finding or an unformatted file fails the suite, so `.ci/run` lints as it tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is a test dependency (pip install -e '.[test]')")
    return [found]


@pytest.mark.parametrize(
    "command", [["check", "--no-cache"], ["format", "--check", "--no-cache"]], ids=["check", "format"]
)
def test_ruff_finds_nothing(command):
    result = subprocess.run([*_ruff(), *command, "."], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
