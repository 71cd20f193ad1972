"""bitsandbytes, as transformers saves it (CONVENTIONS §4): 4-bit nf4/fp4 and 8-bit LLM.int8.

Verified against bitsandbytes 0.50 (`functional.QuantState.as_dict`, `get_4bit_type`,
`backends/default/ops.py`, `nn/modules.py` `Linear8bitLt._save_to_state_dict`,
`Int8Params._quantize`) and transformers 5 (`integrations/bitsandbytes.py`).

4-bit, per weight `w` (e.g. `model.layers.0.mlp.up_proj.weight`):

    w                                   U8 [ceil(O*I/2), 1]  codes of the flattened weight,
                                        two per byte, HIGH nibble = even element; with a
                                        non-uint8 `quant_storage` the same bytes are stored
                                        as BF16/F16/F32/I8 words, [bytes / itemsize, 1]
    w.absmax                            F32 [ceil(O*I/bs)]   (U8 when nested)
    w.quant_map                         F32 [16]             the codebook
    w.nested_absmax, w.nested_quant_map F32                  double quantization only
    w.quant_state.bitsandbytes__nf4     U8 [len]             JSON {quant_type, blocksize,
                                        (or __fp4)           dtype, shape, nested_*}

Blocks of `bs` (32..4096, default 64) run over the flattened weight, across row ends.
`w = quant_map[code] * absmax[k // bs]` in float32, cast to the JSON's dtype. Nested:
`absmax = nested_quant_map[absmax_u8] * nested_absmax[j // nested_blocksize] + offset`.
qtool reads nested too; `qtool.layouts.bitsandbytes` writes non-nested nf4 and fp4.

A quant-state blob that is not a UTF-8 JSON object with `quant_type`, `blocksize`, `dtype`
and `shape` is malformed: bitsandbytes' `QuantState.from_dict` could not load it either, so
qtool stops with a one-line `CheckpointError` naming the file and the tensor (exit 2). A
well-formed state whose values do not fit the tensors leaves them plain, with a note.

8-bit (LLM.int8), per module `m`:

    m.weight         I8  [O, I]   round(w * 127 / absmax of the row)
    m.SCB            F32 [O]      the row absmax ("SCB" sits on the module, not the weight)
    m.weight_format  U8  []       0 = row major; the GPU tile layouts 1..3 (col32,
                                  col_turing, col_ampere) are refused by bitsandbytes 0.50,
                                  so qtool leaves such a weight plain, with a note

`w = q * SCB * float32(1/127)`, two float32 roundings, as `int8_vectorwise_dequant` computes
it (multiplying by the reciprocal, not dividing by 127). The logical dtype is the config's
`torch_dtype`, else float32 (what bitsandbytes returns).
"""

from __future__ import annotations

import json
import math
import struct
from typing import TYPE_CHECKING, Any

from qtool.conventions.base import Pool, by_module, plain_weights, require_convention
from qtool.dtypes import decoded_dtype, float_dtype_named
from qtool.errors import CheckpointError
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.formats.untrusted_json import parse_json
from qtool.qtypes import FP4_BNB_CODEBOOK, NF4_CODEBOOK, qtype  # torch-free tables
from qtool.scheme import CHANNEL, QScheme
from qtool.weight import DATA, Provenance, Weight

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    import torch

__all__ = ["BLOCKSIZES", "Bitsandbytes", "decode"]

NAME = "bitsandbytes"
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes 0.50 accepts
_STATE = ".quant_state.bitsandbytes__"
_QUANT_TYPES = {"nf4": "nf4", "fp4": "fp4_bnb"}  # JSON quant_type -> qtool value type
_PACKING = "uint8, two per byte, high nibble first, over the flattened weight"
_STATE_KEYS = {
    "quant_type": (str, "a string"),
    "blocksize": (int, "an integer"),
    "dtype": (str, "a string"),
    "shape": (list, "a list"),
}  # what QuantState.from_dict reads; fmt: skip
_MAX_DIMS = 8  # a weight's shape; bounds the element count's size arithmetic
_INV_127 = 7.874015718698502e-3  # bitsandbytes multiplies by this (float32 1/127), not / 127
_WEIGHT_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}  # bitsandbytes.utils


class _Unfit(ValueError):
    pass


