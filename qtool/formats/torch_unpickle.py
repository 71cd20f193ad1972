"""What a PyTorch checkpoint's pickle means, without torch: a strict allowlist of globals, each
turned into a plain record (CONVENTIONS §9).

`qtool.formats.pickle_machine` runs the opcodes; `TorchHooks` decides what each global is:

    torch._utils._rebuild_tensor / _v2 / _v3     -> TensorRecord (storage, offset, shape, stride, dtype)
    torch._utils._rebuild_parameter(_with_state) -> the TensorRecord it wraps
    torch._utils._rebuild_qtensor                -> QuantizedRecord (+ scale, zero point, axis)
    torch._tensor._rebuild_from_type_v2 with
      torch._utils._rebuild_wrapper_subclass     -> SubclassRecord (a torchao tensor's type,
                                                    dtype, shape and attribute dict)
    torch.<Name>Storage, torch.cuda.<Name>Storage (legacy files saved from a GPU),
    torch.storage.UntypedStorage                 -> the storage type of a persistent id
    torch.float32 ..., torch.qint8 ..., torch.per_tensor_affine ...  -> DType / QScheme names
    collections.OrderedDict -> PDict; torch.Size -> tuple; torch.device, _get_layout -> text
    _codecs.encode (protocol 2's bytes), builtins.set / frozenset / bytearray

    torchao's tensor subclasses, enums and dataclasses, as `qtool.formats.torchao_classes`
    lists them                                   -> SubclassRecord / Opaque (an enum by member name)

Anything else is refused by its name (`Refused`), before anything is built. Every decision is
made from the name and this module's tables: no module a pickle names is ever imported (so
refusing a hostile torchao name imports neither torch nor torchao, and a torchao pickle reads
without torchao installed), and nothing a pickle names is ever called: the records are data.

Every value from the pickle is checked for its type and range where a record is built
(`PickleError` on a wrong one); sizes against the stored records are checked later, by the
reader that knows them (`qtool.formats.torch_pickle`).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterator

from qtool.formats.pickle_machine import PDict, PickleError, PSet
from qtool.formats.torchao_classes import ENUM, TENSOR, TORCHAO_CLASSES

__all__ = [
    "TorchHooks",
    "Refused",
    "Storage",
    "TensorRecord",
    "QuantizedRecord",
    "SubclassRecord",
    "DType",
    "QSchemeName",
    "Opaque",
    "ITEMSIZE",
    "MAX_DIMS",
    "quiet",
]

MAX_DIMS = 64

# torch dtype name -> bytes per element
ITEMSIZE = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    **{f"{sign}int{bits}": 1 for sign in ("", "u") for bits in range(1, 8)},  # torch.int4 ...: names, one a byte
    "bits8": 1, "bits16": 2,
}  # fmt: skip
_DTYPE_ALIASES = {
    "float": "float32", "double": "float64", "half": "float16", "short": "int16", "int": "int32",
    "long": "int64", "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32",
}  # fmt: skip
_STORAGES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "QInt8Storage": "qint8", "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32", "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}  # fmt: skip
_QSCHEMES = (
    "per_tensor_affine",
    "per_channel_affine",
    "per_channel_affine_float_qparams",
    "per_tensor_symmetric",
    "per_channel_symmetric",
)
_LAYOUTS = ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.jagged")


class Refused(Exception):
    """The pickle names a global outside the allowlist."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(name)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """torch and torchao warn at import time (deprecations, missing CUDA kernels); qtool's
    stderr carries only its own messages."""
    import logging  # only when torch or torchao is imported: 15 ms that listing doesn't pay

    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# -- records -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DType:
    name: str  # canonical torch name, "float32"

    def __str__(self) -> str:
        return f"torch.{self.name}"


@dataclass(frozen=True)
class QSchemeName:
    name: str

    def __str__(self) -> str:
        return f"torch.{self.name}"


@dataclass(eq=False)
class Storage:
    """One storage of the archive: `numel` elements of `dtype` (bytes for an untyped one). A
    legacy view storage is a window `[element_offset, element_offset + numel)` of its root."""

    key: str
    dtype: str
    numel: int
    element_offset: int = 0  # legacy storage views
    root_numel: int | None = None

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(eq=False)
class TensorRecord:
    storage: Storage
    offset: int  # in elements of `dtype`
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(eq=False)
class QuantizedRecord(TensorRecord):
    qscheme: str = "per_tensor_affine"
    scale: float | None = None  # per tensor
    zero_point: int | None = None
    scales: TensorRecord | None = None  # per channel
    zero_points: TensorRecord | None = None
    axis: int | None = None


@dataclass(eq=False)
class SubclassRecord:
    type_name: str  # "torchao.quantization.Int8Tensor"
    dtype: str
    shape: tuple[int, ...]
    state: list[tuple[str, Any]] = field(default_factory=list)


@dataclass(eq=False)
class Opaque:
    """An instance of an allowed torchao enum or dataclass: its type and what built it."""

    type_name: str
    args: tuple
    state: Any = None
    enum_name: str | None = None


# -- globals ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Global:
    kind: str
    name: str  # qualified: "torch._utils._rebuild_tensor_v2"
    value: Any = None  # the storage dtype, the torchao class's row (a TorchaoClass)


_REBUILDS = {
    ("torch._utils", "_rebuild_tensor"): "tensor_v1",
    ("torch._utils", "_rebuild_tensor_v2"): "tensor_v2",
    ("torch._utils", "_rebuild_tensor_v3"): "tensor_v3",
    ("torch._utils", "_rebuild_parameter"): "parameter",
    ("torch._utils", "_rebuild_parameter_with_state"): "parameter_with_state",
    ("torch._utils", "_rebuild_qtensor"): "qtensor",
    ("torch._utils", "_rebuild_wrapper_subclass"): "wrapper_subclass",
    ("torch._tensor", "_rebuild_from_type_v2"): "from_type_v2",
    ("torch._tensor", "_rebuild_from_type"): "from_type",
    ("collections", "OrderedDict"): "ordered_dict",
    ("torch", "Size"): "size",
    ("torch", "device"): "device",
    ("torch.serialization", "_get_layout"): "layout",
    ("_codecs", "encode"): "codecs_encode",
    ("builtins", "set"): "set",
    ("builtins", "frozenset"): "frozenset",
    ("builtins", "bytearray"): "bytearray",
    ("__builtin__", "set"): "set",
    ("__builtin__", "frozenset"): "frozenset",
    ("__builtin__", "bytearray"): "bytearray",
    ("torch", "Tensor"): "tensor_type",
    ("torch._tensor", "Tensor"): "tensor_type",
    ("torch.nn.parameter", "Parameter"): "tensor_type",
    ("torch.nn", "Parameter"): "tensor_type",
}


class TorchHooks:
    """The pickle machine's hooks for a PyTorch checkpoint. `storage_for(key, dtype, numel)`
    is the reader's: it gives the Storage for a persistent id (one object per key)."""

    def __init__(self, storage_for: Callable[[str, str, int, Any], Storage]) -> None:
        self.storage_for = storage_for

    # -- GLOBAL --
    def find_class(self, module: str, name: str) -> Any:
        kind = _REBUILDS.get((module, name))
        qualified = f"{module}.{name}"
        if kind is not None:
            return _Global(kind, qualified)
        if module == "torch.cuda" and name in _STORAGES:  # legacy files saved from a GPU: the same bytes
            return _Global("storage_type", qualified, _STORAGES[name])
        if module in ("torch", "torch.storage"):
            if name in _STORAGES and module == "torch":
                return _Global("storage_type", qualified, _STORAGES[name])
            if name in ("UntypedStorage", "ByteStorage") or (module == "torch" and name == "UntypedStorage"):
                return _Global("storage_type", qualified, "uint8")
            if module == "torch":
                canonical = _DTYPE_ALIASES.get(name, name)
                if canonical in ITEMSIZE:
                    return DType(canonical)
                if name in _QSCHEMES:
                    return QSchemeName(name)
        torchao = TORCHAO_CLASSES.get((module, name))  # a table lookup: nothing is imported
        if torchao is not None:
            return _Global("torchao_tensor" if torchao.kind == TENSOR else "torchao_data", qualified, torchao)
        raise Refused(qualified)

    # -- BINPERSID --
    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) not in (5, 6) or pid[0] != "storage":
            raise PickleError(f"a persistent id that is not a storage ({_short(pid)})")
        storage_type, key, _location, numel = pid[1], pid[2], pid[3], pid[4]
        if not isinstance(storage_type, _Global) or storage_type.kind != "storage_type":
            raise PickleError(f"a storage of type {_short(storage_type)}")
        if not isinstance(key, str) or not key or len(key) > 256:
            raise PickleError("a storage key that is not a short string")
        if not _is_int(numel) or numel < 0:
            raise PickleError(f"storage {key!r} has a bad element count {_short(numel)}")
        view = pid[5] if len(pid) == 6 else None
        return self.storage_for(key, storage_type.value, numel, view)

    # -- REDUCE / NEWOBJ / INST / OBJ --
    def call(self, func: Any, args: tuple) -> Any:
        if not isinstance(func, _Global):
            raise PickleError(f"the pickle calls a {type(func).__name__}, not an allowed global")
        kind = func.kind
        if kind in _TENSOR_KINDS:
            return _rebuild(kind, args)
        if kind == "from_type_v2" or kind == "from_type":
            return _from_type(args)
        if kind == "wrapper_subclass":
            return _wrapper(args)
        if kind == "ordered_dict":
            if args:
                raise PickleError("OrderedDict called with arguments")
            return PDict()
        if kind == "size":
            if len(args) != 1 or not isinstance(args[0], (tuple, list)) or not all(_is_int(v) for v in args[0]):
                raise PickleError("torch.Size of something that is not a list of integers")
            return tuple(args[0])
        if kind == "device" or kind == "layout":
            if not args or not all(isinstance(a, (str, int)) for a in args):
                raise PickleError(f"{func.name} of something that is not text")
            return str(args[0])[:64]
        if kind == "codecs_encode":
            if len(args) != 2 or not isinstance(args[0], str) or args[1] not in ("latin1", "latin-1"):
                raise PickleError("_codecs.encode other than latin-1 text")
            try:
                return args[0].encode("latin-1")
            except UnicodeEncodeError:
                raise PickleError("_codecs.encode of text that is not latin-1") from None
        if kind in ("set", "frozenset"):
            made = PSet(frozen=kind == "frozenset")
            if args:
                if len(args) != 1 or not isinstance(args[0], (list, tuple)):
                    raise PickleError(f"{kind} of something that is not a list")
                made.items = list(args[0])
            return made
        if kind == "bytearray":
            if args and not isinstance(args[0], bytes):
                raise PickleError("bytearray of something that is not bytes")
            return args[0] if args else b""
        if kind == "torchao_data":
            record = Opaque(func.name, args)
            if func.value.kind == ENUM and len(args) == 1 and isinstance(args[0], (str, int, float, bool)):
                member = func.value.members.get(args[0])  # as Enum(value) finds it: 1 == 1.0 == True
                if member is None:
                    raise PickleError(f"{func.name} has no member {_short(args[0])}")
                record.enum_name = member
            return record
        raise PickleError(f"the pickle calls {func.name} in a way qtool does not read")

    # -- BUILD --
    def build(self, obj: Any, state: Any) -> Any:
        if isinstance(obj, PDict):
            obj.state = state  # an OrderedDict's _metadata; not tensors
            return obj
        if isinstance(obj, Opaque):
            obj.state = state
            return obj
        if isinstance(obj, (TensorRecord, SubclassRecord)):
            return obj  # _rebuild_parameter_with_state's attributes, a tensor's __dict__
        raise PickleError(f"BUILD on a {type(obj).__name__}")


