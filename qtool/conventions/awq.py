"""AWQ (CONVENTIONS §3): AutoAWQ's GEMM and GEMV layouts, 4-bit with zero points.

Verified against autoawq 0.2.9 (`modules/linear/gemm.py` and `gemv.py`: `from_linear`;
`utils/packing_utils.py`: `dequantize_gemm`, `AWQ_ORDER`) and the GEMV CUDA kernel of
casper-hansen/AutoAWQ_kernels (`awq_ext/quantization/gemv_cuda.cu`). Per Linear module `m`,
`O` outputs, `I` inputs, `G = I / group_size` (AutoAWQ requires whole groups):

    GEMM  m.qweight I32 [I, O/8]  8 outputs per word, interleaved: nibble k (bits 4k..4k+3)
                                  of word c holds output 8c + [0, 2, 4, 6, 1, 3, 5, 7][k]
          m.qzeros  I32 [G, O/8]  interleaved the same way
          m.scales  F16 [G, O]
    GEMV  m.qweight I32 [O, I/8]  8 inputs per word, natural order, LSB first
          m.qzeros  I32 [O, W]    8 groups per word, natural order
          m.scales  F16 [O, 8W]   columns past G are zero padding
          W = roundup(ceil(G / 8), m) with m = 1, 2, 4 for group size >= 128, 64, 32
    m.bias F16 [O], optional, stays a plain weight of its own.

    W[o, i] = (q[i, o] - z[i // group_size, o]) * s[i // group_size, o], zero points in [0, 15]
    with no offset. GEMM's torch path (`dequantize_gemm`) multiplies in float16; the GEMV kernel
    in float32. qtool returns the scales' dtype by default (bit for bit the former) and the exact
    float32 product on request (bit for bit the latter).

Settings come from config.json's `quantization_config` with `quant_method` "awq": `version`
("gemm" | "gemv"), `group_size` (or `q_group_size`), `bits` (or `w_bit`), `zero_point`. Without
one, the shapes decide: GEMM and GEMV shapes cannot be confused (only a group size of 1 would
make them alike). A GEMV group size that several sizes fit (the zero padding hides it) needs
the config; without it the tensors stay plain with a note. Other AutoAWQ versions (gemv_fast,
marlin) are different layouts, listed with a note, and refused by decode. Labels: `uint4 asym`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.conventions.base import Pool, by_module, plain_weights, require_convention
from qtool.conventions.qweight_configs import awq_config, gptq_config
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.qtypes import qtype
from qtool.scheme import CHANNEL, QScheme, group
from qtool.weight import DATA, Provenance, Weight
from qtool.weight_codes import IntCodes

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    from collections.abc import Callable

    import torch

__all__ = ["NAME", "ORDER", "Awq", "awq_layout_fits", "codes", "decode", "zeros_width"]

NAME = "awq"
VERSIONS = ("gemm", "gemv")
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # GEMM: nibble k of a word holds output 8c + ORDER[k]
UNFIT = "unreadable"
CHUNK_ELEMENTS = 1 << 24  # output elements decoded per step: temporaries stay under ~64 MB
_FLOATS = ("F16", "BF16", "F32")
_ROLES = {"qweight": DATA, "scales": "scale", "qzeros": "zero_point"}


def zeros_width(in_features: int, group_size: int) -> int | None:
    """GEMV's qzeros columns (AutoAWQ's `calculate_zeros_width`); None for a size it refuses."""
    if group_size >= 128:
        multiple = 1
    elif group_size in (64, 32):
        multiple = 128 // group_size
    else:
        return None
    return math.ceil(math.ceil(in_features // group_size / 8) / multiple) * multiple


class _Unfit(ValueError):
    pass


@dataclass(frozen=True)
class _Layout:
    version: str
    in_features: int
    out_features: int
    groups: int
    group_size: int


def _gemm(shapes: dict[str, tuple[int, ...]]) -> _Layout | None:
    """The GEMM layout; its group size is I / G, so no hint is needed."""
    (in_features, packed), (groups, out_features) = shapes["qweight"], shapes["scales"]
    if out_features != 8 * packed or shapes["qzeros"] != (groups, packed) or groups < 1 or in_features % groups:
        return None
    return _Layout("gemm", in_features, out_features, groups, in_features // groups)


def _gemv_sizes(in_features: int, width: int) -> list[int]:
    """Every group size AutoAWQ accepts that gives qzeros `width` columns for `in_features`."""
    sizes = [32, 64] + [1 << k for k in range(7, max(7, in_features.bit_length()) + 1)] + [in_features]
    return sorted(
        {s for s in sizes if s <= in_features and in_features % s == 0 and zeros_width(in_features, s) == width}
    )


def _gemv(shapes: dict[str, tuple[int, ...]], group_hint: int | None) -> _Layout | list[int] | None:
    """The GEMV layout; a list of sizes when several fit and no hint picks one."""
    (out_features, packed), (zero_rows, width), (scale_rows, scale_columns) = (
        shapes["qweight"],
        shapes["qzeros"],
        shapes["scales"],
    )
    if not (out_features == zero_rows == scale_rows) or scale_columns != 8 * width:
        return None
    in_features = 8 * packed
    sizes = _gemv_sizes(in_features, width)
    hint = in_features if group_hint == -1 else group_hint
    if hint in sizes:
        sizes = [hint]
    if not sizes:
        return None
    if len(sizes) > 1:
        return sizes
    return _Layout("gemv", in_features, out_features, in_features // sizes[0], sizes[0])


def _two_dims(shapes: dict[str, tuple[int, ...]]) -> bool:
    return all(role in shapes and len(shapes[role]) == 2 for role in ("qweight", "qzeros", "scales"))


def awq_layout_fits(shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether qweight/qzeros/scales shapes read as AWQ GEMM or GEMV (GPTQ asks, without a config)."""
    return _two_dims(shapes) and (_gemm(shapes) is not None or _gemv(shapes, None) is not None)


