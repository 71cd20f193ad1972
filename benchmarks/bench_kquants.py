"""qtool's native GGUF K-quant encoders against llama.cpp's reference quantizers, same process,
same thread count, same input: MB/s of float32 input, and whether the bytes agree.

The reference is ggml-quants.c compiled with ggml-base's flags by
tests/fixtures/gguf_kquants/make_reference.py (llama.cpp sources from the llama-cpp-python
sdist); its quantize_qN_K(..., quant_weights=NULL) is what llama-quantize runs per chunk of rows.

--imatrix: with importance weights (one per column, log-normal like llama-imatrix's), both sides
take llama.cpp's weighted path, quantize_<type>(..., quant_weights) (Q4_0..Q5_1 included: they
only take it with weights).

    python benchmarks/bench_kquants.py [--llama-cpp DIR] [--threads 2] [--rows 512] [--cols 4096]
    python benchmarks/bench_kquants.py --imatrix --threads 1 --types Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,Q4_0,Q4_1,Q5_0,Q5_1,IQ4_NL,IQ4_XS,IQ3_S
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gguf_kquants"))
import make_reference

from qtool import native


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-cpp", default=make_reference.DEFAULT_LLAMA)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--types", default="Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,Q8_0,Q4_0")
    parser.add_argument(
        "--imatrix", action="store_true", help="with importance weights (llama-quantize --imatrix's path)"
    )
    args = parser.parse_args()
    native.set_threads(args.threads)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    qw = np.exp(rng.normal(-2.0, 1.5, args.cols)).astype(np.float32) if args.imatrix else None
    mb = x.nbytes / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        lib, _ = make_reference.build_library(Path(args.llama_cpp), Path(tmp))
        print(
            f"{args.rows} x {args.cols} float32 ({mb:.1f} MB), {args.threads} threads, {'with' if args.imatrix else 'without'} importance weights"
        )
        print(
            "best of --repeat runs, alternating; wall MB/s and CPU seconds (all threads: the fair measure on a loaded machine)"
        )
        for name in args.types.split(","):
            wall = {"ref": [], "qtool": []}
            cpu = {"ref": [], "qtool": []}
            for _ in range(args.repeat):
                for who in ("ref", "qtool"):
                    t0, c0 = time.perf_counter(), time.process_time()
                    if who == "ref":
                        ref = reference_rows(lib, name, x, args.threads, qw)
                    else:
                        got = native.encode_gguf(
                            name, x, "F32", args.rows, args.cols, None if qw is None else qw.tobytes()
                        )
                    wall[who].append(time.perf_counter() - t0)
                    cpu[who].append(time.process_time() - c0)
            same = bytes(got.data) == ref
            w_ref, w_qt, c_ref, c_qt = min(wall["ref"]), min(wall["qtool"]), min(cpu["ref"]), min(cpu["qtool"])
            print(
                f"{name:7s} llama.cpp {mb / w_ref:8.1f} MB/s {c_ref:6.2f} cpu-s   qtool {mb / w_qt:8.1f} MB/s {c_qt:6.2f} cpu-s   "
                f"ratio wall {w_ref / w_qt:5.2f}x cpu {c_ref / c_qt:5.2f}x   bytes equal: {same}"
            )


def reference_rows(lib, name, x, threads, qw=None):
    """The reference, row by row per thread (the *_ref row functions: no ggml_row_size needed);
    with `qw`, quantize_<type>(chunk, ..., qw) per thread's chunk, as llama-quantize calls it."""
    block, size, function, how = make_reference.TYPES[name]
    rows, cols = x.shape
    row_bytes = cols // block * size
    out = ctypes.create_string_buffer(rows * row_bytes)
    f = getattr(lib, function if qw is None else make_reference.WEIGHTED[name])
    step = -(-rows // threads)

    def part(r0):
        r1 = min(rows, r0 + step)
        if qw is not None:
            f(x[r0].ctypes.data, ctypes.addressof(out) + r0 * row_bytes, r1 - r0, cols, qw.ctypes.data)
        elif how == "row":  # quantize_qN_K(..., NULL) is this same call on the whole chunk
            f(x[r0].ctypes.data, ctypes.addressof(out) + r0 * row_bytes, (r1 - r0) * cols)
        else:
            f(x[r0].ctypes.data, ctypes.addressof(out) + r0 * row_bytes, r1 - r0, cols, None)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, range(0, rows, step)))
    return out.raw


if __name__ == "__main__":
    main()
