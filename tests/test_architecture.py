"""The layers of ARCHITECTURE.md hold: import-linter's contracts in pyproject.toml (layers, the
CLI through the API only, kernels without formats, no import cycles) are kept, and they do
catch a break: the same contracts on a copy of the package with one upward import, and with one
cycle, fail. Importing qtool installs no process-wide hook."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

pytest.importorskip("importlinter", reason="import-linter is a test dependency (pip install -e '.[test]')")


def lint(root) -> subprocess.CompletedProcess:
    """`lint-imports` with the repo's contracts, on the package found under `root`."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", code, "--config", str(REPO / "pyproject.toml")],
        cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_import_contracts_are_kept():
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture
def package_copy(tmp_path):
    shutil.copytree(REPO / "qtool", tmp_path / "qtool", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return tmp_path


def test_an_upward_import_breaks_the_layers(package_copy):
    with open(package_copy / "qtool" / "scheme.py", "a") as handle:
        handle.write("\nfrom qtool import api as _upward  # a fact importing the API\n")
    result = lint(package_copy)
    assert result.returncode != 0
    assert "qtool.scheme is not allowed to import qtool.api" in result.stdout


def test_a_cycle_is_refused(package_copy):
    with open(package_copy / "qtool" / "formats" / "shards.py", "a") as handle:
        handle.write("\nfrom qtool.formats import loader as _cycle  # shards <-> loader\n")
    result = lint(package_copy)
    assert result.returncode != 0
    assert "No import cycles anywhere BROKEN" in result.stdout


def test_importing_qtool_registers_no_process_hooks():
    """The library changes no process state on import: exit hooks are installed by the first
    output a run stages, not by `import`."""
    code = textwrap.dedent(
        """
        import atexit, logging, sys  # logging registers its own exit hook when first imported
        before = atexit._ncallbacks()
        import qtool.api, qtool.formats.staging, qtool.formats.writer, qtool.pipeline, qtool.layouts
        sys.exit(atexit._ncallbacks() - before)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{result.returncode} exit hooks registered on import: {result.stderr}"
