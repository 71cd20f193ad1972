"""A GGUF read as the Hugging Face model it came from, so that transformers' decoder layers can
run it with qtool's own weight readers (`qtool eval`, `compare --text`).

A GGUF carries no config.json and no tokenizer files, and llama.cpp's converter renamed every
tensor and put a llama's q/k rows in its own rotary order. transformers can load a GGUF itself,
but only whole: it dequantizes every tensor into one float model. qtool reads one layer at a
time, so it needs the pieces instead:

    tensors      the same stored tensors (same file, same byte ranges, same GGML types) under their
                 Hugging Face names (`qtool.llamacpp.names.hugging_face_names`): the read side
                 decodes them as any GGUF weight
    rows_back    for a llama's q and k, the permutation that puts the decoded rows back in Hugging
                 Face's order (`RotaryRows(heads, back=True)`); qwen2's are stored as they are
    config.json  built from the metadata with transformers' own table of GGUF key to config field
                 (`transformers.integrations.ggml.GGUF_CONFIG_MAPPING`), read by qtool's bounded
                 reader (`qtool.formats.gguf.read_gguf_key_values`), never gguf-py's GGUFReader
    tokenizer    transformers' own GGUF converter, fed the vocabulary from qtool's reader
                 (`qtool.evaluation.gguf_tokenizer`), so the ids (and whether a BOS is added) are
                 those of transformers' `AutoTokenizer` given `gguf_file=`

Only the architectures qtool maps back are read (llama, which covers Mistral, and qwen2); any
other is a UsageError. Every value in the file is a stranger's: a missing key, a value of the
wrong type, a size out of range (each key read through `qtool.evaluation.gguf_metadata`), a tensor
with no Hugging Face name, a vocabulary whose size is not the token embedding's, is one
CheckpointError line naming the file and the key or tensor (exit 2).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from qtool.errors import CheckpointError, InternalError, UsageError
from qtool.evaluation.gguf_metadata import HINT, SIZE_LIMIT, GgufMetadata
from qtool.evaluation.gguf_tokenizer import GgufVocabulary
from qtool.formats.checkpoint import Checkpoint
from qtool.llamacpp.names import RotaryRows, hugging_face_names
from qtool.message_text import excerpt

__all__ = ["GgufAsHuggingFace", "gguf_as_hugging_face", "MAPPED_ARCHITECTURES"]

# GGUF architecture -> (config.json's model_type, architectures): what hugging_face_names maps back
MAPPED_ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}
# config.json fields a llama or qwen2 GGUF must state (llama.cpp refuses to load one without them)
_REQUIRED = ("num_hidden_layers", "max_position_embeddings", "hidden_size", "intermediate_size",
             "num_attention_heads", "rms_norm_eps")  # fmt: skip
_REALS = ("rms_norm_eps", "rope_theta")  # the float fields; every other one the table maps is a size
_DEFAULT_ROPE_THETA = 10000.0  # llama.cpp's rope_freq_base_train when the file states none (load_hparams)


@dataclass(frozen=True)
class GgufAsHuggingFace:
    """A view of a GGUF checkpoint as the Hugging Face model it came from.

    `checkpoint` holds the same stored tensors keyed (and named) by their Hugging Face names,
    with `side_files["config.json"]` the config made from the metadata. `rows_back` maps a
    Hugging Face weight name to the permutation to apply to its DECODED float tensor (first dim
    the rows) to put q/k rows back in Hugging Face's order (a llama's; empty for qwen2)."""

    checkpoint: Checkpoint
    rows_back: dict[str, RotaryRows]
    _vocabulary: GgufVocabulary | None = field(default=None, repr=False, compare=False)

    def tokenizer(self, notes: list[str]) -> Any:
        """transformers' tokenizer (a `PreTrainedTokenizerFast`) of the GGUF's vocabulary, as
        transformers' `AutoTokenizer` given `gguf_file=` builds it; what transformers logs
        meanwhile becomes `notes`. A GGUF without a vocabulary, or one transformers' converter
        refuses, is one CheckpointError line."""
        path = self.checkpoint.path
        if self._vocabulary is None:
            raise CheckpointError(
                "holds no tokenizer (no tokenizer.ggml.model and tokenizer.ggml.tokens)",
                path=path,
                hint="use a GGUF converted with its tokenizer",
            )
        return self._vocabulary.build(path, self.checkpoint.config["model_type"], notes)


def gguf_as_hugging_face(checkpoint: Checkpoint) -> GgufAsHuggingFace:
    """`checkpoint` (a GGUF of an architecture qtool maps back) as the Hugging Face model it came
    from: see the module's docstring. Reads the file's key-values once (the header only)."""
    from qtool.formats.gguf import read_gguf_key_values

    if checkpoint.format != "gguf" or len(checkpoint.files) != 1:
        raise InternalError(f"{checkpoint.path} is not one GGUF file, so it has no Hugging Face names to map back")
    checkpoint.require_local()  # the key-values are read from the file itself
    file = checkpoint.files[0]
    metadata = GgufMetadata(file, read_gguf_key_values(file))
    checkpoint.verify_unchanged()  # the key-values come from the file the tensors were listed from
    arch = metadata.text("general.architecture", required=True)
    named = hugging_face_names(checkpoint)
    if arch not in MAPPED_ARCHITECTURES or named is None:
        raise UsageError(
            f"a GGUF of architecture {excerpt(arch, 40)!r} is not mapped back to a Hugging Face model "
            f"(qtool maps {', '.join(MAPPED_ARCHITECTURES)})",
            path=checkpoint.path,
        )
    vocab_size = _embedding_rows(checkpoint)
    config = _config(metadata, arch, vocab_size, set(checkpoint.tensors))
    vocabulary = GgufVocabulary.read(metadata, vocab_size)
    tensors, rows_back = {}, {}
    taken: dict[str, str] = {}
    for name, stored in checkpoint.tensors.items():
        hf_name, rows = named(name)
        if hf_name == name:
            raise CheckpointError(
                f"tensor {name!r} has no Hugging Face name in a {arch} model"
                + (
                    " (llama 3's rope scaling factors, which qtool does not map back)"
                    if name == "rope_freqs.weight"
                    else ""
                ),
                path=checkpoint.path,
                hint=f"qtool maps back the tensors llama.cpp's converter writes for a {arch} model",
            )
        if hf_name in taken:  # cannot happen with today's table; a stranger's file must not make it happen
            raise CheckpointError(
                f"tensors {taken[hf_name]!r} and {name!r} both map to {hf_name!r}", path=checkpoint.path
            )
        taken[hf_name] = name
        shape = stored.logical_shape or stored.shape
        if rows is not None:
            if not shape or not rows.fits(shape[0]):
                raise CheckpointError(
                    f"tensor {name!r} has {shape[0] if shape else 0} rows, not a whole number of its "
                    f"{rows.heads} rotary heads' pairs",
                    path=checkpoint.path,
                )
            rows_back[hf_name] = rows
        tensors[hf_name] = replace(stored, name=hf_name)
    view = copy.copy(checkpoint)  # as spread.shard_job slices one: same files and identities, own descriptors
    view.tensors = tensors
    view.side_files = {**checkpoint.side_files, "config.json": config}
    view.notes = list(checkpoint.notes)
    view._fds = {}
    view._identity = dict(checkpoint._identity)
    return GgufAsHuggingFace(view, rows_back, vocabulary)


# -- config.json ----------------------------------------------------------------------------------------


def _embedding_rows(checkpoint: Checkpoint) -> int:
    """token_embd's rows: the vocabulary the model was trained with, which config.json's
    `vocab_size` and the tokenizer must both agree with."""
    stored = checkpoint.tensors.get("token_embd.weight")
    shape = None if stored is None else (stored.logical_shape or stored.shape)
    if not shape or len(shape) != 2 or not 0 < shape[0] < SIZE_LIMIT:
        raise CheckpointError(
            "has no token embedding (token_embd.weight, 2-D)" if not shape else
            f"token_embd.weight has shape {list(shape)}, not [vocabulary, hidden size]",
            path=checkpoint.path,
            hint=HINT,
        )  # fmt: skip
    return shape[0]


def _config_table(arch: str) -> dict[str, str]:
    """config.json field -> GGUF key, from transformers' own table for `arch` and its tokenizer
    ids (the fields this module reads; what else the table maps is left to transformers)."""
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    except ImportError as exc:
        raise UsageError(
            f"reading a GGUF as a Hugging Face model needs transformers ({exc})", hint="pip install 'qtool[calibrate]'"
        ) from None
    table = {name: f"{arch}.{key}" for key, name in GGUF_CONFIG_MAPPING.get(arch, {}).items() if name}
    table.update({name: f"tokenizer.{key}" for key, name in GGUF_CONFIG_MAPPING.get("tokenizer", {}).items() if name})
    missing = [name for name in _REQUIRED if name not in table]
    if missing:
        raise InternalError(f"transformers' GGUF table no longer maps {', '.join(missing)} for {arch}")
    return table


def _config(metadata: GgufMetadata, arch: str, vocab_size: int, tensors: set[str]) -> dict[str, Any]:
    """config.json of the model a llama or qwen2 GGUF came from, as transformers' GGUF loader
    makes it (its table of keys, its float32 values widened) where it knows the key, and where it
    does not: head_dim from `attention.key_length`, rope scaling, biases, `tie_word_embeddings`
    from whether `output.weight` exists, `vocab_size` from token_embd's rows."""
    table = _config_table(arch)
    model_type, class_name = MAPPED_ARCHITECTURES[arch]
    config: dict[str, Any] = {"model_type": model_type, "architectures": [class_name], "hidden_act": "silu"}
    for name in _REQUIRED:
        read = metadata.real if name in _REALS else metadata.size
        config[name] = read(table[name], required=True)
    heads = config["num_attention_heads"]
    kv_heads = metadata.size(table.get("num_key_value_heads", f"{arch}.attention.head_count_kv"))
    config["num_key_value_heads"] = heads if kv_heads is None else kv_heads
    if heads % config["num_key_value_heads"]:
        raise metadata.fail(
            f"{arch}.attention.head_count_kv", f"is {kv_heads}, which does not divide the {heads} attention heads"
        )
    theta = metadata.real(table.get("rope_theta", f"{arch}.rope.freq_base"))
    config["rope_theta"] = _DEFAULT_ROPE_THETA if theta is None else theta
    stated = metadata.size(table.get("vocab_size", f"{arch}.vocab_size"))
    if stated is not None and stated != vocab_size:
        raise metadata.fail(f"{arch}.vocab_size", f"is {stated}, but token_embd.weight has {vocab_size} rows")
    config["vocab_size"] = vocab_size
    head_dim = _head_dim(metadata, arch, config)
    if arch == "llama" or head_dim != config["hidden_size"] // heads:
        config["head_dim"] = head_dim
    scaling = _rope_scaling(metadata, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "llama":  # llama.cpp's llama has optional biases; transformers' LlamaConfig says so in two flags
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    config["tie_word_embeddings"] = "output.weight" not in tensors
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        key = table.get(name)
        token = metadata.token_id(key, vocab_size) if key else None
        if token is not None:
            config[name] = token
    return config


def _head_dim(metadata: GgufMetadata, arch: str, config: dict[str, Any]) -> int:
    """The width of one attention head: `attention.key_length`, else the rotary width (llama,
    whose rotary covers the whole head), else hidden size / heads. transformers' decoder layers
    have one head width for q, k and v, rotated whole: a file saying otherwise is refused."""
    key_length = metadata.size(f"{arch}.attention.key_length")
    value_length = metadata.size(f"{arch}.attention.value_length")
    rotary = metadata.size(f"{arch}.rope.dimension_count")
    head_dim = (
        key_length or (rotary if arch == "llama" else None) or config["hidden_size"] // config["num_attention_heads"]
    )
    if head_dim < 1:
        raise metadata.fail(
            f"{arch}.attention.head_count",
            f"is {config['num_attention_heads']}, more heads than the {config['hidden_size']} wide embedding has",
        )
    if value_length is not None and value_length != head_dim:
        raise metadata.fail(
            f"{arch}.attention.value_length",
            f"is {value_length}, not the head width {head_dim}: transformers' {arch} has one",
        )
    if rotary is not None and rotary != head_dim:
        raise metadata.fail(
            f"{arch}.rope.dimension_count",
            f"is {rotary}, not the head width {head_dim}: transformers' {arch} rotates whole heads",
        )
    return head_dim


def _rope_scaling(metadata: GgufMetadata, arch: str) -> dict[str, Any] | None:
    """The rope scaling the GGUF records, as config.json's `rope_scaling`: linear (also the old
    `rope.scale_linear` key) and YaRN (factor, original context), what llama.cpp's converter and
    qtool write for these architectures; any other is refused rather than run without it."""
    kind = metadata.text(f"{arch}.rope.scaling.type")
    factor = metadata.real(f"{arch}.rope.scaling.factor")
    if kind is None and f"{arch}.rope.scale_linear" in metadata:
        kind, factor = "linear", metadata.real(f"{arch}.rope.scale_linear")
    if kind in (None, "none") or (kind == "linear" and factor == 1.0):
        return None
    if kind not in ("linear", "yarn"):
        raise metadata.fail(
            f"{arch}.rope.scaling.type",
            f"is {excerpt(kind, 40)!r}, a rope scaling qtool does not map back (linear, yarn)",
        )
    if factor is None:
        raise metadata.fail(f"{arch}.rope.scaling.factor", f"is missing, which {kind} rope scaling needs")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original = metadata.size(f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling
