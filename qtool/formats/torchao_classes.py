"""The torchao classes a PyTorch pickle may name, and what qtool rebuilds for each: a table, data.

A torchao checkpoint saved with `torch.save` names torchao's tensor subclasses and the enums and
small dataclasses their state holds (`KernelPreference`, `MappingType`, `PerRow`, ...), each as
`(module, qualified name)`, the way pickle spells a class. `qtool.formats.torch_unpickle` looks
each such name up here and nowhere else: it never imports a module a file names, so a hostile
name is refused without importing torch or torchao (which took 12+ s of `torch._dynamo` on a
loaded machine), and a torchao pickle reads where torchao is not installed. A name not in the
table is refused, as every other global outside the allowlist is.

    TENSOR   a tensor subclass, rebuilt through `_rebuild_wrapper_subclass` as a SubclassRecord
             (its type, dtype, shape and attribute dict); `qtool.conventions.torchao` decodes
             the ones it knows and leaves the others plain with a note
    enum     an `Enum`: its member's name, found from the pickled value (value -> name below)
    DATA     a dataclass or NamedTuple: an opaque record of its arguments and state

The rows are torchao 0.18's (`cls.__module__`, `cls.__qualname__`): its tensor subclasses, and
the value types their attributes hold; torchao's quantize_ configurations, QAT and PT2E types
are not tensor data and are refused. `tests/test_torchao.py` checks every row against the
installed torchao (each a class of its kind, each enum's members) and that every tensor subclass
`torchao.quantization` exports is here: a torchao that moves or adds a class fails that test.

It lives in `formats/`, not beside the torchao convention in `conventions/`, because the pickle
reader decides while unpickling, before any convention runs, and `formats/` sits below
`conventions/` (ARCHITECTURE.md's layers): the table is what a torch pickle may name, as
`torch_unpickle`'s own allowlist of torch globals is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from collections.abc import Mapping

__all__ = ["TorchaoClass", "TORCHAO_CLASSES", "TENSOR", "DATA", "ENUM"]

TENSOR = "tensor"
ENUM = "enum"
DATA = "data"

EnumValue = str | int  # an Enum member's value: torchao's are text or small integers


@dataclass(frozen=True)
class TorchaoClass:
    """What qtool rebuilds for one torchao class: its kind, and an enum's members by value."""

    kind: str  # TENSOR, ENUM or DATA
    members: Mapping[EnumValue, str] = field(default_factory=lambda: MappingProxyType({}))


def _enum(members: dict[EnumValue, str]) -> TorchaoClass:
    return TorchaoClass(ENUM, MappingProxyType(dict(members)))


_TENSOR = TorchaoClass(TENSOR)
_DATA = TorchaoClass(DATA)

