"""Kernel throughput of qtool's GPTQ decoder against a plain-torch unpack written the obvious way.

Issue 4, "Speed" (GPTQ part). In one process, on the same tensors already in memory:

  qtool     `qtool.conventions.gptq.decode` on each weight of a synthesized GPTQ 4-bit g128
            checkpoint (a `MemoryCheckpoint` with a quantize_config.json, resolved through the
            convention registry as any checkpoint is), float16 [O, I] out.
  baseline  the unpack a user writes after reading AutoGPTQ's torch fallback: a Python loop over
            the 8 nibble positions, each `(qweight >> 4j).to(int8) & 15`, stacked into W^T
            [I, O]; zero points unpacked the same way, plus one (v1); then
            `scales[g_idx] * (weight - zeros[g_idx])` in float16, and `.t().contiguous()` for the
            [O, I] weight qtool returns. (Without that transpose, the figure is printed too.)

The weight set is LLaMA-2-7B-shaped (q/k/v/o 4096x4096, gate/up 11008x4096, down 4096x11008),
whole weights until the parameters reach --gb GB as float16 (default 1.0: 512 M parameters,
256 MB packed). qweight and qzeros are random int32 words (every code and zero point 0..15),
scales random positive float16, g_idx = i // 128. Both decoders' outputs are checked equal, bit
for bit, on the first weight before timing. Each side decodes the whole set, 3 times,
interleaved; the figure is the ratio of medians. Target: baseline / qtool >= 2.

    python benchmarks/bench_decode_gptq.py [--gb 1.0] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qtool.conventions import resolve
from qtool.conventions.gptq import decode
from qtool.formats.memory import MemoryCheckpoint

BITS, GROUP = 4, 128
SHAPES = {  # name -> (out_features, in_features)
    "self_attn.q_proj": (4096, 4096),
    "self_attn.k_proj": (4096, 4096),
    "self_attn.v_proj": (4096, 4096),
    "self_attn.o_proj": (4096, 4096),
    "mlp.gate_proj": (11008, 4096),
    "mlp.up_proj": (11008, 4096),
    "mlp.down_proj": (4096, 11008),
}


def synthesize(target_params: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    params, layer = 0, 0
    while params < target_params:
        for name, (out_features, in_features) in SHAPES.items():
            if params >= target_params:
                break
            module = f"model.layers.{layer}.{name}"
            groups = in_features // GROUP
            tensors[f"{module}.qweight"] = torch.randint(
                -(2**31), 2**31, (in_features * BITS // 32, out_features), dtype=torch.int32, generator=generator
            )
            tensors[f"{module}.qzeros"] = torch.randint(
                -(2**31), 2**31, (groups, out_features * BITS // 32), dtype=torch.int32, generator=generator
            )
            tensors[f"{module}.scales"] = (torch.rand(groups, out_features, generator=generator) * 0.01 + 1e-3).half()
            tensors[f"{module}.g_idx"] = (torch.arange(in_features) // GROUP).to(torch.int32)
            params += out_features * in_features
        layer += 1
    return tensors


def obvious(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, transpose: bool = True
) -> torch.Tensor:
    """AutoGPTQ's torch fallback, written with a Python loop over the 8 nibble positions."""
    per_word, mask = 32 // BITS, (1 << BITS) - 1
    nibbles = [((qweight >> (BITS * j)).to(torch.int8) & mask) for j in range(per_word)]
    weight = torch.stack(nibbles, dim=1).reshape(qweight.shape[0] * per_word, qweight.shape[1])  # [I, O]
    zero_nibbles = [((qzeros >> (BITS * j)).to(torch.int8) & mask) for j in range(per_word)]
    zeros = torch.stack(zero_nibbles, dim=2).reshape(qzeros.shape[0], -1) + 1  # [G, O], v1 stores zero - 1
    index = g_idx.long()
    weight_t = scales[index] * (weight - zeros[index])  # [I, O] float16
    return weight_t.t().contiguous() if transpose else weight_t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="float16 gigabytes (10^9 B) of parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tensors = synthesize(int(args.gb * 1e9 / 2))
    config = {"bits": BITS, "group_size": GROUP, "desc_act": False, "sym": False, "quant_method": "gptq"}
    checkpoint = MemoryCheckpoint(tensors, {"quantize_config.json": config})
    weights = [w for w in resolve(checkpoint) if w.quantized]
    params = sum(w.parameters for w in weights)
    print(f"{len(weights)} GPTQ 4-bit g128 weights, {params / 1e6:.0f} M parameters "
          f"({params * 2 / 1e9:.2f} GB as float16, {sum(w.nbytes for w in weights) / 1e9:.2f} GB packed); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip

    def members(weight):
        module = weight.name.removesuffix(".weight")
        return [tensors[f"{module}.{leaf}"] for leaf in ("qweight", "qzeros", "scales", "g_idx")]

    first = weights[0]
    ours, theirs = decode(checkpoint, first), obvious(*members(first))
    if not torch.equal(ours.view(torch.int16), theirs.view(torch.int16)):
        raise SystemExit("FAIL: qtool and the baseline decode different bits")

    def run_qtool() -> None:
        for weight in weights:
            decode(checkpoint, weight)

    def run_baseline(transpose: bool = True) -> None:
        for weight in weights:
            obvious(*members(weight), transpose=transpose)

    labels = ("qtool", "baseline", "baseline, no transpose")
    wall: dict[str, list[float]] = {label: [] for label in labels}
    cpu: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(args.repeats):
        for label, run in zip(labels, (run_qtool, run_baseline, lambda: run_baseline(False))):
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            wall[label].append(time.perf_counter() - start)
            cpu[label].append(time.process_time() - start_cpu)
    medians = {label: statistics.median(values) for label, values in wall.items()}
    cpu_medians = {label: statistics.median(values) for label, values in cpu.items()}
    for label, seconds in medians.items():
        runs = ", ".join(f"{t:.2f}" for t in wall[label])
        print(
            f"{label:24s} median {seconds:6.2f} s wall ({params / seconds / 1e6:5.0f} M params/s), {cpu_medians[label]:6.2f} s CPU; runs: {runs}"
        )
    ratio = medians["baseline"] / medians["qtool"]
    loose = medians["baseline, no transpose"] / medians["qtool"]
    cpu_ratio = cpu_medians["baseline"] / cpu_medians["qtool"]
    print(f"ratio baseline / qtool: {ratio:.2f}x wall (against the baseline without its transpose: {loose:.2f}x; "
          f"CPU time {cpu_ratio:.2f}x); target >= 2x: {'PASS' if ratio >= 2 else 'FAIL'}")  # fmt: skip


if __name__ == "__main__":
    main()
