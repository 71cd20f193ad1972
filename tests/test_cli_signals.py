"""Ctrl-C and SIGTERM at any moment of a real `qtool` process: exit 130 or 143 with one line
and no traceback (or 0 when the run had already finished), outputs cleaned up; and the light
imports that let the handlers go in within milliseconds of start-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, SAMPLES
from tests.signal_helpers import default_signal_dispositions, qtool_handlers_in, signal_when, wait_for_qtool_handlers

TINY = SAMPLES / "tiny-llama"
posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")

# What `import X` may load before `main()` installs the handlers: nothing that takes time.
LIGHT = {"qtool", "qtool.errors", "qtool.cli"}
HEAVY_ROOTS = {"typer", "click", "rich", "torch", "numpy", "safetensors", "gguf", "json", "dataclasses", "typing"}


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "QTOOL_DEBUG"}
    env["PYTHONPATH"] = str(REPO)
    return env


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys; before = set(sys.modules); {statement}; print('\\n'.join(sorted(set(sys.modules) - before)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_environment(), cwd=REPO, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_import_qtool_loads_nothing_heavy_and_every_public_name_still_works():
    loaded = _loaded_after("import qtool")
    assert [m for m in loaded if m.startswith("qtool")] == ["qtool"]
    assert not {m.split(".")[0] for m in loaded} & HEAVY_ROOTS
    import qtool

    for name in qtool.__all__:
        assert getattr(qtool, name) is not None, name
        assert name in dir(qtool)
    namespace: dict = {}
    exec(f"from qtool import {', '.join(qtool.__all__)}", namespace)
    assert namespace["inspect"] is qtool.api.inspect and namespace["QtoolError"] is qtool.errors.QtoolError
    with pytest.raises(AttributeError, match="has no attribute 'nonexistent'"):
        qtool.nonexistent  # noqa: B018


def test_the_console_script_imports_only_light_modules_before_main_installs_the_handlers():
    """pyproject's entry point is `qtool.cli:main`: importing it must not import typer (~25 ms)
    or qtool's readers, so that the handlers are in place ~5 ms after the interpreter's own
    start-up; `main` imports them after."""
    text = (REPO / "pyproject.toml").read_text()
    assert 'qtool = "qtool.cli:main"' in text
    loaded = _loaded_after("import qtool.cli")
    assert {m for m in loaded if m.startswith("qtool")} == LIGHT
    assert not {m.split(".")[0] for m in loaded} & HEAVY_ROOTS
    assert (REPO / "qtool" / "__main__.py").read_text().startswith("from qtool.cli import main\n")


def _start(*args: str, cwd: Path = REPO) -> tuple[subprocess.Popen, float]:
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "qtool", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environment(),
        cwd=cwd,
        preexec_fn=default_signal_dispositions if os.name == "posix" else None,
    )
    return process, started


def _signal_at(delay: float, signum: int, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    process, started = _start(*args, cwd=cwd)
    wait_for_qtool_handlers(process)
    time.sleep(max(0.0, started + delay - time.monotonic()))
    if process.poll() is None:
        process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


DELAYS = [0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0]
SIGNALS = [(signal.SIGINT, 130, "error: interrupted"), (signal.SIGTERM, 143, "error: terminated")]


@posix_only
@pytest.mark.parametrize(("signum", "code", "line"), SIGNALS, ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize(
    "args", [["inspect", str(TINY)], ["inspect", str(TINY), "--stats", "-q"]], ids=["inspect", "inspect-stats"]
)
def test_a_signal_at_any_moment_exits_with_its_code_and_no_traceback(signum, code, line, args):
    """`--stats` imports torch: signals land inside a long import, as Ctrl-C in the first second
    of a quantize does. The first signal is sent the instant qtool's handlers are in, with the
    process frozen there (`signal_when`), so it lands inside the run on any machine; the others
    at fixed delays, wherever those fall."""
    process, _ = _start(*args)
    assert signal_when(process, signum, lambda: qtool_handlers_in(process)), "qtool ended before its handlers showed"
    _, stderr = process.communicate(timeout=120)
    assert (process.returncode, stderr) == (code, line + "\n")
    for delay in DELAYS:
        result = _signal_at(delay, signum, *args)
        assert "Traceback" not in result.stderr, (delay, result.stderr)
        if result.returncode == 0:  # it had finished: the signal came during the exit, or after
            assert result.stderr == ""
        else:
            assert (result.returncode, result.stderr) == (code, line + "\n"), delay


@posix_only
@pytest.mark.parametrize(
    ("first", "then"),
    [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGTERM)],
)
def test_a_second_signal_during_cleanup_leaves_no_traceback(first, then):
    codes = {signal.SIGINT: 130, signal.SIGTERM: 143}
    for delay in (0.1, 0.3, 0.6):
        process, started = _start("inspect", str(TINY), "--stats", "-q")
        wait_for_qtool_handlers(process)
        time.sleep(max(0.0, started + delay - time.monotonic()))
        process.send_signal(first)
        time.sleep(0.001)
        if process.poll() is None:
            process.send_signal(then)
        _, stderr = process.communicate(timeout=120)
        assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
        # Two signals pending at once run in signal-number order: either may be the one reported.
        assert process.returncode in (0, codes[first], codes[then]), (delay, process.returncode, stderr)
        assert len(stderr.splitlines()) == (process.returncode != 0), stderr


def _big_model(folder: Path) -> Path:
    """~200 MB of bf16 linear weights, so that quantizing it takes a while."""
    from tests.conftest import write_safetensors

    folder.mkdir()
    tensors = {
        f"model.layers.{i}.mlp.{p}.weight": ("BF16", (4096, 4096)) for i in range(3) for p in ("up_proj", "down_proj")
    }
    write_safetensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    return folder


def _staging(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if "qtool-tmp" in p.name]


def _quantize_and_signal(tmp_path: Path, signum: int, ready) -> subprocess.CompletedProcess:
    """Quantize ~200 MB and send `signum` while `ready(staging folder)` holds, the process
    frozen in that state (`signal_when`): the signal lands there however loaded the machine."""
    model = _big_model(tmp_path / "model")
    process, _ = _start(
        "quantize", str(model), "-o", str(tmp_path / "out"), "--scheme", "int8", "-q", "--threads", "1", cwd=tmp_path
    )

    def in_state() -> bool:
        try:
            return any(ready(staging) for staging in _staging(tmp_path))
        except FileNotFoundError:  # the staging folder went meanwhile
            return False

    sent = signal_when(process, signum, in_state)
    stdout, stderr = process.communicate(timeout=120)
    assert sent, f"quantize ended (exit {process.returncode}) before the state the signal was meant for: {stderr}"
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@posix_only
@pytest.mark.parametrize(("signum", "code", "line"), SIGNALS, ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_quantize_writes_removes_the_output(tmp_path, signum, code, line):
    """Once a shard file exists the pipeline's `except BaseException` cleanup is in force."""

    def writing(staging: Path) -> bool:
        return any(staging.iterdir())

    result = _quantize_and_signal(tmp_path, signum, writing)
    assert "Traceback" not in result.stderr, result.stderr
    assert (result.returncode, result.stderr) == (code, line + "\n")
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no output, no staging folder


