"""What a GGUF written from a Hugging Face checkpoint says about its model, so llama.cpp can run
it: the hyperparameter key-values after `general.architecture`, then the tokenizer's.

llama.cpp loads a GGUF only when it finds every hyperparameter its architecture needs and a
tokenizer (`tokenizer.ggml.*`). The keys follow llama.cpp's own converter
(`convert_hf_to_gguf.py`, read at llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f:
`TextModel.set_gguf_parameters`, `LlamaModel.set_gguf_parameters`); the tokenizer comes from
`qtool.llamacpp.tokenizer`, the names from `qtool.llamacpp.names`.

A model without a tokenizer, a missing hyperparameter, or a rope scaling qtool does not write is
refused (exit 2) before anything is written, unless the caller allows an incomplete GGUF; then
the file is written with what qtool knows, and a note says no runtime may load it.
"""

from __future__ import annotations

import os
from typing import Any

from qtool.errors import CheckpointError
from qtool.formats.checkpoint import Checkpoint
from qtool.llamacpp.names import TensorNames, config_int
from qtool.llamacpp.tokenizer import refuse_or_note, tokenizer_entries
from qtool.weight import Weight

__all__ = ["model_entries"]


def model_entries(
    source: Checkpoint, weights: list[Weight], names: TensorNames, allow_incomplete: bool
) -> list[tuple[str, Any, str]]:
    """The key-values written after `general.architecture` for `source` (hyperparameters, then
    the tokenizer), as (key, value, GGUFValueType name); notes go to `names.notes`. None for a
    GGUF input (it keeps its own) or an incomplete file of an unknown architecture."""
    if source.format == "gguf" or names.arch == "unknown":
        return []
    config = source.config
    entries = _hyperparameters(source, names.arch, config, allow_incomplete, names.notes)
    rows = _embedding_rows(weights, names)
    return entries + _tokenizer(source, config, names.arch, rows, allow_incomplete, names.notes)


# -- architecture and hyperparameters --------------------------------------------------------------


def _float(config: dict[str, Any], name: str) -> float | None:
    value = config.get(name)
    return (
        float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e38 else None
    )


def _hyperparameters(
    source: Checkpoint, arch: str, config: dict[str, Any], allow_incomplete: bool, notes: list[str]
) -> list[tuple[str, Any, str]]:
    """`LlamaModel.set_gguf_parameters`' keys, from config.json: llama.cpp needs the block
    count, the widths and the head counts; the rest have defaults there."""
    from gguf import Keys, RopeScalingType

    missing = [
        name for name in ("num_hidden_layers", "hidden_size", "num_attention_heads") if config_int(config, name) is None
    ]
    if missing:
        refuse_or_note(
            allow_incomplete,
            notes,
            f"{source.path}: config.json has no positive integer {', '.join(missing)}; llama.cpp needs them to run a {arch} model",
            "fix config.json",
        )
    entries: list[tuple[str, Any, str]] = []

    def put(key: str, value: Any, kind: str) -> None:
        entries.append((key.format(arch=arch), value, kind))

    for key, name in (
        (Keys.LLM.BLOCK_COUNT, "num_hidden_layers"),
        (Keys.LLM.CONTEXT_LENGTH, "max_position_embeddings"),
        (Keys.LLM.EMBEDDING_LENGTH, "hidden_size"),
        (Keys.LLM.FEED_FORWARD_LENGTH, "intermediate_size"),
        (Keys.Attention.HEAD_COUNT, "num_attention_heads"),
        (Keys.Attention.HEAD_COUNT_KV, "num_key_value_heads"),
    ):
        if config_int(config, name) is not None:
            put(key, config_int(config, name), "UINT32")
    rope = _rope_parameters(config)
    scaling = rope.get("rope_type") or rope.get("type")
    factor = _float(rope, "factor")
    if scaling in ("linear", "yarn") and factor is not None:
        put(
            Keys.Rope.SCALING_TYPE,
            RopeScalingType.LINEAR.value if scaling == "linear" else RopeScalingType.YARN.value,
            "STRING",
        )
        put(Keys.Rope.SCALING_FACTOR, factor, "FLOAT32")
        original = config_int(rope, "original_max_position_embeddings")
        if scaling == "yarn" and original is not None:
            put(Keys.Rope.SCALING_ORIG_CTX_LEN, original, "UINT32")
    elif scaling not in (None, "default"):
        # llama3's scaling is a generated rope_freqs tensor in llama.cpp's converter; qtool writes none
        refuse_or_note(
            allow_incomplete,
            notes,
            f"{source.path}: rope scaling {str(scaling)[:40]!r} is not written by qtool; llama.cpp would run the model without it",
            "convert it with llama.cpp's convert_hf_to_gguf.py",
        )
    theta = _float(rope, "rope_theta") if _float(rope, "rope_theta") is not None else _float(config, "rope_theta")
    if theta is not None:
        put(Keys.Rope.FREQ_BASE, theta, "FLOAT32")
    if _float(config, "rms_norm_eps") is not None:
        put(Keys.Attention.LAYERNORM_RMS_EPS, _float(config, "rms_norm_eps"), "FLOAT32")
    head_dim = config_int(config, "head_dim")
    if head_dim is not None:
        put(Keys.Attention.KEY_LENGTH, head_dim, "UINT32")
        put(Keys.Attention.VALUE_LENGTH, head_dim, "UINT32")
    if config_int(config, "vocab_size") is not None:
        put(Keys.LLM.VOCAB_SIZE, config_int(config, "vocab_size"), "UINT32")
    hidden, heads = config_int(config, "hidden_size"), config_int(config, "num_attention_heads")
    rope_dim = head_dim if head_dim is not None else (hidden // heads if hidden and heads else None)
    if rope_dim:
        put(Keys.Rope.DIMENSION_COUNT, rope_dim, "UINT32")
    return entries


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's `rope_parameters`, or the older `rope_scaling`; {} when neither."""
    for name in ("rope_parameters", "rope_scaling"):
        value = config.get(name)
        if isinstance(value, dict):
            return value
    return {}


def _embedding_rows(weights: list[Weight], names: TensorNames) -> int | None:
    """Rows of token_embd: the vocabulary llama.cpp will expect the tokenizer to have."""
    for weight in weights:
        if weight.shape and names.tensor_name(weight.name) == "token_embd.weight":
            return int(weight.shape[0])
    return None


# -- tokenizer ------------------------------------------------------------------------------------


def _tokenizer(
    source: Checkpoint, config: dict[str, Any], arch: str, rows: int | None, allow_incomplete: bool, notes: list[str]
) -> list[tuple[str, Any, str]]:
    """The tokenizer keys, for the vocabulary the token embedding has."""
    folder = _model_folder(source)
    vocab_size = config_int(config, "vocab_size") or rows
    if rows is not None and vocab_size != rows:
        raise CheckpointError(
            f"config.json's vocab_size {vocab_size} differs from the {rows} rows of the token embedding",
            path=folder,
            hint="fix config.json",
        )
    return tokenizer_entries(folder, arch, vocab_size, allow_incomplete, notes)


def _model_folder(source: Checkpoint) -> str:
    """The folder whose side files belong to the model: the one named, or the weights' own."""
    if os.path.isdir(source.path):
        return source.path
    return os.path.dirname(os.path.abspath(source.files[0] if source.files else source.path))
