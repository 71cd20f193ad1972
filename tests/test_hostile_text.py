"""Text from files that no output can carry (issue 42 #7) or that makes a long line (#12).

- A lone UTF-16 surrogate cannot be encoded as UTF-8, so a name holding one breaks `--json`,
  reports and output files half-way. Every reader that makes a str from a file's bytes either
  decodes strict UTF-8 (no surrogate can come out), escapes, or refuses a lone surrogate at read
  (exit 2, one line): the safetensors header and JSON side files (`untrusted_json`), and the
  pickle's protocol-0 UNICODE opcode (`pickle_machine`), the one pickle opcode that can make one.
- A name in a message is escaped once (not repr's escapes escaped again) and then cut, spaces
  or not.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

import qtool
from qtool.errors import CheckpointError
from qtool.message_text import NAME_LIMIT, message_line
from tests.conftest import REPO
from tests.fuzz.handmade import surrogate_key_pt


def _qtool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qtool", *argv], capture_output=True, cwd=REPO, timeout=300)


def _one_line_exit_2(result: subprocess.CompletedProcess, path) -> str:
    stderr = result.stderr.decode("utf-8")  # strict: a surrogate never reaches stderr raw
    assert result.returncode == 2, stderr
    lines = stderr.splitlines()
    assert lines[0].startswith(f"error: {path}:"), lines
    assert "Traceback" not in stderr and "internal error" not in stderr
    return lines[0]


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_lone_surrogate_in_a_pickle_key_is_refused_at_read(tmp_path, legacy):
    path = tmp_path / "model.pt"
    surrogate_key_pt(path, legacy=legacy)
    with pytest.raises(CheckpointError, match="lone UTF-16 surrogate"):
        qtool.open_checkpoint(path)
    result = _qtool("inspect", str(path), "--json")
    assert result.stdout == b""  # no half-written JSON document
    line = _one_line_exit_2(result, path)
    assert "lone UTF-16 surrogate" in line


def test_every_command_refuses_a_surrogate_key_in_one_line(tmp_path):
    path = tmp_path / "model.pt"
    surrogate_key_pt(path)
    plain = tmp_path / "plain.pt"
    import torch

    torch.save({"c.weight": torch.ones(2, 2)}, plain)
    for argv in (
        ["compare", str(plain), str(path)],
        ["quantize", str(path), "-o", str(tmp_path / "out"), "--scheme", "int8", "-q"],
        ["check", str(path), "--html", str(tmp_path / "report.html")],
    ):
        result = _qtool(*argv)
        assert "lone UTF-16 surrogate" in _one_line_exit_2(result, path), argv
        assert not (tmp_path / "out").exists() and not (tmp_path / "report.html").exists()


# -- #12: escaped once, then cut ------------------------------------------------------------------


def test_a_repr_name_is_not_escaped_twice():
    assert message_line("tensor 'a\\x01b' is short") == "tensor 'a\\x01b' is short"  # as repr spells it
    assert message_line("tensor 'a\x01b' is short") == "tensor 'a\\x01b' is short"  # raw: escaped here
    assert message_line(f"tensor {'a' + chr(0x1B) + '[2J'!r}") == "tensor 'a\\x1b[2J'"


@pytest.mark.parametrize("unit", ["\x01 ", "a b", "\x01", "\u200f", "é "])
def test_a_quoted_name_is_cut_whatever_it_holds(unit):
    name = unit * 8000
    line = message_line(f"tensor {name!r} is 999 bytes but shape [4] of F32 needs 16")
    assert line.endswith("…' is 999 bytes but shape [4] of F32 needs 16"), line[-80:]
    assert len(line) <= NAME_LIMIT + 60, len(line)
    assert "\\\\" not in line


def test_cli_error_naming_a_long_name_with_spaces_and_controls_is_short(tmp_path):
    name = "\x01 " * 8000
    raw = json.dumps({name: {"dtype": "F32", "shape": [4], "data_offsets": [0, 999]}}).encode()
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    result = _qtool("inspect", str(path))
    line = _one_line_exit_2(result, path)
    assert len(line) < 300 + len(str(path)), len(line)
    assert "'\\x01 \\x01 " in line and "\\\\" not in line


def test_an_excerpt_is_escaped_then_cut():
    from qtool.message_text import excerpt

    tags = "\U000e0001" * 199  # each escapes to 10 characters
    assert len(excerpt(tags)) == NAME_LIMIT and excerpt(tags).startswith("\\U000e0001")
    assert excerpt("a\\x01b") == "a\\x01b"  # already escaped text is left as it is
    assert message_line(excerpt(tags)) == excerpt(tags)


def test_an_imatrix_entry_name_is_escaped_then_cut(tmp_path):
    """The imatrix reader cut a name to 200 characters, then the message escaped it: a name of
    invisible tag characters and spaces came out 10x longer than the cut."""
    import numpy as np

    from tests.imatrix_files import legacy_bytes

    name = (("\U000e0001" * 150 + " ") * 50).encode()
    path = tmp_path / "bad.dat"
    path.write_bytes(legacy_bytes([(name, 1, np.ones(4)), (name, 1, np.ones(4))]))
    result = _qtool("inspect", str(path))
    line = _one_line_exit_2(result, path)
    assert "appears twice" in line and len(line) < 300 + len(str(path)), len(line)


def test_json_naming_a_path_that_is_not_utf8_is_valid_json_and_utf8(tmp_path):
    """A file name that is not UTF-8 (from the command line or a folder listing) reaches qtool
    as lone surrogates: `--json` wrote it as a raw byte (invalid UTF-8) or failed half-way."""
    import os

    from tests.conftest import write_safetensors

    folder = os.fsencode(tmp_path)
    path = folder + b"/\xff.safetensors"
    write_safetensors(os.fsdecode(path), {"w.weight": ("F32", [2, 2])})
    for env in ({"LC_ALL": "C.UTF-8"}, {"LC_ALL": "C", "PYTHONUTF8": "0"}, {"PYTHONIOENCODING": "utf-8:strict"}):
        result = subprocess.run(
            [sys.executable, "-m", "qtool", "inspect", os.fsdecode(path), "--json"],
            capture_output=True,
            cwd=REPO,
            timeout=300,
            env={**os.environ, **env},
        )
        assert result.returncode == 0, (env, result.stderr)
        document = json.loads(result.stdout.decode("utf-8"))  # strict: valid UTF-8
        assert os.fsencode(document["path"]) == path, env
