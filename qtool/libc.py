"""Linux libc calls that Python's os module lacks (mallopt, sync_file_range, fallocate),
through ctypes, which drops the GIL while they run. Each is None elsewhere (not Linux, or a libc
without it, such as musl's mallopt), and callers then keep the portable behaviour."""

from __future__ import annotations

import ctypes
import sys

__all__ = ["function"]


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
