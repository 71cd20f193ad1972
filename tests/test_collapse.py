from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qtool.cli.collapse import collapse_rows, format_indices
from qtool.cli.text import escape, human_bytes, human_count


def test_format_indices():
    assert format_indices([0, 1, 2, 3]) == "0-3"
    assert format_indices([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert format_indices([4]) == "4"


@given(st.sets(st.integers(0, 200), min_size=1))
def test_format_indices_round_trips(indices):
    out = set()
    for run in format_indices(sorted(indices)).split(","):
        start, _, end = run.partition("-")
        out.update(range(int(start), int(end or start) + 1))
    assert out == indices


def test_collapse_sums_and_keeps_order():
    rows = [
        ["emb.weight", (8, 4), "BF16", 32, 64],
        ["m.layers.0.up.weight", (4, 4), "BF16", 16, 32],
        ["m.layers.1.up.weight", (4, 4), "BF16", 16, 32],
        ["m.layers.2.up.weight", (4, 4), "F32", 16, 64],
        ["m.layers.3.up.weight", (4, 4), "BF16", 16, 32],
        ["norm.weight", (4,), "BF16", 4, 8],
    ]
    out = collapse_rows(rows, key_columns=(1, 2), sum_columns=(3, 4))
    assert out == [
        ["emb.weight", (8, 4), "BF16", 32, 64],
        ["m.layers.[0-1,3].up.weight ×3", (4, 4), "BF16", 48, 96],
        ["m.layers.2.up.weight", (4, 4), "F32", 16, 64],
        ["norm.weight", (4,), "BF16", 4, 8],
    ]


def test_escape_neutralises_terminal_control():
    assert escape("model.layers.0.weight") == "model.layers.0.weight"
    assert escape("evil\x1b[2J\nname\t\x00") == "evil\\x1b[2J\\nname\\t\\x00"
    assert escape("a\\b") == "a\\b"  # a backslash is doubled only where it reads as an escape
    assert escape("a\\x01") == "a\\\\x01"
    assert escape("\u202edrow") == "\\u202edrow"  # right-to-left override


def test_human_numbers():
    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 KiB" and human_bytes(3 * 2**30) == "3.0 GiB"
    assert human_count(999) == "999" and human_count(722176) == "722.18K" and human_count(7_000_000_000) == "7.00B"
