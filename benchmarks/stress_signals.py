"""Run the signal, kill, remote and worker tests again and again under CPU load (issue 43).

    python benchmarks/stress_signals.py                 # 20 runs, two busy processes, pytest -n auto
    python benchmarks/stress_signals.py --runs 5 --busy 4 --json stress.json

Not part of `.ci/run`: it takes a while (a few minutes a run on 2 cores). Each run is one
`python -m pytest -n auto` of the test files below beside `--busy` processes that spin on the
CPU (what `stress --cpu 2` does), with SIGINT and SIGQUIT ignored in pytest, as they are in a
test run started in the background of a script (`.ci/run &`): issue 43's lost SIGINT came from
exactly that. `--foreground` leaves them at their defaults. It prints each run's outcome and the
failed tests, then the failures per run, and keeps a failed run's whole output in `--logs`; it
exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_kill.py",
    "tests/test_cli_signals.py",
    "tests/test_remote.py",
    "tests/test_workers.py",
    "tests/fuzz/test_remote_fuzz.py",
]


def _spin() -> None:
    while True:
        pass


def _as_a_background_job() -> None:
    """In pytest: SIGINT and SIGQUIT ignored, as `cmd &` in a non-interactive shell leaves them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def one_run(tests: list[str], workers: str, foreground: bool, timeout: float) -> tuple[dict, str]:
    """One pytest run: its outcome, and its whole output."""
    started = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-n", workers, "-q", "-rfE", "-p", "no:cacheprovider", *tests]
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=None if foreground else _as_a_background_job,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout)
        code = process.returncode
    except subprocess.TimeoutExpired:
        output, code = f"(run over {timeout} s)", None
    finally:  # the run over, or this script stopped: pytest's workers and their qtool runs too
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)))
    summary = re.findall(r"^=+ (.*(?:passed|failed|error).*) in [\d.]+s", output, re.MULTILINE)
    outcome = {
        "exit": code,
        "seconds": round(time.monotonic() - started, 1),
        "failed": failed,
        "summary": summary[-1] if summary else output.strip().splitlines()[-1:],
    }
    return outcome, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--busy", type=int, default=2, help="processes spinning on the CPU beside pytest")
    parser.add_argument("--workers", default="auto", help="pytest -n")
    parser.add_argument(
        "--foreground", action="store_true", help="leave SIGINT and SIGQUIT at their defaults in pytest"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for one run")
    parser.add_argument("--json", type=Path, help="write every run's outcome here")
    parser.add_argument(
        "--logs", type=Path, default=Path("stress-logs"), help="a failed run's output goes here, as run-N.txt"
    )
    parser.add_argument("tests", nargs="*", default=TESTS)
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the busy processes and pytest on the way out
    burners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for burner in burners:
        burner.start()
    runs = []
    try:
        for number in range(1, args.runs + 1):
            outcome, output = one_run(args.tests, args.workers, args.foreground, args.timeout)
            runs.append(outcome)
            if outcome["exit"] != 0:
                args.logs.mkdir(parents=True, exist_ok=True)
                (args.logs / f"run-{number}.txt").write_text(output)
            verdict = "ok" if outcome["exit"] == 0 else f"FAILED (exit {outcome['exit']})"
            print(f"run {number}/{args.runs}: {verdict}, {outcome['summary']}, {outcome['seconds']} s", flush=True)
            for test in outcome["failed"]:
                print(f"    {test}", flush=True)
            if args.json:
                args.json.write_text(json.dumps({"tests": args.tests, "busy": args.busy, "runs": runs}, indent=1))
    finally:
        for burner in burners:
            burner.terminate()
    bad = sum(outcome["exit"] != 0 for outcome in runs)
    print(
        f"{bad} failed runs / {len(runs)} runs ({os.cpu_count()} cores, {args.busy} busy processes, pytest -n {args.workers})"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
