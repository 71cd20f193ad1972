"""qtool's GGUF header bytes are gguf-py's: `qtool.formats.gguf_writer.gguf_header` against
`GGUFWriter` on the same key-values and tensors (every value type, arrays typed and inferred,
an alignment key, a duplicated key), and on a real 49k-token vocabulary."""

from __future__ import annotations

import io
import math

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.errors import CheckpointError
from qtool.formats.gguf_writer import gguf_header
from qtool.ggml_types import ggml_type_named

_RANGES = {
    "UINT8": st.integers(0, 255), "INT8": st.integers(-128, 127), "UINT16": st.integers(0, 2**16 - 1),
    "INT16": st.integers(-(2**15), 2**15 - 1), "UINT32": st.integers(0, 2**32 - 1), "INT32": st.integers(-(2**31), 2**31 - 1),
    "UINT64": st.integers(0, 2**64 - 1), "INT64": st.integers(-(2**63), 2**63 - 1),
    "FLOAT32": st.floats(width=32, allow_nan=False), "FLOAT64": st.floats(allow_nan=False), "BOOL": st.booleans(),
    "STRING": st.binary(max_size=20) | st.text(max_size=10),
}  # fmt: skip


@st.composite
def entries(draw):
    out = []
    for index in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from([*_RANGES, "ARRAY"]))
        key = f"k{index}.{draw(st.text(min_size=1, max_size=5))}"
        if kind == "ARRAY":
            item = draw(st.sampled_from(list(_RANGES)))
            values = draw(st.lists(_RANGES[item], min_size=1, max_size=8))
            out.append((key, values, f"ARRAY:{item}"))
        else:
            out.append((key, draw(_RANGES[kind]), kind))
    return out


TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "MXFP4", "I32"]


@st.composite
def tensors(draw):
    out = []
    for index in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(TYPES))
        gtype = ggml_type_named(name)
        shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))) + (
            gtype.block_size * draw(st.integers(1, 2)),
        )
        out.append((f"t{index}", shape, name, gtype.nbytes(math.prod(shape))))
    return out


def gguf_py_header(entries, tensors, architecture):
    """What GGUFWriter writes before the data, and where it puts each tensor."""
    writer = gguf.GGUFWriter(None, architecture or "unknown")
    if architecture is None:
        writer.kv_data = [{}]
    for key, value, kind in entries:
        outer, _, inner = kind.partition(":")
        writer.add_key_value(key, value, gguf.GGUFValueType[outer], gguf.GGUFValueType[inner] if inner else None)
        if key == "general.alignment":
            writer.data_alignment = int(value)
    for name, shape, type_name, nbytes in tensors:
        writer.add_tensor_info(
            name, shape, np.dtype(np.float32), nbytes, raw_dtype=gguf.GGMLQuantizationType[type_name]
        )
    buffer = io.BytesIO()
    writer.fout = [buffer]
    writer.state = gguf.gguf_writer.WriterState.EMPTY
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return buffer.getvalue()


@settings(max_examples=200, deadline=None)
@given(entries(), tensors(), st.sampled_from([None, "llama"]), st.sampled_from([None, 32, 64, 256]))
def test_header_bytes_are_gguf_pys(entries, tensors, architecture, alignment):
    if alignment is not None:
        entries = [*entries, ("general.alignment", alignment, "UINT32")]
    header, ranges, size = gguf_header(entries, tensors, architecture=architecture)
    expected = gguf_py_header(entries, tensors, architecture)
    align = alignment or 32
    assert header[: len(expected)] == expected
    assert len(header) == -(-len(expected) // align) * align and not any(header[len(expected) :])
    at = len(header)
    for name, _, _, nbytes in tensors:
        assert ranges[name] == (at, at + nbytes)
        at += -(-nbytes // align) * align
    assert size == at


def test_inferred_arrays_and_a_duplicated_key_follow_gguf_py():
    entries = [
        ("tokenizer.ggml.tokens", [b"<s>", "x", b"\xff"], "ARRAY"),
        ("tokenizer.ggml.scores", [0.5, -1.0], "ARRAY"),
        ("tokenizer.ggml.token_type", [1, 2, 3], "ARRAY"),
        ("blob", b"\x00\x01", "ARRAY"),
        ("general.architecture", "llama", "STRING"),
    ]
    header, _, _ = gguf_header(entries, [], architecture="llama")
    assert header.startswith(gguf_py_header(entries, [], "llama"))


def test_an_empty_array_keeps_its_element_type_where_gguf_py_refuses():
    header, _, _ = gguf_header([("tokenizer.ggml.merges", [], "ARRAY:STRING")], [])
    # u32 ARRAY (9), u32 STRING (8), u64 count 0, after the key
    assert (9).to_bytes(4, "little") + (8).to_bytes(4, "little") + bytes(8) in header
    with pytest.raises(CheckpointError, match="empty array needs its element type"):
        gguf_header([("x", [], "ARRAY")], [])


def test_a_nested_array_is_refused_in_one_line():
    with pytest.raises(CheckpointError, match="nested arrays"):
        gguf_header([("x", [[1]], "ARRAY:ARRAY")], [])


def test_a_real_vocabulary_is_written_as_gguf_py_writes_it():
    import sys

    from qtool.formats.gguf import read_gguf_key_values
    from tests.conftest import SAMPLES

    sys.path.insert(0, str(SAMPLES))
    try:
        from real_models import Unavailable, smollm2_gguf
    finally:
        sys.path.remove(str(SAMPLES))
    try:
        path = smollm2_gguf()
    except Unavailable as exc:
        pytest.skip(str(exc))
    entries = read_gguf_key_values(str(path))
    assert any(len(value) > 40_000 for _, value, kind in entries if kind.startswith("ARRAY"))
    header, _, _ = gguf_header(entries, [])
    assert header.startswith(gguf_py_header(entries, [], None))


def test_llama_ftypes_and_the_quantization_version_are_gguf_pys():
    from qtool.ggml_types import GGML_QUANT_VERSION, LLAMA_FTYPES

    assert GGML_QUANT_VERSION == gguf.GGML_QUANT_VERSION
    assert LLAMA_FTYPES == {m.name: m.value for m in gguf.LlamaFileType if m.name != "GUESSED"}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=12), max_size=20))