# (module, qualified name) -> what to rebuild. torchao 0.18.
TORCHAO_CLASSES: Mapping[tuple[str, str], TorchaoClass] = MappingProxyType({
    # tensor subclasses
    ("torchao.float8.float8_training_tensor", "Float8TrainingTensor"): _TENSOR,
    ("torchao.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor"): _TENSOR,
    ("torchao.prototype.dtypes.uintx.uintx_utils", "UintxTensor"): _TENSOR,
    ("torchao.prototype.mx_formats.mx_tensor", "MXTensor"): _TENSOR,
    ("torchao.prototype.mx_formats.nvfp4_tensor", "NVFP4Tensor"): _TENSOR,
    ("torchao.prototype.quantization.codebook.codebook_quantized_tensor", "CodebookQuantizedTensor"): _TENSOR,
    ("torchao.prototype.quantization.codebook_coreml.codebook_quantized_tensor", "CodebookQuantizedTensor"): _TENSOR,
    ("torchao.prototype.quantization.codebook_groupwise.codebook_quantized_tensor", "CodebookQuantizedPackedTensor"): _TENSOR,
    ("torchao.prototype.quantization.float8_static_quant.prototype_float8_tensor", "PrototypeFloat8Tensor"): _TENSOR,
    ("torchao.prototype.quantization.gguf.gguf_quantized_tensor", "GGUFQuantizedTensor"): _TENSOR,
    ("torchao.prototype.quantization.int4", "Int4OpaqueTensor"): _TENSOR,
    ("torchao.prototype.quantization.int8_lut_tensor.int8_lut_tensor", "Int8LutTensor"): _TENSOR,
    ("torchao.prototype.quantization.uintx.uintx_bit_packed_tensor", "UIntxBitPackedTensor"): _TENSOR,
    ("torchao.quantization", "Float8Tensor"): _TENSOR,
    ("torchao.quantization", "Int4PlainInt32Tensor"): _TENSOR,
    ("torchao.quantization", "Int4PreshuffledTensor"): _TENSOR,
    ("torchao.quantization", "Int4Tensor"): _TENSOR,
    ("torchao.quantization", "Int4TilePackedTo4dTensor"): _TENSOR,
    ("torchao.quantization", "Int8Tensor"): _TENSOR,
    ("torchao.quantization", "IntxOpaqueTensor"): _TENSOR,
    ("torchao.quantization", "IntxUnpackedToInt8Tensor"): _TENSOR,
    ("torchao.quantization.qat.affine_fake_quantized_tensor", "_AffineFakeQuantizedTensor"): _TENSOR,
    ("torchao.quantization.quantize_.workflows.float8.float8_sparse_2x4_1d_data_1d_metadata_tensor", "Float8Sparse2x4_1DData1DMetadataTensor"): _TENSOR,
    ("torchao.quantization.quantize_.workflows.float8.float8_sparse_2x4_2d_data_2d_metadata_tensor", "Float8Sparse2x4_2DData2DMetadataTensor"): _TENSOR,
    ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "NF4Tensor"): _TENSOR,
    # enums their state holds
    ("torchao.float8.config", "Float8LinearRecipeName"): _enum({'tensorwise': 'TENSORWISE', 'rowwise': 'ROWWISE', 'rowwise_with_gw_hp': 'ROWWISE_WITH_GW_HP'}),
    ("torchao.float8.config", "ScalingGranularity"): _enum({'tensorwise': 'TENSORWISE', 'axiswise': 'AXISWISE'}),
    ("torchao.float8.config", "ScalingType"): _enum({'dynamic': 'DYNAMIC', 'disabled': 'DISABLED'}),
    ("torchao.float8.float8_training_tensor", "GemmInputRole"): _enum({'input': 'INPUT', 'weight': 'WEIGHT', 'grad_output': 'GRAD_OUTPUT'}),
    ("torchao.prototype.mx_formats.config", "MXFP8Dim0CastKernelChoice"): _enum({'triton': 'TRITON', 'torch': 'TORCH'}),
    ("torchao.prototype.mx_formats.config", "MXFP8Dim1CastKernelChoice"): _enum({'triton': 'TRITON', 'cuda': 'CUDA', 'torch': 'TORCH', 'cutedsl': 'CUTEDSL', 'flydsl': 'FLYDSL'}),
    ("torchao.prototype.mx_formats.config", "ScaleCalculationMode"): _enum({'floor': 'FLOOR', 'rceil': 'RCEIL', 'ceil': 'CEIL', 'even': 'EVEN'}),
    ("torchao.quantization.quant_primitives", "MappingType"): _enum({1: 'SYMMETRIC', 2: 'SYMMETRIC_NO_CLIPPING_ERR', 3: 'ASYMMETRIC'}),
    ("torchao.quantization.quant_primitives", "TorchAODType"): _enum({1: 'INT1', 2: 'INT2', 3: 'INT3', 4: 'INT4', 5: 'INT5', 6: 'INT6', 7: 'INT7'}),
    ("torchao.quantization.quant_primitives", "ZeroPointDomain"): _enum({1: 'INT', 2: 'FLOAT', 3: 'NONE'}),
    ("torchao.quantization.quantize_.common.kernel_preference", "KernelPreference"): _enum({'auto': 'AUTO', 'torch': 'TORCH', 'mslk': 'MSLK', 'emulated': 'EMULATED', 'triton': 'TRITON'}),
    ("torchao.quantization.quantize_.common.packing_format", "PackingFormat"): _enum({'plain': 'PLAIN', 'opaque': 'OPAQUE'}),
    ("torchao.quantization.quantize_.common.quantization_step", "QuantizationStep"): _enum({'prepare': 'PREPARE', 'convert': 'CONVERT', 'prepare_for_loading': 'PREPARE_FOR_LOADING', 'prepare_for_smoothquant_smoothing_factor': 'PREPARE_FOR_SMOOTHQUANT_SMOOTHING_FACTOR', 'prepare_for_smoothquant_activation_scales': 'PREPARE_FOR_SMOOTHQUANT_ACTIVATION_SCALES'}),
    ("torchao.quantization.quantize_.workflows.float8.float8_packing_format", "Float8PackingFormat"): _enum({'plain': 'PLAIN', 'sparse_2d_data_2d_metadata': 'SPARSE_2D_DATA_2D_METADATA', 'sparse_1d_data_1d_metadata': 'SPARSE_1D_DATA_1D_METADATA'}),
    ("torchao.quantization.quantize_.workflows.int4.int4_choose_qparams_algorithm", "Int4ChooseQParamsAlgorithm"): _enum({'tinygemm': 'TINYGEMM', 'hqq': 'HQQ'}),
    ("torchao.quantization.quantize_.workflows.int4.int4_packing_format", "Int4PackingFormat"): _enum({'plain': 'PLAIN', 'preshuffled': 'PRESHUFFLED', 'plain_int32': 'PLAIN_INT32', 'tile_packed_to_4d': 'TILE_PACKED_TO_4D'}),
    ("torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm", "IntxChooseQParamsAlgorithm"): _enum({'affine': 'AFFINE', 'hqq_scale_only': 'HQQ_SCALE_ONLY'}),
    ("torchao.quantization.quantize_.workflows.intx.intx_packing_format", "IntxPackingFormat"): _enum({'unpacked_to_int8': 'UNPACKED_TO_INT8', 'opaque_aten_kleidiai': 'OPAQUE_ATEN_KLEIDIAI', 'opaque_torchao_auto': 'OPAQUE_TORCHAO_AUTO', 'opaque_torchao_kleidiai': 'OPAQUE_TORCHAO_KLEIDIAI', 'opaque_torchao_lowbit': 'OPAQUE_TORCHAO_LOWBIT'}),
    ("torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor", "IntxUnpackedToInt8TensorActivationQuantization"): _enum({'int8_asym_per_token': 'INT8_ASYM_PER_TOKEN'}),
    ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "CompareOp"): _enum({1: 'EQ', 2: 'LT'}),
    # dataclasses and NamedTuples their state holds
    ("torchao.float8.float8_training_tensor", "LinearMMConfig"): _DATA,
    ("torchao.float8.float8_training_tensor", "ScaledMMConfig"): _DATA,
    ("torchao.float8.inference", "Float8MMConfig"): _DATA,
    ("torchao.prototype.mx_formats.mx_tensor", "QuantizeTensorToMXKwargs"): _DATA,
    ("torchao.prototype.mx_formats.nvfp4_tensor", "QuantizeTensorToNVFP4Kwargs"): _DATA,
    ("torchao.quantization.granularity", "Granularity"): _DATA,
    ("torchao.quantization.granularity", "PerAxis"): _DATA,
    ("torchao.quantization.granularity", "PerBlock"): _DATA,
    ("torchao.quantization.granularity", "PerGroup"): _DATA,
    ("torchao.quantization.granularity", "PerRow"): _DATA,
    ("torchao.quantization.granularity", "PerTensor"): _DATA,
    ("torchao.quantization.granularity", "PerToken"): _DATA,
    ("torchao.quantization.quantize_.workflows.float8.float8_tensor", "QuantizeTensorToFloat8Kwargs"): _DATA,
    ("torchao.quantization.quantize_.workflows.int8.int8_tensor", "QuantizeTensorToInt8Kwargs"): _DATA,
    ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "SubclassTensorArgs"): _DATA,
})  # fmt: skip
