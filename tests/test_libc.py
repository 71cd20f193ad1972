"""qtool.libc finds glibc without `ctypes.util.find_library`, which runs `ldconfig -p` in a
subprocess on every start of the CLI (tens of ms of a small GGUF requantize, issue 18 #14)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest

from qtool import libc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the libc calls are Linux's")
def test_libc_calls_are_found_without_running_ldconfig(monkeypatch):
    def no_ldconfig(name):
        raise AssertionError("find_library runs ldconfig in a subprocess")

    monkeypatch.setattr(ctypes.util, "find_library", no_ldconfig)
    found = libc.function("fallocate", (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64))
    assert found is not None and found.restype is ctypes.c_int


def test_a_call_libc_lacks_is_none():
    assert libc.function("qtool_no_such_call", ()) is None
