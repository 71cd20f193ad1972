"""The layers of ARCHITECTURE.md hold: import-linter's contracts in pyproject.toml (layers, the
CLI through the API only, kernels without formats, no import cycles) are kept, and they do
catch a break: the same contracts on a copy of the package with one upward import, and with one
cycle, fail. Importing qtool installs no process-wide hook."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

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


# -- one table of GGML types ------------------------------------------------------------------------


def ggml_type_tables(source: str) -> list[str]:
    """Where a module's text holds a table of GGML types besides `qtool.ggml_types`' rows: a dict
    keyed by GGML block-type names (two or more, every key one), or a tuple, list or set of
    them alone, two or more at module level, three or more anywhere. A rule comparing against
    a name or two (llama.cpp's mixes: `new in ("Q3_K", "Q4_K")`) is not a table, nor is a
    dict keyed by llama.cpp's file types, which holds names that are not types (Q3_K_M)."""
    import ast

    from qtool.ggml_types import GGML_TYPES

    names = {row.name for row in GGML_TYPES.values() if row.block_size > 1}
    tree = ast.parse(source)
    top = {
        id(node)
        for statement in tree.body
        if isinstance(statement, (ast.Assign, ast.AnnAssign))
        for node in ast.walk(statement)
    }
    found = []
    for node in ast.walk(tree):
        elements = (
            node.keys
            if isinstance(node, ast.Dict)
            else node.elts
            if isinstance(node, (ast.Tuple, ast.List, ast.Set))
            else None
        )
        if not elements or not all(isinstance(e, ast.Constant) and e.value in names for e in elements):
            continue
        least = 2 if isinstance(node, ast.Dict) or id(node) in top else 3
        if len(elements) >= least:
            found.append(f"line {node.lineno}: {', '.join(e.value for e in elements)}")
    return found


def test_there_is_one_table_of_ggml_types():
    """A GGML type is its row in qtool/ggml_types.py: no other module lists types to know a fact
    of them (which need an importance matrix, which gguf-py encodes, which a kernel has)."""
    tables = {}
    for path in sorted((REPO / "qtool").rglob("*.py")):
        if path != REPO / "qtool" / "ggml_types.py":
            found = ggml_type_tables(path.read_text(encoding="utf-8"))
            if found:
                tables[str(path.relative_to(REPO))] = found
    assert not tables, f"a second table of GGML types (make it a field of the rows in qtool/ggml_types.py): {tables}"


def test_a_second_table_of_ggml_types_would_be_found():
    assert ggml_type_tables('NUMPY_TYPES = ("Q8_0", "Q4_0")\n')
    assert ggml_type_tables('def f(t):\n    return t in frozenset({"IQ2_XXS", "IQ2_XS", "IQ1_S"})\n')
    assert ggml_type_tables('def f(t):\n    return {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}.get(t)\n')
    assert not ggml_type_tables('def f(new):\n    return new in ("Q3_K", "Q4_K")\n')  # a rule, not a table
    assert not ggml_type_tables('RULE = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K"}\n')  # keyed by file types
    assert not ggml_type_tables('FLOATS = ("F32", "F16", "BF16")\n')  # plain types are dtypes too


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
            targets = (
                list(node.targets)
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets += target.elts
                    continue
                while isinstance(target, ast.Subscript):  # plan.config["key"] = ... changes the plan too
                    target = target.value
                if isinstance(target, ast.Attribute) and target.attr in fields and planned(target.value):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("setattr", "__setattr__")
                and len(node.args) >= 2
            ):
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
        handle.write(
            "\n\ndef _rewrite(plan, job):\n    plan.metadata = None\n    job.encoding += 1\n    setattr(plan, 'config', {})\n    plan.config['x'] = 1\n"
        )
    assert len(_plan_field_assignments(package_copy / "qtool")) == 4


# -- the calibration runner knows no algorithm ------------------------------------------------------


ALGORITHM_WORDS = ("gptq", "awq", "rtn", "imatrix", "true_sequential", "actorder", "smooth")


def algorithm_names_in(source: str) -> list[str]:
    """Where `source` names a calibration algorithm in its code (not in its docstrings): an
    imported module or name, an identifier, an attribute, a string, a comment."""
    import ast
    import io
    import tokenize

    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
        and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            words = [alias.name for alias in node.names] + [alias.asname or "" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            words = (
                [node.module or ""]
                + [alias.name for alias in node.names]
                + [alias.asname or "" for alias in node.names]
            )
        elif isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            words = (
                [node.name] + [a.arg for a in (*node.args.args, *node.args.kwonlyargs)]
                if not isinstance(node, ast.ClassDef)
                else [node.name]
            )
        elif isinstance(node, ast.arg):
            words = [node.arg]
        elif isinstance(node, ast.keyword):
            words = [node.arg or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words = [node.value]
        else:
            continue
        found += [f"line {node.lineno}: {word!r}" for word in words if any(w in word.lower() for w in ALGORITHM_WORDS)]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and any(w in token.string.lower() for w in ALGORITHM_WORDS):
            found.append(f"line {token.start[0]}: comment {token.string!r}")
    return found


def test_the_calibration_runner_names_no_algorithm():
    """Issue 37: the runner loops over the layers and hands each to a `LayerStep`; which
    algorithm runs is `calibration.algorithms`' business. An algorithm's name, module or knob
    back in runner.py (an `if algorithm == "awq"`, an import of gptq) fails this."""
    source = (REPO / "qtool" / "calibration" / "runner.py").read_text(encoding="utf-8")
    assert algorithm_names_in(source) == []


@pytest.mark.parametrize(
    "line",
    [
        'if options.algorithm == "awq":\n    pass\n',
        "from qtool.calibration import gptq\n",
        "from qtool.calibration.true_sequential import run\n",
        "x = options.actorder  # the column order\n",
        "def f(imatrix=None):\n    return imatrix\n",
    ],
    ids=["branch", "import", "import-from", "knob", "argument"],
)
def test_the_runner_check_finds_an_algorithm_that_comes_back(line):
    source = (REPO / "qtool" / "calibration" / "runner.py").read_text(encoding="utf-8")
    assert algorithm_names_in(source + "\n" + line) != []


# -- API messages name parameters, not flags --------------------------------------------------------


FLAG = re.compile(r"(?<![\w`-])--[a-z][a-z-]+")


def flags_in_raised_messages(root: Path) -> list[str]:
    """Every flag spelled in the message or hint of an error raised below `cli/` (a shell command
    in backticks aside): the API serves scripts too, and the CLI adds the flag from `option=`."""
    import ast

    found = []
    for path in sorted((root / "qtool").rglob("*.py")):
        if path.relative_to(root / "qtool").parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            parts = [*node.exc.args, *(k.value for k in node.exc.keywords if k.arg == "hint")]
            for sub in (s for part in parts for s in ast.walk(part)):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    flag = FLAG.search(re.sub(r"`[^`]*`", "", sub.value))
                    if flag:
                        found.append(f"{path.relative_to(root)}:{node.lineno}: {flag.group()}")
    return found


def test_no_error_below_the_cli_spells_a_flag():
    assert flags_in_raised_messages(REPO) == []


def test_a_flag_in_an_error_below_the_cli_would_be_found(package_copy):
    with open(package_copy / "qtool" / "pipeline.py", "a") as handle:
        handle.write('\n\ndef _bad():\n    raise ValueError("x", hint="use --threads 2, or `ray start --head`")\n')
    assert [line.rsplit(": ", 1)[1] for line in flags_in_raised_messages(package_copy)] == ["--threads"]
