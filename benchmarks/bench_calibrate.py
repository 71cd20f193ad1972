"""Calibrated quantization on a real model: qtool's GPTQ against llm-compressor 0.14's
`GPTQModifier`, and qtool's round-to-nearest, on SmolLM2-135M-Instruct
(sample_models/real_models.py), the same calibration windows for both tools.

For each scheme (int4 g64 sym and asym by default; SmolLM2's hidden size 576 takes group 64):

    qtool rtn    python -m qtool quantize MODEL -o OUT --scheme S --threads 1 -q
    qtool gptq   python -m qtool quantize MODEL -o OUT --scheme S --calibrate CALIB.txt --samples N --seq-len L --threads 1 -q
    llmc gptq    $LLMC_PYTHON this file --llmc-child ...   (oneshot + GPTQModifier, same windows, one thread)

each a whole process, timed with its peak RSS (benchmarks/_measure.py); then the perplexity of
every output (loaded by transformers with compressed-tensors, decompressed) on the first
--eval-windows windows of 512 tokens of the evaluation half of the text, and of the float model.

    python benchmarks/bench_calibrate.py                       # 32 x 512 calibration tokens
    python benchmarks/bench_calibrate.py --samples 8 --schemes int4:g64 --eval-windows 8
    python benchmarks/bench_calibrate.py --samples 128          # the issue's full setting

llm-compressor runs from its own virtual environment (torch pinned to the same version):
    python -m venv /work/venv-llmc && /work/venv-llmc/bin/pip install -c /work/constraints.txt 'llmcompressor==0.14.*'
(--llmc-python PATH, default /work/venv-llmc/bin/python; --skip-llmc to leave it out).
The "float" model is SmolLM2's Q4_1 GGUF dequantized, so each int4 row is a second rounding:
compare the methods with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LLMC_PYTHON = os.environ.get("LLMC_PYTHON", "/work/venv-llmc/bin/python")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _scheme_args(scheme: str) -> dict:
    """compressed-tensors QuantizationArgs for a qtool short form int<b>:g<g>[:asym] or :channel."""
    parts = scheme.split(":")
    bits = int(parts[0][3:])
    args = {"num_bits": bits, "type": "int", "symmetric": "asym" not in parts, "strategy": "channel", "group_size": None}
    for part in parts[1:]:
        if part.startswith("g"):
            args.update(strategy="group", group_size=int(part[1:]))
    return args


def llmc_child(model: str, tokens_path: str, scheme: str, out: str) -> None:
    """In llm-compressor's environment: GPTQ on the given token windows, saved compressed."""
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    windows = json.loads(Path(tokens_path).read_text())
    dataset = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model)
    recipe = GPTQModifier(
        config_groups={"group_0": {"targets": ["Linear"], "weights": _scheme_args(scheme)}},
        ignore=["lm_head"], block_size=128, dampening_frac=0.01,
    )  # fmt: skip
    oneshot(model=loaded, tokenizer=tokenizer, dataset=dataset, recipe=recipe, num_calibration_samples=len(windows), max_seq_length=len(windows[0]))
    loaded.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


def windows_child(model: str, text: str, samples: int, seq_len: int, seed: int, out: str) -> None:
    """The token windows qtool calibrates on, as JSON, for llm-compressor to use the same."""
    sys.path.insert(0, str(REPO))
    from qtool.calibration.samples import SampleOptions, draw_samples, load_tokenizer, read_text

    tokens = draw_samples(read_text(text), load_tokenizer(model), SampleOptions(samples, seq_len, seed), text)
    Path(out).write_text(json.dumps(tokens.tolist()))


