"""Read PyTorch checkpoints (.pt, .pth, .bin) without torch and without running code (CONVENTIONS §9).

The archive, zip or legacy, and its pickle are `qtool.formats.torch_archive`'s; here the
unpickled object graph becomes a checkpoint. The pickle is interpreted with the allowlist of
`qtool.formats.torch_unpickle`: tensors become records (storage, offset, shape, stride, dtype),
nothing is imported or called; any other global is refused by name. torch is never imported
to list a checkpoint; torchao only when the pickle names torchao's types.

What the reader produces:

- Each tensor is a `StoredTensor`. Every size is checked first: the storage's record holds
  exactly its declared bytes, and the tensor's elements (offset, shape and strides) lie
  inside it. A contiguous little-endian tensor is a byte range of the file (`in_file`); a
  strided view, or any tensor of a big-endian archive, is gathered by `read_bytes` from its
  storage's bytes (numpy, no torch) and has no byte range (`in_file=False`, placed past the
  end of the file so a blind read fails loudly).
- A native quantized tensor (`qint8`, `quint8`, `qint32`, `quint4x2`, `quint2x4`) is its
  integer storage with `encoding` = `"torch.<qscheme>"`; its scale and zero point are in
  `TorchCheckpoint.quantization(name)`, and per-channel ones are stored tensors of their own,
  `<name>.q_per_channel_scales` and `<name>.q_per_channel_zero_points`.
- A torchao tensor subclass becomes its tensor attributes, `<name>.<attribute>`, plus a
  `Subclass` record of its type, logical shape, dtype and other attributes, for
  `qtool.conventions.torchao`.
- Containers are walked once per object (a memo reference to an object already seen is
  noted, not walked again): dict keys and tuple/list indexes join with ".", so a
  dynamic-quantized Linear's `fc._packed_params._packed_params` tuple gives
  `..._packed_params.0` (the qint8 weight) and `.1` (the bias). Non-tensor leaves go to
  `metadata`, as bounded text.
- A state dict nested under `state_dict`, `model_state_dict`, `model`, `module`, `net` or
  `params` (Lightning, DeepSpeed, training scripts) is found; tensors outside it (optimizer
  state) are left out and counted in `metadata["torch.skipped"]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from qtool.dtypes import DTYPES, StorageDType
from qtool.errors import CheckpointError
from qtool.formats.checkpoint import SMALL_TENSOR_LIMIT, Checkpoint, StoredTensor
from qtool.formats.pickle_machine import PDict, PSet
from qtool.formats.torch_archive import (
    MAX_ALIASES,
    PICKLE_LIMIT,
    TorchArchive,
    open_archive,
)
from qtool.formats.torch_unpickle import (
    ITEMSIZE,
    DType,
    Opaque,
    QSchemeName,
    QuantizedRecord,
    SubclassRecord,
    TensorRecord,
    quiet,
)
from qtool.message_text import excerpt

__all__ = [
    "SUFFIXES",
    "STATE_DICT_KEYS",
    "PICKLE_LIMIT",
    "Subclass",
    "Quantization",
    "TorchCheckpoint",
    "read_torch_files",
]

SUFFIXES = (".pt", ".pth", ".bin")
STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "params")
MAX_DEPTH = 64
_METADATA_TEXT_LIMIT = 200
_METADATA_ENTRIES = 10_000
_GATHER_LIMIT = 1 << 30  # a broadcast view's bytes, materialized, beyond what its storage holds
# native quantized dtype -> storage dtype of its integer representation
_QUANTIZED = {"qint8": "I8", "quint8": "U8", "qint32": "I32", "quint4x2": "U8", "quint2x4": "U8"}
_QTOOL_DTYPE: dict[str, StorageDType] = {d.torch_name: d for d in DTYPES.values() if d.torch_name}
_QTOOL_DTYPE["float4_e2m1fn_x2"] = DTYPES["U8"]
_ZERO_POINT_RANGE = {
    "qint8": (-128, 127),
    "quint8": (0, 255),
    "qint32": (-(2**31), 2**31 - 1),
    "quint4x2": (0, 15),
    "quint2x4": (0, 3),
}


@dataclass(frozen=True)
class Subclass:
    """A tensor subclass as its pickle describes it: what the pickle holds under `name` besides
    plain tensors. `attributes` is its non-tensor state with torch dtypes as their names
    ("int4"), enums as their member names, tuples as lists."""

    name: str
    type_name: str  # "torchao.quantization.Int8Tensor"
    shape: tuple[int, ...]
    dtype: str  # the logical torch dtype, "bfloat16"
    members: dict[str, str]  # inner attribute -> stored tensor name
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def short_name(self) -> str:
        return self.type_name.rpartition(".")[2]


@dataclass(frozen=True)
class Quantization:
    """A native quantized tensor's quantizer, as pickled: per tensor (scale, zero_point) or per
    channel (axis; the scales and zero points are stored tensors)."""

    dtype: str  # "qint8"
    qscheme: str  # "per_tensor_affine"
    scale: float | None = None
    zero_point: int | None = None
    axis: int | None = None


@dataclass(frozen=True)
class _Gather:
    """How to read a tensor that is not one byte range: its first element's byte in the file,
    its shape and strides in elements, and whether its bytes need swapping."""

    start: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    itemsize: int
    span: int  # bytes from `start` that its elements lie in
    swap: bool


class TorchCheckpoint(Checkpoint):
    """A checkpoint read from PyTorch pickles: byte ranges where the archive has them, and
    gathered reads for strided views."""

    def __init__(
        self,
        path: str,
        files: list[str],
        tensors: dict[str, StoredTensor],
        gathers: dict[str, _Gather],
        quantized: dict[str, Quantization],
        subclasses: dict[str, Subclass],
        metadata: dict[str, str],
        side_files: dict[str, Any],
    ) -> None:
        super().__init__(
            path=path, format="torch", files=files, tensors=tensors, metadata=metadata, side_files=side_files
        )
        self.gathers = gathers
        self.quantized = quantized
        self.subclasses = subclasses

    def quantization(self, tensor: StoredTensor | str) -> Quantization:
        name = tensor if isinstance(tensor, str) else tensor.name
        try:
            return self.quantized[name]
        except KeyError:
            raise CheckpointError(f"holds no quantized tensor {name!r}", path=self.path) from None

    def read_small(self, tensor: StoredTensor) -> bytes:
        if tensor.in_file:
            return super().read_small(tensor)
        if tensor.nbytes > SMALL_TENSOR_LIMIT:
            raise CheckpointError(
                f"tensor {tensor.name!r} is {tensor.nbytes} bytes, too large to read as metadata", path=tensor.file
            )
        return bytes(self.read_bytes(tensor))

    def read_bytes(
        self, tensor: StoredTensor, start: int = 0, size: int | None = None
    ) -> bytes | bytearray | memoryview:
        if tensor.in_file:
            return super().read_bytes(tensor, start, size)
        size = tensor.nbytes - start if size is None else size
        if start < 0 or size < 0 or start + size > tensor.nbytes:
            raise ValueError(
                f"bytes [{start}, {start + size}) are outside tensor {tensor.name!r} of {tensor.nbytes} bytes"
            )
        whole = self._gather(tensor)
        return whole if (start, size) == (0, tensor.nbytes) else whole[start : start + size]

    def _gather(self, tensor: StoredTensor) -> memoryview:
        import numpy as np

        gather = self.gathers[tensor.name]
        if tensor.nbytes > gather.span and tensor.nbytes > _GATHER_LIMIT:
            raise CheckpointError(
                f"tensor {tensor.name!r} is a broadcast view of {tensor.nbytes} bytes over {gather.span} stored; qtool does not expand it",
                path=tensor.file,
            )
        raw = Checkpoint.read_bytes(
            self,
            StoredTensor(
                tensor.name, DTYPES["U8"], (gather.span,), gather.start, gather.start + gather.span, tensor.file
            ),
        )
        flat = np.frombuffer(raw, dtype=np.uint8)
        if gather.span and tensor.nbytes:
            strides = tuple(s * gather.itemsize for s in gather.stride) + (1,)
            values = np.lib.stride_tricks.as_strided(
                flat, shape=(*gather.shape, gather.itemsize), strides=strides, writeable=False
            )
        else:
            values = flat[:0].reshape(*gather.shape, 0) if gather.shape else flat[:0]
        if gather.swap and gather.itemsize > 1:
            values = values[..., ::-1]
        return memoryview(np.ascontiguousarray(values).reshape(-1))

    def load(self, tensor: StoredTensor):
        if tensor.in_file:
            return super().load(tensor)
        import torch

        raw = (
            torch.frombuffer(bytearray(self.read_bytes(tensor)), dtype=torch.uint8)
            if tensor.nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        if tensor.dtype.torch_name is None:
            return raw
        return raw.view(tensor.dtype.torch_dtype()).reshape(tensor.shape)

    def release(self, tensor: StoredTensor) -> None:
        if tensor.in_file:
            super().release(tensor)

    def quantized_tensor(self, tensor: StoredTensor):
        """The torch quantized tensor a native quantized stored tensor holds, rebuilt from its
        bytes and quantizer (imports torch; for decoding)."""
        import torch

        info = self.quantization(tensor)
        shape = tuple(tensor.logical_shape or tensor.shape)
        qdtype = getattr(torch, info.dtype)
        low, high = _ZERO_POINT_RANGE[info.dtype]
        raw = bytes(self.read_bytes(tensor))
        try:
            with quiet():  # torch deprecates quantized tensors, loudly
                if info.scale is not None:
                    if not low <= info.zero_point <= high:
                        raise CheckpointError(
                            f"quantized tensor {tensor.name!r} has zero point {info.zero_point}, outside {info.dtype}'s [{low}, {high}]",
                            path=tensor.file,
                        )
                    made = torch._empty_affine_quantized(
                        shape, scale=info.scale, zero_point=info.zero_point, dtype=qdtype
                    )
                else:
                    scales = self.load(self.tensors[f"{tensor.name}.q_per_channel_scales"]).clone()
                    zeros = self.load(self.tensors[f"{tensor.name}.q_per_channel_zero_points"]).clone()
                    if (
                        not zeros.is_floating_point()
                        and zeros.numel()
                        and not (low <= int(zeros.min()) and int(zeros.max()) <= high)
                    ):
                        raise CheckpointError(
                            f"quantized tensor {tensor.name!r} has zero points outside {info.dtype}'s [{low}, {high}]",
                            path=tensor.file,
                        )
                    made = torch._empty_per_channel_affine_quantized(
                        shape, scales=scales, zero_points=zeros, axis=info.axis, dtype=qdtype
                    )
                storage = made.untyped_storage()
                if storage.nbytes() != len(raw):
                    raise CheckpointError(
                        f"quantized tensor {tensor.name!r} holds {len(raw)} bytes, {info.dtype} {list(shape)} needs {storage.nbytes()}",
                        path=tensor.file,
                    )
                if raw:
                    storage.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8).untyped_storage())
        except RuntimeError as exc:  # torch's checks of values that came from the file
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise CheckpointError(
                f"quantized tensor {tensor.name!r} is invalid: {excerpt(first)}", path=tensor.file
            ) from None
        return made


# -- reading --------------------------------------------------------------------------------------


def read_torch_files(display: str, files: list[str], side_files: dict[str, Any]) -> TorchCheckpoint:
    """Describe each file's tensors; nothing is loaded."""
    tensors: dict[str, StoredTensor] = {}
    gathers: dict[str, _Gather] = {}
    quantized: dict[str, Quantization] = {}
    subclasses: dict[str, Subclass] = {}
    metadata: dict[str, str] = {}
    for file in files:
        archive = open_archive(file)
        describer = _Describer(file, archive)
        root, where, skipped, beside = _find_state_dict(archive.root, describer.reach)
        if where:
            metadata.setdefault("torch.state_dict", where)
        if skipped:
            metadata.setdefault("torch.skipped", ", ".join(skipped))
        describer.walk(root)
        for key, value in beside:
            describer.note(key, value)
        for name, tensor in describer.tensors.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is stored in both {tensors[name].file} and {file}", path=file)
            tensors[name] = tensor
        gathers.update(describer.gathers)
        quantized.update(describer.quantized)
        subclasses.update(describer.subclasses)
        for key, value in describer.metadata.items():
            metadata.setdefault(key, value)
    return TorchCheckpoint(display, files, tensors, gathers, quantized, subclasses, metadata, side_files)