def _shapes(members: dict[str, StoredTensor]) -> dict[str, tuple[int, ...]]:
    roles = {role: leaf for leaf, role in _ROLES.items()}
    return {roles[role]: tensor.shape for role, tensor in members.items() if role in roles}


def read_layout(shapes: dict[str, tuple[int, ...]], version: str | None, group_hint: int | None) -> _Layout:
    if not _two_dims(shapes):
        raise _Unfit("qweight, qzeros and scales must all be 2-D")
    found = {"gemm": _gemm(shapes), "gemv": _gemv(shapes, group_hint)}
    order = [version] if version in found else []
    order += [v for v in VERSIONS if v not in order]
    for candidate in order:
        layout = found[candidate]
        if isinstance(layout, list):
            raise _Unfit(
                f"a GEMV layout whose group size could be any of {layout} (the zero padding hides it); a config must say"
            )
        if layout is not None:
            return layout
    raise _Unfit(
        f"qweight {list(shapes['qweight'])}, qzeros {list(shapes['qzeros'])} and scales {list(shapes['scales'])} "
        "fit neither GEMM ([I, O/8], [G, O/8], [G, O]) nor GEMV ([O, I/8], [O, W], [O, 8W])"
    )


class Awq:
    name = NAME

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        config = awq_config(checkpoint)
        if config is None and gptq_config(checkpoint)[0] is not None:
            return []  # a GPTQ checkpoint: GPTQ has claimed what it reads
        settings = _Settings.read(config)
        weights: list[Weight] = []
        for module, leaves in by_module(pool).items():
            if not {"qweight", "qzeros", "scales"} <= set(leaves) or "g_idx" in leaves:
                continue
            members = {role: leaves[leaf] for leaf, role in _ROLES.items()}
            name = f"{module}.weight" if module else "weight"
            if settings.version is not None and settings.version not in VERSIONS:
                note = f"config.json says AWQ version {settings.version!r}, a layout qtool does not read (gemm and gemv only); qtool cannot decode it"
                weights.append(_unreadable(name, members, settings, note))
                continue
            try:
                weights.append(_resolve(name, members, settings))
            except _Unfit as exc:
                if config is None:
                    weights.extend(plain_weights(members, f"looks like AWQ, but {exc}; left plain"))
                else:
                    note = f"tensors do not fit config.json's AWQ settings ({settings.version or 'gemm'}, group_size {settings.group_size}): {exc}; qtool cannot decode it"
                    weights.append(_unreadable(name, members, settings, note))
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


