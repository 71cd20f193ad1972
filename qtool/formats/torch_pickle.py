"""Read PyTorch pickles (.pt, .pth, .bin) without ever running code from them (CONVENTIONS §9).

The one way in is `torch.load(path, weights_only=True, mmap=True, map_location="cpu")`:

- `weights_only=True` is PyTorch's restricted unpickler. It builds tensors, containers and a
  short allowlist of types; a pickle that names anything else (`os.system`, a model class) is
  refused before it can run. qtool turns that refusal into a `CheckpointError` naming the file.
- `mmap=True` maps the zip archive that `torch.save` writes (since 1.6): loading copies no
  tensor data. Legacy (pre-zip) pickles cannot be mapped; they are refused unread.
- torchao tensor subclasses (Int8Tensor, ...) are allowed only when torchao is installed, and
  then only torchao's tensor, enum and dataclass types, through `torch.serialization.safe_globals`.

What the reader produces:

- Each plain tensor leaf is a `StoredTensor` whose `begin`/`end` are its bytes inside the
  archive: `torch.save` stores every storage as an uncompressed zip record, and with `mmap=True`
  each storage is a window of one mapping of the file, so a tensor's data pointer minus the
  mapping's base is its record offset. A non-contiguous view, or a file where that mapping
  can't be established, has no byte range: `in_file=False`, and `TorchCheckpoint.read_bytes`
  serves its bytes from the loaded tensor.
- A native quantized tensor (`qint8`, `quint8`, `qint32`, `quint4x2`, `quint2x4`) is its
  integer storage (`int_repr()`'s bytes) with `encoding` = `"torch.<qscheme>"`; per-channel
  scales and zero points are stored tensors of their own, `<name>.q_per_channel_scales` and
  `<name>.q_per_channel_zero_points`. `qscheme()` is called only where `is_quantized` holds:
  on a float tensor it raises (the twin of burn's `scheme()` panic).
- A tensor subclass that flattens (`__tensor_flatten__`, as torchao's do) becomes its inner
  tensors, `<name>.<attribute>`, plus a `Subclass` record of its type, logical shape and dtype
  and its flatten context, for `qtool.conventions.torchao` to read.
- Containers are walked: dict keys and tuple/list indexes join with ".", so a dynamic-quantized
  Linear's `fc._packed_params._packed_params` tuple gives `..._packed_params.0` (the qint8
  weight) and `.1` (the bias). Non-tensor leaves (`torch.qint8`, epochs, names) go to
  `metadata`.
- A state dict nested under `state_dict`, `model_state_dict`, `model`, `module`, `net` or
  `params` (Lightning, DeepSpeed, training scripts) is found; tensors outside it (optimizer
  state) are left out and counted in `metadata["torch.skipped"]`.

Inspecting a pickle therefore loads it, but only as a memory map; no tensor data is copied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import pickletools
import re
import struct
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import Any, Iterator

from qtool.dtypes import DTYPES, StorageDType, from_torch
from qtool.errors import CheckpointError
from qtool.formats.checkpoint import SMALL_TENSOR_LIMIT, Checkpoint, StoredTensor

__all__ = ["SUFFIXES", "STATE_DICT_KEYS", "Subclass", "TorchCheckpoint", "read_torch_files"]

SUFFIXES = (".pt", ".pth", ".bin")
STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "params")
_HINT = "qtool reads zip-format PyTorch checkpoints as torch.save writes them, with torch.load(weights_only=True)"
_METADATA_TEXT_LIMIT = 200
# native quantized dtype -> (storage dtype of its integer representation, qtool value type)
_QUANTIZED = {
    "qint8": ("I8", "int8"),
    "quint8": ("U8", "uint8"),
    "qint32": ("I32", "int32"),
    "quint4x2": ("U8", "uint4"),  # two values a byte; the bytes are (nbytes,) U8
    "quint2x4": ("U8", "uint2"),
}


@dataclass(frozen=True)
class Subclass:
    """A tensor subclass as its `__tensor_flatten__` describes it: what the pickle holds under
    `name` besides plain tensors. `attributes` is the flatten context with torch dtypes as
    their names ("int4"), enums as their member names, tuples as lists."""

    name: str
    type_name: str  # "torchao.quantization.Int8Tensor"
    shape: tuple[int, ...]
    dtype: str  # the logical torch dtype, "bfloat16"
    members: dict[str, str]  # inner attribute -> stored tensor name
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def short_name(self) -> str:
        return self.type_name.rpartition(".")[2]


class TorchCheckpoint(Checkpoint):
    """A checkpoint read from pickles: stored tensors with byte ranges where the archive has
    them, and the loaded (memory-mapped) objects for everything a byte range can't describe."""

    def __init__(
        self,
        path: str,
        files: list[str],
        tensors: dict[str, StoredTensor],
        objects: dict[str, Any],
        subclasses: dict[str, Subclass],
        metadata: dict[str, str],
        side_files: dict[str, Any],
    ) -> None:
        super().__init__(path=path, format="torch", files=files, tensors=tensors, metadata=metadata, side_files=side_files)
        self.objects = objects
        self.subclasses = subclasses

    def original(self, tensor: StoredTensor | str):
        """The loaded torch object behind a stored tensor: a quantized tensor keeps its
        quantizer (scales, zero points, axis) here; a subclass is looked up by its own name."""
        name = tensor if isinstance(tensor, str) else tensor.name
        try:
            return self.objects[name]
        except KeyError:
            raise CheckpointError(f"holds no tensor {name!r}", path=self.path) from None

    def _live(self, tensor: StoredTensor):
        """The stored tensor's data as a contiguous torch tensor of its storage dtype."""
        import torch

        value = self.original(tensor)
        if value.is_quantized:
            value = value.int_repr() if value.dtype in (torch.qint8, torch.quint8, torch.qint32) else _packed_bytes(value)
        value = value.contiguous()
        if tensor.dtype.torch_name is None or tuple(value.shape) != tensor.shape:
            return value.reshape(-1).view(torch.uint8)
        return value

    def load(self, tensor: StoredTensor):
        if tensor.in_file:
            return super().load(tensor)
        return self._live(tensor)

    def read_small(self, tensor: StoredTensor) -> bytes:
        if tensor.in_file:
            return super().read_small(tensor)
        if tensor.nbytes > SMALL_TENSOR_LIMIT:
            raise CheckpointError(f"tensor {tensor.name!r} is {tensor.nbytes} bytes, too large to read as metadata", path=self.path)
        return self.read_bytes(tensor)

    def read_bytes(self, tensor: StoredTensor, start: int = 0, size: int | None = None) -> bytes | bytearray:
        if tensor.in_file:
            return super().read_bytes(tensor, start, size)
        import torch

        raw = self._live(tensor).reshape(-1).view(torch.uint8)
        stop = tensor.nbytes if size is None else start + size
        return bytearray(raw[start:stop].numpy().tobytes())

    def release(self, tensor: StoredTensor) -> None:
        if tensor.in_file:
            super().release(tensor)

    def close(self) -> None:
        super().close()
        self.objects = {}


