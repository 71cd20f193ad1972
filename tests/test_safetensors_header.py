"""Property tests of the safetensors header parser (CONVENTIONS §12).

Random valid files must round-trip exactly through `parse_header` / `read_safetensors_file` /
`qtool.open_checkpoint` and agree with the reference reader (`safetensors.safe_open`). Random
corruptions of valid files must raise `CheckpointError` (exit code 2, message starting with the
file's path) and never any other exception; where the reference accepts a corrupted file, qtool
must accept it too, except for duplicate names, where qtool is deliberately stricter.

Cases a naive json.loads reader gets wrong (duplicates, surrogates, huge ints, overflow) are at the bottom.
"""

from __future__ import annotations

import json
import math
import os
import struct
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import safetensors
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import qtool
from qtool.dtypes import DTYPES, nbytes_for
from qtool.errors import EXIT_USAGE, CheckpointError, QtoolError
from qtool.formats.safetensors import MAX_HEADER_SIZE, parse_header, read_header, read_safetensors_file

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


# -- writing files ----------------------------------------------------------------------------------


def tiny_safetensors(path, tensors: dict[str, tuple[str, list[int]]], metadata: dict[str, str] | None = None) -> bytes:
    """Write a safetensors file whose tensors are stored contiguously in dict order; return its bytes."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = nbytes_for(DTYPES[dtype], math.prod(shape))
        assert size is not None, f"{dtype} {shape} does not fill whole bytes"
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", len(raw)) + raw + bytes(i % 251 for i in range(offset))
    with open(path, "wb") as handle:
        handle.write(blob)
    return blob


@dataclass
class Spec:
    """A safetensors file as structure, so corruptions can edit the header and re-render it."""

    entries: list[tuple[str, Any]]  # header order; ("__metadata__", {...}) may be one of them
    data: bytes
    ensure_ascii: bool = True
    separators: tuple[str, str] = (",", ":")
    pad: int = 0  # trailing spaces after the JSON, as the reference writer adds for alignment
    extra_parts: list[tuple[int, str]] = field(default_factory=list)  # raw "key": value texts to splice in

    def part(self, key: str, value: Any) -> str:
        dump = lambda v: json.dumps(v, ensure_ascii=self.ensure_ascii, separators=self.separators)  # noqa: E731
        return dump(key) + self.separators[1] + dump(value)

    def header(self) -> bytes:
        parts = [self.part(k, v) for k, v in self.entries]
        for index, text in sorted(self.extra_parts, reverse=True):
            parts.insert(index, text)
        return ("{" + self.separators[0].join(parts) + "}").encode() + b" " * self.pad

    def blob(self) -> bytes:
        header = self.header()
        return struct.pack("<Q", len(header)) + header + self.data

    @property
    def tensors(self) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.entries if k != "__metadata__"}

    @property
    def metadata(self) -> dict[str, str]:
        return next((v for k, v in self.entries if k == "__metadata__"), None) or {}


@st.composite
def names(draw) -> str:
    name = draw(
        st.one_of(
            st.from_regex(r"[a-z_][a-z0-9_]{0,5}(\.[a-z0-9_]{1,6}){0,4}", fullmatch=True),  # model.layers.0.mlp
            st.text(st.characters(codec="utf-8"), max_size=10),  # any unicode, no surrogates; may be ""
            st.text(st.sampled_from('.é日\u200b\U0001f600 "\\/\t\n\x1b'), min_size=1, max_size=6),
        )
    )
    return name + "_" if name == "__metadata__" else name


@st.composite
def shapes_for(draw, dtype: str) -> list[int]:
    shape = draw(st.lists(st.integers(0, 5), max_size=4))  # [] is a scalar; 0 dims allowed
    if nbytes_for(DTYPES[dtype], math.prod(shape)) is None:
        shape.append(4)  # F4 needs an even count, F6_* a multiple of 4: a last dim of 4 fixes both
    return shape


@st.composite
def valid_specs(draw, min_tensors: int = 0) -> Spec:
    raw = draw(
        st.lists(
            st.tuples(names(), st.sampled_from(list(DTYPES))),
            min_size=min_tensors,
            max_size=6,
            unique_by=lambda t: t[0],
        )
    )
    tensors = [(name, dtype, draw(shapes_for(dtype))) for name, dtype in raw]
    data_order = draw(st.permutations(range(len(tensors))))  # data order differs from header order
    offsets = {}
    position = 0
    for index in data_order:
        name, dtype, shape = tensors[index]
        size = nbytes_for(DTYPES[dtype], math.prod(shape))
        offsets[name] = [position, position + size]
        position += size
    entries: list[tuple[str, Any]] = [
        (name, {"dtype": dtype, "shape": shape, "data_offsets": offsets[name]}) for name, dtype, shape in tensors
    ]
    metadata = draw(
        st.none()
        | st.dictionaries(
            st.text(st.characters(codec="utf-8"), max_size=8),
            st.text(st.characters(codec="utf-8"), max_size=16),
            max_size=4,
        )
    )
    if metadata is not None:
        entries.insert(draw(st.integers(0, len(entries))), ("__metadata__", metadata))
    seed = draw(st.integers(0, 255))
    spec = Spec(
        entries=entries,
        data=bytes((seed + i * 31) % 256 for i in range(position)),
        ensure_ascii=draw(st.booleans()),
        separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])),
    )
    padding = draw(st.sampled_from(["none", "spaces", "align8"]))
    if padding == "spaces":
        spec.pad = draw(st.integers(1, 9))
    elif padding == "align8":
        spec.pad = -len(spec.header()) % 8
    return spec


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("st_headers")


def write(workdir, blob: bytes) -> str:
    # a fresh folder per file: open_checkpoint reads side files (config.json) from the folder
    folder = workdir / uuid.uuid4().hex
    folder.mkdir()
    path = str(folder / "model.safetensors")
    with open(path, "wb") as handle:
        handle.write(blob)
    return path


def cleanup(path: str) -> None:
    os.remove(path)
    os.rmdir(os.path.dirname(path))


# -- the reference reader ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref_dtypes(workdir) -> frozenset[str]:
    """The dtypes the installed `safetensors` can open a header with."""
    supported = set()
    for name in DTYPES:
        path = write(workdir, b"")
        tiny_safetensors(path, {"t": (name, [8])})
        try:
            with safetensors.safe_open(path, "numpy") as handle:
                handle.get_slice("t").get_shape()
            supported.add(name)
        except Exception:  # the reference has no such dtype (older or newer release)
            pass
        cleanup(path)
    return frozenset(supported)


def reference_read(path: str) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]] | None:
    """What `safetensors.safe_open` sees, or None if it rejects the file."""
    try:
        with safetensors.safe_open(path, "numpy") as handle:
            tensors = {}
            for key in handle.keys():
                view = handle.get_slice(key)
                tensors[key] = (view.get_dtype(), list(view.get_shape()))
            return tensors, handle.metadata() or {}
    except Exception:
        return None


# -- what qtool does with a file --------------------------------------------------------------------


def qtool_read(path: str):
    """(tensors, metadata) or the exception; checks the three entry points agree with each other."""
    results = []
    for reader in (read_safetensors_file, _via_parse_header, _via_open_checkpoint):
        try:
            results.append(reader(path))
        except Exception as exc:
            results.append(exc)
    kinds = [type(r).__name__ if isinstance(r, BaseException) else "ok" for r in results]
    assert len(set(kinds)) == 1, f"entry points disagree: {kinds} {results}"
    if isinstance(results[0], BaseException):
        assert len({str(r) for r in results}) == 1, results
    else:
        assert results[0] == results[1] == results[2]
    return results[0]


def _via_parse_header(path: str):
    header, size = read_header(path)
    return parse_header(path, header, size)


def _via_open_checkpoint(path: str):
    checkpoint = qtool.open_checkpoint(path)
    assert checkpoint.format == "safetensors" and checkpoint.files == [path]
    return list(checkpoint.tensors.values()), checkpoint.metadata


def assert_checkpoint_error(result: Any, path: str) -> CheckpointError:
    if not isinstance(result, BaseException):
        pytest.fail(f"qtool accepted an invalid file: {result!r}")
    if not isinstance(result, CheckpointError):
        raise AssertionError(f"expected CheckpointError, got {type(result).__name__}: {result}") from result
    assert isinstance(result, QtoolError) and result.exit_code == EXIT_USAGE == 2
    assert result.path == path
    assert str(result).startswith(path + ": "), str(result)
    assert result.hint
    return result


def as_table(tensors) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    return {t.name: (t.dtype.name, t.shape, t.begin, t.end) for t in tensors}


# -- valid files ------------------------------------------------------------------------------------


@SETTINGS
@given(spec=valid_specs())
def test_valid_files_round_trip(workdir, ref_dtypes, spec: Spec):
    blob = spec.blob()
    path = write(workdir, blob)
    try:
        result = qtool_read(path)
        if isinstance(result, BaseException):
            raise AssertionError(f"qtool rejected a valid file: {result}") from result
        tensors, metadata = result
        header_len = len(spec.header())
        assert header_len == struct.unpack("<Q", blob[:8])[0]
        expected = {
            name: (
                info["dtype"],
                tuple(info["shape"]),
                8 + header_len + info["data_offsets"][0],
                8 + header_len + info["data_offsets"][1],
            )
            for name, info in spec.tensors.items()
        }
        assert len(tensors) == len(expected)
        assert as_table(tensors) == expected
        assert all(t.file == path for t in tensors)
        assert [(t.begin, t.end) for t in tensors] == sorted((t.begin, t.end) for t in tensors)  # data order
        assert all(t.nbytes == nbytes_for(t.dtype, t.numel) for t in tensors)
        assert metadata == spec.metadata
        assert all(type(k) is str and type(v) is str for k, v in metadata.items())

        if {info["dtype"] for info in spec.tensors.values()} <= ref_dtypes:
            reference = reference_read(path)
            assert reference is not None, "the reference reader rejects a file built to be valid"
            ref_tensors, ref_metadata = reference
            assert ref_tensors == {t.name: (t.dtype.name, list(t.shape)) for t in tensors}
            assert ref_metadata == metadata
    finally:
        cleanup(path)


def test_round_trip_examples(workdir):
    """A few hand-written valid files: scalars, 0-size dims, sub-byte dtypes, dotted and unicode names."""
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": ("BF16", [4, 3]),
        "scalar": ("F32", []),
        "empty": ("F16", [0, 7]),
        "日本.weight": ("F4", [3, 2]),
        "packed": ("F6_E2M3", [4]),
        "zero.f6": ("F6_E3M2", [0]),
    }
    path = write(workdir, b"")
    blob = tiny_safetensors(path, tensors, {"format": "pt", "ключ": "значение"})
    header_len = struct.unpack("<Q", blob[:8])[0]
    read, metadata = read_safetensors_file(path)
    assert metadata == {"format": "pt", "ключ": "значение"}
    assert [t.name for t in read] == list(tensors)  # 0-size tensors sort stably by (begin, end)
    begin = 8 + header_len
    for t, (dtype, shape) in zip(read, tensors.values()):
        assert (t.dtype.name, t.shape, t.begin) == (dtype, tuple(shape), begin)
        begin = t.end
    assert begin == len(blob)
    assert read[3].nbytes == 3 and read[4].nbytes == 3  # 6 F4 values, 4 F6 values
    cleanup(path)


# -- corrupted files --------------------------------------------------------------------------------

NOT_INTEGERS = [-1, -7, 2.5, 1.0, 0.0, True, False, None, "2", [2], {"n": 2}]
NOT_OBJECTS = [1, 0, "x", "", [], [1, 2], None, True, False, 1.5]


def _tensor_indexes(spec: Spec, nonempty: bool = False) -> list[int]:
    return [
        i
        for i, (k, v) in enumerate(spec.entries)
        if k != "__metadata__" and (not nonempty or v["data_offsets"][1] > v["data_offsets"][0])
    ]


def _edit_entry(draw, spec: Spec, nonempty: bool = False) -> tuple[Spec, int, dict[str, Any]] | None:
    indexes = _tensor_indexes(spec, nonempty)
    if not indexes:
        return None
    i = draw(st.sampled_from(indexes))
    entries = list(spec.entries)
    info = dict(entries[i][1])
    return replace(spec, entries=entries), i, info


def _splice(blob: bytes, at: int, insert: bytes, remove: int = 0) -> bytes:
    return blob[:at] + insert + blob[at + remove :]


def _with_header(spec: Spec, header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + spec.data


KINDS = [
    "truncate", "header_len", "flip_len", "flip_header", "trailing", "insert_junk_header", "insert_junk_data",
    "non_utf8", "top_level", "bad_metadata", "dup_key", "bad_dtype", "shift_offsets", "resize_offsets",
    "reverse_offsets", "bad_offsets", "bad_shape", "non_object_entry", "missing_field",
]  # fmt: skip


@st.composite
def corrupted(draw, kind: str) -> tuple[bytes, str, bool, str | None]:
    """(file bytes, what was done, whether it must be rejected, a substring the error must contain)."""
    spec = draw(valid_specs())
    blob = spec.blob()
    header = spec.header()
    n = len(header)

    if kind == "truncate":
        cut = draw(st.integers(0, len(blob) - 1))
        return blob[:cut], f"truncated to {cut} of {len(blob)} bytes", True, None
    if kind == "header_len":
        new = draw(
            st.integers(0, len(blob) + 8) | st.sampled_from([MAX_HEADER_SIZE, MAX_HEADER_SIZE + 1, 2**63, 2**64 - 1])
        )
        if new == n:
            new = n + 1
        return _splice(blob, 0, struct.pack("<Q", new), 8), f"header length {n} -> {new}", True, None
    if kind == "flip_len":
        at = draw(st.integers(0, 7))
        return (
            _splice(blob, at, bytes([blob[at] ^ draw(st.integers(1, 255))]), 1),
            f"length byte {at} flipped",
            True,
            None,
        )
    if kind == "flip_header":
        flipped = bytearray(blob)
        for at in draw(st.lists(st.integers(8, 8 + n - 1), min_size=1, max_size=3, unique=True)):
            flipped[at] ^= draw(st.integers(1, 255))
        return bytes(flipped), "header bytes flipped", False, None
    if kind == "trailing":
        extra = draw(st.binary(min_size=1, max_size=16))
        return blob + extra, f"{len(extra)} trailing bytes", True, "trailing bytes"
    if kind == "insert_junk_header":
        junk = draw(st.binary(min_size=1, max_size=8) | st.sampled_from([b" ", b"\n", b"x", b"{", b"}", b",", b'"']))
        at = draw(st.integers(0, n))
        new_header = _splice(header, at, junk)
        if draw(st.booleans()):  # length field updated: may still be valid (e.g. whitespace)
            return _with_header(spec, new_header), f"junk {junk!r} at header byte {at}, length updated", False, None
        return struct.pack("<Q", n) + new_header + spec.data, f"junk {junk!r} at header byte {at}", True, None
    if kind == "insert_junk_data":
        junk = draw(st.binary(min_size=1, max_size=8))
        at = draw(st.integers(8 + n, len(blob)))
        return _splice(blob, at, junk), f"junk {junk!r} in the data at byte {at}", True, None
    if kind == "non_utf8":
        bad = draw(
            st.sampled_from(
                [b"\xff", b"\xfe", b"\x80", b"\xc0\x80", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82"]
            )
        )
        at = draw(st.integers(0, n))
        return _with_header(spec, _splice(header, at, bad)), f"{bad!r} at header byte {at}", True, None
    if kind == "top_level":
        value = draw(st.sampled_from([[], [1], 0, 3.5, "x", None, True, [{"a": 1}]]))
        return _with_header(spec, json.dumps(value).encode()), f"header is {value!r}", True, None
    if kind == "bad_metadata":
        # falsy non-objects ([], 0, "", false) are tested below; these must all be refused
        value = draw(
            st.sampled_from(
                [{"k": 1}, {"k": None}, {"k": ["v"]}, {"k": {}}, {"k": True}, {"a": "b", "k": 2.5}, ["k"], 1, "x", True]
            )
        )
        entries = [e for e in spec.entries if e[0] != "__metadata__"]
        entries.insert(draw(st.integers(0, len(entries))), ("__metadata__", value))
        return replace(spec, entries=entries).blob(), f"__metadata__ = {value!r}", True, "__metadata__"

    # the rest edit one tensor entry
    edit = _edit_entry(draw, spec, nonempty=kind in ("shift_offsets", "reverse_offsets"))
    if edit is None:  # no (non-empty) tensor to edit: truncate instead
        return blob[: len(blob) - 1], "truncated by one byte", True, None
    spec, i, info = edit
    name = spec.entries[i][0]
    begin, end = info["data_offsets"]
    substring = None
    if kind == "dup_key":
        spec.extra_parts = [(draw(st.integers(0, len(spec.entries))), spec.part(name, info))]
        return spec.blob(), f"entry {name!r} written twice", True, "appears twice"
    if kind == "bad_dtype":
        info["dtype"] = draw(
            st.text(max_size=8).filter(lambda s: s not in DTYPES)
            | st.sampled_from(
                [
                    "f32",
                    "FP32",
                    "float32",
                    "F8_E4M3FN",
                    "I4",
                    "U4",
                    "Q4_0",
                    "F32 ",
                    " BF16",
                    None,
                    32,
                    ["F32"],
                    {"F32": 1},
                ]
            )
        )
        substring = "unknown dtype"
    elif kind == "shift_offsets":  # a non-empty tensor moved: overlap, gap, negative or out of range
        delta = draw(st.integers(-6, 6).filter(bool) | st.sampled_from([len(spec.data), 2**40, 2**64]))
        info["data_offsets"] = [begin + delta, end + delta]
    elif kind == "resize_offsets":  # byte length no longer matches the shape
        which = draw(st.sampled_from([0, 1]))
        delta = draw(st.integers(-3, 3).filter(bool) | st.just(2**64))
        offsets = [begin, end]
        offsets[which] += delta
        info["data_offsets"] = offsets
    elif kind == "reverse_offsets":
        info["data_offsets"] = [end, begin]
    elif kind == "bad_offsets":
        info["data_offsets"] = draw(
            st.sampled_from(
                [
                    [float(begin), end],
                    [begin, float(end)],
                    [begin],
                    [begin, end, end],
                    [],
                    None,
                    f"{begin},{end}",
                    {"begin": begin},
                    [str(begin), end],
                    [begin, None],
                ]
            )
            | st.just([True, end] if begin == 1 else [False, end] if begin == 0 else [begin, -end - 1])
        )
    elif kind == "bad_shape":
        bad = draw(st.sampled_from(NOT_INTEGERS))
        shape = list(info["shape"])
        if shape and draw(st.booleans()):
            shape[draw(st.integers(0, len(shape) - 1))] = bad
        else:
            shape.insert(draw(st.integers(0, len(shape))), bad)
        info["shape"] = draw(st.just(shape) | st.sampled_from([None, 3, "[2, 2]", {"0": 2}]))
    elif kind == "non_object_entry":
        info = draw(st.sampled_from(NOT_OBJECTS))
        substring = "not an object"
    elif kind == "missing_field":
        del info[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
    spec.entries[i] = (name, info)
    return spec.blob(), f"entry {name!r} -> {info!r} ({kind})", True, substring


@pytest.mark.parametrize("kind", KINDS)
@settings(SETTINGS, max_examples=15)
@given(data=st.data())
def test_corrupted_files_raise_checkpoint_error_only(workdir, kind, data):
    blob, what, must_fail, substring = data.draw(corrupted(kind), label="corruption")
    note(what)
    path = write(workdir, blob)
    try:
        result = qtool_read(path)
        if isinstance(result, BaseException) or must_fail:
            error = assert_checkpoint_error(result, path)
            if substring:
                assert substring in str(error), str(error)

        reference = reference_read(path)
        event(
            f"qtool {'rejects' if isinstance(result, BaseException) else 'accepts'}, reference {'rejects' if reference is None else 'accepts'}"
        )
        if reference is not None and "written twice" not in what:
            # the reference accepts it, so qtool must too, and read the same thing
            assert not isinstance(result, BaseException), f"reference accepts, qtool says: {result}"
            tensors, metadata = result
            assert reference[0] == {t.name: (t.dtype.name, list(t.shape)) for t in tensors}
            assert reference[1] == metadata
        if must_fail and "written twice" not in what:
            # every deliberate corruption is one the reference refuses as well
            assert reference is None, f"reference accepts a file qtool refuses: {result}"
    finally:
        cleanup(path)


@settings(SETTINGS, max_examples=50)
@given(spec=valid_specs(min_tensors=1), data=st.data())
def test_duplicate_names_are_refused_though_the_reference_keeps_the_last(workdir, ref_dtypes, spec: Spec, data):
    """qtool is stricter than serde's map here (CONVENTIONS §12: duplicate names are not allowed)."""
    i = data.draw(st.sampled_from(_tensor_indexes(spec)))
    name, info = spec.entries[i]
    spec.extra_parts = [(data.draw(st.integers(0, len(spec.entries))), spec.part(name, info))]
    path = write(workdir, spec.blob())
    try:
        error = assert_checkpoint_error(qtool_read(path), path)
        assert f"tensor name {name!r} appears twice" in str(error)
        if {v["dtype"] for v in spec.tensors.values()} <= ref_dtypes:
            assert reference_read(path) is not None  # the reference silently keeps the last one
    finally:
        cleanup(path)


