"""GPTQ (CONVENTIONS §2): AutoGPTQ, GPTQModel and HF optimum checkpoints.

Verified against auto-gptq 0.7.1 (`nn_modules/qlinear/qlinear_cuda.py`, `qlinear_cuda_old.py`:
`pack` and the torch fallback of `forward`) and GPTQModel (`utils/model.py`,
`convert_gptq_v1_to_v2_format_module`). Per Linear module `m`, `O` outputs, `I` inputs, `b` bits
(2, 3, 4 or 8), `G = ceil(I / group_size)` groups (1 when group_size is -1):

    m.qweight   I32 [I*b/32, O]   codes along the input dim, LSB first. For b in 2, 4, 8 word r
                                  holds inputs r*32/b + j at bits j*b; for b = 3 the codes are one
                                  dense bit stream, so inputs 10 and 21 of every 32 straddle words
    m.qzeros    I32 [G, O*b/32]   zero points, packed the same way along the output dim
    m.scales    F16 [G, O]        (BF16 / F32 in some GPTQModel files)
    m.g_idx     I32 [I]           the group of each input; with desc_act it is a permutation
    m.bias      F16 [O]           optional; a plain weight of its own

    W[o, i] = scales[g_idx[i], o] * (q[i, o] - Z[g_idx[i], o])
    format "gptq" (v1):  Z = stored + 1   (the packer subtracts 1; symmetric 4-bit stores 7)
    format "gptq_v2":    Z = stored

AutoGPTQ's g_idx-aware fallback (`qlinear_cuda`) adds the 1 after masking, without a carry, and
so does qtool; `qlinear_cuda_old` masks again after adding, which differs only for a stored
2^b - 1, a value the v1 packer cannot write without corrupting its neighbours.

Settings come from `quantize_config.json`, else `config.json`'s `quantization_config` with
`quant_method` (or GPTQModel's `method`) "gptq": bits, group_size, desc_act, sym and
`checkpoint_format` (or GPTQModel's `format`). With a config, inspecting reads no tensor data.
Without one, bits and group size come from the shapes (`qzeros` gives b = 32 * cols / O), the
format is v1 (the default every GPTQ writer uses), and `qzeros` and `g_idx` are read when they
are small (`SMALL_TENSOR_LIMIT`) to tell sym from asym (all zero points at the midpoint) and
desc_act (a g_idx that is not `i // group_size`); larger ones are not read, and the weight
says so.

Where the config and the tensors disagree (config 4-bit, shapes 8-bit), the tensors win and a
note names the disagreement. Tensors that fit no GPTQ reading under a GPTQ config are a broken
checkpoint: the weight keeps the config's scheme and a note, and `decode` (so `qtool
dequantize`) refuses it with a one-line `CheckpointError` (exit 2); `inspect` still lists it.
Without a config they are a lookalike and stay plain, with a note. Labels: `int<b> sym` for
symmetric files (q - 2^(b-1), like compressed-tensors' int), `uint<b> asym` otherwise.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.conventions.awq import awq_layout_fits
from qtool.conventions.base import Pool, by_module, infer_block_size, plain_weights, require_convention
from qtool.conventions.qweight_configs import awq_config, gptq_config
from qtool.formats.checkpoint import SMALL_TENSOR_LIMIT, Checkpoint, StoredTensor
from qtool.qtypes import qtype
from qtool.scheme import CHANNEL, QScheme, group
from qtool.weight import DATA, Provenance, Weight
from qtool.weight_codes import IntCodes

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    import torch

__all__ = ["BITS", "NAME", "Gptq", "codes", "decode"]

NAME = "gptq"
BITS = (2, 3, 4, 8)
FORMATS = ("gptq", "gptq_v2")
CHUNK_ELEMENTS = 1 << 24  # output elements decoded per step: temporaries stay under ~64 MB
_FLOATS = ("F16", "BF16", "F32")
_INDEX_DTYPES = ("I32", "I64")
UNFIT = "unreadable"  # the provenance detail of a config's weight whose tensors qtool cannot decode
_ROLES = {"qweight": DATA, "scales": "scale", "qzeros": "zero_point", "g_idx": "g_idx"}


# -- settings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Settings:
    """What a config says, each None when it says nothing usable."""

    source: str | None = None
    bits: int | None = None
    group_size: int | None = None  # -1: one group over all inputs
    desc_act: bool | None = None
    sym: bool | None = None
    format: str | None = None
    notes: tuple[str, ...] = ()

    @classmethod
    def read(cls, config: dict[str, Any] | None, source: str | None) -> _Settings:
        if config is None:
            return cls()
        notes = []
        bits = config.get("bits")  # every field as gptq_config() checked it
        if bits is not None and bits not in BITS:
            notes.append(f"{source} says bits {bits!r}, not a GPTQ width ({', '.join(map(str, BITS))}); shapes decide")
            bits = None
        group_size = config.get("group_size")
        if group_size is not None and not (group_size == -1 or group_size > 0):
            notes.append(f"{source} says group_size {group_size!r}; shapes decide")
            group_size = None
        fmt = config.get("checkpoint_format") or config.get("format")
        fmt = fmt.lower() if fmt is not None else None
        if config.get("is_marlin_format") is True:  # AutoGPTQ's marlin repack: another layout
            fmt = "marlin"
        return cls(
            source=source,
            bits=bits,
            group_size=group_size,
            desc_act=config.get("desc_act"),
            sym=config.get("sym"),
            format=fmt,
            notes=tuple(notes),
        )


# -- reading shapes -------------------------------------------------------------------------------


class _Unfit(ValueError):
    """The tensors do not form a GPTQ layout; the message says which part does not fit."""


@dataclass(frozen=True)
class _Layout:
    bits: int
    in_features: int
    out_features: int
    groups: int
    group_size: int | None  # None: one group over all inputs (per channel)


def _group_size(in_features: int, groups: int, hint: int | None) -> int | None:
    """The group size that cuts `in_features` into `groups`; None means per channel."""
    if hint == -1 and groups == 1:
        return None
    if hint and hint > 0 and math.ceil(in_features / hint) == groups:
        return hint  # the config's size, even where it makes one group (g128 on 128 inputs)
    if groups == 1:
        return None
    size = infer_block_size(in_features, groups)
    if size is None:
        raise _Unfit(f"scales has {groups} rows, which no group size gives for {in_features} inputs")
    return size


def _bits_fit(bits: int, shapes: dict[str, tuple[int, ...]], in_features: int | None) -> int | None:
    """in_features under `bits`, or None when qweight / qzeros do not fit that width."""
    words, out_features = shapes["qweight"]
    zero_words = shapes["qzeros"][1]
    if zero_words != math.ceil(out_features * bits / 32):
        return None
    if in_features is None:
        if (words * 32) % bits:
            return None
        return words * 32 // bits
    return in_features if words == math.ceil(in_features * bits / 32) else None


def read_layout(shapes: dict[str, tuple[int, ...]], bits_hint: int | None, group_hint: int | None) -> _Layout:
    """The one GPTQ layout these shapes hold, preferring the config's bits and group size."""
    for role in ("qweight", "qzeros", "scales"):
        if len(shapes[role]) != 2:
            raise _Unfit(f"{role} has shape {list(shapes[role])}, expected 2 dims")
    words, out_features = shapes["qweight"]
    groups, scale_columns = shapes["scales"]
    if scale_columns != out_features:
        raise _Unfit(f"scales has {scale_columns} columns, qweight {out_features}")
    if shapes["qzeros"][0] != groups:
        raise _Unfit(f"qzeros has {shapes['qzeros'][0]} rows, scales {groups}")
    in_features = None
    if "g_idx" in shapes:
        if len(shapes["g_idx"]) != 1:
            raise _Unfit(f"g_idx has shape {list(shapes['g_idx'])}, expected 1 dim")
        in_features = shapes["g_idx"][0]
    fits = {b: i for b in BITS if (i := _bits_fit(b, shapes, in_features)) is not None}
    if not fits:
        inputs = f"{in_features} inputs (g_idx)" if in_features is not None else f"{words} qweight rows"
        raise _Unfit(
            f"qweight [{words}, {out_features}] and qzeros {list(shapes['qzeros'])} fit no width in "
            f"{', '.join(map(str, BITS))} bits for {out_features} outputs and {inputs}"
        )
    if bits_hint in fits:
        bits = bits_hint
    elif len(fits) == 1:
        bits = next(iter(fits))
    else:
        raise _Unfit(f"the shapes fit {' and '.join(f'{b}-bit' for b in fits)} alike; a config must say which")
    in_features = fits[bits]
    size = _group_size(in_features, groups, group_hint)
    return _Layout(bits, in_features, out_features, groups, size)


