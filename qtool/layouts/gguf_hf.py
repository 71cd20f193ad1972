"""What a GGUF written from a Hugging Face checkpoint says about its model, so llama.cpp can run
it: the architecture, the hyperparameters, GGUF's tensor names and the tokenizer.

llama.cpp loads a GGUF only when it knows the architecture, finds every hyperparameter that
architecture needs, finds exactly the tensors it expects under GGUF's names, and finds a
tokenizer (`tokenizer.ggml.*`). qtool writes all of that for the LLaMA family only:

    config.json                                 GGUF architecture   q/k rows
    LlamaForCausalLM   / model_type llama       llama               permuted to llama.cpp's rotary order
    MistralForCausalLM / model_type mistral     llama               permuted
    Qwen2ForCausalLM   / model_type qwen2       qwen2               as stored

The keys follow llama.cpp's own converter (`convert_hf_to_gguf.py`, read at llama.cpp
0c1e57098bba43ac29e6e3b677cdceebdd22334f: `TextModel.set_gguf_parameters`,
`LlamaModel.set_gguf_parameters`), names come from gguf-py's `get_tensor_name_map`, and the
tokenizer from `qtool.layouts.gguf_tokenizer`.

Any other model, a model without a tokenizer, a tensor llama.cpp's architecture does not name,
or a rope scaling qtool does not write is refused (exit 2) before anything is written, unless
the caller allows an incomplete GGUF; then the file is written with what qtool knows, and a
warning says no runtime may load it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from qtool.errors import CheckpointError, UsageError
from qtool.formats.checkpoint import Checkpoint
from qtool.layouts.gguf_tokenizer import refuse_or_note, tokenizer_entries
from qtool.weight import Weight

__all__ = ["GgufModel", "describe_model", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_PERMUTED_ARCHS = ("llama",)  # llama.cpp's converter undoes the HF rotary permutation for these
_DROPPED = (".rotary_emb.inv_freq",)  # buffers of old checkpoints that llama.cpp's converter skips
_SUPPORTED_WORDS = "llama, mistral and qwen2 (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)"

@dataclass
class GgufModel:
    """The model a GGUF describes: its architecture, the key-values written after
    `general.architecture` (hyperparameters, then the tokenizer), and how each weight is named."""

    arch: str  # GGUF architecture, or "unknown"
    entries: list[tuple[str, Any, str]] = field(default_factory=list)  # (key, value, GGUFValueType name)
    notes: list[str] = field(default_factory=list)  # warnings for the user
    _names: Callable[[str], str | None] | None = None
    _heads: tuple[int, int] | None = None

    def tensor_name(self, name: str) -> str | None:
        """The GGUF name of weight `name`; None for a buffer llama.cpp does not read."""
        if self._names is None:
            return name
        return self._names(name)

    def rope_heads(self, name: str) -> int | None:
        """The head count whose rows llama.cpp's converter permutes: q by n_head, k by n_head_kv."""
        if self._heads is None:
            return None
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return self._heads[0]
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return self._heads[1]
        return None


def describe_model(source: Checkpoint, weights: list[Weight], allow_incomplete: bool) -> GgufModel:
    """What to write for `source`: a GGUF input keeps its own names (its metadata is the GGUF
    layout's business); any other checkpoint must be a LLaMA-family model with a tokenizer, or
    `allow_incomplete` must be given (then a warning says no runtime will load the file)."""
    if source.format == "gguf":
        return GgufModel("unknown")
    config = source.config
    arch, what = _architecture(config)
    if arch is None:
        if not allow_incomplete:
            raise UsageError(
                f"{source.path} is {what}: qtool writes GGUF that llama.cpp runs only for {_SUPPORTED_WORDS}",
                hint="write another layout, or allow an incomplete GGUF that no runtime will load",
                option="allow_incomplete_gguf",
            )
        return GgufModel("unknown", notes=[f"writing an incomplete GGUF (architecture \"unknown\", no tokenizer): {what} is not a model qtool describes in GGUF, and no runtime will load the file"])
    model = GgufModel(arch)
    model.entries = _hyperparameters(source, arch, config, allow_incomplete, model.notes)
    model._names = _renamer(arch, config, source, allow_incomplete, model.notes)
    if arch in _PERMUTED_ARCHS:
        model._heads = _heads(config)
    rows = _embedding_rows(weights, model)
    model.entries += _tokenizer(source, config, arch, rows, allow_incomplete, model.notes)
    return model


# -- architecture and hyperparameters --------------------------------------------------------------


def _architecture(config: dict[str, Any]) -> tuple[str | None, str]:
    """(GGUF architecture or None, the model in words) from config.json."""
    architectures = config.get("architectures")
    model_type = config.get("model_type")
    named = architectures[0] if isinstance(architectures, list) and architectures and isinstance(architectures[0], str) else None
    if named is not None:
        words = f'"{named[:80]}"' + (f' (model_type "{model_type[:40]}")' if isinstance(model_type, str) else "")
        return SUPPORTED_ARCHITECTURES.get(named), words
    if isinstance(model_type, str):
        return _MODEL_TYPES.get(model_type), f'model_type "{model_type[:40]}"'
    return None, "a model without config.json's architectures or model_type"


def _int(config: dict[str, Any], name: str) -> int | None:
    value = config.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 32 else None