def perplexity_child(models: list[str], windows: int, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    sys.path.insert(0, str(REPO / "sample_models"))
    from real_models import perplexity, text_split

    _, evaluation = text_split()
    results = {}
    for path in models:
        extra = {"quantization_config": CompressedTensorsConfig(run_compressed=False)} if "quantization_config" in (Path(path) / "config.json").read_text() else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra)
        tokenizer = AutoTokenizer.from_pretrained(path)
        results[path] = perplexity(model, tokenizer, evaluation, 512, windows)[0]
        del model
    Path(out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemes", default="int4:g64,int4:g64:asym")
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--workdir", default=str(Path.home() / ".cache" / "qtool-bench" / "calibrate"))
    parser.add_argument("--llmc-python", default=LLMC_PYTHON)
    parser.add_argument("--skip-llmc", action="store_true")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--llmc-child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--windows-child", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--perplexity-child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llmc_child:
        return llmc_child(*args.llmc_child)
    if args.windows_child:
        model, text, samples, seq_len, seed, out = args.windows_child
        return windows_child(model, text, int(samples), int(seq_len), int(seed), out)
    if args.perplexity_child:
        *models, windows, out = args.perplexity_child
        return perplexity_child(models, int(windows), out)

    import subprocess

    sys.path.insert(0, str(REPO / "sample_models"))
    from real_models import smollm2, text_split

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = str(smollm2())
    calibration, _ = text_split()
    text = work / "calibration.txt"
    text.write_text(calibration)
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)}
    me = str(Path(__file__).resolve())
    tokens = work / "windows.json"
    subprocess.run([sys.executable, me, "--windows-child", model, str(text), str(args.samples), str(args.seq_len), str(args.seed), str(tokens)], check=True, env=env)
    rows = []
    for scheme in args.schemes.split(","):
        tag = scheme.replace(":", "-")
        runs = {
            "qtool rtn": [sys.executable, "-m", "qtool", "quantize", model, "-o", str(work / f"qtool-rtn-{tag}"), "--scheme", scheme, "--threads", "1", "-q", "--overwrite"],
            "qtool gptq": [
                sys.executable, "-m", "qtool", "quantize", model, "-o", str(work / f"qtool-gptq-{tag}"), "--scheme", scheme, "--calibrate", str(text),
                "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--seed", str(args.seed), "--threads", "1", "-q", "--overwrite",
            ],
        }  # fmt: skip
        if not args.skip_llmc:
            import shutil

            shutil.rmtree(work / f"llmc-gptq-{tag}", ignore_errors=True)
            runs["llm-compressor gptq"] = [args.llmc_python, me, "--llmc-child", model, str(tokens), scheme, str(work / f"llmc-gptq-{tag}")]
        for name, cmd in runs.items():
            out = cmd[cmd.index("-o") + 1] if "-o" in cmd else cmd[-1]
            result = measure(cmd, log_stem=work / f"{name.replace(' ', '-')}-{tag}", cwd=REPO, env=env, timeout_s=args.timeout)
            rows.append({"scheme": scheme, "method": name, "output": out, "ok": result.ok, "wall_s": result.wall_s, "cpu_s": result.cpu_s, "peak_rss_gb": result.peak_rss_bytes / 1e9})
            if not result.ok:
                print(f"{name} {scheme} failed:\n{result.stderr_tail()}", file=sys.stderr)
    outputs = [model] + [row["output"] for row in rows if row["ok"]]
    ppl_path = work / "perplexity.json"
    subprocess.run([sys.executable, me, "--perplexity-child", *outputs, str(args.eval_windows), str(ppl_path)], check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    perplexities = json.loads(ppl_path.read_text())
    print(f"SmolLM2-135M-Instruct, calibration {args.samples} x {args.seq_len} tokens (seed {args.seed}), perplexity on {args.eval_windows} windows of 512, one thread each")
    print(f"float: perplexity {perplexities[model]:.2f}")
    print("| scheme | method | perplexity | wall s | CPU s | peak RSS GB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        ppl = perplexities.get(row["output"])
        print(f"| {row['scheme']} | {row['method']} | {ppl:.2f} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | {row['peak_rss_gb']:.2f} |" if ppl else f"| {row['scheme']} | {row['method']} | failed | | | |")
    for scheme in args.schemes.split(","):
        ours = next((r for r in rows if r["scheme"] == scheme and r["method"] == "qtool gptq" and r["ok"]), None)
        theirs = next((r for r in rows if r["scheme"] == scheme and r["method"] == "llm-compressor gptq" and r["ok"]), None)
        if ours and theirs:
            print(f"{scheme}: qtool/llm-compressor wall {ours['wall_s'] / theirs['wall_s']:.2f}x, CPU {ours['cpu_s'] / theirs['cpu_s']:.2f}x, peak RSS {ours['peak_rss_gb'] / theirs['peak_rss_gb']:.2f}x")


if __name__ == "__main__":
    main()
