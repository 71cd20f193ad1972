"""optimum-quanto detection and decoding.

On fixtures written by the real optimum-quanto 0.2.7 (tests/fixtures/make_mlx_quanto_bnb_fixtures.py),
committed with quanto's own `dequantize()` of what it saved: qtool's decode equals it bit for bit
in bfloat16 and float32, because it runs the same torch operations in the scale's dtype
(`scale * q` then `- shift`, or `scale * (q - shift)` in int8). These tests need only the
committed files; the one that regenerates them needs optimum-quanto.
"""

from __future__ import annotations

import json
import math
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.conventions import REGISTRY, decoder_for, quanto, resolve
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "quanto"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]
AMBIGUOUS = {("bf16", "model.layers.0.self_attn.q_proj.weight"): [128, 128]}  # no bias, g128: stored view
runner = CliRunner()

LABELS = {"qint8": "int8 sym channel", "qfloat8_e4m3fn": "fp8_e4m3 channel", "qfloat8_e5m2": "fp8_e5m2 channel",
          "qfloat8_e4m3fnuz": "fp8_e4m3fnuz channel"}  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _label(spec: dict, shape: list[int]) -> str:
    if spec["qtype"] in LABELS:
        return LABELS[spec["qtype"]]
    bits = spec["qtype"].removeprefix("qint")
    granularity = "channel" if spec["group_size"] is None else f"g{spec['group_size']}"
    return f"uint{bits} asym {granularity}"


def _weights(path) -> dict:
    return {w["name"]: w for w in qtool.inspect(path).to_json()["weights"]}


# -- the group rule ----------------------------------------------------------------------------------


def test_group_size_rule_is_quantos():
    # QModuleMixin: in_features > 128 steps 128, 96, 64, 32; otherwise one group per row
    assert [quanto.group_size_for(i) for i in (64, 128, 256, 192, 320, 160, 200, 4096, 11008)] == [
        None, None, 128, 96, 64, 32, None, 128, 128,
    ]  # fmt: skip
    assert quanto.logical_shapes(20, 100) == [(20, 100)]  # per-axis, nothing else fits
    assert quanto.logical_shapes(35, 64) == [(35, 64), (7, 320), (5, 448), (1, 2240)]
    assert quanto.logical_shapes(3, 128) == [(3, 128), (1, 384)]


# -- inspect ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", sorted(MANIFEST))
def test_inspect_reports_logical_shape_scheme_and_true_bits(fixture):
    weights = _weights(FIXTURES / fixture)
    for name, spec in MANIFEST[fixture]["weights"].items():
        w = weights[name]
        shape = AMBIGUOUS.get((fixture, name), spec["shape"])
        assert w["shape"] == shape, name
        assert w["parameters"] == math.prod(spec["shape"])  # exact even where the split is unknown
        assert w["quantized"] is True and w["scheme"]["convention"] == "quanto"
        assert w["scheme"]["label"] == _label(spec, shape), name
        assert w["scheme"]["bits"] == (8 if spec["qtype"] in LABELS else int(spec["qtype"][4:]))
        assert w["dtype"] == {"bf16": "BF16", "f32": "F32"}[fixture]
        roles = {t["role"] for t in w["tensors"]}
        expected_roles = {"data", "scale"} | ({"shift"} if spec["qtype"] in ("qint2", "qint4") else set())
        if "shift" not in spec:  # made by a QModule, which saves its activation scales too
            expected_roles |= {"input_scale", "output_scale"}
        assert roles == expected_roles, name
        stored = sum(
            math.prod(t["shape"]) * (4 if t["dtype"] == "F32" else 2 if t["dtype"] == "BF16" else 1)
            for t in w["tensors"]
        )
        assert w["bits_per_weight"] == pytest.approx(stored * 8 / w["parameters"], abs=1e-4)
        if (fixture, name) not in AMBIGUOUS:
            assert w["notes"] == [], (name, w["notes"])


