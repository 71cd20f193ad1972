"""Every bad input is a `CheckpointError`: exit code 2, one `error: <path>: ...` line and one
`hint: ...` line on stderr, nothing on stdout, no traceback (DESIGN "Errors and exit codes").

Each case is checked through `qtool.open_checkpoint` and through `qtool inspect` (CliRunner).
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.dtypes import DTYPES, nbytes_for
from qtool.errors import CheckpointError, QtoolError

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("QTOOL_DEBUG", raising=False)


# -- writing files ----------------------------------------------------------------------------------


def raw_safetensors(path: Path, header: Any, data: bytes = b"", header_len: int | None = None) -> Path:
    """A safetensors file from a header (dict, str or bytes) and data, with an optional false length."""
    raw = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def tiny_safetensors(
    path: Path, tensors: dict[str, tuple[str, list[int]]], metadata: dict[str, str] | None = None
) -> Path:
    """A valid file: tensors stored contiguously in dict order, zero-filled."""
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = nbytes_for(DTYPES[dtype], math.prod(shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return raw_safetensors(path, header, bytes(offset))


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# -- the cases: each builds its input and returns (what to pass, the file the error names, a substring)

Case = Callable[[Path], tuple[Path, Path, str]]


def missing_path(tmp: Path):
    path = tmp / "nope.safetensors"
    return path, path, "no such file or directory"


def directory_without_checkpoint(tmp: Path):
    folder = tmp / "model"
    folder.mkdir()
    (folder / "README.md").write_text("weights coming soon\n")
    (folder / "model.bin").write_bytes(b"\0" * 16)
    return folder, folder, "directory holds no checkpoint"


def zero_byte_file(tmp: Path):
    path = tmp / "model.safetensors"
    path.write_bytes(b"")
    return path, path, "file is empty (0 bytes)"


def file_under_8_bytes(tmp: Path):
    path = tmp / "model.safetensors"
    path.write_bytes(b"\x05\0\0\0\0")
    return path, path, "file is 5 bytes, shorter than the 8-byte header length"


def header_length_past_end(tmp: Path):
    path = raw_safetensors(tmp / "model.safetensors", b"{}", b"\0" * 10, header_len=1000)
    return path, path, "header length 1000 runs past the end of the 20-byte file"


def header_length_over_100mb(tmp: Path):
    path = raw_safetensors(tmp / "model.safetensors", b"{}", header_len=100_000_001)
    return path, path, "header length 100000001 is over the 100000000-byte limit"


def non_json_header(tmp: Path):
    path = raw_safetensors(tmp / "model.safetensors", b"{this is not json}  ")
    return path, path, "header is not JSON"


def non_utf8_header(tmp: Path):
    path = raw_safetensors(tmp / "model.safetensors", b'{"w\xff\xfe": {}}')
    return path, path, "header is not valid UTF-8 (byte 3)"


def overlapping_offsets(tmp: Path):
    header = {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}
    path = raw_safetensors(tmp / "model.safetensors", header, bytes(6))
    return path, path, "tensor 'b' data_offsets [2, 6) overlaps the previous tensor"


def out_of_range_offsets(tmp: Path):
    header = {"a": entry("F32", [2], 0, 8)}
    path = raw_safetensors(tmp / "model.safetensors", header, bytes(4))
    return path, path, "tensor 'a' data_offsets end 8 is past the end of the 4-byte data"


def gap_between_offsets(tmp: Path):
    header = {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 6, 10)}
    path = raw_safetensors(tmp / "model.safetensors", header, bytes(10))
    return path, path, "tensor 'b' data_offsets [6, 10) leaves a gap before it"


def byte_length_not_matching_shape(tmp: Path):
    header = {"a": entry("BF16", [3], 0, 4)}
    path = raw_safetensors(tmp / "model.safetensors", header, bytes(4))
    return path, path, "tensor 'a' is 4 bytes but shape [3] of BF16 needs 6"


def trailing_bytes(tmp: Path):
    path = tiny_safetensors(tmp / "model.safetensors", {"a": ("F16", [2, 2])})
    with open(path, "ab") as handle:
        handle.write(b"junk")
    return path, path, "4 trailing bytes after the last tensor"


def unknown_dtype(tmp: Path):
    header = {"a": entry("F12", [4], 0, 4)}
    path = raw_safetensors(tmp / "model.safetensors", header, bytes(4))
    return path, path, "tensor 'a' has unknown dtype 'F12'"


def index_naming_missing_shard(tmp: Path):
    folder = tmp / "model"
    tiny_safetensors(folder / "model-00001-of-00002.safetensors", {"a": ("F32", [2])})
    index = folder / "model.safetensors.index.json"
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    index.write_text(json.dumps({"metadata": {"total_size": 16}, "weight_map": weight_map}))
    return folder, index, "index names shard 'model-00002-of-00002.safetensors', which does not exist"


def index_naming_tensor_not_in_shard(tmp: Path):
    folder = tmp / "model"
    tiny_safetensors(folder / "model-00001-of-00001.safetensors", {"a": ("F32", [2])})
    index = folder / "model.safetensors.index.json"
    weight_map = {"a": "model-00001-of-00001.safetensors", "lm_head.weight": "model-00001-of-00001.safetensors"}
    index.write_text(json.dumps({"metadata": {"total_size": 8}, "weight_map": weight_map}))
    return (
        index,
        index,
        "index maps tensor 'lm_head.weight' to 'model-00001-of-00001.safetensors', but that shard does not hold it",
    )


def config_json_not_json(tmp: Path):
    folder = tmp / "model"
    tiny_safetensors(folder / "model.safetensors", {"a": ("F32", [2])})
    (folder / "config.json").write_text('{"model_type": "llama",')
    return folder, folder / "config.json", "is not valid JSON"


def duplicate_tensor_names(tmp: Path):
    text = '{"w": %s, "w": %s}' % (json.dumps(entry("U8", [2], 0, 2)), json.dumps(entry("U8", [2], 2, 4)))
    path = raw_safetensors(tmp / "model.safetensors", text, bytes(4))
    return path, path, "tensor name 'w' appears twice in the header"


CASES: list[Case] = [
    missing_path,
    directory_without_checkpoint,
    zero_byte_file,
    file_under_8_bytes,
    header_length_past_end,
    header_length_over_100mb,
    non_json_header,
    non_utf8_header,
    overlapping_offsets,
    out_of_range_offsets,
    gap_between_offsets,
    byte_length_not_matching_shape,
    trailing_bytes,
    unknown_dtype,
    index_naming_missing_shard,
    index_naming_tensor_not_in_shard,
    config_json_not_json,
    duplicate_tensor_names,
]


def assert_cli_error(result, error: CheckpointError) -> None:
    """Exit 2; stderr is exactly `error: <path>: <message>` and `hint: <hint>`; stdout is empty."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit)  # the boundary exited; nothing escaped
    assert result.stdout == ""
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0] == f"error: {error}"
    assert lines[0].startswith(f"error: {error.path}: ")
    assert lines[1] == f"hint: {error.hint}"
    assert result.stderr.endswith("\n")


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input(tmp_path, case: Case):
    arg, error_path, substring = case(tmp_path)

    with pytest.raises(CheckpointError) as info:
        qtool.open_checkpoint(arg)
    error = info.value
    assert isinstance(error, QtoolError) and error.exit_code == 2
    assert error.path == str(error_path)
    assert str(error).startswith(f"{error_path}: ")
    assert substring in str(error)
    assert error.hint and "\n" not in str(error) + error.hint

    assert_cli_error(runner.invoke(app, ["inspect", str(arg)]), error)
    # the JSON, TSV and --raw paths fail the same way, before anything reaches stdout
    assert_cli_error(runner.invoke(app, ["inspect", str(arg), "--json", "--raw"]), error)