# -- rebuilds -------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, (int, float, str, bytes, type(None), bool)) else type(value).__name__
    return text[:60]


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS or not all(_is_int(v) and v >= 0 for v in value):
        raise PickleError(f"a tensor {what} that is not up to {MAX_DIMS} non-negative integers ({_short(value)})")
    return tuple(value)


_TENSOR_KINDS = ("tensor_v1", "tensor_v2", "tensor_v3", "parameter", "parameter_with_state", "qtensor")


def _rebuild(kind: str, args: tuple) -> TensorRecord | SubclassRecord:
    if kind == "qtensor":
        return _qtensor(args)
    if kind in ("parameter", "parameter_with_state"):
        if len(args) < 1 or not isinstance(args[0], (TensorRecord, SubclassRecord)):
            raise PickleError("_rebuild_parameter of something that is not a tensor")
        return args[0]
    return _tensor(kind, args)


def _tensor(kind: str, args: tuple, quantized: bool = False) -> TensorRecord:
    need = 7 if kind == "tensor_v3" else 4
    if len(args) < need:
        raise PickleError(f"_rebuild_{kind} with {len(args)} arguments")
    storage, offset, shape, stride = args[:4]
    if not isinstance(storage, Storage):
        raise PickleError(f"a tensor whose storage is a {type(storage).__name__}")
    if not _is_int(offset) or offset < 0:
        raise PickleError(f"a tensor with storage offset {_short(offset)}")
    shape, stride = _ints(shape, "shape"), _ints(stride, "stride")
    if len(shape) != len(stride):
        raise PickleError(f"a tensor with {len(shape)} dims and {len(stride)} strides")
    dtype = storage.dtype
    if kind == "tensor_v3":
        if not isinstance(args[6], DType):
            raise PickleError("_rebuild_tensor_v3 without a dtype")
        dtype = args[6].name
    if dtype.startswith(("qint", "quint")) != quantized:
        raise PickleError(f"a {'quantized' if quantized else 'plain'} tensor on a {dtype} storage")
    return TensorRecord(storage, offset, shape, stride, dtype)