def _packed_bytes(value):
    """The raw storage bytes of a sub-byte quantized tensor (quint4x2, quint2x4)."""
    import torch

    storage = value.untyped_storage()
    return torch.frombuffer(bytearray(bytes(storage)), dtype=torch.uint8)


# -- reading ---------------------------------------------------------------------------------------


def read_torch_files(display: str, files: list[str], side_files: dict[str, Any]) -> TorchCheckpoint:
    """Load each pickle (memory-mapped) and describe its tensors."""
    tensors: dict[str, StoredTensor] = {}
    objects: dict[str, Any] = {}
    subclasses: dict[str, Subclass] = {}
    metadata: dict[str, str] = {}
    for file in files:
        loaded = _load(file)
        reader = _Describer(file)
        root, where, skipped = _find_state_dict(loaded)
        if where:
            metadata.setdefault("torch.state_dict", where)
        if skipped:
            metadata.setdefault("torch.skipped", ", ".join(skipped))
        reader.walk(root, "")
        for name, tensor in reader.tensors.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is stored in both {tensors[name].file} and {file}", path=file)
            tensors[name] = tensor
        objects.update(reader.objects)
        subclasses.update(reader.subclasses)
        for key, value in reader.metadata.items():
            metadata.setdefault(key, value)
    return TorchCheckpoint(display, files, tensors, objects, subclasses, metadata, side_files)


