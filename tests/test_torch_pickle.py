"""PyTorch pickles: read without torch and never executed, checked against torch.load(weights_only=True);
native quantized tensors as weights, decoded bit for bit as PyTorch's own `dequantize()`.

Fixtures: tests/fixtures/torch/, written by torch.save (make_pickle_torchao_burn_fixtures.py).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.conventions import decoder_for
from qtool.errors import CheckpointError
from qtool.formats.torch_pickle import TorchCheckpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "torch"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("QTOOL_DEBUG", raising=False)


def weights(path) -> dict:
    return {w.name: w for w in qtool.inspect(path).weights}


def inspect_json(path) -> dict:
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def float_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


# -- reading ------------------------------------------------------------------------------------------


def test_nested_state_dict_is_found_and_the_optimizer_left_out():
    checkpoint = qtool.open_checkpoint(FIXTURES / "native.pt")
    assert checkpoint.format == "torch"
    assert checkpoint.metadata["torch.state_dict"] == "state_dict"
    assert checkpoint.metadata["torch.skipped"] == "optimizer"
    assert checkpoint.metadata["epoch"] == "3"
    assert not any(name.startswith(("state_dict.", "optimizer")) for name in checkpoint.tensors)
    assert {"fc.weight", "fc.bias", "q.per_tensor", "emb.weight"} <= set(checkpoint.tensors)


def test_a_state_dict_under_model_is_found():
    checkpoint = qtool.open_checkpoint(FIXTURES / "dynamic.pth")
    assert checkpoint.metadata["torch.state_dict"] == "model"
    assert checkpoint.metadata["step"] == "10"
    assert checkpoint.metadata["0._packed_params.dtype"] == "torch.qint8"


def torch_tensors(value, name: str = "") -> dict[str, torch.Tensor]:
    """What torch.load(weights_only=True) holds, by the reader's names: quantized tensors as
    their int_repr plus per-channel scales and zero points."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(value, torch.Tensor):
        if value.is_quantized:
            found[name] = value.int_repr()
            if value.qscheme() in (torch.per_channel_affine, torch.per_channel_affine_float_qparams):
                found[f"{name}.q_per_channel_scales"] = value.q_per_channel_scales()
                found[f"{name}.q_per_channel_zero_points"] = value.q_per_channel_zero_points()
        else:
            found[name] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            found.update(torch_tensors(item, f"{name}.{key}" if name else str(key)))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found.update(torch_tensors(item, f"{name}.{index}" if name else str(index)))
    return found


def loaded(path, key=None) -> dict[str, torch.Tensor]:
    state = torch.load(path, weights_only=True)
    return torch_tensors(state[key] if key else state)


def test_every_tensor_reads_back_the_values_torch_load_gives():
    for path, key in (
        (FIXTURES / "native.pt", "state_dict"),
        (FIXTURES / "dynamic.pth", "model"),
        (FIXTURES / "hf" / "pytorch_model.bin", None),
    ):
        checkpoint = qtool.open_checkpoint(path)
        assert isinstance(checkpoint, TorchCheckpoint)
        reference = loaded(path, key)
        assert set(checkpoint.tensors) == set(reference)
        for stored in checkpoint.tensors.values():
            live = reference[stored.name]
            if live.dtype != stored.dtype.torch_dtype():  # torch hands per-channel scales out as float64
                live = live.to(stored.dtype.torch_dtype())
            expected = live.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert bytes(checkpoint.read_bytes(stored)) == expected, stored.name
            assert torch.equal(
                checkpoint.load(stored).reshape(-1).view(torch.uint8),
                torch.frombuffer(bytearray(expected), dtype=torch.uint8),
            )
            if stored.in_file:  # the range is the archive's own bytes
                with open(path, "rb") as handle:
                    handle.seek(stored.begin)
                    assert handle.read(stored.nbytes) == expected, stored.name


def test_a_transposed_view_has_no_byte_range_and_a_slice_has_one():
    checkpoint = qtool.open_checkpoint(FIXTURES / "hf")
    proj, head = checkpoint.tensors["proj.weight"], checkpoint.tensors["head.weight"]
    assert not proj.in_file and proj.shape == (8, 12) and proj.nbytes == 8 * 12 * 4
    assert proj.begin >= os.path.getsize(FIXTURES / "hf" / "pytorch_model.bin")  # a blind pread fails, loudly
    assert head.in_file and head.shape == (8, 8)
    reference = loaded(FIXTURES / "hf" / "pytorch_model.bin")
    assert torch.equal(checkpoint.load(proj), reference["proj.weight"].contiguous())
    assert bytes(checkpoint.read_bytes(proj, 8, 8)) == reference["proj.weight"].contiguous().numpy().tobytes()[8:16]