def test_duplicate_name_across_files_of_a_folder(tmp_path):
    folder = tmp_path / "model"
    a, b = folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors"
    tiny_safetensors(a, {"w": ("U8", [2])})
    tiny_safetensors(b, {"w": ("U8", [2])})
    with pytest.raises(CheckpointError, match="is stored in both") as info:
        qtool.open_checkpoint(folder)
    assert str(info.value).startswith(f"{b}: ")
    result = runner.invoke(app, ["inspect", str(folder)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {b}: tensor 'w' is stored in both")


def test_folder_named_like_a_weights_file(tmp_path):
    # a sub-folder named *.safetensors is not a weights file: the folder lists what it holds
    folder = tmp_path / "model"
    tiny_safetensors(folder / "model.safetensors", {"w": ("U8", [2])})
    (folder / "extra.safetensors").mkdir()
    result = runner.invoke(app, ["inspect", str(folder), "-f", "names"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "w\n"
    assert qtool.open_checkpoint(folder).files == [str(folder / "model.safetensors")]
    # named directly, it is a folder without a checkpoint
    result = runner.invoke(app, ["inspect", str(folder / "extra.safetensors")])
    assert result.exit_code == 2 and "holds no checkpoint" in result.stderr


# -- through a real process -------------------------------------------------------------------------


def run_qtool(*args: str, debug: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QTOOL_DEBUG"}
    if debug:
        env["QTOOL_DEBUG"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "qtool", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )


def test_subprocess_reports_the_error_in_two_lines(tmp_path):
    arg, _, _ = trailing_bytes(tmp_path)
    result = run_qtool("inspect", str(arg))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: {arg}: 4 trailing bytes after the last tensor",
        "hint: the file is not a valid safetensors file; re-export it, or check that the download finished",
    ]


def test_debug_env_shows_the_traceback(tmp_path):
    arg, _, _ = trailing_bytes(tmp_path)
    result = run_qtool("inspect", str(arg), debug=True)
    assert result.returncode != 0
    assert result.stdout == ""
    assert "Traceback" in result.stderr
    assert "CheckpointError" in result.stderr


def test_debug_env_reraises_under_clirunner(tmp_path, monkeypatch):
    arg, _, _ = trailing_bytes(tmp_path)
    monkeypatch.setenv("QTOOL_DEBUG", "1")
    result = runner.invoke(app, ["inspect", str(arg)])
    assert isinstance(result.exception, CheckpointError)
    assert "trailing bytes" in str(result.exception)
    assert result.exit_code != 0
    monkeypatch.setenv("QTOOL_DEBUG", "0")  # "0" means off
    assert runner.invoke(app, ["inspect", str(arg)]).exit_code == 2


def test_lone_surrogate_name_is_refused_not_a_crash(tmp_path):
    header = '{"w\\ud800": %s}' % json.dumps(entry("U8", [1], 0, 1))
    path = raw_safetensors(tmp_path / "model.safetensors", header, b"\0")
    result = run_qtool("inspect", str(path), "--json")
    assert "Traceback" not in result.stderr
    assert result.returncode == 2, result.stderr


# -- names from the file can't drive the terminal --------------------------------------------------

EVIL = "evil\x1b[2J\nname\r\t\x07\x9b1m\u202e"


@pytest.fixture
def evil_model(tmp_path) -> Path:
    return tiny_safetensors(tmp_path / "model.safetensors", {EVIL: ("F16", [2, 2]), "ok.weight": ("F16", [2])})


def _has_raw_controls(text: str, allowed: str = "\n") -> bool:
    return any(not ch.isprintable() and ch not in allowed for ch in text)


@pytest.mark.parametrize("raw", [False, True], ids=["weights", "raw"])
@pytest.mark.parametrize("fmt", ["table", "tsv", "names"])
def test_control_characters_in_names_are_escaped(evil_model, fmt, raw):
    result = runner.invoke(app, ["inspect", str(evil_model), "-f", fmt] + (["--raw"] if raw else []))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert not _has_raw_controls(out, "\n\t" if fmt == "tsv" else "\n"), repr(out)  # TSV's own separators
    for bad in ("\x1b", "\r", "\x07", "\x9b", "\u202e"):
        assert bad not in out
    escaped = "evil\\x1b[2J\\nname\\r\\t\\x07\\x9b1m\\u202e"
    assert escaped in out  # the whole name on one line, escaped
    if fmt == "names":
        assert out.splitlines() == [escaped, "ok.weight"]
    if fmt == "tsv":
        lines = out.splitlines()
        assert len(lines) == 3
        assert len({line.count("\t") for line in lines}) == 1  # no injected column or row
        assert lines[1].split("\t")[0] == escaped


@pytest.mark.parametrize("raw", [False, True], ids=["weights", "raw"])
def test_json_keeps_the_exact_name(evil_model, raw):
    result = runner.invoke(app, ["inspect", str(evil_model), "--json"] + (["--raw"] if raw else []))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.endswith("\n") and "\n" not in out[:-1]  # one line: the name's \n is escaped
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out  # C0 controls are JSON escapes
    document = json.loads(out)
    names = [t["name"] for t in document["tensors"]] if raw else [w["name"] for w in document["weights"]]
    assert EVIL in names
