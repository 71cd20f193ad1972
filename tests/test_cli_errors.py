"""The CLI's error boundary: a bug exits 70 with one line (never 1, which CI reads as a failed
gate), a QtoolError keeps its own code, Ctrl-C and SIGTERM raised as exceptions exit 130 and 143,
and QTOOL_DEBUG=1 adds the traceback. Through CliRunner and through a real process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import qtool.api
import qtool.scheme
from qtool.cli import app
from qtool.errors import EXIT_SOFTWARE, InternalError, Terminated
from tests.conftest import REPO, SAMPLES

runner = CliRunner()
TINY = SAMPLES / "tiny-llama"
REPORT = "(this is a bug in qtool; please report it with QTOOL_DEBUG=1 output)"


def _raise(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc

    return fail


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("QTOOL_DEBUG", raising=False)


# -- through CliRunner -----------------------------------------------------------------------------

# The boundary is the same for every command; these four are this module's neighbours.
CRASHES = {
    "inspect": (qtool.api, "inspect", ["inspect", str(TINY)]),
    "check": (qtool.api, "check", ["check", str(TINY)]),
    "compare": (qtool.api, "prepare_compare", ["compare", str(TINY), str(TINY)]),
    "schemes": (qtool.api, "schemes", ["schemes"]),
}


@pytest.mark.parametrize("command", list(CRASHES))
def test_an_unexpected_exception_exits_70_with_one_line(monkeypatch, command):
    module, function, args = CRASHES[command]
    monkeypatch.setattr(module, function, _raise(RuntimeError("boom")))
    result = runner.invoke(app, args)
    assert result.exit_code == EXIT_SOFTWARE == 70
    assert result.stdout == ""
    assert result.stderr == f"error: internal error: RuntimeError: boom {REPORT}\n"


def test_the_internal_error_line_is_one_line_whatever_the_message(monkeypatch):
    monkeypatch.setattr(qtool.api, "inspect", _raise(ValueError("a\nb\x1b[2J")))
    result = runner.invoke(app, ["inspect", str(TINY)])
    assert result.exit_code == 70
    assert result.stderr == f"error: internal error: ValueError: a\\nb\\x1b[2J {REPORT}\n"
    monkeypatch.setattr(qtool.api, "inspect", _raise(AssertionError()))
    result = runner.invoke(app, ["inspect", str(TINY)])
    assert result.stderr == f"error: internal error: AssertionError {REPORT}\n"


def test_an_internal_error_raised_by_qtool_exits_70_the_same_way(monkeypatch):
    monkeypatch.setattr(qtool.api, "inspect", _raise(InternalError("plan and header disagree on 3 bytes")))
    result = runner.invoke(app, ["inspect", str(TINY)])
    assert result.exit_code == 70
    assert result.stderr == f"error: internal error: plan and header disagree on 3 bytes {REPORT}\n"


def test_expected_errors_and_usage_errors_keep_their_codes(tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path / "missing")])
    assert result.exit_code == 2 and result.stderr.startswith("error: ")
    assert runner.invoke(app, ["inspect", str(TINY), "--no-such-option"]).exit_code == 2
    assert runner.invoke(app, ["no-such-command"]).exit_code == 2


@pytest.mark.parametrize(
    ("exc", "code", "line"),
    [(KeyboardInterrupt(), 130, "error: interrupted"), (Terminated(), 143, "error: terminated")],
)
def test_interrupted_and_terminated_exit_130_and_143(monkeypatch, exc, code, line):
    monkeypatch.setattr(qtool.api, "inspect", _raise(exc))
    result = runner.invoke(app, ["inspect", str(TINY)])
    assert result.exit_code == code
    assert result.stderr == line + "\n"


def test_debug_lets_the_exception_through_under_clirunner(monkeypatch):
    monkeypatch.setattr(qtool.api, "inspect", _raise(RuntimeError("boom")))
    monkeypatch.setenv("QTOOL_DEBUG", "1")
    result = runner.invoke(app, ["inspect", str(TINY)])
    assert isinstance(result.exception, RuntimeError)


# -- through a real process ------------------------------------------------------------------------

# Runs the console script's `main` with qtool.api.inspect broken, as a bug would break it.
CRASHING_MAIN = """
import sys
import qtool.api

