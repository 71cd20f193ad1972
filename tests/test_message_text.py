"""Names from files in messages: escaped, and cut to about 200 characters with "…" (issue 18 #8)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from qtool.message_text import LINE_LIMIT, NAME_LIMIT, escape, message_line, shorten
from tests.conftest import REPO


@given(st.text(max_size=3000), st.integers(min_value=1, max_value=500))
def test_shorten_fits_the_limit_and_keeps_a_prefix(text, limit):
    cut = shorten(text, limit)
    assert len(cut) <= limit
    assert cut == text if len(text) <= limit else (cut.endswith("…") and text.startswith(cut[:-1]))


@given(st.text(max_size=5000))
def test_a_message_line_is_bounded_and_escaped(text):
    line = message_line(text)
    assert len(line) <= LINE_LIMIT
    assert "\n" not in line and "\r" not in line
    assert all(len(word) <= NAME_LIMIT for word in line.split())


def test_short_messages_are_unchanged_and_long_names_keep_their_context():
    assert message_line("tensor 'a.weight' is cut short") == "tensor 'a.weight' is cut short"
    name = "x" * 16000
    line = message_line(f"tensor {name!r} is 999 bytes but shape [4] of F32 needs 16")
    assert line.startswith("tensor 'xxx") and line.endswith("…' is 999 bytes but shape [4] of F32 needs 16")
    assert len(line) < 300
    assert escape("a\x1b[2Jb") == "a\\x1b[2Jb"


def test_a_backslash_is_doubled_only_where_it_would_read_as_an_escape():
    """issue 42 item 24: a user's `re:.*foo\\.bar` was shown as `re:.*foo\\.bar`. A backslash stays
    single unless what follows would read as one of escape's own sequences."""
    assert escape("re:.*foo\\.bar") == "re:.*foo\\.bar"
    assert escape("re:\\d+\\s") == "re:\\d+\\s"
    assert escape("a\\x1b") == "a\\\\x1b" and escape("a\\n") == "a\\\\n" and escape("a\\\\b") == "a\\\\\\b"
    assert escape("a\x1b") == "a\\x1b" and escape("a\\") == "a\\"


@given(st.text(max_size=200))
def test_escaped_text_reads_back_as_it_was(text):
    assert _unescape(escape(text)) == text


def _unescape(shown: str) -> str:
    import re

    singles = {"t": "\t", "n": "\n", "r": "\r", "\\": "\\"}

    def one(found):
        body = found.group(1)
        if body[0] in singles:
            return singles[body[0]]
        if body[0] in "xuU":
            return chr(int(body[1:], 16))
        return found.group(0)

    return re.sub(r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|[tnr\\])", one, shown)


def test_cli_error_naming_a_16_kb_tensor_name_is_one_short_line(tmp_path):
    name = "w" * 16000
    raw = json.dumps({name: {"dtype": "F32", "shape": [4], "data_offsets": [0, 999]}}).encode()
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    result = subprocess.run(
        [sys.executable, "-m", "qtool", "inspect", str(path)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"error: {path}: tensor 'www") and "…" in lines[0]
    assert all(len(line) < 400 for line in lines), [len(line) for line in lines]
