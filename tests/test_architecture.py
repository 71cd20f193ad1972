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

from tests.conftest import REPO, SAMPLES

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


def test_a_plan_is_a_value(tmp_path):
    """`Plan` and `Job` are frozen: assigning a field of a planned quantization raises, so a
    stage after planning (calibration) cannot rewrite it, and returns what it made instead."""
    import dataclasses

    from qtool import api

    for output, scheme in ((tmp_path / "out", "W4A16"), (tmp_path / "out.gguf", "q4_0")):
        plan = api.prepare_quantize(SAMPLES / "tiny-llama", output, scheme)
        try:
            with pytest.raises(dataclasses.FrozenInstanceError):
                plan.metadata = None
            with pytest.raises(dataclasses.FrozenInstanceError):
                plan.calibration = {}
            job = next(job for job in plan.jobs if job.encoding is not None)
            with pytest.raises(dataclasses.FrozenInstanceError):
                job.encoding = None
            with pytest.raises(dataclasses.FrozenInstanceError):
                job.transform = None
        finally:
            plan.source.close()


def _plan_field_assignments(root) -> list[str]:
    """Every `<plan>.<field> = ...` and `<job>.<field> = ...` (also augmented, and setattr /
    object.__setattr__ with such a field named) in the package's modules, where the field is one
    of `Plan`'s or `Job`'s and the name ends in plan or job."""
    import ast
    import dataclasses

    from qtool.plan import Job, Plan

    fields = {f.name for f in dataclasses.fields(Plan)} | {f.name for f in dataclasses.fields(Job)}

    def planned(node) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name.lower().endswith(("plan", "job")) and name != "shard_job"

    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets = list(node.targets) if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets += target.elts
                    continue
                while isinstance(target, ast.Subscript):  # plan.config["key"] = ... changes the plan too
                    target = target.value
                if isinstance(target, ast.Attribute) and target.attr in fields and planned(target.value):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("setattr", "__setattr__") and len(node.args) >= 2:
                if planned(node.args[0]) and isinstance(node.args[1], ast.Constant) and node.args[1].value in fields:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_nothing_assigns_to_a_plan_or_job_after_planning():
    """No module changes a plan's or a job's fields: the planning package and the layouts build
    new values (`dataclasses.replace`), calibration returns a `Calibrated` the executor applies
    beside the plan. A deliberate `plan.metadata = ...` is found."""
    assert _plan_field_assignments(REPO / "qtool") == []


def test_the_plan_assignment_check_finds_one(package_copy):
    with open(package_copy / "qtool" / "pipeline.py", "a") as handle:
        handle.write("\n\ndef _rewrite(plan, job):\n    plan.metadata = None\n    job.encoding += 1\n    setattr(plan, 'config', {})\n    plan.config['x'] = 1\n")
    assert len(_plan_field_assignments(package_copy / "qtool")) == 4