# -- finding the state dict -----------------------------------------------------------------------


def _key_text(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, (bool, float, type(None))) or (isinstance(key, int) and key.bit_length() < 200):
        return str(key)
    return _render(key)


def _entries(value: PDict) -> list[tuple[str, Any]]:
    """A pickled dict's entries by key text, as a dict would hold them: first position, last value."""
    found: dict[str, Any] = {}
    for key, item in value.items:
        found[_key_text(key)] = item
    return list(found.items())


_TENSORS = (TensorRecord, SubclassRecord)


class _Reach:
    """Whether an object holds a tensor anywhere below it: computed once per object, by id,
    without recursion (a memo-shared or cyclic structure is walked in linear time)."""

    def __init__(self) -> None:
        self.known: dict[int, bool] = {}
        self._keep: list[Any] = []  # ids stay valid while the answers are kept

    def __call__(self, value: Any) -> bool:
        if isinstance(value, _TENSORS):
            return True
        if not isinstance(value, (PDict, list, tuple)):
            return False
        if id(value) in self.known:
            return self.known[id(value)]
        stack: list[tuple[Any, bool]] = [(value, False)]
        while stack:
            node, done = stack.pop()
            key = id(node)
            if done:
                self.known[key] = any(isinstance(c, _TENSORS) or self.known.get(id(c), False) for c in _children(node))
                continue
            if key in self.known:
                continue
            self.known[key] = False  # while in progress: a cycle back to it holds nothing new
            self._keep.append(node)
            stack.append((node, True))
            for child in _children(node):
                if isinstance(child, (PDict, list, tuple)) and id(child) not in self.known:
                    stack.append((child, False))
        return self.known[id(value)]