@dataclass(frozen=True)
class _Settings:
    present: bool = False
    version: str | None = None
    group_size: int | None = None
    bits: int | None = None
    zero_point: bool | None = None

    @classmethod
    def read(cls, config: dict[str, Any] | None) -> _Settings:
        if config is None:
            return cls()
        version = config.get("version")
        group_size = config.get("group_size", config.get("q_group_size"))
        bits = config.get("bits", config.get("w_bit"))
        zero_point = config.get("zero_point")
        return cls(  # every field as awq_config() checked it
            present=True,
            version=version.lower() if version is not None else None,
            group_size=group_size if group_size is not None and (group_size == -1 or group_size > 0) else None,
            bits=bits,
            zero_point=zero_point,
        )


def _scheme(group_size: int | None, in_features: int, scale_dtype: str, source: str) -> QScheme:
    return QScheme(
        qtype=qtype("uint4"),
        block=CHANNEL
        if group_size is None or (group_size >= in_features and source == "shapes")
        else group(group_size),
        symmetric=False,
        scale_dtype=scale_dtype,
        zero_point=True,
    )


def _provenance(layout_version: str, source: str, unfit: bool = False) -> Provenance:
    if layout_version == "gemm":
        packing = "int32 along out, 8 per word, nibble k = output [0,2,4,6,1,3,5,7][k]"
    else:
        packing = "int32 along in, 8 per word, LSB first; scales zero-padded"
    details = (("version", layout_version), ("settings", source))
    return Provenance(NAME, packing, (*details, (UNFIT, "yes")) if unfit else details)


def _resolve(name: str, members: dict[str, StoredTensor], settings: _Settings) -> Weight:
    for role, expected in ((DATA, ("I32",)), ("zero_point", ("I32",)), ("scale", _FLOATS)):
        if members[role].dtype.name not in expected:
            raise _Unfit(
                f"{members[role].name.rpartition('.')[2]} is {members[role].dtype.name}, expected {' or '.join(expected)}"
            )
    layout = read_layout(_shapes(members), settings.version, settings.group_size)
    notes = []
    source = "config.json" if settings.present else "shapes"
    if settings.present:
        if settings.version is not None and settings.version != layout.version:
            notes.append(f"config.json says version {settings.version}, tensors are laid out as {layout.version}")
        wanted = layout.in_features if settings.group_size == -1 else settings.group_size
        if settings.group_size is not None and wanted != layout.group_size:
            notes.append(f"config.json says group_size {settings.group_size}, tensors show {layout.group_size}")
        if settings.bits is not None and settings.bits != 4:
            notes.append(f"config.json says {settings.bits}-bit, tensors show 4-bit (AWQ GEMM and GEMV store 4-bit)")
        if settings.zero_point is False:
            notes.append("config.json says zero_point false, but qzeros are stored; they are applied")
    group_size = None if settings.group_size == -1 else layout.group_size
    scheme = _scheme(group_size, layout.in_features, members["scale"].dtype.name, source)
    return Weight(
        name,
        (layout.out_features, layout.in_features),
        members["scale"].dtype.name,
        members,
        scheme,
        _provenance(layout.version, source),
        notes,
    )


def _unreadable(name: str, members: dict[str, StoredTensor], settings: _Settings, note: str) -> Weight:
    """A config's AWQ weight that qtool cannot decode: listed with its note, refused by decode."""
    qweight, scales = members[DATA], members["scale"]
    version = settings.version or "gemm"
    if len(qweight.shape) == 2:
        rows, columns = qweight.shape
        shape = (8 * columns, rows) if version == "gemm" else (rows, 8 * columns)
    else:
        shape = tuple(qweight.shape)
    group_size = settings.group_size if settings.group_size and settings.group_size > 0 else None
    scale_dtype = scales.dtype.name if scales.dtype.name in _FLOATS else "F16"
    scheme = _scheme(group_size, shape[-1] if shape else 0, scale_dtype, "config.json")
    return Weight(name, shape, scale_dtype, members, scheme, _provenance(version, "config.json", unfit=True), [note])


# -- decode ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Parts:
    """What decode and codes both read: the layout, scales and zero points [O, G] in output
    order (GEMV's padding columns cut), and a function giving the codes of rows start..stop."""

    layout: _Layout
    scales: torch.Tensor
    zeros: torch.Tensor  # uint8 [O, G]
    rows: Callable[[int, int], torch.Tensor]  # (start, stop) -> uint8 [stop - start, I]; GEMM: multiples of 8


