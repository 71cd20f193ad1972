"""A Hugging Face checkpoint's tensors as llama.cpp names them in GGUF, and which rows its
converter permutes.

llama.cpp loads a GGUF only when it knows the architecture and finds exactly the tensors it
expects under GGUF's names. qtool writes the LLaMA family only:

    config.json                                 GGUF architecture   q/k rows
    LlamaForCausalLM   / model_type llama       llama               permuted to llama.cpp's rotary order
    MistralForCausalLM / model_type mistral     llama               permuted
    Qwen2ForCausalLM   / model_type qwen2       qwen2               as stored

Names come from gguf-py's `get_tensor_name_map`; the permutation is llama.cpp's converter's
(`LlamaModel.permute` in convert_hf_to_gguf.py, llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f).
Any other model, or a tensor llama.cpp's architecture does not name, is refused (exit 2) unless
the caller allows an incomplete GGUF; then names are kept, and a note says no runtime may load it.
A GGUF input keeps its own names in a GGUF; written as safetensors (`dequantize`), a llama or
qwen2 GGUF's tensors take their Hugging Face names and q/k rows their Hugging Face order back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from qtool.errors import UsageError
from qtool.formats.checkpoint import Checkpoint

__all__ = ["TensorNames", "tensor_names", "RotaryRows", "hugging_face_names", "SUPPORTED_ARCHITECTURES", "config_int"]

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_PERMUTED_ARCHS = ("llama",)  # llama.cpp's converter undoes the HF rotary permutation for these
_DROPPED = (".rotary_emb.inv_freq",)  # buffers of old checkpoints that llama.cpp's converter skips
SUPPORTED_WORDS = "llama, mistral and qwen2 (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)"


@dataclass
class TensorNames:
    """How each weight is named in the GGUF, and which rows are permuted: the GGUF architecture
    ("unknown" for a GGUF input or an incomplete file) and notes for the user."""

    arch: str
    notes: list[str] = field(default_factory=list)
    _names: Callable[[str], str | None] | None = None
    _heads: tuple[int, int] | None = None

    def tensor_name(self, name: str) -> str | None:
        """The GGUF name of weight `name`; None for a buffer llama.cpp does not read."""
        if self._names is None:
            return name
        return self._names(name)

    def rotary(self, name: str) -> RotaryRows | None:
        """The permutation llama.cpp's converter applies to this weight's rows: q by n_head,
        k by n_head_kv; None for every other weight."""
        if self._heads is None:
            return None
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return RotaryRows(self._heads[0])
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return RotaryRows(self._heads[1])
        return None


def tensor_names(source: Checkpoint, allow_incomplete: bool) -> TensorNames:
    """The GGUF names of `source`'s weights: a GGUF input keeps its own; any other checkpoint
    must be a LLaMA-family model, or `allow_incomplete` must be given (then a note says no
    runtime will load the file)."""
    if source.format == "gguf":
        return TensorNames("unknown")
    config = source.config
    arch, what = architecture(config)
    if arch is None:
        if not allow_incomplete:
            raise UsageError(
                f"{source.path} is {what}: qtool writes GGUF that llama.cpp runs only for {SUPPORTED_WORDS}",
                hint="write another layout, or allow an incomplete GGUF that no runtime will load",
                option="allow_incomplete_gguf",
            )
        return TensorNames(
            "unknown",
            notes=[
                f'writing an incomplete GGUF (architecture "unknown", no tokenizer): {what} is not a model qtool describes in GGUF, and no runtime will load the file'
            ],
        )
    names = TensorNames(arch)
    names._names = _renamer(arch, config, source, allow_incomplete, names.notes)
    if arch in _PERMUTED_ARCHS:
        names._heads = _heads(config)
    return names


def architecture(config: dict[str, Any]) -> tuple[str | None, str]:
    """(GGUF architecture or None, the model in words) from config.json."""
    architectures = config.get("architectures")
    model_type = config.get("model_type")
    named = (
        architectures[0]
        if isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
        else None
    )
    if named is not None:
        words = f'"{named[:80]}"' + (f' (model_type "{model_type[:40]}")' if isinstance(model_type, str) else "")
        return SUPPORTED_ARCHITECTURES.get(named), words
    if isinstance(model_type, str):
        return _MODEL_TYPES.get(model_type), f'model_type "{model_type[:40]}"'
    return None, "a model without config.json's architectures or model_type"


def config_int(config: dict[str, Any], name: str) -> int | None:
    """A positive integer field of config.json that fits GGUF's uint32, else None."""
    value = config.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 32 else None


def _heads(config: dict[str, Any]) -> tuple[int, int] | None:
    heads = config_int(config, "num_attention_heads")
    if heads is None:
        return None
    return heads, config_int(config, "num_key_value_heads") or heads


def _renamer(
    arch: str, config: dict[str, Any], source: Checkpoint, allow_incomplete: bool, notes: list[str]
) -> Callable[[str], str | None]:
    """Hugging Face names to GGUF's through gguf-py's `TensorNameMap` for `arch`. A name the
    map does not know is a tensor llama.cpp would refuse to load: refused here."""
    import gguf

    member = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    table = gguf.get_tensor_name_map(member, config_int(config, "num_hidden_layers") or 0)
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
            notes.append(
                f"writing an incomplete GGUF: tensor {name} (and maybe others) keeps its name, which llama.cpp's {arch} architecture does not know"
            )
        unknown.append(name)
        return name

    return rename


@dataclass(frozen=True)
class RotaryRows:
    """Hugging Face's rotary layout of q or k to llama.cpp's (`LlamaModel.permute` in
    convert_hf_to_gguf.py): within each of `heads` heads, rows [0, 2, 4, ..., 1, 3, 5, ...]
    interleave; `back` undoes it (a GGUF's rows in Hugging Face's order). A transform a plan
    declares for the executor to apply on the way out."""

    heads: int
    back: bool = False

    def fits(self, rows: int) -> bool:
        return rows > 0 and rows % (2 * self.heads) == 0

    def apply(self, values: Any, rows: int) -> Any:
        """`values` permuted: raw row-major bytes of `rows` rows (any dtype, never converted), or
        a tensor whose first dim is the rows."""
        half = rows // self.heads // 2
        split = (self.heads, half, 2) if self.back else (self.heads, 2, half)
        if not isinstance(values, (bytes, bytearray, memoryview)):  # a torch tensor
            shape = values.shape
            return values.reshape(*split, -1).transpose(1, 2).reshape(shape).contiguous()
        import numpy as np

        table = np.frombuffer(values, dtype=np.uint8).reshape(rows, -1)
        permuted = table.reshape(*split, table.shape[1]).swapaxes(1, 2).reshape(table.shape)
        return memoryview(np.ascontiguousarray(permuted)).cast("B")


def hugging_face_names(source: Checkpoint) -> Callable[[str], tuple[str, RotaryRows | None]] | None:
    """For a GGUF of an architecture qtool writes (llama, qwen2): each tensor's Hugging Face name
    and, for a llama's q and k, the transform that puts its rows back in Hugging Face's order
    (what `dequantize` writes, so the output pairs with the original). None for any other
    input, whose names are kept."""
    from qtool.naming import gguf_to_hf, rope_heads

    if source.format != "gguf" or source.metadata.get("general.architecture") not in set(
        SUPPORTED_ARCHITECTURES.values()
    ):
        return None
    metadata = source.metadata

    def named(name: str) -> tuple[str, RotaryRows | None]:
        hf = gguf_to_hf(name)
        heads = rope_heads(hf, metadata)
        return hf, (RotaryRows(heads, back=True) if heads else None)

    return named