def _children(node: Any) -> list[Any]:
    if isinstance(node, PDict):
        return [v for _, v in node.items]
    return list(node)


def _find_state_dict(loaded: Any, reach: _Reach) -> tuple[Any, str | None, list[str], list[tuple[str, Any]]]:
    """The state dict to describe, where it was found, the top-level keys left out, and the
    top-level values beside it (epoch, step) to report as metadata.

    A dict with a tensor (or a tuple of them) among its own values is the state dict. Else the
    first of `STATE_DICT_KEYS` that holds tensors is, and other tensor-holding keys (optimizer
    state) are left out. Else everything is described, keys joined with "."."""
    if not isinstance(loaded, PDict):
        return loaded, None, [], []
    entries = _entries(loaded)

    def direct(value: Any) -> bool:
        return isinstance(value, _TENSORS) or (
            isinstance(value, (list, tuple)) and any(isinstance(v, _TENSORS) for v in value)
        )

    if any(direct(v) for _, v in entries):
        return loaded, None, [], []
    by_key = dict(entries)
    for key in STATE_DICT_KEYS:
        value = by_key.get(key)
        if isinstance(value, PDict) and reach(value):
            skipped = [k for k, v in entries if k != key and reach(v)]
            beside = [(k, v) for k, v in entries if k != key and not reach(v)]
            return value, key, skipped, beside
    return loaded, None, [], []