def test_bits_per_weight_by_hand():
    w = _weights(FIXTURES / "bf16")["model.layers.0.self_attn.k_proj.weight"]
    # [32, 256] qint4 g128: 64 groups; U8 [32, 128] = 4096 B, bf16 scale and shift [64, 1] = 128 B
    # each, bf16 input_scale and output_scale 2 B each
    assert w["bytes"] == 4096 + 128 + 128 + 4
    assert w["bits_per_weight"] == pytest.approx(4356 * 8 / 8192, abs=1e-4)
    w = _weights(FIXTURES / "f32")["model.layers.0.mlp.zp_proj.weight"]
    assert {t["role"]: t["dtype"] for t in w["tensors"]} == {"data": "U8", "scale": "F32", "shift": "U8"}
    assert w["scheme"]["zero_point"] is True


def test_an_unrecorded_shape_is_shown_as_stored_and_says_why():
    w = _weights(FIXTURES / "bf16")["model.layers.0.self_attn.q_proj.weight"]
    assert w["shape"] == [128, 128] and w["parameters"] == 64 * 256
    assert w["notes"] == [
        (
            "quanto records no shape: shown as its 128 groups of 128; [out, in] may also be [64, 256], [32, 512], "
            "[16, 1024], [8, 2048], [4, 4096], [2, 8192], [1, 16384] (a .bias beside it would tell)"
        )
    ]


def _copy(fixture, tmp_path, side_files):
    shutil.copy(FIXTURES / fixture / "model.safetensors", tmp_path / "model.safetensors")
    for name, value in side_files.items():
        (tmp_path / name).write_text(json.dumps(value))
    return tmp_path


def test_the_quantization_map_is_never_required(tmp_path):
    with_map = _weights(FIXTURES / "f32")
    without = _weights(_copy("f32", tmp_path, {}))
    assert without.keys() == with_map.keys()
    for name, w in with_map.items():
        assert (without[name]["shape"], without[name]["scheme"]) == (w["shape"], w["scheme"]), name


def test_a_map_that_disagrees_with_the_tensors_gets_a_note(tmp_path):
    qmap = json.loads((FIXTURES / "f32" / "quantization_map.json").read_text())
    qmap["model.layers.0.mlp.up_proj"]["weights"] = "qint2"
    qmap["model.layers.0.self_attn.q_proj"]["weights"] = "qfloat8_e4m3fn"
    weights = _weights(_copy("f32", tmp_path, {"quanto_qmap.json": qmap}))
    assert weights["model.layers.0.mlp.up_proj.weight"]["scheme"]["label"] == "uint4 asym channel"
    assert weights["model.layers.0.mlp.up_proj.weight"]["notes"] == [
        "quanto_qmap.json says qint2, the tensors show qint4; read as the tensors show"
    ]
    assert weights["model.layers.0.self_attn.q_proj.weight"]["notes"] == [
        "quanto_qmap.json says qfloat8_e4m3fn, the tensors show qint8; read as the tensors show"
    ]


def _tiny_packed(make_safetensors, rows: int, packed_rows: int, columns: int, side: dict | None = None):
    path = make_safetensors(
        {
            "m.weight._data._data": ("U8", [packed_rows, columns]),
            "m.weight._scale": ("F32", [rows, 1]),
            "m.weight._shift": ("F32", [rows, 1]),
        },
        data={
            "m.weight._data._data": bytes(range(packed_rows * columns)),
            "m.weight._scale": struct.pack(f"<{rows}f", *[0.5 * (r + 1) for r in range(rows)]),
            "m.weight._shift": struct.pack(f"<{rows}f", *[1.0] * rows),
        },
    )
    for name, value in (side or {}).items():
        (path.parent / name).write_text(json.dumps(value))
    return path


