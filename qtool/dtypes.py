"""One table of storage dtypes. Nothing else in qtool recomputes these facts.

A storage dtype is what a container says a tensor's bytes are (safetensors' `dtype` string,
GGUF's type id, burn's DType). It says nothing about quantization: an `I8` tensor is plain
int8 data until a convention finds its scale.

Sub-byte types (F4, F6_*) are counted in logical elements, as safetensors' header does:
a `[O, I]` F4 tensor holds O*I four-bit values in O*I/2 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "StorageDType",
    "DTYPES",
    "WEIGHT_FLOATS",
    "storage_dtype",
    "nbytes_for",
    "from_torch",
    "decoded_dtype",
    "float_dtype_named",
    "weight_float_of",
]

Kind = Literal["bool", "int", "uint", "float", "complex"]


@dataclass(frozen=True)
class StorageDType:
    name: str  # the safetensors dtype string, e.g. "BF16"
    bits: int  # bits per logical element
    kind: Kind
    torch_name: str | None  # attribute of the `torch` module, resolved lazily; None if torch has no such dtype
    gguf_id: int | None = None  # GGMLQuantizationType id of the plain GGUF type, where one exists
    burn_name: str | None = None  # burn's DType variant name, where one exists

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_integer(self) -> bool:
        return self.kind in ("int", "uint")

    def torch_dtype(self):  # -> torch.dtype; imports torch, so only call where data is touched
        import torch

        if self.torch_name is None or not hasattr(torch, self.torch_name):
            raise TypeError(f"torch {torch.__version__} has no dtype for safetensors {self.name}")
        return getattr(torch, self.torch_name)


_TABLE: tuple[StorageDType, ...] = (
    StorageDType("BOOL", 8, "bool", "bool", burn_name="Bool"),
    StorageDType("U8", 8, "uint", "uint8", burn_name="U8"),
    StorageDType("I8", 8, "int", "int8", gguf_id=24, burn_name="I8"),
    StorageDType("U16", 16, "uint", "uint16", burn_name="U16"),
    StorageDType("I16", 16, "int", "int16", gguf_id=25, burn_name="I16"),
    StorageDType("U32", 32, "uint", "uint32", burn_name="U32"),
    StorageDType("I32", 32, "int", "int32", gguf_id=26, burn_name="I32"),
    StorageDType("U64", 64, "uint", "uint64", burn_name="U64"),
    StorageDType("I64", 64, "int", "int64", gguf_id=27, burn_name="I64"),
    StorageDType("F16", 16, "float", "float16", gguf_id=1, burn_name="F16"),
    StorageDType("BF16", 16, "float", "bfloat16", gguf_id=30, burn_name="BF16"),
    StorageDType("F32", 32, "float", "float32", gguf_id=0, burn_name="F32"),
    StorageDType("F64", 64, "float", "float64", gguf_id=28, burn_name="F64"),
    StorageDType("C64", 64, "complex", "complex64"),
    StorageDType("F8_E4M3", 8, "float", "float8_e4m3fn"),
    StorageDType("F8_E5M2", 8, "float", "float8_e5m2"),
    StorageDType("F8_E8M0", 8, "float", "float8_e8m0fnu"),
    # torch packs two e2m1 values per element (float4_e2m1fn_x2); views go through uint8.
    StorageDType("F4", 4, "float", None),
    StorageDType("F6_E2M3", 6, "float", None),
    StorageDType("F6_E3M2", 6, "float", None),
    StorageDType("F8_E4M3FNUZ", 8, "float", "float8_e4m3fnuz"),
    StorageDType("F8_E5M2FNUZ", 8, "float", "float8_e5m2fnuz"),
)

DTYPES: dict[str, StorageDType] = {d.name: d for d in _TABLE}


def storage_dtype(name: str) -> StorageDType:
    """Look up a safetensors dtype string; the UnknownNameError (a KeyError) lists the valid names."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        from qtool.errors import UnknownNameError

        raise UnknownNameError(f"unknown dtype {name!r}", hint=f"known: {' '.join(DTYPES)}") from None


def nbytes_for(dtype: StorageDType, numel: int) -> int | None:
    """Bytes that `numel` elements occupy, or None when they don't fill whole bytes."""
    bits = dtype.bits * numel
    return bits // 8 if bits % 8 == 0 else None


def from_torch(dtype) -> StorageDType:
    """The safetensors dtype of a torch dtype (uint8 for torch's packed fp4)."""
    name = str(dtype).removeprefix("torch.")
    for entry in _TABLE:
        if entry.torch_name == name:
            return entry
    if name == "float4_e2m1fn_x2":
        return DTYPES["U8"]
    raise KeyError(f"torch dtype {dtype} has no safetensors dtype")


# The float dtypes a weight's values are computed and written in (f64 is only copied through)
WEIGHT_FLOATS = ("BF16", "F16", "F32")

# How configs (torch_dtype, a quant state's dtype, torchao's records) and users (--dtype) spell
# them: torch's names, with or without "torch.", and the short forms.
_FLOAT_SPELLINGS = {
    "bfloat16": "BF16", "bf16": "BF16",
    "float16": "F16", "half": "F16", "f16": "F16", "fp16": "F16",
    "float32": "F32", "float": "F32", "f32": "F32", "fp32": "F32",
}  # fmt: skip


def float_dtype_named(text: object) -> str | None:
    """The weight float dtype ("BF16", "F16", "F32") a config or user spells `text`, or None."""
    if not isinstance(text, str):
        return None
    return _FLOAT_SPELLINGS.get(text.lower().removeprefix("torch."))


def weight_float_of(torch_dtype) -> str | None:
    """The weight float dtype of a torch dtype ("BF16" for torch.bfloat16), or None."""
    name = str(torch_dtype).removeprefix("torch.")
    return _FLOAT_SPELLINGS.get(name) if name in ("bfloat16", "float16", "float32") else None


def decoded_dtype(name: str):  # -> torch.dtype
    """The torch dtype a decoder returns for a weight whose logical dtype is `name`: bf16 and
    f16 weights decode to themselves, everything else (F32, unknown, a storage dtype) to f32."""
    import torch

    return {"BF16": torch.bfloat16, "F16": torch.float16}.get(name, torch.float32)