# -- describing tensors ---------------------------------------------------------------------------


class _Describer:
    """Walks the interpreted pickle and builds stored tensors, subclass records and metadata."""

    def __init__(self, path: str, archive: TorchArchive) -> None:
        self.path = path
        self.archive = archive
        self.reach = _Reach()
        self.tensors: dict[str, StoredTensor] = {}
        self.gathers: dict[str, _Gather] = {}
        self.quantized: dict[str, Quantization] = {}
        self.subclasses: dict[str, Subclass] = {}
        self.metadata: dict[str, str] = {}
        self._seen: dict[int, str] = {}
        self._described: dict[int, tuple[Any, str]] = {}  # id(record) -> (record, its first name)
        self._aliases = 0

    def walk(self, root: Any) -> None:
        self._walk(root, "", 0)

    def _walk(self, value: Any, name: str, depth: int) -> None:
        if isinstance(value, _TENSORS):
            first = self._described.get(id(value))
            if first is None:
                self._described[id(value)] = (value, name or "tensor")  # the record is kept: its id stays its own
                self._tensor(name or "tensor", value)
            else:
                self._alias(name or "tensor", value, first[1])
            return
        if isinstance(value, (list, tuple)) and not self.reach(value):
            self._meta(name or "value", value)
            return
        if not isinstance(value, (PDict, list, tuple)):
            self._meta(name or "value", value)
            return
        first = self._seen.get(id(value))
        if first is not None:
            self._meta(name or "value", f"<the same object as {first or '(the top level)'}>")
            return
        self._seen[id(value)] = name
        if depth >= MAX_DEPTH:
            self._meta(name or "value", "<nested too deeply>")
            return
        if isinstance(value, PDict):
            for key, item in _entries(value):
                self._walk(item, f"{name}.{key}" if name else key, depth + 1)
        else:
            for index, item in enumerate(value):
                self._walk(item, f"{name}.{index}" if name else str(index), depth + 1)

    def _alias(self, name: str, record: Any, first: str) -> None:
        """Another name of a tensor record already described, at most MAX_ALIASES per pickle.
        A plain tensor's entries are copied under the new name, not checked again."""
        self._aliases += 1
        if self._aliases > MAX_ALIASES:
            raise CheckpointError(
                f"names already-listed tensors more than {MAX_ALIASES} times (one tensor under many names), more than qtool reads",
                path=self.path,
                hint="save each tensor once (tied weights under a few names are fine)",
            )
        if (
            type(record) is not TensorRecord or first not in self.tensors
        ):  # quantized, subclass, or skipped: described again
            self._tensor(name, record)
            return
        if name in self.tensors:
            raise CheckpointError(f"holds two tensors named {name!r}", path=self.path)
        self.tensors[name] = replace(self.tensors[first], name=name)
        if first in self.gathers:
            self.gathers[name] = self.gathers[first]

    def note(self, name: str, value: Any) -> None:
        """A value beside the state dict, as metadata."""
        self._meta(name, value)

    def _meta(self, name: str, value: Any) -> None:
        if len(self.metadata) >= _METADATA_ENTRIES and name not in self.metadata:
            self.metadata["torch.metadata_left_out"] = "more than 10000 non-tensor values"
            return
        self.metadata[name] = value if isinstance(value, str) and len(value) <= _METADATA_TEXT_LIMIT else _render(value)

    # -- tensors --
    def _tensor(self, name: str, record: Any) -> None:
        if isinstance(record, SubclassRecord):
            self._subclass(name, record)
        elif isinstance(record, QuantizedRecord):
            self._quantized(name, record)
        else:
            dtype = _QTOOL_DTYPE.get(record.dtype)
            if dtype is None:
                self._meta(name, f"<tensor of torch.{record.dtype}, which qtool has no dtype for>")
                return
            self._place(name, record, dtype, record.shape)

    def _quantized(self, name: str, record: QuantizedRecord) -> None:
        stored = DTYPES[_QUANTIZED[record.dtype]]
        encoding = f"torch.{record.qscheme}"
        if record.dtype in ("quint4x2", "quint2x4"):  # the whole storage, two or four values a byte
            whole = TensorRecord(record.storage, 0, (record.storage.nbytes,), (1,), "uint8")
            self._place(name, whole, stored, whole.shape, encoding, record.shape)
        else:
            self._place(name, record, stored, record.shape, encoding, record.shape)
        self.quantized[name] = Quantization(record.dtype, record.qscheme, record.scale, record.zero_point, record.axis)
        if record.scales is not None and record.zero_points is not None:
            self._tensor(f"{name}.q_per_channel_scales", record.scales)
            self._tensor(f"{name}.q_per_channel_zero_points", record.zero_points)

    def _subclass(self, name: str, record: SubclassRecord) -> None:
        members: dict[str, str] = {}
        attributes: dict[str, Any] = {}
        for attribute, value in record.state:
            if isinstance(value, TensorRecord):
                members[attribute] = f"{name}.{attribute}"
                self._tensor(members[attribute], value)
            elif not attribute.startswith("_") and len(attributes) < 64:
                attributes[attribute] = _plain(value, 0)
        self.subclasses[name] = Subclass(name, record.type_name, record.shape, record.dtype, members, attributes)

    def _place(
        self, name: str, record: TensorRecord, dtype: StorageDType, shape, encoding=None, logical_shape=None
    ) -> None:
        """The stored tensor, after checking that its elements lie inside its storage's record."""
        if name in self.tensors:
            raise CheckpointError(f"holds two tensors named {name!r}", path=self.path)
        storage = record.storage
        where = self.archive.records.get(storage.key)
        if where is None:
            raise CheckpointError(f"tensor {name!r} names storage {storage.key!r}, which has no data", path=self.path)
        record_start, record_bytes = where
        window_start = record_start + storage.element_offset * storage.itemsize
        window_bytes = storage.nbytes
        if storage.element_offset * storage.itemsize + window_bytes > record_bytes:
            raise CheckpointError(
                f"tensor {name!r} views bytes past the end of storage {storage.key!r}", path=self.path
            )
        itemsize = ITEMSIZE[record.dtype]
        numel = 1
        for dim in record.shape:
            numel *= dim
        extent = 0 if numel == 0 else 1 + sum((d - 1) * s for d, s in zip(record.shape, record.stride))
        first = record.offset * itemsize
        if numel and first + extent * itemsize > window_bytes:
            raise CheckpointError(
                f"tensor {name!r} ({record.dtype} {list(record.shape)}, offset {record.offset}, strides {list(record.stride)}) "
                f"needs {first + extent * itemsize} bytes of storage {storage.key!r}, which holds {window_bytes}",
                path=self.path,
                hint="the file is damaged; fetch or save it again",
            )
        nbytes = numel * itemsize
        if dtype.bits * _numel(shape) != nbytes * 8:
            raise CheckpointError(f"tensor {name!r}: {dtype.name} {list(shape)} is not {nbytes} bytes", path=self.path)
        begin = window_start + first
        if _contiguous(record.shape, record.stride) and (self.archive.little_endian or itemsize == 1):
            tensor = StoredTensor(
                name, dtype, tuple(shape), begin, begin + nbytes, self.path, encoding, logical_shape, True
            )
        else:
            past_end = self.archive.size  # no byte range: a reader that ignores `in_file` fails, loudly
            tensor = StoredTensor(
                name, dtype, tuple(shape), past_end, past_end + nbytes, self.path, encoding, logical_shape, False
            )
            span = extent * itemsize
            self.gathers[name] = _Gather(
                begin, record.shape, record.stride, itemsize, span, not self.archive.little_endian
            )
        self.tensors[name] = tensor


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for dim, step in zip(reversed(shape), reversed(stride)):
        if dim == 0:
            return True
        if dim != 1 and step != expected:
            return False
        expected *= dim
    return True