def test_planar_packing_decodes_by_hand(make_safetensors):
    # 3 rows of 4 at 4 bits: 2 packed rows; byte r holds row r (low nibble) and row r + 2 (high)
    path = _tiny_packed(make_safetensors, rows=3, packed_rows=2, columns=4)
    checkpoint = qtool.open_checkpoint(path)
    [weight] = resolve(checkpoint, REGISTRY)
    assert weight.shape == (3, 4) and weight.scheme.label == "uint4 asym channel"
    packed = list(range(8))
    rows = [[b & 0xF for b in packed[0:4]], [b & 0xF for b in packed[4:8]], [b >> 4 for b in packed[0:4]]]
    expected = [[0.5 * (r + 1) * q - 1.0 for q in row] for r, row in enumerate(rows)]
    assert quanto.decode(checkpoint, weight).tolist() == expected


def test_two_or_four_bits_without_a_map_is_left_plain(make_safetensors, tmp_path):
    # 2 rows pack into 1 byte row at 2 bits and at 4 bits alike
    path = _tiny_packed(make_safetensors, rows=2, packed_rows=1, columns=4)
    weights = resolve(qtool.open_checkpoint(path), REGISTRY)
    assert all(w.scheme is None for w in weights) and len(weights) == 3
    assert weights[0].notes == [
        "looks like an optimum-quanto weight, but 2 rows pack into 1 bytes at 2 and at 4 bits, and no quantization map says which; left plain"
    ]
    path = _tiny_packed(
        make_safetensors,
        rows=2,
        packed_rows=1,
        columns=4,
        side={"quantization_map.json": {"m": {"weights": "qint2", "activations": "none"}}},
    )
    [weight] = resolve(qtool.open_checkpoint(path), REGISTRY)
    assert weight.scheme.label == "uint2 asym channel" and weight.notes == []


def test_i8_data_without_a_scale_is_plain(make_safetensors):
    path = make_safetensors({"m.weight._data": ("I8", [4, 4]), "m.input_scale": ("F32", [])})
    weights = resolve(qtool.open_checkpoint(path))
    assert [w.scheme for w in weights] == [None, None]


# -- decode against quanto's dequantize ------------------------------------------------------------


@pytest.mark.parametrize("fixture", sorted(MANIFEST))
def test_decode_equals_quantos_dequantize_bit_for_bit(fixture):
    checkpoint = qtool.open_checkpoint(FIXTURES / fixture)
    weights = {w.name: w for w in resolve(checkpoint)}
    reference = load_file(FIXTURES / fixture / "reference" / "weights.safetensors")
    assert set(reference) == set(MANIFEST[fixture]["weights"])
    for name, expected in reference.items():
        weight = weights[name]
        out = decoder_for(weight).decode(checkpoint, weight, "cpu")
        assert list(out.shape) == AMBIGUOUS.get((fixture, name), list(expected.shape)), name
        assert out.dtype == expected.dtype, name
        assert torch.equal(_bits(out), _bits(expected)), name


@pytest.mark.parametrize("fixture", sorted(MANIFEST))
def test_qtool_dequantize_writes_quantos_dequantize(fixture, tmp_path):
    out = tmp_path / "out.safetensors"
    result = runner.invoke(app, ["dequantize", str(FIXTURES / fixture), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    written = load_file(out)
    for name, expected in load_file(FIXTURES / fixture / "reference" / "weights.safetensors").items():
        got = written[name]
        assert list(got.shape) == AMBIGUOUS.get((fixture, name), list(expected.shape)), name
        assert got.dtype == expected.dtype and torch.equal(_bits(got), _bits(expected)), name


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
    assert report.conventions == ["quanto", "plain"]


# -- the fixtures are the tool's own ------------------------------------------------------------------


def test_the_fixture_script_reproduces_the_committed_files(tmp_path):
    pytest.importorskip("optimum.quanto")
    from tests.fixtures import make_mlx_quanto_bnb_fixtures as maker

    maker.make_quanto(tmp_path / "quanto")
    for path in sorted(p for p in FIXTURES.rglob("*") if p.is_file() and p.name != "manifest.json"):
        assert (tmp_path / "quanto" / path.relative_to(FIXTURES)).read_bytes() == path.read_bytes(), path
