"""Byte buffers for streaming: large ones backed by transparent huge pages, and the torch views
of raw bytes that the executor and the encoders hand each other.

Streaming allocates a fresh buffer per weight read and per encoded output. A fresh 90 MB
buffer from malloc is 22,000 page faults plus a memset, and glibc serves it with mmap (worker
threads allocate from arenas too small for it), so every weight paid again: on a 2-core machine
that was most of a quantize run's system time. Anonymous memory advised MADV_HUGEPAGE faults in
2 MB at a time (45 faults for the same buffer), zero-filled by the kernel.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qtool.dtypes import StorageDType

__all__ = ["allocate", "HUGE_PAGES_FROM", "tensor_from_bytes", "tensor_bytes"]

HUGE_PAGES_FROM = 8 << 20  # bytes: smaller buffers come from the ordinary heap


def allocate(nbytes: int) -> memoryview:
    """A writable, zero-filled buffer of `nbytes` bytes; it lives as long as the view does."""
    if nbytes >= HUGE_PAGES_FROM and hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE"):
        try:
            region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            region.madvise(mmap.MADV_HUGEPAGE)
            return memoryview(region)
        except (OSError, ValueError):
            pass
    return memoryview(bytearray(nbytes))


def tensor_from_bytes(raw, dtype: StorageDType, shape: tuple[int, ...]):
    """The torch view of a tensor's raw bytes (raw uint8 for dtypes torch lacks). Imports torch."""
    import torch

    if not memoryview(raw).nbytes:
        return torch.empty(shape, dtype=dtype.torch_dtype() if dtype.torch_name else torch.uint8)
    flat = torch.frombuffer(raw, dtype=torch.uint8)
    if dtype.torch_name is None:
        return flat
    return flat.view(dtype.torch_dtype()).reshape(shape)


def tensor_bytes(tensor) -> memoryview:
    """A tensor's bytes, row-major, on the CPU."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
