"""llama.cpp's quantizers compiled here from its C sources, for the tests that compare qtool's
bytes with llama.cpp's on random rows (the K-quants, the importance-weighted types, IQ2/IQ3).
The build is tests/fixtures/gguf_kquants/make_reference.py's, which also made the committed
fixtures; the tests skip when the sources (`LLAMA_CPP_SRC`) or gcc are missing."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

LLAMA_CPP = os.environ.get("LLAMA_CPP_SRC", "/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp")
FIXTURE = Path(__file__).parent / "fixtures" / "gguf_kquants"


@contextmanager
def compiled_llama_cpp() -> Iterator[tuple[ModuleType, Any]]:
    """make_reference and the library it built from llama.cpp's ggml-quants.c; skips the test
    when that cannot be built here."""
    if not (Path(LLAMA_CPP) / "ggml" / "src" / "ggml-quants.c").is_file() or shutil.which("gcc") is None:
        pytest.skip(f"llama.cpp sources not at {LLAMA_CPP} (LLAMA_CPP_SRC) or no gcc")
    sys.path.insert(0, str(FIXTURE))
    try:
        import make_reference
    finally:
        sys.path.remove(str(FIXTURE))
    with tempfile.TemporaryDirectory() as tmp:
        lib, _ = make_reference.build_library(Path(LLAMA_CPP), Path(tmp))
        yield make_reference, lib
