"""`re:` patterns from users and configs are bounded in time (issue 42 #6, second half).

Python's `re` backtracks catastrophically on `re:.*(a+)+$` or `(a|aa)+$` against a name of 40
a's: the run hangs for hours. qtool compiles them with the `regex` module (which sees through
the first) and bounds each match (`MATCH_SECONDS`): a pattern over the bound is exit 2, naming
it. Each check runs in a process with a deadline, so a regression is a failure, not a hang.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, write_safetensors

EVIL_NAME = "a" * 40 + ".weight"
DEADLINE = 60  # seconds; the bounded match is refused in about one


def _qtool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qtool", *argv], capture_output=True, text=True, cwd=REPO, timeout=DEADLINE
    )


@pytest.fixture
def evil_model(tmp_path):
    return write_safetensors(
        tmp_path / "model.safetensors", {EVIL_NAME: ("F32", [8, 128]), "b.weight": ("F32", [8, 128])}
    )


def _refused(result: subprocess.CompletedProcess, pattern: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: ") and pattern in lines[0] and "backtracks" in lines[0], lines
    assert "Traceback" not in result.stderr and len(lines) <= 2


def test_the_library_refuses_a_match_past_the_bound():
    code = textwrap.dedent(
        """
        from qtool.errors import UsageError
        from qtool.patterns import compile_pattern
        match = compile_pattern("re:(a|aa)+$")
        try:
            match("a" * 40 + "!")
        except UsageError as exc:
            print(exc)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=DEADLINE)
    assert "pattern 're:(a|aa)+$' took over" in result.stdout, result.stderr


def test_the_issues_tensor_scheme_finishes(evil_model, tmp_path):
    """`.*(a+)+$` is what the issue ran: the regex module matches it at once, so it just works."""
    out = tmp_path / "out"
    result = _qtool(
        "quantize",
        str(evil_model),
        "-o",
        str(out),
        "--scheme",
        "W4A16",
        "--tensor-scheme",
        "re:.*(a+)+$=W8A16",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        [
            "quantize",
            "{model}",
            "-o",
            "{out}",
            "--scheme",
            "W4A16",
            "--tensor-scheme",
            "re:(a|aa)+$=W8A16",
            "--dry-run",
        ],
        ["quantize", "{model}", "-o", "{out}", "--scheme", "W4A16", "--ignore", "re:(a|aa)+$", "--dry-run"],
        ["inspect", "{model}", "-k", "re:(a|aa)+$"],
        ["check", "{model}", "--allow-plain", "re:(a|aa)+$"],
        ["compare", "{model}", "{model}", "--map", "re:(a|aa)+$=x"],
    ],
    ids=["tensor-scheme", "ignore", "filter", "allow-plain", "map"],
)
def test_every_option_that_takes_a_pattern_refuses_a_runaway_one(evil_model, tmp_path, argv):
    result = _qtool(*(a.format(model=evil_model, out=tmp_path / "out") for a in argv))
    _refused(result, "(a|aa)+$")


def test_help_says_patterns_are_bounded():
    for command, flag in (
        ("quantize", "--tensor-scheme"),
        ("inspect", "--filter"),
        ("check", "--allow-plain"),
        ("compare", "--map"),
    ):
        text = " ".join(_qtool(command, "--help").stdout.replace("│", " ").split())
        assert "a regex match over 0.25 s on one name is refused" in text, (command, flag)