@posix_only
@pytest.mark.parametrize(("signum", "code", "line"), SIGNALS, ids=["SIGINT", "SIGTERM"])
def test_a_signal_as_the_output_is_created_leaves_no_staging_folder(tmp_path, signum, code, line):
    """The instant after the staging folder appears, before the pipeline's cleanup is in
    force: only the writer's registry of open outputs (`writer.abort_all()`, which the CLI
    calls on a signal) can remove it."""
    result = _quantize_and_signal(tmp_path, signum, lambda staging: True)
    assert "Traceback" not in result.stderr, result.stderr
    assert (result.returncode, result.stderr) == (code, line + "\n")
    assert not (tmp_path / "out").exists()
    assert _staging(tmp_path) == []


# -- SIGHUP and the other signals that end a run (issue 18, item 9) ---------------------------------

ENDING = [
    (signal.SIGHUP, 129, "error: terminated by SIGHUP"),
    (signal.SIGQUIT, 131, "error: terminated by SIGQUIT"),
    (signal.SIGUSR1, 138, "error: terminated by SIGUSR1"),
    (signal.SIGUSR2, 140, "error: terminated by SIGUSR2"),
    (signal.SIGALRM, 142, "error: terminated by SIGALRM"),
]


@posix_only
@pytest.mark.parametrize(("signum", "code", "line"), ENDING, ids=[s.name for s, _, _ in ENDING])
def test_a_closed_terminal_or_another_ending_signal_cleans_up_like_sigterm(tmp_path, signum, code, line):
    """A closed terminal or a dropped ssh (SIGHUP) killed quantize and left its staging folder
    until the next run; SIGQUIT, SIGUSR1/2 and SIGALRM the same. Each is now SIGTERM's path:
    cleanup, one line, exit 128 + the signal's number (129 for SIGHUP)."""
    result = _quantize_and_signal(tmp_path, signum, lambda staging: True)
    assert "Traceback" not in result.stderr, result.stderr
    assert (result.returncode, result.stderr) == (code, line + "\n")
    assert not (tmp_path / "out").exists()
    assert _staging(tmp_path) == []


