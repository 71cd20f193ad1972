"""Large byte buffers for streaming, backed by transparent huge pages.

Streaming allocates a fresh buffer per weight read and per encoded output. A fresh 90 MB
buffer from malloc is 22,000 page faults plus a memset, and glibc serves it with mmap (worker
threads allocate from arenas too small for it), so every weight paid again: on a 2-core machine
that was most of a quantize run's system time. Anonymous memory advised MADV_HUGEPAGE faults in
2 MB at a time (45 faults for the same buffer), zero-filled by the kernel.
"""

from __future__ import annotations

import mmap

__all__ = ["allocate", "HUGE_PAGES_FROM"]

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