class Bitsandbytes:
    name = NAME

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        weights = self._detect_8bit(checkpoint, pool)
        taken = {member.name for weight in weights for member in weight.members.values()}
        pool = {name: tensor for name, tensor in pool.items() if name not in taken}
        for state_name in [n for n in pool if _STATE in n]:
            base, _, quant_type = state_name.partition(_STATE)
            members = {"quant_state": pool[state_name]}
            for leaf, role in (("", DATA), (".absmax", "scale"), (".quant_map", "quant_map"),
                               (".nested_absmax", "nested_absmax"), (".nested_quant_map", "nested_quant_map")):  # fmt: skip
                if base + leaf in pool:
                    members[role] = pool[base + leaf]
            try:
                weights.append(_resolve(checkpoint, base, quant_type, members))
            except _Unfit as exc:
                weights.extend(plain_weights(members, f"looks like bitsandbytes 4-bit, but {exc}; left plain"))
        return weights

    def decode(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
        return decode(checkpoint, weight, device)

    def _detect_8bit(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        """`m.weight` I8 + `m.SCB` (+ `m.weight_format`): Linear8bitLt's state dict."""
        weights: list[Weight] = []
        for module, leaves in by_module(pool).items():
            if "SCB" not in leaves or "weight" not in leaves:
                continue
            members = {DATA: leaves["weight"], "scale": leaves["SCB"]}
            if "weight_format" in leaves:
                members["weight_format"] = leaves["weight_format"]
            try:
                weights.append(_resolve_8bit(checkpoint, module, members))
            except _Unfit as exc:
                weights.extend(plain_weights(members, f"looks like bitsandbytes 8-bit, but {exc}; left plain"))
        return weights


def _malformed(tensor: StoredTensor, why: str) -> CheckpointError:
    return CheckpointError(
        f"bitsandbytes quant state {tensor.name!r} is malformed: {why}",
        path=tensor.file,
        hint="the file is damaged or was not written by bitsandbytes; save the model again",
    )


def _read_state(checkpoint: Checkpoint, tensor: StoredTensor) -> dict[str, Any]:
    """The quant-state JSON object; CheckpointError if it is not one bitsandbytes could load."""
    if tensor.dtype.name != "U8" or len(tensor.shape) != 1:
        raise _Unfit(f"{tensor.name} is {tensor.dtype.name} {list(tensor.shape)}, expected U8 JSON bytes")
    raw = checkpoint.read_small(tensor)
    try:
        state = parse_json(raw, tensor.file)
    except CheckpointError as exc:  # its reason, in this message's words
        raise _malformed(tensor, f"the blob {exc.message}") from None
    if not isinstance(state, dict):
        raise _malformed(tensor, f"it holds a JSON {type(state).__name__}, not an object")
    for key, (kind, word) in _STATE_KEYS.items():
        value = state.get(key)
        if value is None or not isinstance(value, kind) or isinstance(value, bool):
            found = "missing" if key not in state else f"{json.dumps(value)[:40]}, not {word}"
            raise _malformed(tensor, f"{key!r} is {found}")
    return state


def _resolve_8bit(checkpoint: Checkpoint, module: str, members: dict[str, StoredTensor]) -> Weight:
    data, scb = members[DATA], members["scale"]
    if data.dtype.name != "I8" or len(data.shape) != 2:
        raise _Unfit(f"{data.name} is {data.dtype.name} {list(data.shape)}, expected I8 [out, in]")
    rows = data.shape[0]
    if not scb.dtype.is_float or scb.shape not in ((rows,), (rows, 1)):
        raise _Unfit(f"{scb.name} is {scb.dtype.name} {list(scb.shape)}, expected F32 [{rows}]")
    layout = "row"
    fmt = members.get("weight_format")
    if fmt is not None:
        if not fmt.dtype.is_integer or fmt.numel != 1:
            raise _Unfit(f"{fmt.name} is {fmt.dtype.name} {list(fmt.shape)}, expected one integer")
        code = int.from_bytes(checkpoint.read_small(fmt), "little", signed=fmt.dtype.kind == "int")
        layout = _WEIGHT_FORMATS.get(code, f"unknown ({code})")
        if layout != "row":
            raise _Unfit(f"weight_format is {code} ({layout}), and bitsandbytes reads only 0 (row)")
    scheme = QScheme(
        qtype=qtype("int8"),
        block=CHANNEL,
        symmetric=True,
        scale_dtype=scb.dtype.name,
    )
    provenance = Provenance(
        NAME, details=(("layout", "LLM.int8 row-wise absmax (SCB), w = q * SCB / 127"), ("weight_format", layout))
    )
    config = checkpoint.config
    logical = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return Weight(data.name, data.shape, float_dtype_named(logical) or "F32", members, scheme, provenance)


def _resolve(checkpoint: Checkpoint, base: str, quant_type: str, members: dict[str, StoredTensor]) -> Weight:
    if quant_type not in _QUANT_TYPES:
        raise _Unfit(f"quant type {quant_type!r} is neither nf4 nor fp4")
    for role, leaf in ((DATA, ""), ("scale", ".absmax"), ("quant_map", ".quant_map")):
        if role not in members:
            raise _Unfit(f"{base + leaf} is missing")
    state = _read_state(checkpoint, members["quant_state"])
    shape, blocksize, dtype = state.get("shape"), state.get("blocksize"), state.get("dtype")
    if state.get("quant_type") != quant_type:
        raise _Unfit(f"the quant state says {state.get('quant_type')!r}, its name says {quant_type!r}")
    if not (
        shape
        and len(shape) <= _MAX_DIMS
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape)
    ):
        raise _malformed(members["quant_state"], f"'shape' is {json.dumps(shape)[:40]}, not a list of sizes")
    if blocksize not in BLOCKSIZES:
        raise _Unfit(f"blocksize {blocksize!r} is not one of {list(BLOCKSIZES)}")
    numel = math.prod(shape)
    data, absmax, quant_map = members[DATA], members["scale"], members["quant_map"]
    needed, itemsize = math.ceil(numel / 2), max(1, data.dtype.bits // 8)
    # a non-uint8 quant_storage holds the same bytes in wider words, the last one maybe padded
    if not needed <= data.nbytes < needed + itemsize or data.nbytes % itemsize:
        raise _Unfit(f"{data.name} holds {data.nbytes} bytes, {list(shape)} needs {needed}")
    nested = "nested_absmax" in members
    blocks = math.ceil(numel / blocksize)
    if absmax.shape != (blocks,) or absmax.dtype.name != ("U8" if nested else "F32"):
        raise _Unfit(
            f"absmax is {absmax.dtype.name} {list(absmax.shape)}, expected {'U8' if nested else 'F32'} [{blocks}]"
        )
    if quant_map.dtype.name != "F32" or quant_map.shape != (16,):
        raise _Unfit(f"quant_map is {quant_map.dtype.name} {list(quant_map.shape)}, expected F32 [16]")
    notes = []
    if nested:
        if (
            "nested_quant_map" not in members
            or not isinstance(state.get("nested_blocksize"), int)
            or state["nested_blocksize"] < 1
        ):
            raise _Unfit("double quantization needs nested_quant_map and a nested_blocksize")
        if not isinstance(state.get("nested_offset"), (int, float)):
            raise _Unfit("double quantization needs a numeric nested_offset")
        nested_blocks = math.ceil(blocks / state["nested_blocksize"])
        if members["nested_absmax"].shape != (nested_blocks,) or members["nested_quant_map"].shape != (256,):
            raise _Unfit(
                f"nested_absmax {list(members['nested_absmax'].shape)} / nested_quant_map do not fit {blocks} blocks"
            )
    value_type = qtype(_QUANT_TYPES[quant_type])
    expected_map = struct.pack("<16f", *_codebook_values(value_type.name))
    if checkpoint.read_small(quant_map) != expected_map:
        notes.append(
            f"quant_map differs from bitsandbytes' {quant_type} table; bitsandbytes decodes with its table, so does qtool"
        )
    if len(shape) >= 2 and shape[-1] % blocksize:
        notes.append(f"blocks of {blocksize} run across rows of {shape[-1]} (bitsandbytes blocks the flattened weight)")
    extra = [("blocks", "over the flattened weight"), ("double_quant", "yes" if nested else "no")]
    packing = _PACKING
    if data.dtype.name != "U8":
        packing += f", the bytes stored as {data.dtype.name} words (quant_storage)"
        extra.append(("quant_storage", data.dtype.name))
    scheme = QScheme(
        qtype=value_type,
        block=(1, blocksize),
        symmetric=True,
        scale_dtype="F32",
    )
    provenance = Provenance(NAME, packing, tuple(extra))
    return Weight(base, tuple(shape), float_dtype_named(dtype) or "F32", members, scheme, provenance, notes)


def _codebook_values(name: str) -> list[float]:
    """The float32 table as bitsandbytes builds it (divided by its absmax in float32)."""
    values = FP4_BNB_CODEBOOK if name == "fp4_bnb" else NF4_CODEBOOK
    largest = struct.unpack("<f", struct.pack("<f", max(abs(v) for v in values)))[0]
    return [struct.unpack("<f", struct.pack("<f", v / largest))[0] if v else v for v in values]


def decode(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
    """The float weight in its logical shape and dtype, as bitsandbytes' `dequantize_4bit` or,
    for 8-bit, `int8_vectorwise_dequant`."""
    import torch

    from qtool import kernels

    scheme = weight.require_scheme()
    require_convention(weight, NAME)
    dtype = decoded_dtype(weight.dtype)
    if scheme.qtype.name == "int8":
        codes = checkpoint.load(weight.data).to(device)  # [O, I] int8
        scb = checkpoint.load(weight.members["scale"]).to(device).float().reshape(-1, 1)
        inverse = torch.tensor(_INV_127, dtype=torch.float32, device=codes.device)
        return (codes.float() * scb * inverse).to(dtype)
    numel = math.prod(weight.shape)
    blocksize = scheme.block[-1]
    packed = checkpoint.load(weight.data).to(device).reshape(-1)  # any quant_storage: its bytes
    codes = kernels.unpack_nibbles(packed.view(torch.uint8), high_first=True)[:numel]
    absmax = checkpoint.load(weight.members["scale"]).to(device)
    if "nested_absmax" in weight.members:
        state = _read_state(checkpoint, weight.members["quant_state"])
        nested_map = checkpoint.load(weight.members["nested_quant_map"]).to(device)
        nested_absmax = checkpoint.load(weight.members["nested_absmax"]).to(device)
        values = nested_map[absmax.long()]
        absmax = kernels.dequantize(values, nested_absmax, None, (state["nested_blocksize"],), torch.float32)
        absmax = absmax + torch.tensor(float(state["nested_offset"]), device=absmax.device)
    out = kernels.dequantize(codes, absmax, None, (blocksize,), dtype, qtype=scheme.qtype)
    return out.reshape(weight.shape)