def inspect(*args, **kwargs):
    raise {exc}

qtool.api.inspect = inspect
from qtool.cli import main
sys.argv = ["qtool", "inspect", sys.argv[1]]
main()
"""


def crashing_qtool(exc: str, *, debug: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QTOOL_DEBUG"}
    env["PYTHONPATH"] = str(REPO)
    if debug:
        env["QTOOL_DEBUG"] = "1"
    return subprocess.run(
        [sys.executable, "-c", CRASHING_MAIN.format(exc=exc), str(TINY)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_subprocess_a_bug_exits_70_with_one_line_and_no_traceback():
    result = crashing_qtool("RuntimeError('boom')")
    assert result.returncode == 70
    assert result.stdout == ""
    assert result.stderr == f"error: internal error: RuntimeError: boom {REPORT}\n"


def test_subprocess_debug_shows_the_traceback_and_still_exits_70():
    result = crashing_qtool("RuntimeError('boom')", debug=True)
    assert result.returncode == 70
    assert "Traceback (most recent call last)" in result.stderr
    assert 'raise RuntimeError("boom")' in result.stderr or "RuntimeError: boom" in result.stderr
    assert result.stderr.endswith(f"error: internal error: RuntimeError: boom {REPORT}\n")


def test_subprocess_debug_keeps_a_qtool_errors_own_code():
    result = crashing_qtool("__import__('qtool').UsageError('bad', hint='do this')", debug=True)
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.endswith("error: bad\nhint: do this\n")


@pytest.mark.parametrize(
    ("exc", "code", "line"),
    [("KeyboardInterrupt", 130, "interrupted"), ("__import__('qtool.errors').errors.Terminated", 143, "terminated")],
)
def test_subprocess_interrupted_and_terminated(exc, code, line):
    result = crashing_qtool(exc)
    assert result.returncode == code
    assert result.stderr == f"error: {line}\n"


def test_a_signal_aborts_the_writers_open_outputs(monkeypatch):
    """The writer's registry of open outputs (`abort_all`, when it has one) is emptied before the
    exit, a write-behind thread's outputs included; a failing abort is a warning, not a crash."""
    import qtool.formats.writer

    calls = []
    monkeypatch.setattr(qtool.formats.writer, "abort_all", lambda: calls.append(1), raising=False)
    monkeypatch.setattr(qtool.api, "inspect", _raise(Terminated()))
    result = runner.invoke(app, ["inspect", str(TINY)])
    assert (result.exit_code, result.stderr, calls) == (143, "error: terminated\n", [1])
    monkeypatch.setattr(qtool.formats.writer, "abort_all", _raise(OSError(5, "Input/output error")), raising=False)
    result = runner.invoke(app, ["inspect", str(TINY)])
    assert result.exit_code == 143
    assert (
        result.stderr
        == "warning: cleaning up the outputs failed: OSError: [Errno 5] Input/output error\nerror: terminated\n"
    )


def test_an_error_after_a_signal_is_the_signals_doing_not_a_bug(monkeypatch):
    """A library that swallows the KeyboardInterrupt mid-import fails on the next import (numpy:
    'cannot load module more than once per process'): that is the interruption, not a bug."""
    import signal

    import qtool.cli

    monkeypatch.setattr(qtool.cli._Signals, "raised", signal.SIGINT)
    monkeypatch.setattr(qtool.cli._Signals, "reported", False)
    monkeypatch.setattr(qtool.api, "inspect", _raise(ImportError("cannot load module more than once per process")))
    result = runner.invoke(app, ["inspect", str(TINY)])
    assert (result.exit_code, result.stderr) == (130, "error: interrupted\n")
