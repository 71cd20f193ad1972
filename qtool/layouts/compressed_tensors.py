"""The compressed-tensors layout (CONVENTIONS §1): the tensors and `quantization_config` that
compressed-tensors 0.20.1 writes for a scheme, bit for bit (tests/test_ct_codec.py). What vLLM
and transformers load.

    encoded_layout   every stored tensor of a weight (name, dtype, shape), from its shape alone,
                     so the plan fixes the headers before any data exists
    encode           the tensors themselves, in torch (min-max calibration, the package's rounding)
    config_for       the `quantization_config` of a set of modules
    CompressedTensors   the `Layout`: the above, and which jobs a fused CPU kernel writes
                     (`encoding`: int per channel or per group with scales in the weight's dtype)

Reading them back is `qtool.conventions.compressed_tensors` (detect and decode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.dtypes import WEIGHT_FLOATS, weight_float_of
from qtool.errors import SchemeError
from qtool.layouts.base import refusal_of
from qtool.layouts.safetensors import CHUNK_ELEMENTS, SafetensorsLayout
from qtool.plan import IntRows
from qtool.qtypes import QType, qtype
from qtool.scheme import QScheme
from qtool.weight import Weight

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    import torch

__all__ = [
    "CT_VERSION",
    "CompressedTensors",
    "encoded_layout",
    "encode",
    "pack_int_codes",
    "config_for",
    "row_group_int_layout",
    "scale_storage",
]


def _usage(message: str, hint: str | None = None) -> SchemeError:
    return SchemeError(message, hint=hint)


CT_VERSION = "0.20.1"  # the package version whose layouts and config this codec reproduces


@dataclass(frozen=True)
class _QuantArgs:
    """A scheme as compressed-tensors stores it: the format and its weight QuantizationArgs
    (compressed-tensors' own word for the settings of one config group)."""

    format: str
    num_bits: int
    type: str  # "int" | "float"
    strategy: str  # tensor | channel | group | tensor_group | block
    symmetric: bool
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    scale_dtype: str | None = None  # the config's torch dtype string, only where the preset sets one
    activations: str | None = None  # "token" | "group128": dynamic fp8 input activations
    observer: str = "minmax"  # how the scales were chosen; recorded when not the default min-max

    def weights_args(self) -> dict[str, Any]:
        """`QuantizationArgs.model_dump()` as compressed-tensors serializes it: unset
        block_structure, scale_dtype, actorder, observer and zp_dtype are left out."""
        args: dict[str, Any] = {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": self.strategy,
            "dynamic": False,
        }
        if self.block_structure is not None:
            args["block_structure"] = list(self.block_structure)
        if self.scale_dtype is not None:
            args["scale_dtype"] = self.scale_dtype
        if self.observer != "minmax":  # llm-compressor records its observer here ("mse")
            args["observer"] = self.observer
        return args

    def input_args(self) -> dict[str, Any] | None:
        # qtool does no calibration, so activations are dynamic: per token (the FP8_DYNAMIC
        # preset), or per group of 128 for block weights (the FP8_BLOCK preset). The FP8
        # preset's static per-tensor input_scale would need calibration data; a dynamic
        # per-token scheme with the same weights is what compressed-tensors and vLLM load.
        if self.activations is None:
            return None
        group = 128 if self.activations == "group128" else None
        return {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "group_size": group,
            "strategy": "group" if group else "token",
            "dynamic": True,
        }


def _quant_args(scheme: QScheme) -> _QuantArgs:
    """The compressed-tensors layout for a scheme, or a UsageError naming what it can store."""
    qt, gran = scheme.qtype, scheme.granularity
    if scheme.rule:
        raise _usage(
            f"{scheme.rule} is a GGUF block type (llama.cpp's own scale rule); compressed-tensors cannot store it",
            hint="write it with the gguf layout",
        )
    kind = scheme.scale_kind
    float_scale = kind == "auto" or scheme.scale_dtype.upper() in WEIGHT_FLOATS
    e8m0, e4m3 = kind == "e8m0" or scheme.scale_dtype.upper() == "U8", kind == "e4m3"
    strategy = gran  # qtool's granularity names are compressed-tensors' strategy names
    if gran == "channel" and scheme.block[-1] is not None:
        raise _usage(f"compressed-tensors stores one scale per output channel, not {scheme.granularity_label}")
    group_size = scheme.group_size if gran == "group" else None
    block = None
    if gran == "block":
        *lead, rows, cols = scheme.block
        if lead and any(b != 1 for b in lead) or rows is None or cols is None:
            raise _usage(f"compressed-tensors blocks are 2-D with fixed sizes, not {list(scheme.block)}")
        block = (rows, cols)
    if qt.kind == "int":
        if not qt.signed:
            raise _usage(
                f"compressed-tensors stores signed ints: use int{qt.bits} (with :asym for a zero point), not {qt.name}"
            )
        if not float_scale:
            raise _usage(f"compressed-tensors stores int scales as the weight's float dtype, not {scheme.scale_dtype}")
        return _QuantArgs(
            "pack-quantized", qt.bits, "int", strategy, scheme.symmetric, group_size, block, observer=scheme.observer
        )
    if not scheme.symmetric:
        raise _usage(f"compressed-tensors quantizes {qt.name} symmetrically only")
    if qt.name == "fp8_e4m3" and float_scale:
        acts = "group128" if gran == "block" else "token"
        return _QuantArgs("float-quantized", 8, "float", strategy, True, group_size, block, activations=acts)
    if qt.name == "fp8_e4m3" and e8m0 and group_size == 32:
        return _QuantArgs("mxfp8-quantized", 8, "float", "group", True, 32, scale_dtype="torch.uint8")
    if qt.name == "fp4_e2m1" and e4m3 and group_size == 16:
        return _QuantArgs(
            "nvfp4-pack-quantized", 4, "float", "tensor_group", True, 16, scale_dtype="torch.float8_e4m3fn"
        )
    if qt.name == "fp4_e2m1" and e8m0 and group_size == 32:
        return _QuantArgs("mxfp4-pack-quantized", 4, "float", "group", True, 32, scale_dtype="torch.uint8")
    raise _usage(
        f"compressed-tensors has no layout for {scheme.label} with {scheme.scale_dtype} scales",
        hint="it stores int1..int8 (pack-quantized), fp8_e4m3 with float scales, mxfp8 g32, nvfp4 g16 "
        "and mxfp4 g32; nf4 is written by the bitsandbytes layout",
    )


def _module_of(name: str) -> str:
    if not name.endswith(".weight"):
        raise _usage(f"compressed-tensors quantizes Linear weights named '<module>.weight', not {name!r}")
    return name[: -len(".weight")]


def _check_shape(name: str, shape: tuple[int, ...], args: _QuantArgs) -> tuple[int, int]:
    if len(shape) != 2:
        raise _usage(f"compressed-tensors quantizes 2-D Linear weights; {name} has shape {list(shape)}")
    rows, cols = shape
    # Groups must divide in_features: compressed-tensors 0.20.1 raises "tensor column shape
    # must be divisble by the given group_size" on a ragged last group. 2-D blocks may be
    # partial (the package pads them), and tensor / channel strategies take any shape.
    if args.group_size and cols % args.group_size:
        divisors = [g for g in (256, 128, 64, 32, 16, 8) if cols % g == 0 and g != args.group_size]
        raise _usage(
            f"compressed-tensors refuses group size {args.group_size} for {name}: "
            f"in_features {cols} is not a multiple of {args.group_size}",
            hint=(f"use a group size that divides {cols} (e.g. {divisors[0]})" if divisors else "use per-channel")
            + ", or leave this weight unquantized",
        )
    return rows, cols


def scale_storage(scheme: QScheme, dtype: str) -> str:
    """The stored dtype of a float scale: the weight's dtype for "auto", as compressed-tensors
    does, else the dtype the scheme names. A weight stored as blocks (a GGUF tensor, dtype U8)
    is quantized from its float32 decoding: float32 scales, as the encoder makes them."""
    scale = scheme.scale_dtype.upper()
    if scale == "AUTO":
        return dtype if dtype in WEIGHT_FLOATS else "F32"
    return scale


def _block_of(args: _QuantArgs, shape: tuple[int, int]) -> tuple[int, int]:
    rows, cols = shape
    if args.strategy == "tensor":
        return rows, cols
    if args.strategy == "channel":
        return 1, cols
    if args.block_structure:
        return args.block_structure
    return 1, args.group_size or cols


def _scale_shape(args: _QuantArgs, shape: tuple[int, int]) -> tuple[int, ...]:
    if args.strategy == "tensor":
        return (1,)
    rows, cols = shape
    block_rows, block_cols = _block_of(args, shape)
    return (math.ceil(rows / block_rows), math.ceil(cols / block_cols))


def encoded_layout(
    name: str, shape: tuple[int, ...], dtype: str, scheme: QScheme
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(stored name, safetensors dtype, shape) of every tensor `encode` writes for this weight,
    in that order, computed from the shape alone."""
    module, args = _module_of(name), _quant_args(scheme)
    rows, cols = _check_shape(name, tuple(shape), args)
    grid = _scale_shape(args, (rows, cols))
    bits = args.num_bits
    if args.format == "pack-quantized":
        layout = [(f"{module}.weight_packed", "I32", (rows, math.ceil(cols * bits / 32)))]
        layout.append((f"{module}.weight_scale", scale_storage(scheme, dtype), grid))
        if not args.symmetric:
            if args.strategy in ("group", "channel"):  # packed along dim 0, as the package does
                layout.append((f"{module}.weight_zero_point", "I32", (math.ceil(rows * bits / 32), grid[1])))
            else:
                layout.append((f"{module}.weight_zero_point", "I8", grid))
        layout.append((f"{module}.weight_shape", "I64", (2,)))
        return layout
    if args.format == "float-quantized":
        return [
            (f"{module}.weight", "F8_E4M3", (rows, cols)),
            (f"{module}.weight_scale", scale_storage(scheme, dtype), grid),
        ]
    if args.format == "mxfp8-quantized":
        return [(f"{module}.weight", "F8_E4M3", (rows, cols)), (f"{module}.weight_scale", "U8", grid)]
    if args.format == "nvfp4-pack-quantized":
        return [
            (f"{module}.weight_packed", "U8", (rows, cols // 2)),
            (f"{module}.weight_scale", "F8_E4M3", grid),
            (f"{module}.weight_global_scale", "F32", (1,)),
        ]
    return [(f"{module}.weight_packed", "U8", (rows, cols // 2)), (f"{module}.weight_scale", "U8", grid)]


def row_group_int_layout(scheme: QScheme, shape: tuple[int, ...], dtype: str) -> tuple[int, int, bool, str] | None:
    """(bits, group, symmetric, observer) when this weight is written as pack-quantized ints with one
    scale (and zero point) per row group, the scale stored in the weight's own dtype: the
    layouts qtool.native encodes. None for every other layout (torch encodes those)."""
    from qtool.errors import QtoolError

    try:
        args = _quant_args(scheme)
    except QtoolError:
        return None
    if args.format != "pack-quantized" or args.strategy not in ("channel", "group"):
        return None
    if len(shape) != 2 or dtype not in WEIGHT_FLOATS or scale_storage(scheme, dtype) != dtype:
        return None
    group = shape[1] if args.strategy == "channel" else args.group_size
    if not group or shape[1] % group:
        return None
    return args.num_bits, group, args.symmetric, args.observer


def encode(name: str, weight: torch.Tensor, scheme: QScheme) -> dict[str, torch.Tensor]:
    """The stored tensors of one Linear weight, exactly as compressed-tensors 0.20.1 writes
    them after min-max calibration (its `calculate_qparams` / `generate_gparam`) and
    `compress_model`; int schemes with the mse observer take their scales (and zero points)
    from qtool.kernels.mse instead. Computes on weight's device, in weight's dtype where the package does."""

    from qtool import kernels

    if not weight.dtype.is_floating_point or weight.dtype.itemsize == 1:
        raise _usage(f"{name}: encode takes a float16/bfloat16/float32 weight, not {weight.dtype}")
    dtype = weight_float_of(weight.dtype) or "F16"
    layout = encoded_layout(name, tuple(weight.shape), dtype, scheme)
    args = _quant_args(scheme)
    shape = (weight.shape[0], weight.shape[1])
    block = _block_of(args, shape)
    grid = _scale_shape(args, shape)
    names = [entry[0] for entry in layout]
    out: dict[str, torch.Tensor] = {}
    if args.format == "pack-quantized":
        value_type = qtype(f"int{args.num_bits}")
        observe = kernels.choose_qparams_mse if args.observer == "mse" else kernels.choose_qparams
        scale, zero_point = observe(weight, block, value_type, args.symmetric, scale_storage(scheme, dtype))
        values = kernels.quantize(weight, scale, zero_point, block, value_type)
        return pack_int_codes(name, values, scale, zero_point, scheme, dtype)
    elif args.format == "float-quantized":
        value_type = qtype("fp8_e4m3")
        scale, _ = kernels.choose_qparams(weight, block, value_type, True, scale_storage(scheme, dtype))
        out[names[0]] = kernels.quantize(weight, scale, None, block, value_type)
        out[names[1]] = scale.reshape(grid)
    elif args.format == "mxfp8-quantized":
        value_type = qtype("fp8_e4m3")
        scale = _mx_scale(weight, block, value_type)
        out[names[0]] = kernels.quantize(weight, scale, None, block, value_type)
        out[names[1]] = scale
    elif args.format == "nvfp4-pack-quantized":
        value_type = qtype("fp4_e2m1")
        global_scale = kernels.choose_global_scale(weight, value_type, "ue4m3")
        scale, _ = kernels.choose_qparams(weight, block, value_type, True, "E4M3", global_scale=global_scale)
        codes = kernels.quantize(weight, scale, None, block, value_type, global_scale=global_scale)
        out[names[0]] = kernels.pack_nibbles(codes)  # low nibble = even element
        out[names[1]] = scale
        out[names[2]] = global_scale
    else:  # mxfp4-pack-quantized
        value_type = qtype("fp4_e2m1")
        scale = _mx_scale(weight, block, value_type)
        out[names[0]] = kernels.pack_nibbles(kernels.quantize(weight, scale, None, block, value_type))
        out[names[1]] = scale
    return {key: tensor.contiguous() for key, tensor in out.items()}


def pack_int_codes(
    name: str, values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, scheme: QScheme, dtype: str
) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors of int codes already chosen (by min-max rounding in `encode`,
    or by a calibrated algorithm such as GPTQ): `values` [out, in] int8 in qmin..qmax, `scale`
    and `zero_point` (int8, or None) of the scale grid's numel; `dtype` the weight's float dtype.
    Modifies `values` in place."""
    import torch

    from qtool import kernels

    layout = encoded_layout(name, tuple(values.shape), dtype, scheme)
    args = _quant_args(scheme)
    if args.format != "pack-quantized":
        raise _usage(f"{name}: {scheme.label} is not stored as pack-quantized ints")
    grid = _scale_shape(args, (values.shape[0], values.shape[1]))
    names = [entry[0] for entry in layout]
    out: dict[str, torch.Tensor] = {}
    offset = 1 << (args.num_bits - 1)  # stored as q + 2^(b-1): in uint8, v + offset wraps to exactly that
    unsigned = values.view(torch.uint8).add_(offset)
    out[names[0]] = kernels.pack_int32(unsigned, args.num_bits, dim=-1, check=False)
    out[names[1]] = scale.reshape(grid)
    if zero_point is not None:
        if args.strategy in ("group", "channel"):
            zero_point = kernels.pack_int32(zero_point.reshape(grid).to(torch.int32) + offset, args.num_bits, dim=0)
        out[names[2]] = zero_point.reshape(layout[2][2])
    out[names[-1]] = torch.tensor(list(values.shape), dtype=torch.int64, device=values.device)
    return {key: tensor.contiguous() for key, tensor in out.items()}


def _mx_scale(weight: torch.Tensor, block: tuple[int, int], value_type: QType) -> torch.Tensor:
    """E8M0 exponents as the package stores them. It keeps the scale as 2^(u - 127) in the
    weight's dtype while quantizing; in float16 that underflows to 0 for u <= 102, which it
    then replaces by its eps for uint8 scales, 1.0, i.e. u = 127 (all-zero or tiny groups of
    float16 weights). Mirrored, so the bytes stay identical."""
    import torch

    from qtool import kernels

    scale, _ = kernels.choose_qparams(weight, block, value_type, True, "E8M0")
    if weight.dtype == torch.float16:
        scale = torch.where(scale <= 102, torch.full_like(scale, 127), scale)
    return scale


def config_for(schemes_by_module: dict[str, QScheme], ignore: list[str], dtype: str | None = None) -> dict[str, Any]:
    """The `quantization_config` that compressed-tensors' ModelCompressor writes for these
    modules: one config group per distinct layout, targeting the module names; top-level
    format = the groups' format, or "mixed-precision" when they differ.

    `dtype` (the model's dtype) is accepted for symmetry with the other writers:
    compressed-tensors records no scale dtype for float scales, which follow each weight."""
    from qtool.patterns import natural_key

    if not schemes_by_module:
        raise _usage("no quantized modules: a compressed-tensors config needs at least one")
    if dtype is not None and str(dtype).upper() not in (*WEIGHT_FLOATS, "BFLOAT16", "FLOAT16", "FLOAT32"):
        raise _usage(f"the model dtype must be a float dtype, got {dtype!r}")
    targets: dict[_QuantArgs, list[str]] = {}
    for module, scheme in schemes_by_module.items():
        module = module[: -len(".weight")] if module.endswith(".weight") else module
        targets.setdefault(_quant_args(scheme), []).append(module)
    groups = {}
    for index, (args, modules) in enumerate(targets.items()):
        groups[f"group_{index}"] = {
            "targets": sorted(modules, key=natural_key),
            "weights": args.weights_args(),
            "input_activations": args.input_args(),
            "output_activations": None,
            "format": args.format,
        }
    formats = {args.format for args in targets}
    return {
        "config_groups": groups,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


# -- the layout --------------------------------------------------------------------------------


class CompressedTensors(SafetensorsLayout):
    """compressed-tensors: pack-quantized ints, fp8, mxfp4/mxfp8, nvfp4 (what vLLM and
    transformers load), with `quantization_config` in config.json (and in the `__metadata__`
    of a single-file output)."""

    name = "compressed-tensors"
    description = "compressed-tensors safetensors (vLLM, transformers)"
    metadata_key = "quantization_config"

    encoded_layout = staticmethod(encoded_layout)
    quantization_config = staticmethod(config_for)
    encode_tensors = staticmethod(encode)

    def refusal(self, scheme: QScheme) -> str | None:
        return refusal_of(lambda: _quant_args(scheme))

    def check(self, weight: Weight, scheme: QScheme) -> None:
        _check_shape(weight.name, tuple(weight.shape), _quant_args(scheme))
        _module_of(weight.name)

    def whole_weight(self, encoded: dict[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
        import torch

        return {
            name: torch.tensor(list(shape), dtype=tensor.dtype) if name.endswith(".weight_shape") else tensor
            for name, tensor in encoded.items()
        }

    def row_chunk(self, weight: Weight, scheme: QScheme) -> int | None:
        shape = tuple(weight.shape)
        if len(shape) != 2 or scheme.granularity == "tensor" or scheme.global_scale:
            return None  # per-tensor and global scales need the whole weight at once
        rows, cols = shape
        step = math.lcm(scheme.block_for(shape)[0], 32)  # zero points pack 32/b rows per word, blocks span block rows
        chunk = max(step, (CHUNK_ELEMENTS // max(cols, 1)) // step * step)
        return chunk if chunk < rows else None

    def encoding(self, weight: Weight, scheme: QScheme) -> IntRows | None:
        """IntRows where qtool.native's fused kernel writes these exact tensors: pack-quantized
        int per channel or group, the scale in the weight's own dtype."""
        layout = row_group_int_layout(scheme, tuple(weight.shape), weight.dtype)
        return IntRows(*layout) if layout is not None else None
