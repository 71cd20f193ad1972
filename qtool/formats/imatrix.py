"""Read llama.cpp's importance-matrix files (`llama-imatrix`'s output, `llama-quantize --imatrix`'s
input), as hostile files: every count, size and value checked before it is used.

Two formats, told apart as llama.cpp's `common_imatrix_load` tells them: a file that opens as
GGUF is the GGUF format, anything else the legacy `.dat` format.

    GGUF (llama-imatrix today)    key-values general.type = "imatrix", imatrix.datasets
                                  (array of strings), imatrix.chunk_count and imatrix.chunk_size
                                  (u32); per weight two F32 tensors, `<name>.in_sum2`
                                  [matrices, columns]: the sum over tokens of each input
                                  column's squared activation, and `<name>.counts` [matrices, 1]:
                                  the tokens summed, one count per expert of a 3-D tensor
    legacy .dat                   i32 entries | entries × (i32 name length, name, i32 ncall,
                                  i32 nval, nval × f32 (sum / count) × ncall) | optional
                                  i32 chunk count, i32 length + dataset name

`ImatrixEntry.importance()` is what llama-quantize hands its quantizers as `quant_weights`
(tools/quantize/quantize.cpp `load_imatrix`): per matrix, in_sum2 / count in float32 with the
count rounded as `std::lround` rounds it, and 1 for a matrix no token reached (count 0); for a
legacy entry, values / ncall (as they are when ncall is 0).

llama.cpp itself accepts more than this reader: a GGUF whose sums hold NaN (llama-quantize
stops later, mid-file), a sums tensor whose size is no multiple of its counts, a legacy file
with a repeated name (the last wins) or bytes after the dataset name. Each is refused here in
one line naming the file, before anything is written. Reading needs numpy, never torch.

The file is opened once through `regular_files.open_regular`: a FIFO is never waited on and a
device (`/dev/zero`, or a `.dat` linked to it) never read; a legacy file is read whole, at
most `MAX_LEGACY_BYTES`, a GGUF through its own bounded cursor.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from qtool.errors import ImatrixError

__all__ = [
    "imatrix_gguf_bytes",
    "COUNTS_SUFFIX",
    "KEY_CHUNK_COUNT",
    "KEY_CHUNK_SIZE",
    "KEY_DATASETS",
    "SUMS_SUFFIX",
    "Imatrix",
    "ImatrixEntry",
    "is_imatrix_gguf",
    "read_imatrix",
]

SUMS_SUFFIX, COUNTS_SUFFIX = ".in_sum2", ".counts"
KEY_TYPE, KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE = (
    "general.type",
    "imatrix.datasets",
    "imatrix.chunk_count",
    "imatrix.chunk_size",
)
MAX_LEGACY_BYTES = 1 << 32  # a legacy .dat read whole; a MoE model's with hundreds of experts is ~1 GB
MAX_NAME_BYTES = 1 << 16  # a weight's name; GGML's own limit is 63 bytes, a legacy file has none
MAX_COUNT = 1 << 53  # tokens: a float32 count above this is no count llama-imatrix wrote
INT32_MAX = (1 << 31) - 1
_HINT = "make it again with llama-imatrix, or check that the copy finished"


@dataclass(frozen=True)
class ImatrixEntry:
    """One weight's statistics, by its GGUF tensor name. `sums` is float32 [matrices * columns]
    (a legacy file: the values as stored, already divided by the count and times ncall);
    `counts` one per matrix (GGUF: tokens, rounded as llama.cpp rounds them; legacy: (ncall,))."""

    name: str
    sums: Any = field(repr=False)  # numpy float32, flat
    counts: tuple[int, ...]
    legacy: bool = False

    @property
    def values(self) -> int:
        return int(self.sums.size)

    @property
    def matrices(self) -> int:
        """Experts of a 3-D tensor (1 for a 2-D one); a legacy entry does not say, and counts 1."""
        return 1 if self.legacy else len(self.counts)

    @property
    def columns(self) -> int:
        return self.values // self.matrices

    def importance(self) -> Any:
        """float32 [values]: llama-quantize's quant_weights for this weight, matrix after matrix."""
        import numpy as np

        if self.legacy:
            ncall = self.counts[0]
            return self.sums / np.float32(ncall) if ncall > 0 else self.sums.copy()
        out = np.ones(self.values, dtype=np.float32)
        width = self.columns
        for index, count in enumerate(self.counts):
            if count > 0:
                out[index * width : (index + 1) * width] = self.sums[index * width : (index + 1) * width] / np.float32(
                    count
                )
        return out