def _qtensor(args: tuple) -> QuantizedRecord:
    if len(args) < 5:
        raise PickleError("_rebuild_qtensor with too few arguments")
    base = _tensor("tensor_v1", args[:4], quantized=True)
    params = args[4]
    if not isinstance(params, tuple) or not params or not isinstance(params[0], QSchemeName):
        raise PickleError("_rebuild_qtensor without a qscheme")
    record = QuantizedRecord(base.storage, base.offset, base.shape, base.stride, base.dtype, qscheme=params[0].name)
    if record.qscheme in ("per_tensor_affine", "per_tensor_symmetric"):
        if (
            len(params) != 3
            or not isinstance(params[1], (int, float))
            or isinstance(params[1], bool)
            or not _is_int(params[2])
        ):
            raise PickleError("a per-tensor quantized tensor without a numeric scale and integer zero point")
        record.scale, record.zero_point = float(params[1]), params[2]
        if abs(record.zero_point) >= 1 << 63:
            raise PickleError("a zero point out of int64 range")
    elif record.qscheme in ("per_channel_affine", "per_channel_affine_float_qparams", "per_channel_symmetric"):
        if (
            len(params) != 4
            or not isinstance(params[1], TensorRecord)
            or not isinstance(params[2], TensorRecord)
            or not _is_int(params[3])
        ):
            raise PickleError("a per-channel quantized tensor without scale and zero-point tensors and an axis")
        record.scales, record.zero_points, record.axis = params[1], params[2], params[3]
        if record.qscheme == "per_channel_affine" and record.zero_points.dtype.startswith(("float", "bfloat")):
            record.qscheme = "per_channel_affine_float_qparams"  # as torch's rebuild does: float zero points choose it
        if not 0 <= record.axis < max(len(record.shape), 1):
            raise PickleError(f"a per-channel quantized tensor with axis {record.axis} of {len(record.shape)} dims")
        channels = record.shape[record.axis] if record.shape else 1
        for what, member in (("scales", record.scales), ("zero points", record.zero_points)):
            if member.numel != channels:
                raise PickleError(f"a per-channel quantized tensor with {member.numel} {what} for {channels} channels")
    return record


