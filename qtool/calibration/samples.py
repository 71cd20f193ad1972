"""Calibration text to token windows: a `.txt` file, a `.jsonl` file with a `text` field per
line, or a folder of them (its files in name order), tokenized with the model's own tokenizer,
cut into windows of `seq_len` tokens and `samples` of them drawn with `seed`.

Every bad input is one line naming the file: a missing or empty text, a JSON line without a
string `text`, a text with fewer tokens than samples x seq_len (saying how many it has).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qtool.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    import torch

__all__ = ["SampleOptions", "read_text", "draw_samples", "load_tokenizer", "tokenized"]

MAX_TEXT_BYTES = 1 << 30  # a calibration text larger than this is surely a mistake


@dataclass(frozen=True)
class SampleOptions:
    samples: int = 128
    seq_len: int = 512
    seed: int = 0

    def check(self) -> None:
        if self.samples < 1:
            raise UsageError(f"samples {self.samples} must be at least 1", option="samples")
        if self.seq_len < 2:
            raise UsageError(f"seq_len {self.seq_len} must be at least 2", option="seq_len")


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith((".txt", ".jsonl")))
        if not names:
            raise UsageError(f"{path}: the folder holds no .txt or .jsonl file", option="calibrate")
        return [os.path.join(path, n) for n in names]
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such calibration text", option="calibrate")
    if not path.endswith((".txt", ".jsonl")):
        raise UsageError(f"{path}: a calibration text is a .txt or .jsonl file, or a folder of them", option="calibrate")
    return [path]


def _read(path: str) -> str:
    try:
        size = os.path.getsize(path)
        if size > MAX_TEXT_BYTES:
            raise CheckpointError(f"is {size} bytes, more than a calibration text's {MAX_TEXT_BYTES}", path=path)
        with open(path, "rb") as handle:
            raw = handle.read(MAX_TEXT_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot be read: {exc.strerror}", path=path) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"is not UTF-8 text (byte {exc.start})", path=path) from None


def _jsonl_texts(path: str, content: str) -> list[str]:
    from qtool.formats.untrusted_json import parse_json

    texts = []
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        value = parse_json(line, path, where=f"line {number}")
        text = value.get("text") if isinstance(value, dict) else None
        if not isinstance(text, str):
            raise CheckpointError(f"line {number} has no string field \"text\"", path=path)
        texts.append(text)
    return texts


def read_text(path: str | os.PathLike[str]) -> list[str]:
    """The documents of a calibration text, in order; an empty text is refused."""
    path = os.fspath(path)
    documents: list[str] = []
    for file in _files(path):
        content = _read(file)
        documents.extend(_jsonl_texts(file, content) if file.endswith(".jsonl") else [content])
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise UsageError(f"{path}: the calibration text is empty", option="calibrate")
    return documents


def load_tokenizer(model_folder: str, notes: list[str] | None = None):
    """The model's own tokenizer from its folder (local files only, never the folder's own
    code: `qtool.formats.transformers_boundary`), or a one-line refusal. What transformers logs
    meanwhile goes to `notes`."""
    from qtool.formats.transformers_boundary import auto_tokenizer

    if not model_folder or not os.path.isdir(model_folder):
        raise UsageError(f"{model_folder}: calibration needs a model folder with its tokenizer", option="calibrate")
    if not any(os.path.isfile(os.path.join(model_folder, n)) for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise UsageError(f"{model_folder} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)", hint="calibration tokenizes the text with the model's own tokenizer", option="calibrate")
    try:
        return auto_tokenizer(model_folder, model_folder, [] if notes is None else notes)
    except (CheckpointError, UsageError):
        raise
    except Exception as exc:  # transformers raises anything from OSError to ValueError here
        raise UsageError(f"{model_folder}: its tokenizer cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})", option="calibrate") from None


def tokenized(tokenizer, text: str, **options) -> list[int]:
    """The token ids of `text`; a panic in the Rust tokenizer (a regex that backtracks) is one
    line naming the tokenizer file."""
    from qtool.formats.transformers_boundary import tokenizer_panics

    with tokenizer_panics(os.path.join(str(getattr(tokenizer, "name_or_path", "") or "."), "tokenizer.json")):
        return tokenizer(text, **options)["input_ids"]


def draw_samples(documents: list[str], tokenizer, options: SampleOptions, where: str) -> "torch.Tensor":
    """[samples, seq_len] int64 token ids: the documents tokenized and joined, cut into
    non-overlapping windows, `samples` of them drawn with `seed` (the same every run)."""
    import torch

    options.check()
    tokenizer.model_max_length = 1 << 62  # the text is cut into windows here; no warning about its length
    ids: list[int] = []
    for document in documents:
        ids.extend(tokenized(tokenizer, document, add_special_tokens=False))
    windows = len(ids) // options.seq_len
    needed = options.samples * options.seq_len
    if windows < options.samples:
        raise UsageError(
            f"{where}: the calibration text has {len(ids)} tokens, fewer than samples x seq_len = {options.samples} x {options.seq_len} = {needed}",
            hint="give more text, or fewer samples or a shorter seq_len",
            option="calibrate",
        )
    chosen = random.Random(options.seed).sample(range(windows), options.samples)
    tokens = torch.tensor(ids[: windows * options.seq_len], dtype=torch.int64).view(windows, options.seq_len)
    return tokens[torch.tensor(chosen)]