@dataclass(frozen=True)
class Imatrix:
    """An importance-matrix file: its entries by name (in name order, as llama.cpp's std::map
    keeps them), the calibration texts it names (raw bytes, as written), and its chunks."""

    path: str
    format: str  # "gguf" | "dat"
    entries: dict[str, ImatrixEntry]
    datasets: tuple[bytes, ...]
    chunk_count: int
    chunk_size: int  # 0 in a legacy file, which does not record it

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "kind": "imatrix",
            "path": self.path,
            "format": self.format,
            "entries": len(self.entries),
            "chunk_count": self.chunk_count,
            "chunk_size": self.chunk_size,
            "datasets": [d.decode("utf-8", "backslashreplace") for d in self.datasets],
            "tensors": [
                {
                    "name": e.name,
                    "columns": e.columns,
                    "matrices": e.matrices,
                    "counts": list(e.counts),
                }
                for e in self.entries.values()
            ],
        }


def _fail(path: str, message: str) -> ImatrixError:
    return ImatrixError(message, path=path, hint=_HINT)


def is_imatrix_gguf(metadata: dict[str, str], tensor_names: Collection[str]) -> bool:
    """Whether a GGUF read as a checkpoint is an importance matrix: general.type says so, or
    its tensors are llama-imatrix's pairs."""
    if metadata.get(KEY_TYPE) == "imatrix":
        return True
    return bool(tensor_names) and all(n.endswith((SUMS_SUFFIX, COUNTS_SUFFIX)) for n in tensor_names)


def read_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    """Read and check an importance-matrix file of either format."""
    from qtool.formats.regular_files import NotReadable, open_regular

    path = os.fspath(path)
    try:
        fd, info = open_regular(path)
    except NotReadable as exc:
        raise ImatrixError(
            f"cannot read: {exc}", path=path, hint="pass the .gguf or .dat file llama-imatrix wrote"
        ) from None
    try:
        try:
            magic = os.pread(fd, 4, 0)
        except OSError as exc:
            raise ImatrixError(f"cannot read: {exc.strerror or exc}", path=path) from None
        return _read_gguf(path, fd) if magic == b"GGUF" else _read_legacy(path, fd, info)
    finally:
        os.close(fd)


# -- GGUF ------------------------------------------------------------------------------------------