def _from_type(args: tuple) -> Any:
    if len(args) < 3:
        raise PickleError("_rebuild_from_type_v2 with too few arguments")
    func, new_type, inner = args[0], args[1], args[2]
    state = args[3] if len(args) > 3 else None
    if not isinstance(func, _Global) or not isinstance(new_type, _Global) or not isinstance(inner, tuple):
        raise PickleError("_rebuild_from_type_v2 of something that is not a rebuild")
    if func.kind == "wrapper_subclass" and new_type.kind == "torchao_tensor":
        record = _wrapper(inner)
        if record.type_name != new_type.name:
            raise PickleError(f"a {record.type_name} rebuilt as a {new_type.name}")
        if state is not None:
            if not isinstance(state, PDict):
                raise PickleError(f"a {new_type.name} whose state is a {type(state).__name__}")
            record.state = [(k, v) for k, v in state.items if isinstance(k, str)]
        return record
    if new_type.kind == "tensor_type" and func.kind in _TENSOR_KINDS:
        return _rebuild(func.kind, inner)
    raise PickleError(f"_rebuild_from_type_v2 of {func.name} as {new_type.name}, which qtool does not read")


def _wrapper(args: tuple) -> SubclassRecord:
    if len(args) < 3:
        raise PickleError("_rebuild_wrapper_subclass with too few arguments")
    cls, dtype, size = args[0], args[1], args[2]
    if not isinstance(cls, _Global) or cls.kind != "torchao_tensor":
        raise PickleError("_rebuild_wrapper_subclass of something that is not an allowed tensor subclass")
    if not isinstance(dtype, DType):
        raise PickleError(f"a {cls.name} without a dtype")
    return SubclassRecord(cls.name, dtype.name, _ints(size, "shape"))
