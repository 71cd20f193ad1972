"""GGUF decode speed: qtool's decoders against the gguf package's numpy ones.

Two measures on GGUF files of Q8_0, Q4_0 and Q4_K tensors (written with the gguf package;
Q4_K blocks are random valid bytes with small finite f16 scales, since gguf-py cannot
quantize K-quants):

- kernel throughput: parameters per second decoded in-process from the same bytes already in
  memory to float32, `gguf.quants.dequantize` against qtool's native kernel
  (`qtool.native.decode_gguf`, what `qtool dequantize` runs on the CPU; target >= 3x) and
  against its torch decoders (`qtool.conventions.gguf.decode_blocks`, the CUDA path);
- whole process: `qtool dequantize FILE -o OUT --dtype bf16` vs a script doing
  `gguf.quants.dequantize` of every tensor plus `safetensors.torch.save_file` of bf16
  (target >= 1.5x), with peak RSS (target < 1 GB).

    python benchmarks/bench_decode.py --size-gb 1
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure

TYPES = ("Q8_0", "Q4_0", "Q4_K")
COLS = 4096

BASELINE = """
import sys, numpy as np, torch, gguf
from safetensors.torch import save_file
reader = gguf.GGUFReader(sys.argv[1])
out = {t.name: torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type))).to(torch.bfloat16) for t in reader.tensors}
save_file(out, sys.argv[2])
"""


def write_gguf(path: Path, kind: str, params: int, seed: int) -> int:
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows_per_tensor = 4096
    tensors = max(1, params // (rows_per_tensor * COLS))
    writer = gguf.GGUFWriter(str(path), "llama")
    for index in range(tensors):
        if kind == "Q4_K":
            blocks = rng.integers(0, 256, size=(rows_per_tensor * COLS // block, size), dtype=np.uint8)
            scales = rng.uniform(1e-4, 1e-3, size=(blocks.shape[0], 2)).astype(np.float16)
            blocks[:, :4] = scales.view(np.uint8)  # d and dmin first: small finite f16
            data = blocks.reshape(rows_per_tensor, -1)
        else:
            weights = rng.standard_normal((rows_per_tensor, COLS), dtype=np.float32) * 0.02
            data = gguf.quants.quantize(weights, qtype)
        writer.add_tensor(f"blk.{index}.ffn_up.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors * rows_per_tensor * COLS


def kernel_times(path: Path, repeats: int) -> tuple[float, float, float]:
    """Median seconds to decode every tensor of the file: native, torch, gguf package."""
    import gguf
    import numpy as np
    import torch

    from qtool import native
    from qtool.conventions.gguf import decode_blocks

    reader = gguf.GGUFReader(str(path))
    tensors = [(np.array(t.data), t.tensor_type, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors]
    if not native.available():
        raise SystemExit("qtool.native is not built: pip install -e . with a C compiler")
    times: dict[str, list[float]] = {"native": [], "torch": [], "gguf": []}
    for _ in range(repeats):
        start = time.perf_counter()
        for raw, qtype, _ in tensors:
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            native.decode_gguf(qtype.name, raw, raw.size // type_size, block_size, "F32")
        times["native"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for raw, qtype, shape in tensors:
            decode_blocks(torch.from_numpy(raw.reshape(-1).view(np.uint8)), qtype.name, shape)
        times["torch"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for raw, qtype, _ in tensors:
            gguf.quants.dequantize(raw, qtype)
        times["gguf"].append(time.perf_counter() - start)
    return statistics.median(times["native"]), statistics.median(times["torch"]), statistics.median(times["gguf"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.0, help="parameters per file, in GB of bf16 (default 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--kernel-only", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kernel_only:
        print(*kernel_times(Path(args.kernel_only), args.repeats))
        return 0
    params = int(args.size_gb * 1e9 / 2)
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as work:
        print(
            f"{'type':6} {'params':>8} {'native s':>9} {'torch s':>8} {'gguf s':>7} {'ratio':>6} {'torch':>6}   "
            f"{'qtool deq s':>11} {'RSS GB':>6} {'baseline s':>10} {'RSS GB':>6} {'ratio':>6}"
        )
        for kind in args.types.split(","):
            path = Path(work) / f"{kind}.gguf"
            count = write_gguf(path, kind, params, seed=0)
            # whole processes first, and the in-process kernel timing in a child of its own: a
            # child forked from a parent holding GBs reports that parent's RSS as its own peak
            qtool_run = measure(
                [
                    sys.executable,
                    "-m",
                    "qtool",
                    "dequantize",
                    str(path),
                    "-o",
                    f"{work}/q.safetensors",
                    "--dtype",
                    "bf16",
                    "-q",
                    "--overwrite",
                ],
                log_stem=Path(work) / f"{kind}-qtool",
            )
            base_run = measure(
                [sys.executable, "-c", BASELINE, str(path), f"{work}/b.safetensors"],
                log_stem=Path(work) / f"{kind}-base",
            )
            for run in (qtool_run, base_run):
                if not run.ok:
                    print(run.stderr_tail())
                    return 1
            kernel = subprocess.run(
                [sys.executable, __file__, "--kernel-only", str(path), "--repeats", str(args.repeats)],
                capture_output=True,
                text=True,
                check=True,
            )
            ours, torch_s, theirs = map(float, kernel.stdout.split())
            print(
                f"{kind:6} {count / 1e6:7.0f}M {ours:9.2f} {torch_s:8.2f} {theirs:7.2f} {theirs / ours:5.2f}x {theirs / torch_s:5.2f}x   "
                f"{qtool_run.wall_s:11.2f} {qtool_run.peak_rss_bytes / 1e9:6.2f} {base_run.wall_s:10.2f} "
                f"{base_run.peak_rss_bytes / 1e9:6.2f} {base_run.wall_s / qtool_run.wall_s:5.2f}x"
            )
            os.remove(path)
    print("ratio = gguf / native (the CPU path), torch = gguf / torch decoders (the CUDA path's code, on the CPU)")
    print("targets: kernel >= 3x, whole process >= 1.5x, qtool RSS < 1 GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
