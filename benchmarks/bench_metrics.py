"""The cost of float64 error measures: `ErrorStats.update` against its float32 predecessor.

Both measure one 4096x4096 bf16 weight against a bf16 reconstruction, in process, rounds
interleaved, on one torch thread and on every thread. The baseline is the previous
`ErrorStats.update` (until 2458d0a), copied below: float32 copies of the whole chunk, then
float32 BLAS dots over 1M-element slices added up in float64. Also printed: each one's relative
error against an exactly rounded float64 sum (math.fsum is too slow at this size; a float64
sum of float64 terms, pairwise, is the reference, good to ~1e-16).

With `--baseline-kernels PATH` (a `_kernels*.so` built from an earlier commit), it also times
qtool.native's `encode_int` (encode + error sums, one thread) against that build, rounds
interleaved: the float32-lane sums of 2458d0a against today's float64 ones.

    python benchmarks/bench_metrics.py --repeats 3
    python benchmarks/bench_metrics.py --repeats 7 --baseline-kernels /tmp/old/_kernels.so
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import print_environment

_BASELINE_SLICE = 1 << 20


def baseline_update(original, reconstructed) -> tuple[float, float, float, float]:
    """The float32 ErrorStats.update of 2458d0a: (sum x^2, sum x*e, sum e^2, max |e|)."""
    import torch

    x = original.reshape(-1).to(torch.float32)
    error = x - reconstructed.reshape(-1).to(torch.float32)
    xx = xe = ee = 0.0
    for start in range(0, x.numel(), _BASELINE_SLICE):
        xs, es = x[start : start + _BASELINE_SLICE], error[start : start + _BASELINE_SLICE]
        xx += float(torch.dot(xs, xs))
        xe += float(torch.dot(xs, es))
        ee += float(torch.dot(es, es))
    return xx, xe, ee, max(float(error.amax()), -float(error.amin()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", type=int, default=4096, help="rows and columns of the weight")
    parser.add_argument("--baseline-kernels", type=Path, help="a qtool.native _kernels .so of an earlier commit")
    args = parser.parse_args()

    import torch

    from qtool.error_measures import ErrorStats

    print_environment(("torch", "numpy"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.size, args.size, generator=g).to(torch.bfloat16)
    y = (x.float() + 0.01 * torch.randn(args.size, args.size, generator=g)).to(torch.bfloat16)
    xd = x.double().reshape(-1)
    ed = xd - y.double().reshape(-1)
    reference = (float((xd * xd).sum()), float((ed * ed).sum()))
    del xd, ed
    threads = torch.get_num_threads()
    for count in sorted({1, threads}):
        torch.set_num_threads(count)
        times: dict[str, list[float]] = {"float32 (baseline)": [], "float64": []}
        for _ in range(args.repeats):
            started = time.perf_counter()
            base = baseline_update(x, y)
            times["float32 (baseline)"].append(time.perf_counter() - started)
            started = time.perf_counter()
            new = ErrorStats().update(x, y)
            times["float64"].append(time.perf_counter() - started)
        medians = {name: statistics.median(values) for name, values in times.items()}
        ratio = medians["float64"] / medians["float32 (baseline)"]
        print(f"{count} thread(s), median of {args.repeats}:")
        for name, values in times.items():
            print(f"  {name:20s} {medians[name] * 1e3:8.1f} ms   runs {', '.join(f'{v * 1e3:.1f}' for v in values)}")
        print(f"  float64 / baseline   {ratio:.2f}x")
        print(
            f"  relative error of sum x^2 / sum e^2: baseline {base[0] / reference[0] - 1:.1e} / {base[2] / reference[1] - 1:.1e}, "
            f"float64 {new.signal / reference[0] - 1:.1e} / {new.noise / reference[1] - 1:.1e}"
        )
    torch.set_num_threads(threads)
    if args.baseline_kernels:
        bench_native(args.baseline_kernels, args.size, args.repeats)
    return 0


def bench_native(path: Path, size: int, repeats: int) -> None:
    import importlib.util

    import torch

    from qtool.native import _kernels

    spec = importlib.util.spec_from_file_location("_kernels", path)
    assert spec is not None and spec.loader is not None
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    g = torch.Generator().manual_seed(1)
    print(f"native encode_int of a {size}x{size} weight, one thread, median of {repeats}:")
    for dtype_name, dtype, code in (("BF16", torch.bfloat16, 2), ("F32", torch.float32, 0)):
        weight = torch.randn(size, size, generator=g).to(dtype)
        src = weight.view(torch.uint8).numpy().tobytes()
        for label, bits, group, symmetric in (
            ("int8 channel", 8, size, True),
            ("W4A16 g128", 4, 128, True),
            ("W4A16_ASYM", 4, 128, False),
            ("int4 g32", 4, 32, True),
        ):
            times: dict[str, list[float]] = {"baseline": [], "today": []}
            for _ in range(repeats):
                for name, module in (("baseline", baseline), ("today", _kernels)):
                    packed, scale = (
                        bytearray(size * size * bits // 8),
                        bytearray(size * (size // group) * weight.element_size()),
                    )
                    zero_point = None if symmetric else bytearray(size * (size // group))
                    started = time.perf_counter()
                    module.encode_int(src, code, size, group, packed, scale, zero_point, bits, 0, size)
                    times[name].append(time.perf_counter() - started)
            old, new = statistics.median(times["baseline"]), statistics.median(times["today"])
            print(
                f"  {dtype_name} {label:13s} baseline {old * 1e3:6.1f} ms  today {new * 1e3:6.1f} ms  today / baseline {new / old:.2f}x"
            )


if __name__ == "__main__":
    raise SystemExit(main())
