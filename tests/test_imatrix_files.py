"""llama.cpp's importance-matrix files (qtool/formats/imatrix.py): the fixtures llama-imatrix
wrote (tests/fixtures/imatrix/make_fixtures.py) read in both formats to the same importance, the
importance as llama-quantize's `load_imatrix` derives it, and every hostile file one
ImatrixError naming the file."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qtool.errors import ImatrixError
from qtool.formats.imatrix import ImatrixEntry, read_imatrix
from tests.imatrix_files import TINY_DAT, TINY_GGUF, legacy_bytes, write_imatrix_gguf

TINY_NAMES = [
    f"blk.{i}.{n}.weight"
    for i in range(2)
    for n in (
        "attn_k",
        "attn_output",
        "attn_q",
        "attn_v",
        "ffn_down",
        "ffn_gate",
        "ffn_up",
    )
]


def test_the_gguf_fixture_holds_what_llama_imatrix_wrote():
    imatrix = read_imatrix(TINY_GGUF)
    assert imatrix.format == "gguf"
    assert list(imatrix.entries) == TINY_NAMES
    assert (imatrix.chunk_count, imatrix.chunk_size, imatrix.datasets) == (
        4,
        64,
        (b"topics.txt",),
    )
    q = imatrix.entries["blk.0.attn_q.weight"]
    assert (q.columns, q.matrices, q.counts) == (256, 1, (256,))  # 4 chunks x 64 tokens
    assert imatrix.entries["blk.0.ffn_down.weight"].columns == 128  # the MLP's width
    # q, k and v see the same input: llama-imatrix sums the same squares for each
    assert np.array_equal(q.sums, imatrix.entries["blk.0.attn_k.weight"].sums)


def test_the_legacy_fixture_gives_the_same_importance_as_the_gguf_one():
    """Two files llama-imatrix wrote from one run, in two layouts and two formulas
    ((sum / count) * ncall / ncall against sum / count): the same weights to float rounding."""
    gguf_file, dat = read_imatrix(TINY_GGUF), read_imatrix(TINY_DAT)
    assert dat.format == "dat" and list(dat.entries) == TINY_NAMES
    assert (dat.chunk_count, dat.chunk_size, dat.datasets) == (4, 0, (b"topics.txt",))
    assert dat.entries["blk.0.attn_q.weight"].counts == (4,)  # ncall: ceil(256 tokens / 64)
    for name in TINY_NAMES:
        np.testing.assert_allclose(
            dat.entries[name].importance(),
            gguf_file.entries[name].importance(),
            rtol=1e-6,
        )


def test_importance_is_llama_quantizes_sums_over_counts_per_expert_and_one_where_no_token_came():
    sums = np.arange(12, dtype=np.float32).reshape(3, 4) * np.float32(0.1)
    entry = ImatrixEntry("blk.0.ffn_up_exps.weight", sums.ravel(), (3, 0, 7))
    got = entry.importance()
    assert got.dtype == np.float32 and got.shape == (12,)
    assert np.array_equal(got[:4], sums[0] / np.float32(3))
    assert np.array_equal(got[4:8], np.ones(4, dtype=np.float32))  # llama.cpp: e = 1 for a zero count
    assert np.array_equal(got[8:], sums[2] / np.float32(7))
    legacy = ImatrixEntry("w", sums.ravel(), (0,), legacy=True)
    assert np.array_equal(legacy.importance(), sums.ravel())  # ncall 0: the values as they are


def test_counts_round_as_lround_does(tmp_path):
    path = tmp_path / "m.gguf"
    write_imatrix_gguf(path, {"a.weight": (np.ones((3, 32)), [2.5, 0.49999997, 3.4999998])})
    assert read_imatrix(path).entries["a.weight"].counts == (3, 0, 3)


def test_a_3d_expert_entry_reads_as_matrices_of_columns(tmp_path):
    path = tmp_path / "moe.gguf"
    write_imatrix_gguf(path, {"blk.0.ffn_down_exps.weight": (np.ones((4, 64)), [10, 0, 3, 1])})
    entry = read_imatrix(path).entries["blk.0.ffn_down_exps.weight"]
    assert (entry.matrices, entry.columns, entry.counts) == (4, 64, (10, 0, 3, 1))


def _gguf_case(tmp_path, **changes):
    entries = {"blk.0.attn_q.weight": (np.ones(32), [4])}
    extra = changes.pop("extra", ())
    entries.update(changes.pop("entries", {}))
    path = tmp_path / "bad.gguf"
    write_imatrix_gguf(path, entries, extra=extra, **changes)
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"entries": {"x.weight": (np.array([1.0, np.nan] * 16), [1])}},
            "x.weight.in_sum2 holds NaN or inf",
        ),
        (
            {"entries": {"x.weight": (np.array([1.0, np.inf] * 16), [1])}},
            "x.weight.in_sum2 holds NaN or inf",
        ),
        ({"entries": {"x.weight": (-np.ones(32), [1])}}, "negative sum of squares"),
        (
            {"entries": {"x.weight": (np.ones(32), [-1])}},
            "x.weight.counts holds a count that is negative",
        ),
        (
            {"entries": {"x.weight": (np.ones(32), [np.nan])}},
            "x.weight.counts holds a count that is negative, NaN",
        ),
        (
            {"extra": [("y.weight.in_sum2", np.ones(8, dtype=np.float32))]},
            "y.weight has no.counts tensor",
        ),
        (
            {"extra": [("y.weight.counts", np.ones(1, dtype=np.float32))]},
            "y.weight has no.in_sum2 tensor",
        ),
        (
            {
                "extra": [
                    ("y.weight.in_sum2", np.ones(8, dtype=np.float16)),
                    ("y.weight.counts", np.ones(1, dtype=np.float32)),
                ]
            },
            "y.weight.in_sum2 is F16",
        ),
        (
            {
                "extra": [
                    ("y.weight.in_sum2", np.ones(9, dtype=np.float32)),
                    ("y.weight.counts", np.ones(2, dtype=np.float32)),
                ]
            },
            "9 sums, not a whole row per each of its 2 counts",
        ),
        (
            {"metadata": False},
            "missing imatrix metadata (imatrix.datasets, imatrix.chunk_count, imatrix.chunk_size)",
        ),
    ],
)
def test_a_bad_gguf_imatrix_is_one_error_naming_the_file(tmp_path, changes, message):
    path = _gguf_case(tmp_path, **changes)
    with pytest.raises(ImatrixError) as caught:
        read_imatrix(path)
    assert message in caught.value.message
    assert caught.value.path == str(path) and "\n" not in str(caught.value)


def test_a_gguf_without_imatrix_tensors_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    write_imatrix_gguf(path, {}, extra=[("token_embd.weight", np.ones((2, 32), dtype=np.float32))])
    with pytest.raises(ImatrixError, match="holds no .in_sum2 / .counts tensors"):
        read_imatrix(path)


def test_a_cut_gguf_imatrix_is_one_error(tmp_path):
    data = TINY_GGUF.read_bytes()
    for size in (
        3,
        10,
        30,
        200,
        len(data) // 2,
        len(data) - 40,
    ):  # the last bytes are padding
        path = tmp_path / f"cut{size}.gguf"
        path.write_bytes(data[:size])
        with pytest.raises(ImatrixError):
            read_imatrix(path)


GOOD_LEGACY = [
    (b"blk.0.attn_q.weight", 2, np.ones(8)),
    (b"blk.0.ffn_down.weight", 2, np.full(4, 0.5)),
]


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "file is empty"),
        (struct.pack("<i", 0), "has 0 entries"),
        (struct.pack("<i", -3), "has -3 entries"),
        (struct.pack("<i", 2**30) + b"\0" * 32, "entries need at least"),
        (
            legacy_bytes([(b"a.weight", 1, np.ones(4)), (b"a.weight", 1, np.ones(4))]),
            "entry a.weight appears twice",
        ),
        (legacy_bytes([(b"a.weight", -1, np.ones(4))]), "entry a.weight has -1 calls"),
        (legacy_bytes([(b"a\xffb", 1, np.ones(4))]), "entry 1's name is not UTF-8"),
        (legacy_bytes([(b"a\0b", 1, np.ones(4))]), "holds a NUL byte"),
        (
            legacy_bytes([(b"a.weight", 1, np.array([1.0, np.nan, 1.0, 1.0]))]),
            "entry a.weight holds NaN or inf",
        ),
        (legacy_bytes([(b"a.weight", 1, -np.ones(4))]), "negative mean of squares"),
        (legacy_bytes(GOOD_LEGACY) + b"junk", "has 4 bytes after its last field"),
        (legacy_bytes(GOOD_LEGACY, chunk_count=-1, dataset=None), "chunk count of -1"),
        (legacy_bytes(GOOD_LEGACY)[:-3], "file is cut short: the dataset name"),
        (
            struct.pack("<i", 1) + struct.pack("<i", 2**31 - 1) + b"\0" * 20,
            "has a name of 2147483647 bytes",
        ),
        (
            legacy_bytes([(b"a.weight", 1, np.ones(4))])[:-6] + b"\0\0\0\0\0\0",
            None,
        ),  # fine: a value of 0
    ],
)
def test_a_bad_legacy_imatrix_is_one_error_naming_the_file(tmp_path, data, message):
    path = tmp_path / "bad.dat"
    path.write_bytes(data)
    if message is None:
        read_imatrix(path)
        return
    with pytest.raises(ImatrixError) as caught:
        read_imatrix(path)
    assert message in caught.value.message, caught.value.message
    assert caught.value.path == str(path)


def test_a_legacy_file_without_its_trailer_reads_with_no_chunks_and_no_dataset(
    tmp_path,
):
    path = tmp_path / "m.dat"
    path.write_bytes(legacy_bytes(GOOD_LEGACY, chunk_count=None))
    imatrix = read_imatrix(path)
    assert (imatrix.chunk_count, imatrix.datasets) == (0, ())
    assert list(imatrix.entries) == ["blk.0.attn_q.weight", "blk.0.ffn_down.weight"]
    path.write_bytes(legacy_bytes(GOOD_LEGACY, dataset=b"a.txt\0hidden"))
    assert read_imatrix(path).datasets == (b"a.txt",)  # a C string, as llama.cpp reads it


def test_every_prefix_of_the_legacy_fixture_reads_or_is_one_error(tmp_path):
    data = TINY_DAT.read_bytes()
    path = tmp_path / "cut.dat"
    for size in list(range(64)) + list(range(64, len(data), 997)):
        path.write_bytes(data[:size])
        try:
            read_imatrix(path)
        except ImatrixError:
            pass


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)), min_size=1, max_size=6))
def test_flipped_bytes_in_either_format_read_or_are_one_error(tmp_path, flips):
    for source in (TINY_DAT, TINY_GGUF):
        data = bytearray(source.read_bytes())
        for offset, value in flips:
            data[offset % len(data)] = value
        path = tmp_path / source.name
        path.write_bytes(bytes(data))
        try:
            read_imatrix(path)
        except ImatrixError:
            pass


def test_the_writer_makes_llama_imatrixs_file_byte_for_byte():
    """qtool imatrix's writer, given what the fixture holds, writes the fixture's own bytes."""
    from qtool.formats.imatrix import imatrix_gguf_bytes

    imatrix = read_imatrix(TINY_GGUF)
    entries = {name: (e.sums, list(e.counts)) for name, e in imatrix.entries.items()}
    assert (
        imatrix_gguf_bytes(entries, list(imatrix.datasets), imatrix.chunk_count, imatrix.chunk_size)
        == TINY_GGUF.read_bytes()
    )


def test_the_writer_lays_out_expert_tensors_as_matrices_of_columns(tmp_path):
    from qtool.formats.imatrix import imatrix_gguf_bytes

    sums = np.arange(3 * 32, dtype=np.float32)
    path = tmp_path / "moe.gguf"
    path.write_bytes(imatrix_gguf_bytes({"blk.0.ffn_up_exps.weight": (sums, [5, 0, 2])}, ["t.txt"], 1, 64))
    entry = read_imatrix(path).entries["blk.0.ffn_up_exps.weight"]
    assert (entry.matrices, entry.columns, entry.counts) == (3, 32, (5, 0, 2)) and np.array_equal(entry.sums, sums)