# -- values as text ---------------------------------------------------------------------------------


class _Full(Exception):
    pass


def _render(value: Any, limit: int = _METADATA_TEXT_LIMIT) -> str:
    """At most `limit` characters describing a value; the work stops there, whatever its size
    or nesting (a shared or cyclic structure is cut at depth 8)."""
    parts: list[str] = []
    used = [0]

    def put(text: str) -> None:
        parts.append(text)
        used[0] += len(text)
        if used[0] > limit:
            raise _Full

    def go(item: Any, depth: int, top: bool) -> None:
        if depth > 8:
            put("...")
        elif isinstance(item, str):
            put(item if top else repr(item[: limit + 1]))
        elif isinstance(item, bool) or item is None or isinstance(item, float):
            put(repr(item))
        elif isinstance(item, int):
            put(str(item) if item.bit_length() <= 640 else f"<int of {item.bit_length()} bits>")
        elif isinstance(item, bytes):
            put(repr(item[: limit + 1]))
        elif isinstance(item, (DType, QSchemeName)):
            put(str(item))
        elif isinstance(item, Opaque):
            put(item.enum_name or f"<{item.type_name.rpartition('.')[2]}>")
        elif isinstance(item, _TENSORS):
            put("<tensor>")
        elif isinstance(item, (list, tuple, PSet)):
            items = item.items if isinstance(item, PSet) else item
            put({list: "[", tuple: "("}.get(type(item), "{"))
            for index, child in enumerate(items):
                if index:
                    put(", ")
                go(child, depth + 1, False)
            put({list: "]", tuple: ",)" if len(items) == 1 else ")"}.get(type(item), "}"))
        elif isinstance(item, PDict):
            put("{")
            for index, (key, child) in enumerate(item.items):
                if index:
                    put(", ")
                go(key, depth + 1, False)
                put(": ")
                go(child, depth + 1, False)
            put("}")
        else:
            put(f"<{type(item).__name__}>")

    try:
        go(value, 0, True)
    except _Full:
        kind = {PDict: "dict", PSet: "set"}.get(type(value), type(value).__name__)
        return f"<{kind}, over {limit} characters>"
    return "".join(parts)


def _plain(value: Any, depth: int) -> Any:
    """A subclass attribute as plain data: torch dtypes by name, enums by member name."""
    if depth > 8:
        return None
    if isinstance(value, (DType, QSchemeName)):
        return value.name
    if isinstance(value, Opaque):
        if value.enum_name is not None:
            return value.enum_name
        return {"_type": value.type_name.rpartition(".")[2]}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value[:256]]
    if isinstance(value, PDict):
        return {_key_text(k): _plain(v, depth + 1) for k, v in value.items[:256]}
    if value is None or isinstance(value, (bool, float, str)):
        return value
    if isinstance(value, int):
        return value if value.bit_length() <= 64 else None
    return _render(value)
