"""Shared test helpers. `write_safetensors` builds files byte by byte, without torch, so tests
can make any dtype, any layout, and any corruption."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from qtool.dtypes import DTYPES

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_models"
CT_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "compressed_tensors"


def tensor_bytes(dtype: str, shape) -> int:
    return DTYPES[dtype].bits * math.prod(shape) // 8


def write_safetensors(path, tensors: dict, metadata: dict | None = None, data: dict | None = None) -> Path:
    """tensors: {name: (dtype, shape)}; data: optional {name: bytes}, zeros otherwise."""
    header: dict = {}
    blobs = []
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = tensor_bytes(dtype, shape)
        blob = (data or {}).get(name, bytes(size))
        assert len(blob) == size, (name, len(blob), size)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        blobs.append(blob)
        offset += size
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path


@pytest.fixture
def make_safetensors(tmp_path):
    def make(tensors: dict, name: str = "model.safetensors", **kwargs) -> Path:
        return write_safetensors(tmp_path / name, tensors, **kwargs)

    return make