def _load(path: str):
    """torch.load, and nothing else: weights_only, memory-mapped, on the CPU."""
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=path) from None
    if size == 0:
        raise CheckpointError("file is empty (0 bytes)", path=path, hint="the download or save did not finish; fetch or save it again")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            "is not a zip-format PyTorch checkpoint (a legacy pickle, or not a checkpoint at all); it was not unpickled",
            path=path,
            hint="re-save it with a current torch.save (PyTorch >= 1.6 writes the zip format), from a source you trust",
        )
    needs = _torchao_references(path)
    allowed = _torchao_allowlist(path, needs) if needs else []
    import torch

    allowing = torch.serialization.safe_globals(allowed) if allowed else contextlib.nullcontext()
    try:
        with _quiet(), allowing:
            return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as exc:  # the unpickler raises UnpicklingError, RuntimeError, KeyError, ...
        raise _load_error(path, exc) from None


def _load_error(path: str, exc: Exception) -> CheckpointError:
    text = str(exc)
    refused = re.search(r"GLOBAL ([\w.]+)", text)
    if refused:
        return CheckpointError(
            f"refused: the pickle calls {refused.group(1)}, which is not tensor data; qtool never runs code from a checkpoint",
            path=path,
            hint="if you trust the file, load it yourself and re-save only its tensors: torch.save(model.state_dict(), ...)",
        )
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return CheckpointError(f"cannot load: {first[:300]}", path=path, hint=_HINT)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch and torchao warn at load and import time (deprecations, missing CUDA kernels);
    qtool's stderr carries only its own messages."""
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