def _read_gguf(path: str, fd: int) -> Imatrix:
    import numpy as np

    from qtool.errors import CheckpointError
    from qtool.formats.gguf import read_gguf_file, read_gguf_key_values

    try:
        tensors, _ = read_gguf_file(path)
        key_values = {key: (value, kind) for key, value, kind in read_gguf_key_values(path)}
    except CheckpointError as exc:
        raise ImatrixError(exc.message, path=path, hint=exc.hint) from None
    missing = [key for key in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if key not in key_values]
    if missing:
        raise _fail(
            path,
            f"missing imatrix metadata ({', '.join(missing)}); llama-quantize refuses such a file",
        )
    datasets_value, datasets_kind = key_values[KEY_DATASETS]
    if datasets_kind != "ARRAY:STRING":
        raise _fail(path, f"{KEY_DATASETS} is {datasets_kind}, not an array of strings")
    chunks = []
    for key in (KEY_CHUNK_COUNT, KEY_CHUNK_SIZE):
        value, kind = key_values[key]
        if kind != "UINT32" or value > INT32_MAX:
            raise _fail(
                path,
                f"{key} is {value} ({kind}); llama.cpp reads a u32 up to {INT32_MAX}",
            )
        chunks.append(value)

    pairs: dict[str, list[Any]] = {}
    for tensor in tensors:  # names are unique: read_gguf_file refuses a repeated one
        for suffix, slot in ((SUMS_SUFFIX, 0), (COUNTS_SUFFIX, 1)):
            if tensor.name.endswith(suffix) and len(tensor.name) > len(suffix):
                pairs.setdefault(tensor.name[: -len(suffix)], [None, None])[slot] = tensor
    if not pairs:
        raise _fail(
            path,
            f"holds no {SUMS_SUFFIX} / {COUNTS_SUFFIX} tensors: not an importance matrix",
        )
    entries: dict[str, ImatrixEntry] = {}
    # the sums and counts are read from the descriptor read_imatrix checked
    for name in sorted(pairs, key=lambda n: n.encode("utf-8", "surrogateescape")):
        sums_t, counts_t = pairs[name]
        shown = _shown(name)
        if sums_t is None or counts_t is None:
            raise _fail(
                path,
                f"{shown} has {'no' + SUMS_SUFFIX if sums_t is None else 'no' + COUNTS_SUFFIX} tensor to pair with its {'counts' if sums_t is None else 'sums'}",
            )
        for tensor in (sums_t, counts_t):
            if tensor.encoding is not None or tensor.dtype.name != "F32":
                raise _fail(
                    path,
                    f"{_shown(tensor.name)} is {tensor.encoding or tensor.dtype.name}; llama.cpp reads F32 sums and counts",
                )
        if counts_t.numel == 0 or sums_t.numel == 0:
            raise _fail(
                path,
                f"{shown} has {sums_t.numel} sums and {counts_t.numel} counts; both must be non-empty",
            )
        if sums_t.numel % counts_t.numel:
            raise _fail(
                path,
                f"{shown} has {sums_t.numel} sums, not a whole row per each of its {counts_t.numel} counts",
            )
        sums = _floats(fd, sums_t, path)
        raw_counts = _floats(fd, counts_t, path).astype(np.float64)
        if not np.isfinite(sums).all():
            raise _fail(path, f"{shown}{SUMS_SUFFIX} holds NaN or inf")
        if (sums < 0).any():
            raise _fail(path, f"{shown}{SUMS_SUFFIX} holds a negative sum of squares")
        if not np.isfinite(raw_counts).all() or (raw_counts < 0).any() or (raw_counts > MAX_COUNT).any():
            raise _fail(
                path,
                f"{shown}{COUNTS_SUFFIX} holds a count that is negative, NaN, inf or above 2^53",
            )
        counts = tuple(int(c) for c in np.floor(raw_counts + 0.5))  # std::lround of a non-negative value
        entries[name] = ImatrixEntry(name, sums, counts)
    return Imatrix(
        path,
        "gguf",
        entries,
        tuple(bytes(d) for d in datasets_value),
        chunks[0],
        chunks[1],
    )


def _floats(fd: int, tensor, path: str) -> Any:
    import numpy as np

    data = os.pread(fd, tensor.nbytes, tensor.begin)
    if len(data) != tensor.nbytes:
        raise _fail(
            path,
            f"file is truncated: {_shown(tensor.name)} ends past the end of the file",
        )
    return np.frombuffer(data, dtype="<f4").astype(np.float32)


def _shown(name: str) -> str:
    from qtool.message_text import excerpt

    return excerpt(name)


# -- legacy .dat -----------------------------------------------------------------------------------