@pytest.mark.parametrize(
    "blob, substring",
    [
        (b"", "empty"),
        (b"\x02\x00\x00", "shorter than the 8-byte"),
        (struct.pack("<Q", 2), "past the end"),
        (struct.pack("<Q", MAX_HEADER_SIZE + 1) + b"{}", "over the 100000000-byte limit"),
        (struct.pack("<Q", 2**64 - 1) + b"{}", "over the"),
        (struct.pack("<Q", 2) + b"{}" + b"\0", "1 trailing bytes"),
        (struct.pack("<Q", 4) + b"[{}]", "expected an object"),
        (struct.pack("<Q", 2) + b"{]", "not JSON"),
        (struct.pack("<Q", 3) + b"{\xff}", "not valid UTF-8"),
        (struct.pack("<Q", 9) + b'{"a":"b"}', "not an object"),
        (struct.pack("<Q", 100) + b"[" * 100, "not JSON"),
        (struct.pack("<Q", 30_000) + b"[" * 30_000, "not JSON"),  # deeper than the recursion limit
    ],
)
def test_hand_written_corruptions(workdir, blob, substring):
    path = write(workdir, blob)
    try:
        error = assert_checkpoint_error(qtool_read(path), path)
        assert substring in str(error), str(error)
        assert reference_read(path) is None
    finally:
        cleanup(path)


