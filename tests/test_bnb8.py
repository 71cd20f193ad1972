"""bitsandbytes as transformers saves it: 8-bit LLM.int8, 4-bit with double quantization and a
non-uint8 `quant_storage`, and the malformed quant-state blob.

On fixtures written by the real bitsandbytes 0.50.2 CPU backend (Linear8bitLt / Linear4bit
state dicts, tests/fixtures/make_mlx_quanto_bnb_fixtures.py), committed with bitsandbytes' own
dequantization (`int8_vectorwise_dequant`, float32; `dequantize_4bit`): qtool's decode equals
it bit for bit. These tests need only the committed files; the one that regenerates them needs
bitsandbytes.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.conventions import bitsandbytes as bnb
from qtool.conventions import decoder_for, resolve
from qtool.errors import CheckpointError
from tests.conftest import REPO, write_safetensors

FIXTURES = REPO / "tests" / "fixtures" / "bnb"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("QTOOL_DEBUG", raising=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _weights(path) -> dict:
    return {w["name"]: w for w in qtool.inspect(path).to_json()["weights"]}


def _label(spec: dict) -> str:
    if spec["bits"] == 8:
        return "int8 sym channel"
    return f"{'nf4' if spec['quant_type'] == 'nf4' else 'fp4_bnb'} g{spec['blocksize']}"


# -- inspect ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", sorted(MANIFEST))
def test_inspect_reports_logical_shape_scheme_and_true_bits(fixture):
    weights = _weights(FIXTURES / fixture)
    dtype = {"int8": "F16", "nf4_nested": "BF16", "fp4_nested": "F16"}[fixture]  # config / quant state
    for name, spec in MANIFEST[fixture]["weights"].items():
        w = weights[name]
        assert w["shape"] == spec["shape"] and w["parameters"] == math.prod(spec["shape"]), name
        assert w["quantized"] is True and w["scheme"]["convention"] == "bitsandbytes"
        assert w["scheme"]["label"] == _label(spec) and w["scheme"]["bits"] == spec["bits"], name
        assert w["dtype"] == dtype
        assert w["bits_per_weight"] == pytest.approx(w["bytes"] * 8 / w["parameters"], abs=1e-4)
        assert {t["role"] for t in w["tensors"]} >= {"data", "scale"}


def test_int8_members_and_bits_by_hand():
    w = _weights(FIXTURES / "int8")["model.layers.0.self_attn.q_proj.weight"]
    assert {t["role"]: (t["name"], t["dtype"], t["shape"]) for t in w["tensors"]} == {
        "data": ("model.layers.0.self_attn.q_proj.weight", "I8", [16, 64]),
        "scale": ("model.layers.0.self_attn.q_proj.SCB", "F32", [16]),
        "weight_format": ("model.layers.0.self_attn.q_proj.weight_format", "U8", []),
    }
    # 16 x 64 int8 + 16 f32 row absmax + 1 byte of format
    assert w["bytes"] == 1024 + 64 + 1 and w["bits_per_weight"] == pytest.approx(1089 * 8 / 1024, abs=1e-4)
    assert w["scheme"]["granularity"] == "channel" and w["scheme"]["scale_dtype"] == "F32"


def test_a_non_uint8_quant_storage_is_read_as_its_bytes():
    w = _weights(FIXTURES / "nf4_nested")["model.layers.0.mlp.up_proj.weight"]
    data = next(t for t in w["tensors"] if t["role"] == "data")
    assert (data["dtype"], data["shape"]) == ("BF16", [24 * 128 // 4, 1])  # 2 codes per byte, 2 bytes per word
    assert {t["role"] for t in w["tensors"]} == {
        "data",
        "scale",
        "quant_map",
        "nested_absmax",
        "nested_quant_map",
        "quant_state",
    }
    checkpoint = qtool.open_checkpoint(FIXTURES / "nf4_nested")
    [weight] = [x for x in resolve(checkpoint) if x.name == "model.layers.0.mlp.up_proj.weight"]
    assert (
        dict(weight.provenance.details)["quant_storage"] == "BF16"
        and dict(weight.provenance.details)["double_quant"] == "yes"
    )


# -- decode against bitsandbytes' own dequantization ----------------------------------------------


@pytest.mark.parametrize("fixture", sorted(MANIFEST))
def test_decode_equals_bitsandbytes_bit_for_bit(fixture):
    checkpoint = qtool.open_checkpoint(FIXTURES / fixture)
    weights = {w.name: w for w in resolve(checkpoint)}
    reference = load_file(FIXTURES / fixture / "reference" / "weights.safetensors")
    assert set(reference) == set(MANIFEST[fixture]["weights"])
    for name, expected in reference.items():
        weight = weights[name]
        if expected.dtype == torch.float32 and weight.dtype != "F32":
            weight = replace(weight, dtype="F32")  # int8_vectorwise_dequant returns float32
        out = decoder_for(weight).decode(checkpoint, weight, "cpu")
        assert out.shape == expected.shape and out.dtype == expected.dtype, name
        assert torch.equal(_bits(out), _bits(expected)), name


@pytest.mark.parametrize("fixture", sorted(MANIFEST))
def test_qtool_dequantize_writes_bitsandbytes_output(fixture, tmp_path):
    source = FIXTURES / fixture
    if fixture == "int8":  # without config.json there is no torch_dtype: float32, as bitsandbytes returns
        source = tmp_path / "int8"
        source.mkdir()
        shutil.copy(FIXTURES / fixture / "model.safetensors", source / "model.safetensors")
    out = tmp_path / "out.safetensors"
    result = runner.invoke(app, ["dequantize", str(source), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    written = load_file(out)
    for name, expected in load_file(FIXTURES / fixture / "reference" / "weights.safetensors").items():
        assert written[name].dtype == expected.dtype and torch.equal(_bits(written[name]), _bits(expected)), name


def test_int8_in_the_configs_dtype_is_bitsandbytes_output_rounded_once(tmp_path):
    out = tmp_path / "out.safetensors"
    assert runner.invoke(app, ["dequantize", str(FIXTURES / "int8"), "-o", str(out)]).exit_code == 0
    written = load_file(out)
    for name, expected in load_file(FIXTURES / "int8" / "reference" / "weights.safetensors").items():
        assert written[name].dtype == torch.float16 and torch.equal(written[name], expected.to(torch.float16)), name


# -- 8-bit lookalikes, by hand ------------------------------------------------------------------------


def _int8(tmp_path, scb=("F32", [2]), fmt=("U8", []), fmt_value=0):
    tensors = {"m.weight": ("I8", [2, 3]), "m.SCB": scb}
    scales = ([2.0, 0.5] + [1.0] * 8)[: math.prod(scb[1])]  # SCB is float32 unless a test says otherwise
    data = {"m.weight": bytes([1, 127, 0x81, 0xFF, 0, 64]), "m.SCB": struct.pack(f"<{len(scales)}f", *scales)}
    if fmt is not None:
        tensors["m.weight_format"] = fmt
        data["m.weight_format"] = bytes([fmt_value])
    return write_safetensors(tmp_path / "model.safetensors", tensors, data=data)


def test_int8_decodes_by_hand(tmp_path):
    checkpoint = qtool.open_checkpoint(_int8(tmp_path))
    [weight] = resolve(checkpoint)
    assert (weight.name, weight.shape, weight.dtype, weight.scheme.label) == (
        "m.weight",
        (2, 3),
        "F32",
        "int8 sym channel",
    )
    inverse = torch.tensor(1 / 127, dtype=torch.float32)
    expected = (
        torch.tensor([[1, 127, -127], [-1, 0, 64]], dtype=torch.float32) * torch.tensor([[2.0], [0.5]])
    ) * inverse
    assert torch.equal(bnb.decode(checkpoint, weight), expected)
    assert bnb.decode(checkpoint, weight)[0, 1].item() == pytest.approx(2.0)


@pytest.mark.parametrize(
    "kwargs, note",
    [
        ({"fmt_value": 1}, "weight_format is 1 (col32), and bitsandbytes reads only 0 (row)"),
        ({"scb": ("F32", [3])}, "m.SCB is F32 [3], expected F32 [2]"),
        ({"scb": ("I32", [2])}, "m.SCB is I32 [2], expected F32 [2]"),
    ],
    ids=["col32", "scb-shape", "scb-dtype"],
)
def test_an_int8_layout_bitsandbytes_would_refuse_stays_plain(tmp_path, kwargs, note):
    weights = resolve(qtool.open_checkpoint(_int8(tmp_path, **kwargs)))
    assert all(w.scheme is None for w in weights) and len(weights) == 3
    assert all(w.notes == [f"looks like bitsandbytes 8-bit, but {note}; left plain"] for w in weights)


def test_an_i8_tensor_without_scb_is_plain(make_safetensors):
    weights = resolve(qtool.open_checkpoint(make_safetensors({"m.weight": ("I8", [4, 4]), "m.bias": ("F16", [4])})))
    assert [w.scheme for w in weights] == [None, None]


def test_weight_format_is_optional(tmp_path):
    [weight] = resolve(qtool.open_checkpoint(_int8(tmp_path, fmt=None)))
    assert weight.scheme.label == "int8 sym channel" and set(weight.members) == {"data", "scale"}


# -- a malformed quant-state blob: exit 2, one line naming the file -------------------------------------


def _blob_checkpoint(tmp_path, blob: bytes):
    """The committed fp4 fixture with its first quant-state blob replaced by `blob`."""
    from safetensors import safe_open

    tensors, data = {}, {}
    with safe_open(FIXTURES / "fp4_nested" / "model.safetensors", "pt") as handle:
        for name in handle.keys():
            value = handle.get_tensor(name)
            if name == "model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__fp4":
                value = torch.tensor(list(blob), dtype=torch.uint8)
            dtype = {torch.uint8: "U8", torch.float32: "F32", torch.float16: "F16"}[value.dtype]
            tensors[name] = (dtype, list(value.shape))
            data[name] = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return write_safetensors(tmp_path / "in" / "model.safetensors", tensors, data=data)


STATE = "model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__fp4"


@pytest.mark.parametrize(
    "blob, why",
    [
        (b'{"quant_type": "fp4", "blocksize": 64,', "the blob is not valid JSON at line 1 column 39"),
        (b"\xff\xfe{}", "the blob is not UTF-8 (byte 0)"),
        (b"[1, 2]", "it holds a JSON list, not an object"),
        (b'{"quant_type": "fp4", "blocksize": 64, "dtype": "float16"}', "'shape' is missing"),
        (
            b'{"quant_type": "fp4", "blocksize": "64", "dtype": "float16", "shape": [20, 130]}',
            "'blocksize' is \"64\", not an integer",
        ),
        (
            b'{"quant_type": "fp4", "blocksize": 64, "dtype": "float16", "shape": [20, "x"]}',
            "'shape' is [20, \"x\"], not a list of sizes",
        ),
    ],
    ids=["truncated", "not-utf8", "list", "no-shape", "blocksize-string", "shape-items"],
)
@pytest.mark.parametrize("command", ["inspect", "dequantize"])
def test_a_malformed_quant_state_is_one_error_line_and_exit_2(tmp_path, blob, why, command):
    path = _blob_checkpoint(tmp_path, blob)
    args = (
        ["inspect", str(path)]
        if command == "inspect"
        else ["dequantize", str(path), "-o", str(tmp_path / "out.safetensors")]
    )
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == f"error: {path}: bitsandbytes quant state {STATE!r} is malformed: {why}"
    assert len(lines) == 2 and lines[1].startswith("hint: ") and "Traceback" not in result.stderr
    assert not (tmp_path / "out.safetensors").exists()
    with pytest.raises(CheckpointError):
        qtool.inspect(path)


def test_a_well_formed_state_that_does_not_fit_stays_plain(tmp_path):
    blob = b'{"quant_type": "fp4", "blocksize": 48, "dtype": "float16", "shape": [20, 130]}'
    weights = {w.name: w for w in resolve(qtool.open_checkpoint(_blob_checkpoint(tmp_path, blob)))}
    assert weights["model.layers.0.mlp.up_proj.weight"].scheme is None
    assert weights["model.layers.0.mlp.up_proj.weight"].notes == [
        "looks like bitsandbytes 4-bit, but blocksize 48 is not one of [32, 64, 128, 256, 512, 1024, 2048, 4096]; left plain"
    ]
    assert weights["model.layers.0.mlp.down_proj.weight"].scheme is not None


# -- ambiguity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", sorted(MANIFEST))
def test_no_plain_tensor_is_reported_as_quantized(fixture):
    report = qtool.inspect(FIXTURES / fixture)
    quantized = {w.name for w in report.weights if w.quantized}
    assert quantized == set(MANIFEST[fixture]["weights"])
    for weight in report.weights:
        if weight.name not in quantized:
            assert weight.scheme is None and list(weight.members) == ["data"], weight.name
    assert set(MANIFEST[fixture]["plain"]) <= {w.name for w in report.weights if not w.quantized}
    members = [t.name for w in report.weights for t in w.members.values()]
    assert sorted(members) == sorted(report.checkpoint.tensors)
    assert report.conventions == ["bitsandbytes", "plain"]


# -- the fixtures are the tool's own ------------------------------------------------------------------


def test_the_fixture_script_reproduces_the_committed_files(tmp_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("transformers")
    from tests.fixtures import make_mlx_quanto_bnb_fixtures as maker

    maker.make_bnb(tmp_path / "bnb")
    for path in sorted(p for p in FIXTURES.rglob("*") if p.is_file() and p.name != "manifest.json"):
        made = tmp_path / "bnb" / path.relative_to(FIXTURES)
        if (
            path.parent.name == "reference"
        ):  # bitsandbytes' own decoding: by value (its zeros' sign varies by code path)
            ours, committed = load_file(str(made)), load_file(str(path))
            assert set(ours) == set(committed) and all(
                torch.equal(ours[k], committed[k]) and ours[k].dtype == committed[k].dtype for k in ours
            ), path
        else:  # what bitsandbytes and transformers write: byte for byte
            assert made.read_bytes() == path.read_bytes(), path