def test_a_string_array_read_from_a_file_is_its_items_and_is_written_back_as_they_would_be(items):
    """A GGUF input's string arrays (a vocabulary) are read as one `StringArray` and written back
    from its bytes: equal to the items, pickled whole (shard jobs), and the header bytes are those
    of the same items packed one by one."""
    import pickle
    import struct

    from qtool.formats.gguf import _Cursor

    raw = b"".join(struct.pack("<Q", len(item)) + item for item in items)
    cursor = _Cursor(b"pad" + raw, 3 + len(raw), "x.gguf")
    cursor.pos = 3
    array = cursor.string_array(len(items), "the array")
    assert cursor.pos == 3 + len(raw) and array.raw == raw
    assert array == items and list(array) == items and len(array) == len(items)
    assert pickle.loads(pickle.dumps(array)) == array
    as_read, _, _ = gguf_header([("tokenizer.ggml.tokens", array, "ARRAY:STRING")], [])
    as_items, _, _ = gguf_header([("tokenizer.ggml.tokens", list(items), "ARRAY:STRING")], [])
    assert as_read == as_items


def test_a_string_array_cut_short_is_one_error():
    import struct

    from qtool.formats.gguf import _Cursor

    raw = struct.pack("<Q", 5) + b"abcde" + struct.pack("<Q", 9) + b"abc"
    with pytest.raises(CheckpointError, match="cut short"):
        _Cursor(raw, len(raw), "x.gguf").string_array(2, "the array 'tokens'")


@pytest.mark.parametrize("length", [2**63 - 1, 2**64 - 1], ids=["2^63-1", "2^64-1"])
def test_a_string_length_past_any_offset_is_one_error(length):
    """A string of a skipped array whose length carries the walk past what an offset holds: the
    next length's read overflowed (an OverflowError, exit 70, found fuzzing `qtool convert`)."""
    import struct

    from qtool.formats.gguf import _Cursor

    raw = struct.pack("<Q", length) + b"abc" + struct.pack("<Q", 1) + b"d" + b"\0" * 32
    cursor = _Cursor(raw, len(raw), "x.gguf")
    with pytest.raises(CheckpointError, match="cut short"):
        cursor.skip_strings(2, "the array 'tokens'")


def test_a_vocabulary_walked_by_the_listing_is_not_walked_again_until_the_file_changes(tmp_path, monkeypatch):
    """Planning a GGUF requantize reads the header twice (listing, then key-values): the second
    read takes each string array's end from the first walk, keyed by the file's identity, so
    another version of the file is walked afresh."""
    from qtool.formats import gguf as reader

    path = tmp_path / "v.gguf"

    def write(tokens):
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_token_list(tokens)
        writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()

    first = [f"t{i}" * (i % 3 + 1) for i in range(20)]  # longer than the listing shows in full
    write(first)
    monkeypatch.setattr(reader, "_walked", {})
    reader.read_gguf_file(str(path))
    assert [key[-1] for key in reader._walked] == [20]
    lengths_read, real = [], reader._U64

    class Counting:
        @staticmethod
        def unpack_from(buf, pos):
            lengths_read.append(pos)
            return real.unpack_from(buf, pos)

    monkeypatch.setattr(reader, "_U64", Counting)
    entries = reader._read_key_values(str(path))
    monkeypatch.setattr(reader, "_U64", real)
    assert lengths_read == []  # not walked again
    assert list(dict((key, value) for key, value, _ in entries)["tokenizer.ggml.tokens"]) == [t.encode() for t in first]
    second = [f"u{i}" for i in range(20)]  # the same count at the same offset, another file
    write(second)
    entries = reader._read_key_values(str(path))
    assert list(dict((key, value) for key, value, _ in entries)["tokenizer.ggml.tokens"]) == [
        t.encode() for t in second
    ]
