"""Resource bombs and exact cases from issue 10 that random mutation is unlikely to hit, written
into the regression corpus as ordinary cases (the same runner, the same outcome classes).

    python -m tests.fuzz.handmade            # (re)writes tests/fuzz/regressions/*/handmade-*

- pt/handmade-billion-laughs: `L = [L, L]` 40 deep under one tensor, 1.9 kB; torch.load shares
  the memo references, a state-dict walk that expands them never ends.
- pt_legacy/handmade-billion-laughs: the same in the legacy (non-zip) format.
- gguf/handmade-dims-overflow-*: a tensor with dims [0, 64, 2^62], through `inspect --stats`
  and `check --no-nan` (size arithmetic that overflows).
"""

from __future__ import annotations

import struct
import sys
import tempfile
from pathlib import Path

from tests.fuzz.campaign import Case

HERE = Path(__file__).resolve().parent


def billion_laughs(path: Path, depth: int = 40, legacy: bool = False) -> None:
    import torch

    nest: list = [torch.zeros(2)]
    for _ in range(depth):
        nest = [nest, nest]
    torch.save({"model": nest}, path, _use_new_zipfile_serialization=not legacy)


def gguf_dims_overflow(path: Path) -> None:
    """One F32 tensor whose dims are [0, 64, 2^62]: zero elements, and a product of the others
    that overflows 64 bits once multiplied by the element size."""
    import gguf
    import numpy as np

    with tempfile.TemporaryDirectory() as scratch:
        plain = Path(scratch) / "plain.gguf"
        writer = gguf.GGUFWriter(str(plain), "llama")
        writer.add_tensor("output.weight", np.arange(16, dtype=np.float32).reshape(2, 8))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        data = bytearray(plain.read_bytes())
    from tests.fuzz.structure import parse

    s = parse("plain.gguf", bytes(data))
    dims = [f for f in s.fields if f.kind == "dim"]
    info_end = next(r.end for r in s.regions if r.kind == "tensor_info")
    old_data = -(-info_end // 32) * 32
    start = dims[0].offset
    struct.pack_into("<I", data, start - 4, 3)
    head = bytes(data[:start]) + struct.pack("<3Q", 0, 64, 2**62) + bytes(data[dims[-1].offset + 8 : info_end])
    path.write_bytes(head + bytes(-len(head) % 32) + bytes(data[old_data:]))


def write_all(regressions: Path) -> list[Path]:
    written = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        billion_laughs(scratch / "model.pt")
        billion_laughs(scratch / "legacy.pt", legacy=True)
        gguf_dims_overflow(scratch / "model.gguf")
        cases = [
            ("pt", "handmade-billion-laughs", "model.pt", ["inspect", "{in}"], "model.pt", "L = [L, L] nested 40 deep (torch.save shares the memo references): 1.9 kB", "torchpt"),
            ("pt_legacy", "handmade-billion-laughs", "model.pt", ["inspect", "{in}"], "legacy.pt", "L = [L, L] nested 40 deep, legacy format", "torchpt"),
            ("gguf", "handmade-dims-overflow-stats", "model.gguf", ["inspect", "{in}", "--stats"], "model.gguf", "dims [0, 64, 2^62]", "readers"),
            ("gguf", "handmade-dims-overflow-no-nan", "model.gguf", ["check", "{in}", "--no-nan"], "model.gguf", "dims [0, 64, 2^62]", "readers"),
        ]
        for container, name, target, argv, source, what, area in cases:
            case = Case(container, "handmade", target, argv, [f"handmade: {what}"], {target: (scratch / source).read_bytes()})
            folder = regressions / container / name
            case.write(folder, extra={"area": area, "signature": ["handmade", what, area]})
            written.append(folder)
    return written


if __name__ == "__main__":
    for folder in write_all(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "regressions"):
        print(folder)
