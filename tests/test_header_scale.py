"""Headers from strangers at scale: 100k tensors list in seconds (benchmarks/bench_inspect.py
times 100k and 1.6M), and names and shapes that broke the arithmetic are one line, exit 2, or
simply listed."""

from __future__ import annotations

import dataclasses
import json
import struct
import time

import pytest
from typer.testing import CliRunner

from qtool.cli import app
from qtool.dtypes import DTYPES
from qtool.formats.checkpoint import StoredTensor
from qtool.weight import DATA, Weight

runner = CliRunner()


def empty_tensors_header(path, count: int) -> None:
    """A header of `count` zero-size tensors and no data, as a fuzzer's resource bomb."""
    header = {f"model.layers.{i}.weight": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
    blob = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)


def test_a_100k_tensor_header_lists_in_seconds(tmp_path):
    path = tmp_path / "many.safetensors"
    empty_tensors_header(path, 100_000)
    started = time.perf_counter()
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    elapsed = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["summary"]["weights"] == 100_000 and len(document["weights"]) == 100_000
    assert [w["name"] for w in document["weights"][:3]] == [f"model.layers.{i}.weight" for i in range(3)]
    assert elapsed < 15, f"{elapsed:.1f} s (5.9 s before, on a quiet machine; bench_inspect.py has the figure)"


def test_a_name_with_thousands_of_digits_lists(tmp_path):
    """Sorting by natural order int()ed every run of digits: 5000 of them is a ValueError."""
    path = tmp_path / "digits.safetensors"
    name = "layer." + "9" * 5000
    header = json.dumps(
        {
            name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "layer.2": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        }
    )
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(8))
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert [w["name"] for w in json.loads(result.stdout)["weights"]] == ["layer.2", name]


@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--stats"], ["check", "--no-nan"]], ids=" ".join)
def test_an_empty_shape_whose_dims_overflow_is_exit_2(tmp_path, command):
    """[0, 2^62, 64] passes the reference reader (its running product is 0), but torch's and
    numpy's stride arithmetic overflows on it: --stats died with exit 70."""
    path = tmp_path / "overflow.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [0, 2**62, 64], "data_offsets": [0, 0]}})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode())
    result = runner.invoke(app, [command[0], str(path), *command[1:]])
    assert result.exit_code == 2, result.output
    assert (
        result.stderr.splitlines()[0]
        == f"error: {path}: tensor 'w' shape [0, 4611686018427387904, 64] overflows 64 bits"
    )


def test_fast_constructors_build_the_same_objects():
    tensor = StoredTensor("w", DTYPES["F32"], (2, 3), 8, 32, "f.safetensors")
    built = Weight.plain(tensor, ["a note"])
    assert built == Weight("w", (2, 3), "F32", {DATA: tensor}, notes=["a note"])
    assert all(hasattr(built, f.name) for f in dataclasses.fields(Weight))