def _shapes(members: dict[str, StoredTensor]) -> dict[str, tuple[int, ...]]:
    roles = {role: leaf for leaf, role in _ROLES.items()}
    return {roles[role]: tensor.shape for role, tensor in members.items() if role in roles}


def _check_dtypes(members: dict[str, StoredTensor]) -> None:
    for role, expected in ((DATA, ("I32",)), ("zero_point", ("I32",)), ("scale", _FLOATS), ("g_idx", _INDEX_DTYPES)):
        tensor = members.get(role)
        if tensor is not None and tensor.dtype.name not in expected:
            leaf = tensor.name.rpartition(".")[2]
            packing = (
                " (GPTQModel's pack_dtype other than int32 is not read)"
                if role in (DATA, "zero_point") and tensor.dtype.is_integer
                else ""
            )
            raise _Unfit(f"{leaf} is {tensor.dtype.name}, expected {' or '.join(expected)}{packing}")


# -- small metadata reads (inspect without a config) -------------------------------------------------


def read_ints(checkpoint: Checkpoint, tensor: StoredTensor) -> list[int] | None:
    """The values of a small little-endian int32/int64 tensor, or None when it is too large to read."""
    if tensor.nbytes > SMALL_TENSOR_LIMIT or tensor.dtype.name not in _INDEX_DTYPES:
        return None
    raw = checkpoint.read_small(tensor)
    code = "i" if tensor.dtype.name == "I32" else "q"
    return list(struct.unpack(f"<{len(raw) // struct.calcsize(code)}{code}", raw))


