"""Linux libc calls that Python's os module lacks (mallopt, sync_file_range, fallocate),
through ctypes, which drops the GIL while they run. Each is None elsewhere (not Linux, or a libc
without it, such as musl's mallopt), and callers then keep the portable behaviour."""

from __future__ import annotations

import ctypes
import sys

__all__ = ["function", "trim_heap"]


def function(name: str, argtypes: tuple, restype=ctypes.c_int):
    """libc's `name` with these argument types, errno kept for ctypes.get_errno(); or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        found = getattr(_libc(), name)
    except (OSError, AttributeError):
        return None
    found.argtypes, found.restype = argtypes, restype
    return found


def _libc() -> ctypes.CDLL:
    """glibc's libc.so.6 by its name; else whatever `find_library` finds, which runs
    `ldconfig -p` in a subprocess (~20-50 ms of every start, so only where the name fails)."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        from ctypes.util import find_library

        return ctypes.CDLL(find_library("c") or "libc.so.6", use_errno=True)


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim(0)), holes inside it
    included. qtool's runs keep freed memory on the heap for speed (`M_TRIM_THRESHOLD` 1 GiB);
    a long run whose phases free much (calibration, layer after layer) calls this between them,
    so one phase's freed blocks are not resident through the next. Nothing where it is absent."""
    trim = function("malloc_trim", (ctypes.c_size_t,))
    if trim is not None:
        trim(0)
