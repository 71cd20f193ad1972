"""Write importance-matrix files for tests, in both of llama.cpp's formats, byte for byte as
llama-imatrix lays them out (tools/imatrix/imatrix.cpp `save_imatrix`, `save_imatrix_legacy`)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "imatrix"
TINY_GGUF = FIXTURES / "tiny-imatrix.gguf"
TINY_DAT = FIXTURES / "tiny-imatrix.dat"


def write_imatrix_gguf(
    path,
    entries: dict,
    *,
    datasets=("text.txt",),
    chunk_count=2,
    chunk_size=64,
    extra=(),
    metadata=True,
) -> None:
    """`entries`: name -> (sums [matrices, columns] float32, counts [matrices]); `extra`:
    (tensor name, array) written as they are, after the pairs."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "")  # an empty arch: no general.architecture, as llama-imatrix writes
    writer.add_string("general.type", "imatrix")
    if metadata:
        writer.add_array("imatrix.datasets", list(datasets))
        writer.add_uint32("imatrix.chunk_count", chunk_count)
        writer.add_uint32("imatrix.chunk_size", chunk_size)
    for name in sorted(entries):
        sums, counts = entries[name]
        sums = np.asarray(sums, dtype=np.float32)
        counts = np.asarray(counts, dtype=np.float32)
        writer.add_tensor(
            f"{name}.in_sum2",
            sums.reshape(len(counts), -1) if sums.ndim == 1 and len(counts) > 1 else sums,
        )
        writer.add_tensor(
            f"{name}.counts",
            counts.reshape(len(counts), 1) if len(counts) > 1 else counts,
        )
    for name, array in extra:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def legacy_bytes(
    entries: list[tuple[bytes, int, np.ndarray]],
    *,
    chunk_count: int | None = 2,
    dataset: bytes | None = b"text.txt",
    n_entries: int | None = None,
) -> bytes:
    """`entries`: (name, ncall, values) in file order."""
    out = struct.pack("<i", len(entries) if n_entries is None else n_entries)
    for name, ncall, values in entries:
        values = np.asarray(values, dtype="<f4")
        out += struct.pack("<i", len(name)) + name + struct.pack("<ii", ncall, values.size) + values.tobytes()
    if chunk_count is not None:
        out += struct.pack("<i", chunk_count)
        if dataset is not None:
            out += struct.pack("<i", len(dataset)) + dataset
    return out
