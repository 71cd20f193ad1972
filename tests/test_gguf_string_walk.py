"""A GGUF header's string arrays (a vocabulary's 49k-150k tokens and merges) are walked in C
(`qtool.native.skip_prefixed`, handed to qtool.formats by `qtool.api`, issue 42 #15: ~15 ms of a
SmolLM2 requantize in Python): the same ends and the same refusals as the Python walk, on
hostile lengths and cut files."""

from __future__ import annotations

import struct

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool import api, native
from qtool.errors import CheckpointError
from qtool.formats import gguf as qtool_gguf

pytestmark = pytest.mark.skipif(not native.available(), reason="the native extension is not built")


def python_walk(buf: bytes, pos: int, count: int) -> int:
    """The reference: each string a u64 length then its bytes; -1 where one runs past the end."""
    for _ in range(count):
        if pos + 8 > len(buf):
            return -1
        pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        if pos > len(buf):
            return -1
    return pos


def packed(strings: list[bytes]) -> bytes:
    return b"".join(struct.pack("<Q", len(s)) + s for s in strings)


@settings(max_examples=300, deadline=None)
@given(
    strings=st.lists(st.binary(max_size=12), max_size=20),
    extra=st.integers(0, 3),
    cut=st.integers(0, 40),
    lie=st.one_of(st.none(), st.tuples(st.integers(0, 19), st.sampled_from([13, 2**31, 2**63, 2**64 - 1]))),
    start=st.integers(0, 9),
)
def test_the_c_walk_ends_where_the_python_walk_does(strings, extra, cut, lie, start):
    buf = bytearray(b"\xaa" * start + packed(strings))
    if lie is not None and lie[0] < len(strings):  # a hostile length in place of a true one
        at = start + sum(8 + len(s) for s in strings[: lie[0]])
        buf[at : at + 8] = struct.pack("<Q", lie[1])
    buf = bytes(buf[: max(start, len(buf) - cut)])
    for count in {len(strings), len(strings) + extra, max(0, len(strings) - extra)}:
        assert native.skip_prefixed(buf, start, count) == python_walk(buf, start, count), (count, buf)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        native.skip_prefixed(b"12345678", 9, 1)
    with pytest.raises(ValueError):
        native.skip_prefixed(b"12345678", 0, -1)
    assert native.skip_prefixed(b"", 0, 0) == 0


def test_the_api_hands_the_c_walk_to_the_header_reader():
    assert qtool_gguf._prefixed_walk is api._prefixed_walk


def _vocabulary_file(path, tokens: int) -> int:
    """A GGUF with a `tokens`-string array; returns the array's first string's offset."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"token-{i}" for i in range(tokens)])
    writer.add_uint32("after.the.vocabulary", 7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    data = path.read_bytes()
    return data.index(struct.pack("<Q", len("token-0")) + b"token-0")


@pytest.mark.parametrize("cut", [None, "in a length", "in a string", "a lying length"])
def test_the_header_reads_and_refuses_the_same_with_either_walk(tmp_path, cut):
    path = tmp_path / "vocab.gguf"
    first = _vocabulary_file(path, 500)
    data = bytearray(path.read_bytes())
    if cut == "in a length":
        data = data[: first + 15 + 3]  # 3 bytes into the second length
    elif cut == "in a string":
        data = data[: first + 15 + 8 + 4]  # 4 bytes into the second string
    elif cut == "a lying length":
        data[first : first + 8] = struct.pack("<Q", 2**63)
    path.write_bytes(bytes(data))
    outcomes = []
    try:
        for walk in (None, api._prefixed_walk):
            qtool_gguf.use_prefixed_walk(walk)
            qtool_gguf._walked.clear()
            try:
                outcomes.append(qtool_gguf.read_gguf_file(str(path)))
            except CheckpointError as exc:
                outcomes.append(str(exc))
    finally:
        qtool_gguf.use_prefixed_walk(api._prefixed_walk)
        qtool_gguf._walked.clear()
    assert outcomes[0] == outcomes[1]
    if cut is None:
        tensors, metadata = outcomes[0]
        assert metadata["tokenizer.ggml.tokens"] == "[500 × str]" and metadata["after.the.vocabulary"] == "7"
    else:
        assert "runs past the end of the file" in outcomes[0] or "cut short" in outcomes[0], outcomes[0]


def test_a_real_vocabulary_reads_the_same_with_either_walk():
    import sys

    from tests.conftest import REPO

    sys.path.insert(0, str(REPO / "sample_models"))
    from real_models import Unavailable, smollm2_gguf

    try:
        path = str(smollm2_gguf())
    except Unavailable as exc:
        pytest.skip(str(exc))
    results = []
    try:
        for walk in (None, api._prefixed_walk):
            qtool_gguf.use_prefixed_walk(walk)
            qtool_gguf._walked.clear()
            results.append(qtool_gguf.read_gguf_file(path))
            results.append(qtool_gguf.read_gguf_key_values(path))
    finally:
        qtool_gguf.use_prefixed_walk(api._prefixed_walk)
        qtool_gguf._walked.clear()
    assert results[0] == results[2] and results[1] == results[3]


@pytest.mark.parametrize("native_on", ["1", "0"])
def test_a_length_past_any_file_is_exit_2_in_one_line_not_an_overflow(tmp_path, native_on):
    """A vocabulary string whose length is 2**63: the Python walk's next read took an offset past
    ssize_t and raised OverflowError (exit 70, "internal error"); both walks refuse the file."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    path = tmp_path / "lying.gguf"
    first = _vocabulary_file(path, 50)
    data = bytearray(path.read_bytes())
    data[first : first + 8] = struct.pack("<Q", 2**63)
    path.write_bytes(bytes(data))
    done = subprocess.run(
        [sys.executable, "-m", "qtool", "inspect", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "QTOOL_NATIVE": native_on},
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "runs past the end of the file" in errors[0], done.stderr
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr


def test_an_extension_built_before_the_walk_falls_back_to_python(tmp_path, monkeypatch):
    """A checkout whose compiled extension predates `skip_prefixed` (not rebuilt after a pull)
    reads GGUF headers with the Python walk instead of failing on every one."""

    class Stale:  # an extension module without the function
        pass

    path = tmp_path / "vocab.gguf"
    _vocabulary_file(path, 500)
    monkeypatch.setattr(native, "_kernels", Stale())
    assert native.skip_prefixed(packed([b"ab"]), 0, 1) is None
    qtool_gguf._walked.clear()
    try:
        tensors, metadata = qtool_gguf.read_gguf_file(str(path))
    finally:
        qtool_gguf._walked.clear()
    assert metadata["tokenizer.ggml.tokens"] == "[500 × str]" and metadata["after.the.vocabulary"] == "7"
