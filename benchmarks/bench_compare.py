"""Benchmark `qtool compare` of a bf16 model against its W4A16 version.

Issue 5, "Proof". `qtool compare` dequantizes both sides of each pair and measures them, one
pair at a time; the baseline is the dequantization alone, `qtool dequantize` of the same
W4A16 file, so the ratio says what matching, reading the bf16 side and measuring cost on
top of decoding.

The model is bench_quantize.py's synthesized LLaMA-2-7B-shaped bf16 checkpoint (default
~2 GB: 4 layers, 2.14 GB in 3 shards), made the same way by the same code, imported from it.
Its W4A16 version is made once, untimed, by `qtool quantize --scheme W4A16`. Then, each as a
whole child process with this interpreter, --repeats rounds of:

  D  python -m qtool dequantize W4A16 -o D.safetensors --dtype bf16 -q     (the baseline)
  C  python -m qtool compare MODEL W4A16 --json -q > C.json

Before each timed run the output is removed, `sync` is called, and the run's inputs are read
once (`cat > /dev/null`), so both start from a warm page cache. Wall time is spawn to reap;
peak RSS is the child's own `ru_maxrss` (touched mmap-ed pages included). C's JSON is checked
untimed: every weight matched, 7 per layer measured below "exact", the worst above 15 dB.

Targets: C / D < 1.5 (median wall time), peak RSS of C under 1 GB (10^9 bytes). The parent
uses the standard library only. Exit status is 0 whatever the result, unless --strict.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import Measurement, in_work_dir, measure, print_environment
from bench_quantize import GB, Llama, indent, remove, synthesize, warm

REPO = Path(__file__).resolve().parent.parent
TARGET_RATIO = 1.5  # compare / dequantize, wall time
RSS_LIMIT = 1.0 * GB


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time `qtool compare MODEL W4A16` against `qtool dequantize W4A16` on a synthesized LLaMA-shaped bf16 checkpoint."
    )
    p.add_argument(
        "--size-gb", type=float, default=2.0, help="model size in GB (10^9 bytes); default 2 (4 layers, 2.14 GB)"
    )
    p.add_argument("--layers", type=int, help="decoder layers (overrides --size-gb); 1 is a quick ~0.9 GB trial")
    p.add_argument("--repeats", type=int, default=1, help="timed rounds of D and C (default 1); the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="where to put the model and outputs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed")
    p.add_argument("--strict", action="store_true", help="exit 1 if a target fails or a run fails")
    args = p.parse_args(argv)
    if args.repeats < 1 or (args.layers is not None and args.layers < 1):
        p.error("--repeats and --layers must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print_environment(("torch", "safetensors", "qtool"))
    return in_work_dir(args.workdir, "bench-compare-", args.keep, lambda root: run(args, root))


def timed(
    cmd: list[str], inputs: list[Path], output: Path, log_stem: Path, timeout: float, stdout_to: Path | None = None
) -> Measurement:
    remove(output)
    os.sync()
    for path in inputs:
        warm(path)
    m = measure(cmd, log_stem=log_stem, cwd=REPO, timeout_s=timeout)
    if stdout_to is not None and m.ok:
        shutil.copyfile(m.stdout_path, stdout_to)
    os.sync()  # write-back now, untimed
    return m


def run(args: argparse.Namespace, root: Path) -> int:
    model = Llama(layers=args.layers) if args.layers else Llama.for_size(args.size_gb * GB)
    logs, model_dir, w4, out = root / "logs", root / "model", root / "w4", root / "out"
    logs.mkdir()
    out.mkdir()
    need = model.nbytes * 2.5
    if shutil.disk_usage(root).free < need:
        raise SystemExit(f"error: {root} needs about {need / GB:.0f} GB free")
    print(
        f"\nmodel: LLaMA-2-7B shapes, {model.layers} layers, {len(model.tensors())} tensors, {model.nbytes / GB:.2f} GB bf16"
    )
    print(f"synthesizing in {model_dir} ...", flush=True)
    print(f"  written in {synthesize(model, model_dir, args.seed, logs):.1f} s")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "qtool")], check=False)
    py = sys.executable
    print("quantizing to W4A16 once (untimed) ...", flush=True)
    m = measure(
        [py, "-m", "qtool", "quantize", str(model_dir), "-o", str(w4), "--scheme", "W4A16", "-q"],
        log_stem=logs / "quantize",
        cwd=REPO,
        timeout_s=args.timeout,
    )
    if not m.ok:
        raise SystemExit(f"error: qtool quantize failed:\n{indent(m.stderr_tail())}")
    w4_bytes = sum(p.stat().st_size for p in w4.rglob("*.safetensors"))
    print(f"  {w4_bytes / GB:.2f} GB in {m.wall_s:.1f} s")

    runs: dict[str, list[Measurement]] = {"D": [], "C": []}
    report = out / "C.json"
    for r in range(1, args.repeats + 1):
        for key, cmd, inputs, output, stdout_to in (
            (
                "D",
                [py, "-m", "qtool", "dequantize", str(w4), "-o", str(out / "D.safetensors"), "--dtype", "bf16", "-q"],
                [w4],
                out / "D.safetensors",
                None,
            ),
            (
                "C",
                [py, "-m", "qtool", "compare", str(model_dir), str(w4), "--json", "-q"],
                [model_dir, w4],
                report,
                report,
            ),
        ):
            m = timed(cmd, inputs, output, logs / f"{key}-{r}", args.timeout, stdout_to)
            if not m.ok:
                why = "timed out" if m.timed_out else f"exit status {m.returncode}"
                print(f"  {key} round {r}: FAILED ({why}):\n{indent(m.stderr_tail())}")
                return 1
            runs[key].append(m)
            print(
                f"  {key} round {r}: {m.wall_s:7.2f} s  {m.peak_rss_bytes / GB:.2f} GB  (cpu {m.cpu_s:.1f} s, load avg {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        remove(out / "D.safetensors")

    document = json.loads(report.read_text())
    summary = document["summary"]
    expected_quantized = model.n_quantized
    check_ok = (
        summary["matched"] == len(model.tensors())
        and summary["only_in_a"] == summary["only_in_b"] == 0
        and summary["measured"] - summary["exact"] == expected_quantized
        and summary["worst"]["sqnr_db"] > 15
    )
    print(
        f"  check {'ok' if check_ok else 'FAILED'}: {summary['matched']} matched, {summary['measured'] - summary['exact']} quantized pairs, "
        f"model SQNR {summary['sqnr_db']:.2f} dB, worst {summary['worst']['name']} {summary['worst']['sqnr_db']:.2f} dB"
    )

    wall = {k: statistics.median(x.wall_s for x in v) for k, v in runs.items()}
    cpu = {k: statistics.median(x.cpu_s for x in v) for k, v in runs.items()}
    rss = {k: max(x.peak_rss_bytes for x in v) for k, v in runs.items()}
    print(f"\n{'run':<4} {'what':<48} {'median s':>9} {'cpu s':>7} {'peak RSS GB':>12}")
    for key, what in (("D", "qtool dequantize W4A16 --dtype bf16"), ("C", "qtool compare MODEL W4A16")):
        print(f"{key:<4} {what:<48} {wall[key]:>9.2f} {cpu[key]:>7.1f} {rss[key] / GB:>12.2f}")
    print(
        f"\nmodel {model.nbytes / GB:.2f} GB bf16 ({model.layers} layers), W4A16 {w4_bytes / GB:.2f} GB; median of {args.repeats}; "
        f"load average now {', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    ratio = wall["C"] / wall["D"]
    results = [ratio < TARGET_RATIO, rss["C"] < RSS_LIMIT, check_ok]
    print("\ntargets")
    print(
        f"  {'PASS' if results[0] else 'FAIL'}  C/D = {wall['C']:.2f} s / {wall['D']:.2f} s = {ratio:.2f}x  (target < {TARGET_RATIO}x)"
    )
    print(
        f"  {'PASS' if results[1] else 'FAIL'}  peak RSS C = {rss['C'] / GB:.2f} GB  (target < {RSS_LIMIT / GB:.1f} GB)"
    )
    assert not {"torch", "numpy", "safetensors"} & set(sys.modules), "the parent must stay stdlib-only"
    return 1 if args.strict and not all(results) else 0


if __name__ == "__main__":
    sys.exit(main())