def test_empty_header_and_metadata_only_are_valid(workdir):
    for header in (b"{}", b'{"__metadata__":{"a":"b"}}', b'{"__metadata__":null}   '):
        path = write(workdir, struct.pack("<Q", len(header)) + header)
        tensors, metadata = read_safetensors_file(path)
        assert tensors == [] and metadata == ({"a": "b"} if b'"a"' in header else {})
        assert reference_read(path) is not None
        cleanup(path)


# -- cases where the reference refuses and a naive reader would not -------------------------------

_ENTRY = '"dtype":"U8","shape":[1],"data_offsets":[0,1]'


def _raw_file(workdir, header: str, data: bytes = b"x") -> str:
    raw = header.encode()
    return write(workdir, struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("where", ["shape", "extra_field", "metadata_key_value"])
def test_huge_integer_literal_is_a_checkpoint_error(workdir, where):
    big = "9" * 5000
    header = {
        "shape": '{"a":{"dtype":"U8","shape":[%s],"data_offsets":[0,1]}}' % big,
        "extra_field": '{"a":{%s,"x":%s}}' % (_ENTRY, big),
        "metadata_key_value": '{"__metadata__":{"k":%s},"a":{%s}}' % (big, _ENTRY),
    }[where]
    path = _raw_file(workdir, header)
    try:
        assert reference_read(path) is None  # serde: "number out of range"
        assert_checkpoint_error(qtool_read(path), path)
    finally:
        cleanup(path)


@pytest.mark.parametrize(
    "header",
    [
        '{"a":{"dtype":"U8","shape":[1],"data\\u005foffsets":[0,1]},"a":{%s}}' % _ENTRY,
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"\\u0061":{%s}}'
        % _ENTRY.replace("data_offsets", "data\\u005foffsets"),
        '{"a":5,"a":{%s}}' % _ENTRY,
        '{"a":{},"a":{%s}}' % _ENTRY,
    ],
    ids=["escaped-key", "escaped-name-and-key", "first-is-number", "first-is-empty-object"],
)
def test_duplicate_names_are_always_refused(workdir, header):
    path = _raw_file(workdir, header)
    try:
        error = assert_checkpoint_error(qtool_read(path), path)
        assert "appears twice" in str(error)
    finally:
        cleanup(path)


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(
            '{"\\ud800x":{%s}}' % _ENTRY,
            id="lone-surrogate-name",
        ),
        pytest.param(
            '{"__metadata__":{"k":"\\udc00"},"a":{%s}}' % _ENTRY,
            id="lone-surrogate-metadata",
        ),
        *[
            pytest.param(
                '{"__metadata__":%s,"a":{%s}}' % (value, _ENTRY),
                id=f"metadata-{value}",
            )
            for value in ("[]", "0", '""', "false")
        ],
        pytest.param(
            '{"__metadata__":{"a":"b"},"__metadata__":{"c":"d"},"a":{%s}}' % _ENTRY,
            id="duplicate-metadata",
        ),
        pytest.param(
            '{"a":{"dtype":"I8",%s}}' % _ENTRY,
            id="duplicate-dtype-field",
        ),
        pytest.param(
            '{"a":{%s,"x":NaN}}' % _ENTRY,
            id="nan-literal",
        ),
        pytest.param(
            '{"z":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]},"a":{%s}}' % _ENTRY,
            id="shape-overflow",
        ),
        pytest.param(
            '{"z":{"dtype":"U8","shape":[18446744073709551616,0],"data_offsets":[0,0]},"a":{%s}}' % _ENTRY,
            id="shape-entry-over-u64",
        ),
    ],
)
def test_what_the_reference_refuses_qtool_refuses(workdir, header):
    path = _raw_file(workdir, header)
    try:
        assert reference_read(path) is None
        assert_checkpoint_error(qtool_read(path), path)
    finally:
        cleanup(path)