def test_model_folders_read_their_pickle_and_config():
    checkpoint = qtool.open_checkpoint(FIXTURES / "hf")
    assert checkpoint.files == [str(FIXTURES / "hf" / "pytorch_model.bin")]
    assert checkpoint.config["torch_dtype"] == "bfloat16"
    sharded = qtool.open_checkpoint(FIXTURES / "sharded")
    assert len(sharded.files) == 2
    assert set(sharded.tensors) == set(checkpoint.tensors)
    assert sharded.tensors["proj.weight"].in_file  # saved contiguous in the shard


def test_listing_a_pickle_never_imports_torch():
    code = (
        "import sys, qtool\n"
        "for path in sys.argv[1:]:\n"
        "    assert qtool.inspect(path).weights\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    paths = [str(FIXTURES / n) for n in ("native.pt", "dynamic.pth", "hf", "sharded")]
    done = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = weights(FIXTURES / "native.pt")
    assert found["fc.weight"].scheme is None and found["fc.weight"].dtype == "F32"


# -- native quantized tensors ---------------------------------------------------------------------------


def test_native_quantized_tensors_are_weights_with_their_scheme():
    found = weights(FIXTURES / "native.pt")
    per_tensor = found["q.per_tensor"]
    assert per_tensor.convention == "torch-native"
    assert per_tensor.scheme.label == "uint8 asym tensor"
    assert (per_tensor.shape, per_tensor.parameters, per_tensor.bits_per_weight) == ((8, 16), 128, 8.0)
    assert dict(per_tensor.provenance.details)["zero_point"] == "3"
    channel = found["q.per_channel"]
    assert channel.scheme.label == "int8 sym channel"  # qint8, zero points all 0
    assert set(channel.members) == {"data", "scale", "zero_point"}
    assert channel.scheme.scale_dtype == "F64"
    assert channel.bits_per_weight == (8 * 16 + 8 * 8 + 8 * 8) * 8 / 128  # int8 + f64 scales + i64 zero points
    axis1 = found["q.axis1"]
    assert axis1.scheme.block == (None, 1) and dict(axis1.provenance.details)["axis"] == "1"
    # one scale per column: channel-wise along axis 1, not a block of every row by one column
    assert (axis1.scheme.granularity, axis1.scheme.channel_axis) == ("channel", 1)
    assert axis1.scheme.label == "int8 asym channel(axis=1)"  # qint8, zero points in [-4, 4)
    assert channel.scheme.channel_axis == 0
    embedding = found["emb.weight"]
    assert dict(embedding.provenance.details)["qscheme"] == "per_channel_affine_float_qparams"
    assert embedding.scheme.label == "uint8 asym channel"
    assert embedding.scheme.scale_dtype == "F32"


def test_dynamic_linear_packed_params_are_one_weight_each():
    found = weights(FIXTURES / "dynamic.pth")
    assert found["0.weight"].scheme.label == "int8 sym tensor"
    assert found["0.weight"].shape == (16, 32) and found["0.weight"].data.name == "0._packed_params._packed_params.0"
    assert found["2.weight"].shape == (8, 16)
    assert found["0.bias"].scheme is None and found["0.bias"].data.name == "0._packed_params._packed_params.1"
    assert not any("_packed_params" in name for name in found)
    assert {n for n, w in found.items() if w.quantized} == {"0.weight", "2.weight"}


@pytest.mark.parametrize("fixture, reference", [("native.pt", "native"), ("dynamic.pth", "dynamic")])
def test_decoding_is_pytorchs_dequantize_bit_for_bit(fixture, reference):
    inspection = qtool.inspect(FIXTURES / fixture)
    expected = load_file(FIXTURES / "reference" / f"{reference}.safetensors")
    decoded = 0
    for weight in inspection.weights:
        if weight.quantized:
            out = decoder_for(weight).decode(inspection.checkpoint, weight, "cpu")
            assert out.dtype == torch.float32 and tuple(out.shape) == weight.shape
            assert torch.equal(float_bits(out), float_bits(expected[weight.name])), weight.name
            decoded += 1
    assert decoded == len([k for k in expected if not k.endswith(".bias")])


def test_no_plain_tensor_is_reported_as_quantized():
    expected = {
        "native.pt": {"q.per_tensor", "q.per_channel", "q.axis1", "emb.weight"},
        "dynamic.pth": {"0.weight", "2.weight"},
        "hf": set(),
        "sharded": set(),
    }
    for fixture, quantized in expected.items():
        found = weights(FIXTURES / fixture)
        assert {n for n, w in found.items() if w.quantized} == quantized, fixture
        for weight in found.values():
            if not weight.quantized:
                assert weight.data.encoding is None and weight.notes == [], weight.name


def test_inspect_json_says_torch():
    doc = inspect_json(FIXTURES / "dynamic.pth")
    assert doc["format"] == "torch"
    by_name = {w["name"]: w for w in doc["weights"]}
    assert by_name["0.weight"]["scheme"]["convention"] == "torch-native"
    assert by_name["0.weight"]["parameters"] == 512 and by_name["0.weight"]["bits_per_weight"] == 8.0
    assert doc["summary"]["quantized_weights"] == 2


# -- bad input: exit 2, one error line, and nothing executed ---------------------------------------------


class _Payload:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _exit_2(path: Path, text: str) -> str:
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: {path}:") and text in lines[0], lines
    assert "Traceback" not in result.stderr
    return lines[0]


def test_a_pickle_that_would_run_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.zeros(2), "payload": _Payload(marker)}, path)
    line = _exit_2(path, "refused: the pickle calls posix.system")
    assert "never runs code" in line
    with pytest.raises(CheckpointError):
        qtool.open_checkpoint(path)
    assert not marker.exists()