def _read_legacy(path: str, fd: int, info: os.stat_result) -> Imatrix:
    import numpy as np

    from qtool.formats.regular_files import read_descriptor

    if info.st_size > MAX_LEGACY_BYTES:
        raise _fail(path, f"is {info.st_size} bytes, more than a legacy importance matrix's {MAX_LEGACY_BYTES}")
    try:
        data = read_descriptor(fd, info.st_size)
    except OSError as exc:
        raise ImatrixError(f"cannot read: {exc.strerror or exc}", path=path) from None
    if len(data) > info.st_size:
        raise _fail(path, "grew while it was read")
    size = len(data)
    pos = 0

    def int32(what: str) -> int:
        nonlocal pos
        if pos + 4 > size:
            raise _fail(
                path,
                f"file is cut short: {what} at byte {pos} needs 4 bytes, the file has {size}",
            )
        (value,) = struct.unpack_from("<i", data, pos)
        pos += 4
        return value

    def take(count: int, what: str) -> bytes:
        nonlocal pos
        if pos + count > size:
            raise _fail(
                path,
                f"file is cut short: {what} at byte {pos} needs {count} bytes, the file has {size}",
            )
        pos += count
        return data[pos - count : pos]

    if size == 0:
        raise _fail(path, "file is empty (0 bytes)")
    n_entries = int32("the entry count")
    if n_entries < 1:
        raise _fail(
            path,
            f"has {n_entries} entries: not an importance matrix (neither GGUF nor llama.cpp's legacy .dat)",
        )
    if n_entries * 16 > size - pos:  # name length, ncall, nval, one value at least
        raise _fail(
            path,
            f"{n_entries} entries need at least {n_entries * 16} bytes, {size - pos} are left: not an importance matrix, or cut short",
        )
    entries: dict[str, ImatrixEntry] = {}
    for index in range(n_entries):
        length = int32(f"the name length of entry {index + 1}")
        if not 0 < length <= MAX_NAME_BYTES:
            raise _fail(path, f"entry {index + 1} has a name of {length} bytes")
        raw = take(length, f"the name of entry {index + 1}")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail(path, f"entry {index + 1}'s name is not UTF-8") from None
        if "\0" in name:
            raise _fail(path, f"entry {index + 1}'s name {_shown(name)} holds a NUL byte")
        if name in entries:
            raise _fail(path, f"entry {_shown(name)} appears twice")
        ncall = int32(f"the call count of {_shown(name)}")
        nval = int32(f"the value count of {_shown(name)}")
        if ncall < 0 or nval < 1:
            raise _fail(path, f"entry {_shown(name)} has {ncall} calls and {nval} values")
        sums = np.frombuffer(take(4 * nval, f"the {nval} values of {_shown(name)}"), dtype="<f4").astype(np.float32)
        if not np.isfinite(sums).all():
            raise _fail(path, f"entry {_shown(name)} holds NaN or inf")
        if (sums < 0).any():
            raise _fail(path, f"entry {_shown(name)} holds a negative mean of squares")
        entries[name] = ImatrixEntry(name, sums, (ncall,), legacy=True)
    chunk_count, datasets = 0, ()
    if pos < size:  # the chunk count, then the dataset name, both optional
        chunk_count = int32("the chunk count")
        if chunk_count < 0:
            raise _fail(path, f"has a chunk count of {chunk_count}")
        if pos < size:
            length = int32("the dataset name's length")
            if length < 0:
                raise _fail(path, f"has a dataset name of {length} bytes")
            dataset = take(length, "the dataset name")
            datasets = (dataset.split(b"\0", 1)[0],) if length > 0 else ()  # a C string, as llama.cpp reads it
        if pos != size:
            raise _fail(path, f"has {size - pos} bytes after its last field")
    ordered = {name: entries[name] for name in sorted(entries, key=lambda n: n.encode("utf-8"))}
    return Imatrix(path, "dat", ordered, datasets, chunk_count, 0)


# -- writing (qtool imatrix) -----------------------------------------------------------------------


def imatrix_gguf_bytes(
    entries: dict[str, tuple[Any, list[int]]], datasets: list[bytes | str], chunk_count: int, chunk_size: int
) -> bytes:
    """The GGUF imatrix file llama-imatrix's `save_imatrix` writes: general.type, the datasets,
    chunk count and size, then per weight in name order `<name>.in_sum2` F32 [matrices, columns]
    and `<name>.counts` F32 [matrices, 1]. `entries`: name -> (float32 sums [matrices * columns],
    counts per matrix)."""
    import numpy as np

    from qtool.formats.gguf_writer import gguf_header

    header_entries = [
        (KEY_TYPE, "imatrix", "STRING"),
        (KEY_DATASETS, list(datasets), "ARRAY:STRING"),
        (KEY_CHUNK_COUNT, chunk_count, "UINT32"),
        (KEY_CHUNK_SIZE, chunk_size, "UINT32"),
    ]
    tensors, blobs = [], {}
    for name in sorted(entries, key=lambda n: n.encode("utf-8")):
        sums, counts = entries[name]
        sums = np.ascontiguousarray(sums, dtype="<f4").ravel()
        matrices = len(counts)
        columns = sums.size // matrices
        # ggml drops trailing dims of 1: a 2-D weight's sums are 1-D [columns], its counts [1]
        sums_shape, counts_shape = ((matrices, columns), (matrices, 1)) if matrices > 1 else ((columns,), (1,))
        blobs[name + SUMS_SUFFIX] = sums.tobytes()
        blobs[name + COUNTS_SUFFIX] = np.asarray(counts, dtype="<f4").tobytes()
        tensors += [
            (name + SUMS_SUFFIX, sums_shape, "F32", sums.nbytes),
            (name + COUNTS_SUFFIX, counts_shape, "F32", 4 * matrices),
        ]
    header, ranges, size = gguf_header(header_entries, tensors)
    out = bytearray(size)
    out[: len(header)] = header
    for name, blob in blobs.items():
        begin, end = ranges[name]
        out[begin:end] = blob
    return bytes(out)