@posix_only
def test_sighup_while_quantize_writes_removes_the_output(tmp_path):
    result = _quantize_and_signal(tmp_path, signal.SIGHUP, lambda staging: any(staging.iterdir()))
    assert (result.returncode, result.stderr) == (129, "error: terminated by SIGHUP\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@posix_only
@pytest.mark.parametrize("delay", [0.05, 0.3, 0.75])
def test_sighup_at_any_moment_of_inspect_exits_129(delay):
    result = _signal_at(delay, signal.SIGHUP, "inspect", str(TINY), "--stats", "-q")
    assert "Traceback" not in result.stderr, result.stderr
    assert (result.returncode, result.stderr) in ((129, "error: terminated by SIGHUP\n"), (0, "")), delay


@posix_only
def test_sighup_stays_ignored_under_nohup():
    """`nohup qtool ...` ignores SIGHUP: qtool keeps it ignored and finishes."""
    process = subprocess.Popen(
        [sys.executable, "-m", "qtool", "inspect", str(TINY), "--stats", "-q"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environment(),
        cwd=REPO,
        preexec_fn=lambda: (default_signal_dispositions(), signal.signal(signal.SIGHUP, signal.SIG_IGN)),
    )
    wait_for_qtool_handlers(process)
    for _ in range(5):
        time.sleep(0.1)
        if process.poll() is None:
            process.send_signal(signal.SIGHUP)
    stdout, stderr = process.communicate(timeout=120)
    assert (process.returncode, stderr) == (0, ""), stderr
    assert stdout


@posix_only
def test_started_with_sigint_ignored_qtool_still_handles_the_other_signals_from_its_first_line(tmp_path):
    """A script's `qtool ... &` starts qtool with SIGINT ignored. qtool keeps that, but its first
    line skipped every early handler with it: a SIGTERM during start-up then killed the process
    silently (no `error: terminated`), where the docstring of `qtool.cli` promises one line."""
    probe = tmp_path / "qtool"  # named as the console script is: qtool acts as the command
    probe.write_text(
        "import signal\nimport qtool\nhandlers = [signal.getsignal(getattr(signal, n)) for n in ('SIGINT', 'SIGTERM', 'SIGHUP')]\n"
        "print(*(h.name if isinstance(h, signal.Handlers) else h.__name__ for h in handlers))\n"
    )

    def background() -> None:
        default_signal_dispositions()
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    result = subprocess.run(
        [sys.executable, str(probe)],
        capture_output=True,
        text=True,
        env=_environment(),
        timeout=120,
        preexec_fn=background,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["SIG_IGN", "_exit_at_once", "_exit_at_once"]


@posix_only
@pytest.mark.parametrize("then", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_a_second_signal_while_the_early_handler_writes_its_line_adds_no_second_line(tmp_path, then):
    """The stress run's one failure: SIGTERM during start-up, then SIGINT 1 ms later. Python ran
    the second early handler inside the first, after its `error: terminated` and before its
    exit: two lines and exit 130. Here the second signal lands exactly there, every time."""
    probe = tmp_path / "qtool"  # named as the console script is: qtool acts as the command
    probe.write_text(
        "import os, signal, sys\nimport qtool\n"
        "write = os.write\n"
        f"def write_then_signal(fd, data):\n    os.write = write\n    n = write(fd, data)\n    os.kill(os.getpid(), {int(then)})\n    return n\n"
        "os.write = write_then_signal\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('the early handler returned', flush=True)\n"
    )
    result = subprocess.run(
        [sys.executable, str(probe)],
        capture_output=True,
        text=True,
        env=_environment(),
        timeout=120,
        preexec_fn=default_signal_dispositions,
    )
    assert (result.returncode, result.stdout, result.stderr) == (143, "", "error: terminated\n")
