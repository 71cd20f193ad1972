"""The bitsandbytes layout (CONVENTIONS §4): 4-bit nf4 and fp4 weights as transformers saves
them after `load_in_4bit` (non-nested), byte for byte bitsandbytes 0.50's CPU `quantize_4bit`,
with `BitsAndBytesConfig` as config.json's `quantization_config`.

Reading them back is `qtool.conventions.bitsandbytes`.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from qtool.conventions.bitsandbytes import _QUANT_TYPES, _STATE, BLOCKSIZES
from qtool.dtypes import DTYPES, WEIGHT_FLOATS, weight_float_of
from qtool.errors import SchemeError
from qtool.layouts.base import refusal_of
from qtool.layouts.safetensors import SafetensorsLayout
from qtool.scheme import QScheme
from qtool.weight import Weight

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    import torch

__all__ = ["Bitsandbytes", "encoded_layout", "encode", "config_for"]


def _settings(name: str, shape: tuple[int, ...], scheme: QScheme) -> tuple[str, int]:
    quant_type = {value: key for key, value in _QUANT_TYPES.items()}.get(scheme.qtype.name)
    if quant_type is None:
        raise SchemeError(f"bitsandbytes 4-bit stores nf4 or fp4_bnb, not {scheme.qtype.name}", hint="e.g. nf4:g64")
    blocksize = scheme.group_size
    if blocksize is None:
        raise SchemeError(f"bitsandbytes quantizes in blocks (nf4:g64), not per {scheme.granularity}")
    if blocksize not in BLOCKSIZES:
        raise SchemeError(f"bitsandbytes blocksize must be one of {list(BLOCKSIZES)}, not {blocksize}")
    if scheme.scale_dtype.upper() not in ("F32", "AUTO"):
        raise SchemeError(f"bitsandbytes stores float32 absmax scales, not {scheme.scale_dtype}")
    if math.prod(shape) == 0:
        raise SchemeError(f"{name} has no elements to quantize")
    return quant_type, blocksize


def _state_blob(quant_type: str, blocksize: int, dtype: str, shape: tuple[int, ...]) -> bytes:
    # QuantState.as_dict(packed=True): the non-tensor items, in this order, json.dumps defaults
    torch_name = DTYPES[dtype].torch_name if dtype in WEIGHT_FLOATS else None
    if torch_name is None:
        raise SchemeError(f"bitsandbytes quantizes float16/bfloat16/float32 weights, not {dtype}")
    state = {"quant_type": quant_type, "blocksize": blocksize, "dtype": torch_name, "shape": list(shape)}
    return json.dumps(state).encode("utf-8")


def encoded_layout(
    name: str, shape: tuple[int, ...], dtype: str, scheme: QScheme
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(stored name, safetensors dtype, shape) of every tensor `encode` writes, from the shape alone."""
    quant_type, blocksize = _settings(name, tuple(shape), scheme)
    numel = math.prod(shape)
    blob = _state_blob(quant_type, blocksize, dtype, tuple(shape))
    return [
        (name, "U8", (math.ceil(numel / 2), 1)),
        (f"{name}.absmax", "F32", (math.ceil(numel / blocksize),)),
        (f"{name}.quant_map", "F32", (16,)),
        (f"{name}{_STATE}{quant_type}", "U8", (len(blob),)),
    ]


def encode(name: str, weight: torch.Tensor, scheme: QScheme) -> dict[str, torch.Tensor]:
    """The stored tensors of one weight, byte for byte as bitsandbytes' CPU `quantize_4bit`
    (non-nested) and transformers' save write them."""
    import torch

    from qtool import kernels

    dtype = weight_float_of(weight.dtype) or str(weight.dtype)
    layout = encoded_layout(name, tuple(weight.shape), dtype, scheme)
    quant_type, blocksize = _settings(name, tuple(weight.shape), scheme)
    value_type = scheme.qtype
    flat = weight.reshape(-1)
    numel, block = flat.numel(), (blocksize,)
    absmax, _ = kernels.choose_qparams(flat, block, value_type, True, "F32")
    codes = kernels.quantize(flat, absmax, None, block, value_type)
    full = numel - numel % blocksize
    if full < numel:
        # bitsandbytes treats a partial last block apart: it divides by the absmax there (the
        # full blocks multiply by its reciprocal) and stores that absmax clamped to 1e-38
        tail_max = absmax[-1:].clamp(min=1e-38)
        tail = torch.clamp(flat[full:].float() / tail_max, -1, 1)
        codes[full:] = kernels.codebook_encode(tail, value_type.name)
        absmax = torch.cat([absmax[:-1], tail_max])
    if numel % 2:  # the odd last byte pairs with the code of 0.0, as bitsandbytes pads
        zero = kernels.codebook_encode(torch.zeros(1, device=flat.device), value_type.name)
        codes = torch.cat([codes, zero])
    blob = _state_blob(quant_type, blocksize, dtype, tuple(weight.shape))
    tensors = (
        kernels.pack_nibbles(codes, high_first=True).reshape(-1, 1),
        absmax,
        kernels.codebook(value_type.name, flat.device).clone(),
        torch.tensor(list(blob), dtype=torch.uint8, device=flat.device),
    )
    return {entry[0]: tensor.contiguous() for entry, tensor in zip(layout, tensors)}


def config_for(schemes_by_module: dict[str, QScheme], ignore: list[str], dtype: str | None = None) -> dict[str, Any]:
    """transformers' `BitsAndBytesConfig(load_in_4bit=True, ...).to_dict()` for these modules.
    The blocksize is not in it: a pre-quantized weight's quant state carries its own."""
    if not schemes_by_module:
        raise SchemeError("no quantized modules: a bitsandbytes config needs at least one")
    quant_types = {_settings(module, (1,), scheme)[0] for module, scheme in schemes_by_module.items()}
    if len(quant_types) > 1:
        raise SchemeError(f"one bitsandbytes config holds one 4-bit type, got {' and '.join(sorted(quant_types))}")
    name = str(dtype).upper() if dtype else "F32"
    compute = DTYPES[name].torch_name if name in WEIGHT_FLOATS else None
    if compute is None:
        raise SchemeError(f"the model dtype must be BF16, F16 or F32, got {dtype!r}")
    return {
        "quant_method": "bitsandbytes",
        "_load_in_8bit": False,
        "_load_in_4bit": True,
        "llm_int8_threshold": 6.0,
        "llm_int8_skip_modules": list(ignore),
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "bnb_4bit_quant_type": quant_types.pop(),
        "bnb_4bit_use_double_quant": False,
        "bnb_4bit_compute_dtype": compute,
        "bnb_4bit_quant_storage": "uint8",
        "load_in_4bit": True,
        "load_in_8bit": False,
    }


class Bitsandbytes(SafetensorsLayout):
    """bitsandbytes 4-bit (nf4, fp4), as transformers loads it."""

    name = "bitsandbytes"
    description = "bitsandbytes 4-bit nf4/fp4 safetensors (transformers)"

    encoded_layout = staticmethod(encoded_layout)
    quantization_config = staticmethod(config_for)
    encode_tensors = staticmethod(encode)

    def refusal(self, scheme: QScheme) -> str | None:
        return refusal_of(lambda: _settings("weight", (1,), scheme))

    def check(self, weight: Weight, scheme: QScheme) -> None:
        _settings(weight.name, tuple(weight.shape), scheme)
        _state_blob("nf4", 64, weight.dtype, tuple(weight.shape))