def _torchao_references(path: str) -> list[str]:
    """The torchao globals the archive's pickle names, found by reading its opcodes: parsing,
    never unpickling. `torch.save` writes protocol 2 (GLOBAL "module name"); protocol 4's
    STACK_GLOBAL takes the two strings pushed before it."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickle_name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if pickle_name is None:
                return []
            data = archive.read(pickle_name)
    except (zipfile.BadZipFile, OSError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read the archive: {exc}", path=path, hint=_HINT) from None
    found: list[str] = []
    strings: list[str] = []
    try:
        for opcode, argument, _ in pickletools.genops(data):
            if opcode.name == "GLOBAL" and isinstance(argument, str):
                module, _, name = argument.partition(" ")
                if module.split(".")[0] == "torchao":
                    found.append(f"{module}.{name}")
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                module, name = strings[-2], strings[-1]
                if module.split(".")[0] == "torchao":
                    found.append(f"{module}.{name}")
            if isinstance(argument, str):
                strings.append(argument)
    except Exception:  # a malformed pickle: torch.load gives the precise error
        return found
    return list(dict.fromkeys(found))


def _torchao_allowlist(path: str, names: list[str]) -> list[Any]:
    """torchao's data types the pickle names, once torchao is imported. Only tensor subclasses,
    enums and dataclasses are allowed: types that hold data. A torchao function stays refused."""
    import importlib

    wanted = next((n.rpartition(".")[2] for n in names if n.endswith("Tensor")), names[0].rpartition(".")[2])
    try:
        with _quiet():
            importlib.import_module("torchao")
    except ImportError:
        raise CheckpointError(
            f"needs torchao to read {wanted}; pip install torchao",
            path=path,
            hint="the file holds torchao tensor subclasses, which only torchao's classes can rebuild",
        ) from None
    import torch

    allowed = []
    for qualified in names:
        module_name, _, attribute = qualified.rpartition(".")
        try:
            with _quiet():
                value = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError):
            continue  # torch.load names it in its refusal
        if isinstance(value, type) and (
            issubclass(value, (torch.Tensor, enum.Enum)) or dataclasses.is_dataclass(value) or issubclass(value, tuple)
        ):
            allowed.append(value)
    return allowed


# -- finding the state dict -----------------------------------------------------------------------


def _holds_tensors(value: Any, depth: int = 0) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return True
    if depth > 64:
        return False
    if isinstance(value, dict):
        return any(_holds_tensors(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v, depth + 1) for v in value)
    return False


def _find_state_dict(loaded: Any) -> tuple[Any, str | None, list[str]]:
    """The state dict to describe, where it was found, and the top-level keys left out.

    A dict with a tensor (or a tuple of them) among its own values is the state dict. Else the
    first of `STATE_DICT_KEYS` that holds tensors is, and other tensor-holding keys (optimizer
    state) are left out. Else everything is described, keys joined with "."."""
    import torch

    if not isinstance(loaded, dict):
        return loaded, None, []

    def direct(value: Any) -> bool:
        return isinstance(value, torch.Tensor) or (isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value))

    if any(direct(v) for v in loaded.values()):
        return loaded, None, []
    for key in STATE_DICT_KEYS:
        value = loaded.get(key)
        if isinstance(value, dict) and _holds_tensors(value):
            skipped = [str(k) for k, v in loaded.items() if k != key and _holds_tensors(v)]
            root = dict(value)
            for k, v in loaded.items():  # scalars beside it (epoch, step) stay visible as metadata
                if k != key and not _holds_tensors(v):
                    root.setdefault(f"__meta__.{k}", v)
            return root, str(key), skipped
    return loaded, None, []


# -- describing tensors ---------------------------------------------------------------------------


@dataclass
class _Record:
    offset: int  # absolute offset of the record's bytes in the file
    size: int


class _Describer:
    """Walks a loaded object and builds stored tensors, subclass records and metadata."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tensors: dict[str, StoredTensor] = {}
        self.objects: dict[str, Any] = {}
        self.subclasses: dict[str, Subclass] = {}
        self.metadata: dict[str, str] = {}
        self.file_size = os.path.getsize(path)
        self._records = _records(path)
        self._pending: list[tuple[str, Any, StorageDType, tuple[int, ...], str | None, tuple[int, ...] | None, bool]] = []

    # -- the walk --
    def walk(self, value: Any, name: str) -> None:
        self._walk(value, name, 0)
        self._place()

    def _walk(self, value: Any, name: str, depth: int) -> None:
        import torch

        if depth > 64:
            self._meta(name, "<nested too deeply>")
            return
        if isinstance(value, torch.Tensor):
            self._tensor(name or "tensor", value)
        elif isinstance(value, dict):
            for key, item in value.items():
                key_text = str(key)
                if key_text.startswith("__meta__."):
                    self._meta(key_text[len("__meta__.") :], item)
                    continue
                self._walk(item, f"{name}.{key_text}" if name else key_text, depth + 1)
        elif isinstance(value, (list, tuple)) and _holds_tensors(value):
            for index, item in enumerate(value):
                self._walk(item, f"{name}.{index}" if name else str(index), depth + 1)
        else:
            self._meta(name or "value", value)

    def _meta(self, name: str, value: Any) -> None:
        text = str(value)
        if len(text) > _METADATA_TEXT_LIMIT:
            text = f"<{type(value).__name__}, {len(text)} characters>"
        self.metadata[name] = text

    def _tensor(self, name: str, tensor) -> None:
        import torch

        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
            self._subclass(name, tensor)
            return
        if tensor.is_quantized:  # the guard: qscheme() raises on a tensor that is not quantized
            self._quantized(name, tensor)
            return
        try:
            dtype = from_torch(tensor.dtype)
        except KeyError:
            self._meta(name, f"<tensor of {tensor.dtype}, which qtool has no dtype for>")
            return
        self._add(name, tensor, dtype, tuple(tensor.shape))

    def _quantized(self, name: str, tensor) -> None:
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        storage, _ = _QUANTIZED.get(dtype_name, ("U8", None))
        scheme = str(tensor.qscheme()).removeprefix("torch.")
        shape = tuple(tensor.shape)
        stored_dtype = DTYPES[storage]
        if dtype_name in ("quint4x2", "quint2x4"):
            nbytes = tensor.untyped_storage().nbytes()
            self._add(name, tensor, stored_dtype, (nbytes,), f"torch.{scheme}", shape, whole_storage=True)
        else:
            self._add(name, tensor, stored_dtype, shape, f"torch.{scheme}", shape)
        if scheme in ("per_channel_affine", "per_channel_affine_float_qparams"):
            self._tensor(f"{name}.q_per_channel_scales", tensor.q_per_channel_scales())
            self._tensor(f"{name}.q_per_channel_zero_points", tensor.q_per_channel_zero_points())

    def _subclass(self, name: str, tensor) -> None:
        import torch

        inner_names, context = tensor.__tensor_flatten__()
        members: dict[str, str] = {}
        for inner in inner_names:
            value = getattr(tensor, inner, None)
            if isinstance(value, torch.Tensor):
                members[inner] = f"{name}.{inner}"
                self._tensor(members[inner], value)
        attributes = {str(k): _plain(v) for k, v in context.items()} if isinstance(context, dict) else {"context": _plain(context)}
        cls = type(tensor)
        self.subclasses[name] = Subclass(
            name=name,
            type_name=f"{cls.__module__}.{cls.__qualname__}",
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
            members=members,
            attributes=attributes,
        )
        self.objects[name] = tensor

    def _add(self, name, tensor, dtype: StorageDType, shape, encoding=None, logical_shape=None, whole_storage=False) -> None:
        if name in self.objects:
            raise CheckpointError(f"holds two tensors named {name!r}", path=self.path)
        self.objects[name] = tensor
        self._pending.append((name, tensor, dtype, shape, encoding, logical_shape, whole_storage))

    # -- byte ranges --
    def _place(self) -> None:
        """Give each tensor its byte range in the archive where one exists."""
        base = self._mapping_base()
        for name, tensor, dtype, shape, encoding, logical_shape, whole_storage in self._pending:
            nbytes = _nbytes(tensor, dtype, shape, whole_storage)
            begin = self._begin(tensor, dtype, base, nbytes, whole_storage)
            if begin is None:
                # no byte range: placed past the end of the file, so a reader that ignores
                # `in_file` fails ("cut short") instead of reading the wrong bytes
                begin, in_file = self.file_size, False
            else:
                in_file = True
            self.tensors[name] = StoredTensor(name, dtype, shape, begin, begin + nbytes, self.path, encoding, logical_shape, in_file)
        self._pending = []

    def _mapping_base(self) -> int | None:
        """Where the archive is mapped: the one address that puts every storage on a record of
        its own size. None when there is no such address (then no tensor has a byte range)."""
        if not self._records:
            return None
        storages = {}
        for _, tensor, *_ in self._pending:
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            storages[storage.data_ptr()] = storage.nbytes()
        storages = {ptr: size for ptr, size in storages.items() if size}
        if not storages:
            return None
        by_offset = {record.offset: record.size for record in self._records}
        lowest = min(storages)
        for record in self._records:
            base = lowest - record.offset
            if all(by_offset.get(ptr - base) == size for ptr, size in storages.items()):
                return base
        return None

    def _begin(self, tensor, dtype: StorageDType, base: int | None, nbytes: int, whole_storage: bool) -> int | None:
        if base is None or not tensor.is_contiguous():
            return None
        storage = tensor.untyped_storage()
        begin = storage.data_ptr() - base
        if not whole_storage:
            begin += tensor.storage_offset() * tensor.element_size()
        if begin < 0 or begin + nbytes > self.file_size:
            return None
        return begin