def _float(config: dict[str, Any], name: str) -> float | None:
    value = config.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e38 else None


def _hyperparameters(source: Checkpoint, arch: str, config: dict[str, Any], allow_incomplete: bool, notes: list[str]) -> list[tuple[str, Any, str]]:
    """`LlamaModel.set_gguf_parameters`' keys, from config.json: llama.cpp needs the block
    count, the widths and the head counts; the rest have defaults there."""
    from gguf import Keys, RopeScalingType

    missing = [name for name in ("num_hidden_layers", "hidden_size", "num_attention_heads") if _int(config, name) is None]
    if missing:
        refuse_or_note(allow_incomplete, notes, f"{source.path}: config.json has no positive integer {', '.join(missing)}; llama.cpp needs them to run a {arch} model", "fix config.json")
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
        if _int(config, name) is not None:
            put(key, _int(config, name), "UINT32")
    rope = _rope_parameters(config)
    scaling = rope.get("rope_type") or rope.get("type")
    factor = _float(rope, "factor")
    if scaling in ("linear", "yarn") and factor is not None:
        put(Keys.Rope.SCALING_TYPE, RopeScalingType.LINEAR.value if scaling == "linear" else RopeScalingType.YARN.value, "STRING")
        put(Keys.Rope.SCALING_FACTOR, factor, "FLOAT32")
        original = _int(rope, "original_max_position_embeddings")
        if scaling == "yarn" and original is not None:
            put(Keys.Rope.SCALING_ORIG_CTX_LEN, original, "UINT32")
    elif scaling not in (None, "default"):
        # llama3's scaling is a generated rope_freqs tensor in llama.cpp's converter; qtool writes none
        refuse_or_note(
            allow_incomplete, notes, f"{source.path}: rope scaling {str(scaling)[:40]!r} is not written by qtool; llama.cpp would run the model without it", "convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    theta = _float(rope, "rope_theta") if _float(rope, "rope_theta") is not None else _float(config, "rope_theta")
    if theta is not None:
        put(Keys.Rope.FREQ_BASE, theta, "FLOAT32")
    if _float(config, "rms_norm_eps") is not None:
        put(Keys.Attention.LAYERNORM_RMS_EPS, _float(config, "rms_norm_eps"), "FLOAT32")
    head_dim = _int(config, "head_dim")
    if head_dim is not None:
        put(Keys.Attention.KEY_LENGTH, head_dim, "UINT32")
        put(Keys.Attention.VALUE_LENGTH, head_dim, "UINT32")
    if _int(config, "vocab_size") is not None:
        put(Keys.LLM.VOCAB_SIZE, _int(config, "vocab_size"), "UINT32")
    hidden, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
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


def _heads(config: dict[str, Any]) -> tuple[int, int] | None:
    heads = _int(config, "num_attention_heads")
    if heads is None:
        return None
    return heads, _int(config, "num_key_value_heads") or heads


# -- tensor names ----------------------------------------------------------------------------------


def _renamer(arch: str, config: dict[str, Any], source: Checkpoint, allow_incomplete: bool, notes: list[str]) -> Callable[[str], str | None]:
    """Hugging Face names to GGUF's through gguf-py's `TensorNameMap` for `arch`. A name the
    map does not know is a tensor llama.cpp would refuse to load: refused here."""
    import gguf

    member = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    table = gguf.get_tensor_name_map(member, _int(config, "num_hidden_layers") or 0)
    unknown: list[str] = []

    def rename(name: str) -> str | None:
        if name.endswith(_DROPPED):
            return None
        mapped = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is not None:
            return mapped
        if not allow_incomplete:
            raise UsageError(
                f"{source.path}: tensor {name} has no GGUF name in llama.cpp's {arch} architecture, so llama.cpp would not load the file",
                hint="check that config.json describes these weights, or allow an incomplete GGUF that no runtime may load",
                option="allow_incomplete_gguf",
            )
        if not unknown:
            notes.append(f"writing an incomplete GGUF: tensor {name} (and maybe others) keeps its name, which llama.cpp's {arch} architecture does not know")
        unknown.append(name)
        return name

    return rename


def _embedding_rows(weights: list[Weight], model: GgufModel) -> int | None:
    """Rows of token_embd: the vocabulary llama.cpp will expect the tokenizer to have."""
    for weight in weights:
        if weight.shape and model.tensor_name(weight.name) == "token_embd.weight":
            return int(weight.shape[0])
    return None


# -- tokenizer ------------------------------------------------------------------------------------


def _tokenizer(source: Checkpoint, config: dict[str, Any], arch: str, rows: int | None, allow_incomplete: bool, notes: list[str]) -> list[tuple[str, Any, str]]:
    """The tokenizer keys, for the vocabulary the token embedding has."""
    folder = _model_folder(source)
    vocab_size = _int(config, "vocab_size") or rows
    if rows is not None and vocab_size != rows:
        raise CheckpointError(f"config.json's vocab_size {vocab_size} differs from the {rows} rows of the token embedding", path=folder, hint="fix config.json")
    return tokenizer_entries(folder, arch, vocab_size, allow_incomplete, notes)


def _model_folder(source: Checkpoint) -> str:
    """The folder whose side files belong to the model: the one named, or the weights' own."""
    if os.path.isdir(source.path):
        return source.path
    return os.path.dirname(os.path.abspath(source.files[0] if source.files else source.path))