def test_a_legacy_pickle_with_a_payload_is_refused_unread(tmp_path):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.bin"
    with open(path, "wb") as handle:
        pickle.dump({"payload": _Payload(marker)}, handle)
    _exit_2(path, "refused: the pickle calls posix.system")
    assert not marker.exists()


def test_a_whole_pickled_module_is_refused(tmp_path):
    path = tmp_path / "module.pt"
    torch.save(torch.nn.Linear(2, 2), path)
    _exit_2(path, "refused: the pickle calls torch.nn.modules.linear.Linear")


def test_a_zero_byte_pickle_is_refused(tmp_path):
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    _exit_2(path, "file is empty (0 bytes)")


def test_a_damaged_archive_is_refused(tmp_path):
    path = tmp_path / "cut.pt"
    torch.save({"w": torch.zeros(64)}, path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_length + extra_length
    data[start : start + 8] = b"\xff" * 8  # the pickle's first opcodes
    path.write_bytes(bytes(data))
    _exit_2(path, "cannot read the archive: Bad CRC-32")


def test_a_truncated_pickle_is_refused(tmp_path):
    path = tmp_path / "cut.bin"
    torch.save({"w": torch.zeros(4096)}, path)
    path.write_bytes(path.read_bytes()[:5000])
    _exit_2(path, "has no end-of-central-directory record")


def test_a_folder_of_unrelated_pickles_asks_which(tmp_path):
    for name in ("optimizer.pt", "rng_state.pth"):
        torch.save({"x": torch.zeros(1)}, tmp_path / name)
    _exit_2(tmp_path, "holds 2 PyTorch pickles")
    shutil.copy(FIXTURES / "hf" / "pytorch_model.bin", tmp_path / "pytorch_model.bin")
    assert set(qtool.open_checkpoint(tmp_path).tensors) == {"embed.weight", "proj.weight", "head.weight", "norm.weight"}


# -- qtool dequantize ---------------------------------------------------------------------------------


def test_dequantize_writes_pytorchs_values(tmp_path):
    qtool.dequantize(FIXTURES / "native.pt", tmp_path / "out.safetensors", dtype="f32")
    out = load_file(tmp_path / "out.safetensors")
    expected = load_file(FIXTURES / "reference" / "native.safetensors")
    for name, tensor in expected.items():
        assert torch.equal(float_bits(out[name]), float_bits(tensor)), name
    state = torch.load(FIXTURES / "native.pt", weights_only=True)["state_dict"]
    assert torch.equal(out["fc.weight"], state["fc.weight"]) and torch.equal(out["fc.bias"], state["fc.bias"])
    assert not any(".q_per_channel_" in name for name in out)


def test_dequantize_a_dynamic_quantized_model_gives_linear_names(tmp_path):
    qtool.dequantize(FIXTURES / "dynamic.pth", tmp_path / "out.safetensors", dtype="f32")
    out = load_file(tmp_path / "out.safetensors")
    expected = load_file(FIXTURES / "reference" / "dynamic.safetensors")
    assert set(expected) <= set(out)
    for name, tensor in expected.items():
        assert torch.equal(float_bits(out[name]), float_bits(tensor)), name


def test_dequantize_copies_strided_tensors(tmp_path):
    qtool.dequantize(FIXTURES / "hf", tmp_path / "out.safetensors")
    out = load_file(tmp_path / "out.safetensors")
    state = torch.load(FIXTURES / "hf" / "pytorch_model.bin", weights_only=True)
    assert set(out) == set(state)
    for name, tensor in state.items():
        assert torch.equal(out[name], tensor), name