def _parts(checkpoint: Checkpoint, weight: Weight, device: str | torch.device) -> _Parts:
    import torch

    from qtool import kernels
    from qtool.errors import CheckpointError

    scheme = weight.require_scheme()
    require_convention(weight, NAME)
    version = weight.provenance.detail("version")
    if weight.provenance.detail(UNFIT) is not None:
        raise CheckpointError(
            f"{weight.name}: {weight.notes[-1] if weight.notes else 'not an AWQ layout qtool reads'}",
            path=weight.data.file,
        )
    try:
        layout = read_layout(_shapes(weight.members), version, scheme.group_size or -1)
    except _Unfit as exc:
        raise CheckpointError(f"{weight.name}: AWQ tensors do not fit: {exc}", path=weight.data.file) from None
    if (layout.out_features, layout.in_features) != tuple(weight.shape) or layout.version != version:
        raise CheckpointError(
            f"{weight.name}: AWQ tensors hold a {layout.version} [{layout.out_features}, {layout.in_features}] weight, not {list(weight.shape)}",
            path=weight.data.file,
        )
    out_features, in_features, groups = layout.out_features, layout.in_features, layout.groups

    def load(role: str) -> torch.Tensor:
        return checkpoint.load(weight.members[role]).to(device)

    scales, qzeros, qweight = load("scale"), load("zero_point"), load(DATA)
    reverse = torch.tensor([ORDER.index(k) for k in range(8)], device=qweight.device)  # [0, 4, 1, 5, 2, 6, 3, 7]
    if layout.version == "gemv":
        zeros = kernels.unpack_int32(qzeros, 4, qzeros.shape[1] * 8, dim=-1)[:, :groups]  # [O, G], natural order
        scales = scales[:, :groups]  # the padding columns are zeros

        def rows(start: int, stop: int) -> torch.Tensor:
            return kernels.unpack_int32(qweight[start:stop], 4, in_features, dim=-1)  # [n, I]
    else:
        zeros = kernels.unpack_int32(qzeros, 4, out_features, dim=-1)  # [G, O] in nibble order
        zeros = zeros.view(groups, -1, 8).index_select(2, reverse).reshape(groups, out_features).t()
        scales = scales.t()

        def rows(start: int, stop: int) -> torch.Tensor:
            packed = qweight[:, start // 8 : stop // 8]  # [I, n/8]
            nibbles = kernels.unpack_int32(packed, 4, stop - start, dim=-1)  # [I, n] in nibble order
            # [n/8, 8, I] in output order: one gather does the de-interleave and the transpose
            return (
                nibbles.view(in_features, -1, 8)
                .permute(1, 2, 0)
                .index_select(1, reverse)
                .reshape(stop - start, in_features)
            )

    return _Parts(layout, scales, zeros, rows)


def decode(
    checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The float weight [O, I] in the scales' dtype unless `dtype` says otherwise; bit for bit
    AutoAWQ's `dequantize_gemm` (GEMM) and its GEMV kernel's float32 products (GEMV)."""
    import torch

    from qtool.kernels.grouped import dequantize_grouped

    parts = _parts(checkpoint, weight, device)
    out_features, in_features, size = parts.layout.out_features, parts.layout.in_features, parts.layout.group_size
    scales, zeros = parts.scales, parts.zeros
    out = torch.empty(out_features, in_features, dtype=dtype or scales.dtype, device=scales.device)
    step = max(8, CHUNK_ELEMENTS // max(in_features, 1) // 8 * 8)
    for start in range(0, out_features, step):  # row blocks of up to 16 M elements, not rows
        stop = min(out_features, start + step)
        dequantize_grouped(
            parts.rows(start, stop), scales[start:stop], zeros[start:stop], group_size=size, bits=4, dtype=out.dtype,
            out=out[start:stop],
        )  # fmt: skip
    return out


def codes(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> IntCodes:
    """The weight's 4-bit grid as stored: codes [O, I] de-interleaved (GEMM) as `decode` does,
    scales [O, G] in their file dtype, zero points [O, G] as stored (AutoAWQ stores them
    without an offset). The product is formed in the scales' dtype, as `dequantize_gemm` does."""
    import torch

    parts = _parts(checkpoint, weight, device)
    layout = parts.layout
    return IntCodes(
        codes=parts.rows(0, layout.out_features).to(torch.int16),
        scale=parts.scales.contiguous(),
        zero=parts.zeros.to(torch.int32).contiguous(),
        minimum=None,
        bits=4,
        group=layout.group_size,
    )