def _nbytes(tensor, dtype: StorageDType, shape: tuple[int, ...], whole_storage: bool) -> int:
    if whole_storage:
        return tensor.untyped_storage().nbytes()
    count = 1
    for dim in shape:
        count *= dim
    return count * dtype.bits // 8


def _records(path: str) -> list[_Record]:
    """The archive's uncompressed data records (`<archive>/data/<key>`) and where their bytes
    start: after each local header, whose extra field torch.save uses to align the data."""
    records = []
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb") as handle:
            byteorder = next((n for n in archive.namelist() if n.endswith("/byteorder") or n == "byteorder"), None)
            if byteorder is not None and archive.read(byteorder).strip() not in (b"little", b""):
                return []  # a big-endian archive: its bytes are not what torch hands out
            for info in archive.infolist():
                if "/data/" not in f"/{info.filename}" or info.compress_type != zipfile.ZIP_STORED:
                    continue
                handle.seek(info.header_offset)
                header = handle.read(30)
                if len(header) != 30 or header[:4] != b"PK\x03\x04":
                    continue
                name_length, extra_length = struct.unpack("<HH", header[26:30])
                records.append(_Record(info.header_offset + 30 + name_length + extra_length, info.file_size))
    except (zipfile.BadZipFile, OSError):
        return []
    return records


def _plain(value: Any) -> Any:
    """A flatten-context value as plain data: torch dtypes by name, enums by member name."""
    import torch

    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple, torch.Size)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"_type": type(value).__name__, **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    return repr(value)