def _midpoint_row(bits: int, stored: int, columns: int, words: int) -> bytes:
    """The bytes of one qzeros row in which every one of `columns` fields stores `stored`."""
    unit = sum(stored << (bits * k) for k in range(32)).to_bytes(4 * bits, "little")  # 32 fields, `bits` words
    return (unit * math.ceil(columns / 32))[: 4 * words]


def _symmetric(checkpoint: Checkpoint, qzeros: StoredTensor, layout: _Layout, fmt: str) -> bool | None:
    """Whether every zero point is the midpoint 2^(b-1) (stored minus one under v1); None if not read."""
    if qzeros.nbytes > SMALL_TENSOR_LIMIT:
        return None
    stored = (1 << (layout.bits - 1)) - (1 if fmt == "gptq" else 0)
    row = _midpoint_row(layout.bits, stored, layout.out_features, qzeros.shape[1])
    return checkpoint.read_small(qzeros) == row * qzeros.shape[0]


def _desc_act(checkpoint: Checkpoint, g_idx: StoredTensor | None, layout: _Layout) -> bool | None:
    if g_idx is None:
        return False
    values = read_ints(checkpoint, g_idx)
    if values is None:
        return None
    size = layout.group_size or layout.in_features
    return any(v != i // size for i, v in enumerate(values))


# -- the convention -------------------------------------------------------------------------------


class Gptq:
    name = NAME

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        config, source = gptq_config(checkpoint)
        if config is None and awq_config(checkpoint) is not None:
            return []  # an AWQ checkpoint: that convention reads these names
        settings = _Settings.read(config, source)
        weights: list[Weight] = []
        for module, leaves in by_module(pool).items():
            if "qweight" not in leaves or "scales" not in leaves:
                continue
            members = {role: leaves[leaf] for leaf, role in _ROLES.items() if leaf in leaves}
            prefix = f"{module}." if module else ""
            if "qzeros" not in leaves:
                weights.extend(
                    plain_weights(
                        members, "qweight and scales without qzeros: not a GPTQ or AWQ layout qtool reads; left plain"
                    )
                )
                continue
            if config is None and "g_idx" not in leaves and awq_layout_fits(_shapes(members)):
                continue  # shapes that read as AWQ and carry no g_idx: AWQ's
            if settings.format is not None and settings.format not in FORMATS:
                note = f"{source} says format {settings.format!r}, a layout qtool does not read ({' and '.join(FORMATS)} only); qtool cannot decode it"
                weights.append(_broken(prefix + "weight", members, settings, note))
                continue
            try:
                weights.append(_resolve(checkpoint, prefix + "weight", members, settings))
            except _Unfit as exc:
                if config is None:
                    weights.extend(plain_weights(members, f"looks like GPTQ, but {exc}; left plain"))
                else:
                    note = f"tensors do not fit {source} ({settings.bits or 'unknown'}-bit, group_size {settings.group_size}): {exc}; qtool cannot decode it"
                    weights.append(_broken(prefix + "weight", members, settings, note))
        return weights

    def decode(
        self,
        checkpoint: Checkpoint,
        weight: Weight,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return decode(checkpoint, weight, device, dtype)

    def codes(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> IntCodes:
        return codes(checkpoint, weight, device)


def _scheme(layout_bits: int, group_size: int | None, symmetric: bool, scale_dtype: str) -> QScheme:
    value_type = qtype(f"int{layout_bits}" if symmetric else f"uint{layout_bits}")
    return QScheme(
        qtype=value_type,
        block=CHANNEL if group_size is None else group(group_size),
        symmetric=symmetric,
        scale_dtype=scale_dtype,
        zero_point=True,  # GPTQ stores zero points even when symmetric
    )


def _provenance(layout_bits: int, fmt: str, desc_act: bool | None, source: str, unfit: bool = False) -> Provenance:
    packing = "int32 along in, LSB first" + (", one bit stream across 3 words" if layout_bits == 3 else "")
    details = (
        ("format", fmt),
        ("desc_act", "unknown" if desc_act is None else "yes" if desc_act else "no"),
        ("settings", source),
    )
    return Provenance(NAME, packing, (*details, (UNFIT, "yes")) if unfit else details)


def _resolve(checkpoint: Checkpoint, name: str, members: dict[str, StoredTensor], settings: _Settings) -> Weight:
    _check_dtypes(members)
    layout = read_layout(_shapes(members), settings.bits, settings.group_size)
    notes = list(settings.notes)
    said = settings.source
    fmt = settings.format or "gptq"
    if said is not None:
        if settings.bits is not None and settings.bits != layout.bits:
            notes.append(f"{said} says {settings.bits}-bit, tensors show {layout.bits}-bit")
        if settings.group_size is not None and settings.group_size != (layout.group_size or -1):
            shown = layout.group_size if layout.group_size else "-1 (one group)"
            notes.append(f"{said} says group_size {settings.group_size}, tensors show {shown}")
        symmetric, desc_act = bool(settings.sym), settings.desc_act  # the config's word; no data is read
        if settings.sym is None:
            notes.append(f"{said} does not say sym; labelled asym because zero points are stored and applied")
        if desc_act and "g_idx" not in members:
            notes.append(f"{said} says desc_act, but there is no g_idx; decoded in column order")
    else:
        symmetric_read = _symmetric(checkpoint, members["zero_point"], layout, fmt)
        if symmetric_read is None:
            symmetric = False
            notes.append(
                "no GPTQ config; qzeros too large to read at inspect: labelled asym (zero points are applied either way)"
            )
        else:
            symmetric = symmetric_read
            if not symmetric and _symmetric(checkpoint, members["zero_point"], layout, "gptq_v2"):
                notes.append(
                    "no GPTQ config: every zero point stores the gptq_v2 midpoint; decoded as gptq (v1), the default"
                )
        desc_act = _desc_act(checkpoint, members.get("g_idx"), layout)
        said = "shapes"
    scheme = _scheme(layout.bits, layout.group_size, symmetric, members["scale"].dtype.name)
    provenance = _provenance(layout.bits, fmt, desc_act, said)
    return Weight(
        name, (layout.out_features, layout.in_features), members["scale"].dtype.name, members, scheme, provenance, notes
    )


def _broken(name: str, members: dict[str, StoredTensor], settings: _Settings, note: str) -> Weight:
    """A GPTQ config's weight whose tensors fit no GPTQ layout: listed, refused by decode."""
    qweight, scales = members[DATA], members["scale"]
    bits = settings.bits or 4
    out_features = qweight.shape[-1] if qweight.shape else 0
    in_features = (
        members["g_idx"].shape[0]
        if "g_idx" in members and members["g_idx"].shape
        else (qweight.shape[0] * 32 // bits if qweight.shape else 0)
    )
    group_size = settings.group_size if settings.group_size and settings.group_size > 0 else None
    scale_dtype = scales.dtype.name if scales.dtype.name in _FLOATS else "F16"
    scheme = _scheme(bits, group_size, bool(settings.sym), scale_dtype)
    provenance = _provenance(
        bits, settings.format or "gptq", settings.desc_act, settings.source or "shapes", unfit=True
    )
    return Weight(name, (out_features, in_features), scale_dtype, members, scheme, provenance, [*settings.notes, note])


# -- decode ---------------------------------------------------------------------------------------


def _decode_layout(weight: Weight) -> _Layout:
    """Re-check the stored shapes against the weight's scheme, as a CheckpointError if they fail."""
    from qtool.errors import CheckpointError

    scheme = weight.require_scheme()
    if weight.provenance.detail(UNFIT) is not None:
        why = weight.notes[-1] if weight.notes else "its tensors fit no GPTQ layout"
        raise CheckpointError(f"{weight.name}: {why}", path=weight.data.file)
    try:
        _check_dtypes(weight.members)
        layout = read_layout(_shapes(weight.members), scheme.bits, scheme.group_size or -1)
        if layout.bits != scheme.bits or (layout.out_features, layout.in_features) != tuple(weight.shape):
            raise _Unfit(f"the tensors hold a {layout.bits}-bit [{layout.out_features}, {layout.in_features}] weight")
    except _Unfit as exc:
        raise CheckpointError(
            f"{weight.name}: GPTQ tensors do not fit their config: {exc}", path=weight.data.file
        ) from None
    return layout


@dataclass(frozen=True)
class _Parts:
    """What decode and codes both read: the layout, the scales and zero points [G, O] (the v1
    offset applied), the group of each input, and the packed codes still in their words."""

    layout: _Layout
    scales: torch.Tensor
    zeros: torch.Tensor  # int16 [G, O]
    g_idx: torch.Tensor  # int64 [I]
    group_size: int | None  # set where g_idx is i // group_size with full groups
    qweight: torch.Tensor  # I32 [I*b/32, O]


def _parts(checkpoint: Checkpoint, weight: Weight, device: str | torch.device) -> _Parts:
    import torch

    from qtool import kernels
    from qtool.errors import CheckpointError
    from qtool.kernels.grouped import uniform_group_size

    require_convention(weight, NAME)
    layout = _decode_layout(weight)
    bits, out_features, in_features, groups = layout.bits, layout.out_features, layout.in_features, layout.groups

    def load(role: str) -> torch.Tensor:
        return checkpoint.load(weight.members[role]).to(device)

    scales = load("scale")
    zeros = kernels.unpack_int32(load("zero_point"), bits, out_features, dim=-1).to(torch.int16)  # [G, O]
    if weight.provenance.detail("format", "gptq") == "gptq":
        zeros += 1  # v1 stores zero points minus one
    if "g_idx" in weight.members:
        g_idx = load("g_idx").to(torch.int64)
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise CheckpointError(
                f"{weight.name}: g_idx holds groups {int(g_idx.min())}..{int(g_idx.max())}, scales has {groups}",
                path=weight.data.file,
            )
    else:
        size = layout.group_size or in_features
        g_idx = torch.arange(in_features, device=scales.device) // size
    return _Parts(layout, scales, zeros, g_idx, uniform_group_size(g_idx, groups), load(DATA))


def decode(
    checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The float weight [O, I], in the scales' dtype unless `dtype` says otherwise, always
    indexing through g_idx. Bit for bit AutoGPTQ's torch dequantization (see kernels/grouped.py
    for the precision), for every width, v1 and v2, with and without desc_act."""
    import torch

    from qtool import kernels
    from qtool.kernels.grouped import dequantize_grouped

    parts = _parts(checkpoint, weight, device)
    bits, out_features, in_features = parts.layout.bits, parts.layout.out_features, parts.layout.in_features
    scales, qweight = parts.scales, parts.qweight  # qweight [I*b/32, O]
    out = torch.empty(out_features, in_features, dtype=dtype or scales.dtype, device=scales.device)
    step = max(1, CHUNK_ELEMENTS // max(in_features, 1))
    scales_t, zeros_t = scales.t(), parts.zeros.t()  # [O, G]
    for start in range(0, out_features, step):  # row blocks of up to 16 M elements, not rows
        stop = min(out_features, start + step)
        values = kernels.unpack_int32(qweight[:, start:stop].t(), bits, in_features, dim=-1)  # [n, I] uint8
        dequantize_grouped(
            values, scales_t[start:stop], zeros_t[start:stop], parts.g_idx,
            group_size=parts.group_size, bits=bits, dtype=out.dtype, out=out[start:stop],
        )  # fmt: skip
    return out


def codes(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> IntCodes:
    """The weight's grid as stored: unsigned codes [O, I] (unpacked as `decode` does), the
    scales [O, G] in their file dtype, the zero points [O, G] with v1's +1 applied (so a
    symmetric 4-bit file gives 8, and a v1 file that stored 15 gives 16, a value outside the
    4-bit range that only some targets hold), and `g_idx` where it is not `i // group_size`
    (desc_act). The product is formed in the scales' dtype, as AutoGPTQ's torch path does."""
    import torch

    from qtool import kernels

    parts = _parts(checkpoint, weight, device)
    layout = parts.layout
    group = layout.group_size or layout.in_features
    values = kernels.unpack_int32(parts.qweight.t(), layout.bits, layout.in_features, dim=-1).to(torch.int16)
    trivial = torch.equal(parts.g_idx, torch.arange(layout.in_features, device=parts.g_idx.device) // group)
    return IntCodes(
        codes=values,
        scale=parts.scales.t().contiguous(),
        zero=parts.zeros.t().to(torch.int32).contiguous(),
        minimum=None,
        bits=layout.bits,
        group=group,
        g_idx=None if trivial else parts.g_idx.to(torch.int32),
    )
