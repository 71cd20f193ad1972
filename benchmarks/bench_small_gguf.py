"""`qtool dequantize` of a tiny GGUF: the whole process, against `qtool inspect` of the same file.

Issue 18 #13: a 13 KB GGUF took ~11 s wall for 3.6 s of CPU, the main thread waiting while the
read worker imported torch for a block type that had no native decoder (MXFP4). A small file
should cost what starting qtool costs, so the baseline is `qtool inspect FILE --json` (start-up
plus the header, no torch) in the same run, interleaved; the figure is the median of the
per-round ratios dequantize / inspect. `QTOOL_NATIVE=0` (torch decoders) is shown for contrast.

    python benchmarks/bench_small_gguf.py --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import in_work_dir, measure

# two weights of 4096 values of each type, one block a row: block bytes drawn at random, scales kept finite
TYPES = ("Q8_0", "Q4_K", "MXFP4", "NVFP4")


def write_gguf(path: Path, type_name: str) -> None:
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
        data = rng.integers(0, 256, size=(64 * 64 // block, size), dtype=np.uint8)
        if type_name == "Q8_0":
            data[:, 0:2] = rng.uniform(-2, 2, size=(len(data), 1)).astype(np.float16).view(np.uint8)
        elif type_name == "Q4_K":
            data[:, 0:4] = rng.uniform(-2, 2, size=(len(data), 2)).astype(np.float16).view(np.uint8)
        elif type_name == "MXFP4":
            data[:, 0] = rng.integers(100, 150, size=len(data), dtype=np.uint8)
        writer.add_tensor(name, data, raw_dtype=kind)  # one block a row
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()

    def body(root: Path) -> int:
        qtool = [sys.executable, "-m", "qtool"]
        repo = Path(__file__).resolve().parent.parent
        print("type    file   inspect s  dequantize s (cpu s)  ratio  torch decoders s  ratio")
        for type_name in TYPES:
            path = root / f"{type_name}.gguf"
            write_gguf(path, type_name)
            rows: dict[str, list[float]] = {"inspect": [], "native": [], "torch": [], "cpu": []}
            for round_ in range(args.repeats + 1):  # round 0: warm-up, discarded
                figures = {}
                for label, cmd, env in (
                    ("inspect", [*qtool, "inspect", str(path), "--json"], None),
                    (
                        "native",
                        [*qtool, "dequantize", str(path), "-o", str(root / f"{type_name}-n{round_}.safetensors")],
                        None,
                    ),
                    (
                        "torch",
                        [*qtool, "dequantize", str(path), "-o", str(root / f"{type_name}-t{round_}.safetensors")],
                        {**os.environ, "QTOOL_NATIVE": "0"},
                    ),
                ):
                    result = measure(
                        cmd, log_stem=root / f"{type_name}-{label}-{round_}", cwd=repo, env=env, timeout_s=120
                    )
                    if not result.ok:
                        print(f"{type_name} {label} failed:\n{result.stderr_tail()}")
                        return 1
                    figures[label] = result.wall_s
                    if label == "native":
                        figures["cpu"] = result.cpu_s
                if round_:
                    for key, value in figures.items():
                        rows[key].append(value)
            ratio = statistics.median(n / i for n, i in zip(rows["native"], rows["inspect"]))
            torch_ratio = statistics.median(t / i for t, i in zip(rows["torch"], rows["inspect"]))
            print(
                f"{type_name:6} {path.stat().st_size:6} B  {statistics.median(rows['inspect']):7.2f}  "
                f"{statistics.median(rows['native']):9.2f} ({statistics.median(rows['cpu']):.2f})  "
                f"{ratio:9.2f}x  {statistics.median(rows['torch']):10.2f}  {torch_ratio:9.2f}x"
            )
        return 0

    return in_work_dir(args.workdir, "qtool-bench-small-gguf-", args.keep, body)


if __name__ == "__main__":
    sys.exit(main())
