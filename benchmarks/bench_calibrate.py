"""Calibrated quantization on a real model: qtool's GPTQ and AWQ against llm-compressor 0.14's
`GPTQModifier` and `AWQModifier` (+ `QuantizationModifier`), and qtool's round-to-nearest, on
SmolLM2-135M-Instruct (sample_models/real_models.py), the same calibration windows for both tools.

For each scheme (int4 g64 sym and asym by default; SmolLM2's hidden size 576 takes group 64):

    qtool rtn    python -m qtool quantize MODEL -o OUT --scheme S --threads 1 -q
    qtool gptq   python -m qtool quantize MODEL -o OUT --scheme S --calibrate CALIB.txt --samples N --seq-len L --threads 1 -q
                 (qtool's defaults: actorder "static", as llm-compressor 0.14's GPTQModifier; the bench's
                 --actorder none or weight passes that order to qtool instead)
    llmc gptq    $LLMC_PYTHON this file --llmc-child ...   (oneshot + GPTQModifier, same windows, one thread)
    qtool awq    ... --algorithm awq                        (20-point grid, duo scaling: llm-compressor's defaults)
    llmc awq     $LLMC_PYTHON this file --llmc-child ... awq (AWQModifier defaults + QuantizationModifier;
                 on a CPU-only machine its cache's pin_memory is made a no-op, as it needs CUDA)

each a whole process, timed with its peak RSS (benchmarks/_measure.py); then the perplexity of
every output (loaded by transformers with compressed-tensors, decompressed) on the first
--eval-windows windows of 512 tokens of the evaluation half of the text, and of the float model.

    python benchmarks/bench_calibrate.py                       # 32 x 512 calibration tokens
    python benchmarks/bench_calibrate.py --samples 8 --schemes int4:g64 --eval-windows 8
    python benchmarks/bench_calibrate.py --samples 128          # the issue's full setting
    python benchmarks/bench_calibrate.py --methods awq --schemes int4:g64   # AWQ only
    python benchmarks/bench_calibrate.py --methods gptq --schemes int3:g64,int3:g64:mse   # both observers
    python benchmarks/bench_calibrate.py --methods gptq,gptq-ts --schemes int4:g64,int4:g64:asym   # and --true-sequential
    python benchmarks/bench_calibrate.py --methods gptq-ts --schemes int4:g64,int4:g64:asym,int3:g64 --eval-windows 32   # true sequential only

Memory flat in depth (--depth 8,30): random-weight models of SmolLM2's width (hidden 576,
intermediate 1536, 9 heads, its tokenizer) with each number of layers, bf16, made once in the
workdir; qtool GPTQ int4 g64 on each, one process each: peak RSS and the per-layer time from
its --json report (median over layers).

    python benchmarks/bench_calibrate.py --depth 8,30 --samples 8 --seq-len 512
    python benchmarks/bench_calibrate.py --depth 8,30 --samples 32 --methods gptq-ts   # true sequential

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
from _measure import measure

REPO = Path(__file__).resolve().parent.parent
LLMC_PYTHON = os.environ.get("LLMC_PYTHON", "/work/venv-llmc/bin/python")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _scheme_args(scheme: str) -> dict:
    """compressed-tensors QuantizationArgs for a qtool short form int<b>:g<g>[:asym][:mse] or
    :channel (":mse": both tools' mse observer)."""
    parts = scheme.split(":")
    bits = int(parts[0][3:])
    args = {
        "num_bits": bits,
        "type": "int",
        "symmetric": "asym" not in parts,
        "strategy": "channel",
        "group_size": None,
    }
    if "mse" in parts:
        args["observer"] = "mse"
    for part in parts[1:]:
        if part.startswith("g"):
            args.update(strategy="group", group_size=int(part[1:]))
    return args


def llmc_child(model: str, tokens_path: str, scheme: str, out: str, algorithm: str = "gptq") -> None:
    """In llm-compressor's environment: GPTQ (or AWQ, then round to nearest) on the given token
    windows, saved compressed."""
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    windows = json.loads(Path(tokens_path).read_text())
    dataset = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model)
    groups = {"group_0": {"targets": ["Linear"], "weights": _scheme_args(scheme)}}
    if algorithm == "awq":
        from llmcompressor.modifiers.transform import AWQModifier

        if not torch.cuda.is_available():  # AWQ pins its cached activations for host-to-device copies
            from llmcompressor.pipelines.cache import IntermediatesCache

            IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
        recipe = [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    else:
        recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"], block_size=128, dampening_frac=0.01)
    oneshot(
        model=loaded,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(windows),
        max_seq_length=len(windows[0]),
    )
    loaded.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


def windows_child(model: str, text: str, samples: int, seq_len: int, seed: int, out: str) -> None:
    """The token windows qtool calibrates on, as JSON, for llm-compressor to use the same."""
    sys.path.insert(0, str(REPO))
    from qtool.calibration.samples import SampleOptions, draw_samples, load_tokenizer, read_text

    tokens = draw_samples(read_text(text), load_tokenizer(model), SampleOptions(samples, seq_len, seed), text)
    Path(out).write_text(json.dumps(tokens.tolist()))


def random_model_child(model: str, layers: int, out: str) -> None:
    """`model`'s architecture with `layers` decoder layers, random weights, bf16, and its tokenizer."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    built.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model) / name).exists():
            shutil.copy(Path(model) / name, Path(out) / name)


def depth(args, model: str, text: Path, work: Path, env: dict) -> None:
    import statistics
    import subprocess

    me = str(Path(__file__).resolve())
    mode = " --true-sequential" if "gptq-ts" in args.methods.split(",") else ""
    print(
        f"GPTQ{mode} int4:g64, calibration {args.samples} x {args.seq_len} tokens, random models of SmolLM2-135M's width, one thread"
    )
    print("| layers | wall s | CPU s | peak RSS GB | median s per layer |")
    print("|---|---|---|---|---|")
    for layers in (int(n) for n in args.depth.split(",")):
        folder = work / f"random-{layers}"
        if not (folder / "config.json").exists():
            subprocess.run(
                [sys.executable, me, "--random-model-child", model, str(layers), str(folder)], check=True, env=env
            )
        out = work / f"depth-{layers}"
        cmd = [
            sys.executable, "-m", "qtool", "quantize", str(folder), "-o", str(out), "--scheme", "int4:g64", "--calibrate", str(text),
            "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--threads", "1", "--overwrite", "--json",
            *(["--true-sequential"] if "gptq-ts" in args.methods.split(",") else []),
        ]  # fmt: skip
        result = measure(cmd, log_stem=work / f"depth-{layers}", cwd=REPO, env=env, timeout_s=args.timeout)
        if not result.ok:
            print(f"| {layers} | failed: {result.stderr_tail(3)} |")
            continue
        document = json.loads(result.stdout_path.read_text())
        per_layer = statistics.median(layer["seconds"] for layer in document["calibration"]["layers"])
        print(
            f"| {layers} | {result.wall_s:.1f} | {result.cpu_s:.1f} | {result.peak_rss_bytes / 1e9:.2f} | {per_layer:.2f} |"
        )


def perplexity_child(models: list[str], windows: int, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    sys.path.insert(0, str(REPO / "sample_models"))
    from real_models import perplexity, text_split

    _, evaluation = text_split()
    results = {}
    for path in models:
        extra = (
            {"quantization_config": CompressedTensorsConfig(run_compressed=False)}
            if "quantization_config" in (Path(path) / "config.json").read_text()
            else {}
        )
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
    parser.add_argument(
        "--methods",
        default="rtn,gptq,awq",
        help="of rtn, gptq, gptq-ts, awq: gptq-ts is qtool's --true-sequential GPTQ (each against llm-compressor's GPTQ, run once)",
    )
    parser.add_argument(
        "--actorder",
        default="default",
        help="qtool GPTQ's --actorder (static, weight, none); 'default' passes none and runs qtool's default (static, as llm-compressor 0.14's GPTQModifier)",
    )
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--workdir", default=str(Path.home() / ".cache" / "qtool-bench" / "calibrate"))
    parser.add_argument("--llmc-python", default=LLMC_PYTHON)
    parser.add_argument("--skip-llmc", action="store_true")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--llmc-child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--windows-child", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--perplexity-child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--random-model-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--depth", help="layer counts, e.g. 8,30: peak memory and per-layer time by depth (GPTQ only)")
    args = parser.parse_args()
    if args.llmc_child:
        return llmc_child(*args.llmc_child)
    if args.windows_child:
        model, text, samples, seq_len, seed, out = args.windows_child
        return windows_child(model, text, int(samples), int(seq_len), int(seed), out)
    if args.perplexity_child:
        *models, windows, out = args.perplexity_child
        return perplexity_child(models, int(windows), out)
    if args.random_model_child:
        model, layers, out = args.random_model_child
        return random_model_child(model, int(layers), out)

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
    if args.depth:
        return depth(args, model, text, work, env)
    me = str(Path(__file__).resolve())
    tokens = work / "windows.json"
    subprocess.run(
        [
            sys.executable,
            me,
            "--windows-child",
            model,
            str(text),
            str(args.samples),
            str(args.seq_len),
            str(args.seed),
            str(tokens),
        ],
        check=True,
        env=env,
    )
    rows = []
    for scheme in args.schemes.split(","):
        tag = scheme.replace(":", "-")
        methods = args.methods.split(",")
        qtool = [
            sys.executable,
            "-m",
            "qtool",
            "quantize",
            model,
            "--scheme",
            scheme,
            "--threads",
            "1",
            "-q",
            "--overwrite",
        ]
        calibrated = [
            "--calibrate",
            str(text),
            "--samples",
            str(args.samples),
            "--seq-len",
            str(args.seq_len),
            "--seed",
            str(args.seed),
        ]
        runs = {}
        if "rtn" in methods:
            runs["qtool rtn"] = [*qtool, "-o", str(work / f"qtool-rtn-{tag}")]
        for algorithm in ("gptq", "awq"):
            if algorithm not in methods and not (algorithm == "gptq" and "gptq-ts" in methods):
                continue
            order = ["--actorder", args.actorder] if algorithm == "gptq" and args.actorder != "default" else []
            if algorithm in methods:
                runs[f"qtool {algorithm}"] = [
                    *qtool,
                    "-o",
                    str(work / f"qtool-{algorithm}-{tag}"),
                    *calibrated,
                    "--algorithm",
                    algorithm,
                    *order,
                ]
            if algorithm == "gptq" and "gptq-ts" in methods:
                runs["qtool gptq true-sequential"] = [
                    *qtool,
                    "-o",
                    str(work / f"qtool-gptq-ts-{tag}"),
                    *calibrated,
                    "--algorithm",
                    "gptq",
                    *order,
                    "--true-sequential",
                ]
            if not args.skip_llmc:
                import shutil

                shutil.rmtree(work / f"llmc-{algorithm}-{tag}", ignore_errors=True)
                runs[f"llm-compressor {algorithm}"] = [
                    args.llmc_python,
                    me,
                    "--llmc-child",
                    model,
                    str(tokens),
                    scheme,
                    str(work / f"llmc-{algorithm}-{tag}"),
                    algorithm,
                ]
        for name, cmd in runs.items():
            out = cmd[cmd.index("-o") + 1] if "-o" in cmd else cmd[-2]
            result = measure(
                cmd, log_stem=work / f"{name.replace(' ', '-')}-{tag}", cwd=REPO, env=env, timeout_s=args.timeout
            )
            rows.append(
                {
                    "scheme": scheme,
                    "method": name,
                    "output": out,
                    "ok": result.ok,
                    "wall_s": result.wall_s,
                    "cpu_s": result.cpu_s,
                    "peak_rss_gb": result.peak_rss_bytes / 1e9,
                }
            )
            if not result.ok:
                print(f"{name} {scheme} failed:\n{result.stderr_tail()}", file=sys.stderr)
    outputs = [model] + [row["output"] for row in rows if row["ok"]]
    ppl_path = work / "perplexity.json"
    subprocess.run(
        [sys.executable, me, "--perplexity-child", *outputs, str(args.eval_windows), str(ppl_path)],
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    perplexities = json.loads(ppl_path.read_text())
    print(
        f"SmolLM2-135M-Instruct, calibration {args.samples} x {args.seq_len} tokens (seed {args.seed}), perplexity on {args.eval_windows} windows of 512, one thread each"
    )
    print(f"float: perplexity {perplexities[model]:.2f}")
    print("| scheme | method | perplexity | wall s | CPU s | peak RSS GB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        ppl = perplexities.get(row["output"])
        print(
            f"| {row['scheme']} | {row['method']} | {ppl:.2f} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | {row['peak_rss_gb']:.2f} |"
            if ppl
            else f"| {row['scheme']} | {row['method']} | failed | | | |"
        )
    for scheme in args.schemes.split(","):
        for algorithm, method in (("gptq", "qtool gptq"), ("gptq", "qtool gptq true-sequential"), ("awq", "qtool awq")):
            ours = next((r for r in rows if r["scheme"] == scheme and r["method"] == method and r["ok"]), None)
            theirs = next(
                (r for r in rows if r["scheme"] == scheme and r["method"] == f"llm-compressor {algorithm}" and r["ok"]),
                None,
            )
            if ours and theirs:
                print(
                    f"{scheme} {method}: qtool/llm-compressor wall {ours['wall_s'] / theirs['wall_s']:.2f}x, CPU {ours['cpu_s'] / theirs['cpu_s']:.2f}x, "
                    f"peak RSS {ours['peak_rss_gb'] / theirs['peak_rss_gb']:.2f}x, perplexity {perplexities[ours['output']]:.2f} vs {perplexities[theirs['output']]:.2f}"
                )  # fmt: skip


if __name__ == "__main__":
    main()
