"""MLX (mlx-lm) detection and decoding.

On fixtures written by the real mlx 0.32.4 (tests/fixtures/make_mlx_quanto_bnb_fixtures.py),
committed with `mx.dequantize`'s own output: qtool's decode equals it bit for bit, for affine
in bfloat16, float16 and float32 (qtool rounds `q * scale` and then `+ bias` in the scales'
dtype, as mx does on CPU) and for mxfp4 / mxfp8 / nvfp4 in float32 and in mx's default
bfloat16. These tests need only the committed files; the one that regenerates them needs mlx.
A hand-written 3-bit layout checks the straddling bit stream without mlx at all.
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
from qtool.conventions import REGISTRY, decoder_for, resolve
from qtool.conventions import mlx as mlx_convention
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "mlx"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]
runner = CliRunner()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _label(spec: dict) -> str:
    if spec["mode"] == "affine":
        return f"uint{spec['bits']} asym g{spec['group_size']}"
    return f"{spec['mode']} g{spec['group_size']}"


def _weights(path) -> dict:
    return {w["name"]: w for w in qtool.inspect(path).to_json()["weights"]}


# -- inspect ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", sorted(MANIFEST))
def test_inspect_reports_logical_shape_scheme_and_true_bits(fixture):
    weights = _weights(FIXTURES / fixture)
    for name, spec in MANIFEST[fixture]["weights"].items():
        w = weights[name]
        assert w["shape"] == spec["shape"], name
        assert w["parameters"] == math.prod(spec["shape"])
        assert w["quantized"] is True and w["scheme"]["convention"] == "mlx"
        assert w["scheme"]["label"] == _label(spec), name
        assert w["scheme"]["bits"] == spec["bits"]
        assert w["scheme"]["group_size"] == spec["group_size"]
        roles = {t["role"] for t in w["tensors"]}
        assert roles == ({"data", "scale", "bias"} if spec["mode"] == "affine" else {"data", "scale"})
        stored = sum(
            math.prod(t["shape"]) * {"U32": 4, "U8": 1, "BF16": 2, "F16": 2, "F32": 4}[t["dtype"]] for t in w["tensors"]
        )
        assert w["bits_per_weight"] == pytest.approx(stored * 8 / w["parameters"], abs=1e-4)
        if fixture != "noconfig":
            assert w["notes"] == [], w["notes"]


def test_bits_per_weight_by_hand():
    w = _weights(FIXTURES / "affine")["model.layers.0.b4_g64.weight"]
    # [4, 128] at 4 bits: U32 [4, 16] = 256 B, bf16 scales and biases [4, 2] = 16 B each
    assert (w["bytes"], w["bits_per_weight"]) == (288, 4.5)
    w = _weights(FIXTURES / "affine")["model.layers.0.b3_g32.weight"]
    assert w["tensors"][0]["shape"] == [4, 12]  # 128 * 3 / 32 words: 3-bit values straddle words
    assert w["bits_per_weight"] == pytest.approx((4 * 12 * 4 + 2 * 4 * 4 * 2) * 8 / 512)
    w = _weights(FIXTURES / "fp")["model.layers.0.nvfp4.weight"]
    assert (w["bytes"], w["scheme"]["scale_dtype"]) == (4 * 16 * 4 + 4 * 8, "E4M3")  # 4.5 bits


def test_per_module_overrides_pick_between_settings_the_shapes_cannot_tell_apart():
    # 256 bits per group fits 4-bit g64, 8-bit g32 and 2-bit g128 alike: only the config tells
    weights = _weights(FIXTURES / "affine")
    for name, label in (("b8_g32", "uint8 asym g32"), ("b2_g128", "uint2 asym g128"), ("b4_g64", "uint4 asym g64")):
        assert weights[f"model.layers.0.{name}.weight"]["scheme"]["label"] == label
    assert weights["model.embed_tokens.weight"]["scheme"]["label"] == "uint4 asym g64"  # the top level
    assert weights["model.embed_tokens.weight"]["shape"] == [16, 128]


def test_settings_for_follows_to_quantized_defaults():
    config = {
        "group_size": 32,
        "bits": 4,
        "mode": "mxfp4",
        "a": {"group_size": 32, "bits": 8},
        "b": {"mode": "nvfp4"},
        "c": False,
    }
    S = mlx_convention.Settings
    assert mlx_convention.settings_for(config, "a") == S("affine", 32, 8)  # no mode: affine, as to_quantized
    assert mlx_convention.settings_for(config, "b") == S("nvfp4", 16, 4)  # that mode's defaults
    assert mlx_convention.settings_for(config, "c") is False
    assert mlx_convention.settings_for(config, "other") == S("mxfp4", 32, 4)
    assert mlx_convention.settings_for({"bits": 3}, "x") == S("affine", 64, 3)
    assert mlx_convention.settings_for(None, "x") is None


def test_without_a_config_the_shapes_decide_and_say_so():
    weights = _weights(FIXTURES / "noconfig")
    assert weights["f32_b3_g64.weight"]["notes"] == [
        "no config names its settings: read as 3-bit g64 (MLX's default group first); the shapes also fit 6-bit g32"
    ]
    assert weights["f16_b5_g128.weight"]["notes"] == ["no MLX config: settings read from the shapes"]
    assert weights["experts_b4_g64.weight"]["scheme"]["block"] == [1, 1, 64]
    assert weights["plain_u32"]["scheme"] is None  # U32 without scales is plain data


def _copy(fixture, tmp_path, config):
    shutil.copy(FIXTURES / fixture / "model.safetensors", tmp_path / "model.safetensors")
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_config_and_tensors_disagree_the_tensors_win_with_a_note(tmp_path):
    config = {"quantization": {"group_size": 64, "bits": 4, "mode": "affine", "model.layers.0.b8_g64": {"group_size": 64, "bits": 4},
                               "model.layers.0.b3_g32": {"mode": "mxfp4"}, "model.layers.0.skip": False, "model.layers.0.b6_g64": False}}  # fmt: skip
    weights = _weights(_copy("affine", tmp_path, config))
    w = weights["model.layers.0.b8_g64.weight"]
    assert w["scheme"]["label"] == "uint8 asym g64" and w["shape"] == [4, 128]
    assert w["notes"] == [
        "config.json says affine 4-bit g64, the tensors show affine 8-bit g64; read as the tensors show"
    ]
    assert weights["model.layers.0.b3_g32.weight"]["notes"] == [
        "config.json says mxfp4 4-bit g32, the tensors show affine 3-bit g32; read as the tensors show"
    ]
    assert weights["model.layers.0.b6_g64.weight"]["notes"] == [
        "config.json lists this module as not quantized; its tensors are quantized",
        "read as 6-bit g64 (MLX's default group first); the shapes also fit 3-bit g128",
    ]
    assert weights["model.layers.0.skip.weight"]["scheme"] is None
    checkpoint = qtool.open_checkpoint(tmp_path)
    [weight] = [x for x in resolve(checkpoint) if x.name == "model.layers.0.b8_g64.weight"]
    reference = load_file(FIXTURES / "affine" / "reference" / "weights.safetensors")["model.layers.0.b8_g64.weight"]
    assert torch.equal(_bits(decoder_for(weight).decode(checkpoint, weight, "cpu")), _bits(reference))


def test_a_layout_that_does_not_fit_stays_plain_with_a_note(make_safetensors):
    path = make_safetensors({"m.weight": ("U32", [4, 16]), "m.scales": ("BF16", [4, 3]), "m.biases": ("BF16", [4, 3])})
    weights = {w.name: w for w in resolve(qtool.open_checkpoint(path))}
    assert all(w.scheme is None for w in weights.values())
    assert weights["m.weight"].notes == [
        "looks like an MLX quantized weight, but 16 words per row cannot split into 3 groups; left plain"
    ]


# -- decode against mx.dequantize ----------------------------------------------------------------


@pytest.mark.parametrize("fixture", sorted(MANIFEST))
def test_decode_equals_mx_dequantize_bit_for_bit(fixture):
    checkpoint = qtool.open_checkpoint(FIXTURES / fixture)
    weights = {w.name: w for w in resolve(checkpoint)}
    reference = load_file(FIXTURES / fixture / "reference" / "weights.safetensors")
    assert set(reference) == set(MANIFEST[fixture]["weights"])
    for name, expected in reference.items():
        weight = weights[name]
        out = decoder_for(weight).decode(checkpoint, weight, "cpu")
        assert out.shape == expected.shape, name
        if expected.dtype == torch.float32 and out.dtype != torch.float32:
            # mx's reference was asked for float32; the weight's own dtype is the config's bf16
            out = mlx_convention.decode(checkpoint, replace(weight, dtype="F32"))
        assert out.dtype == expected.dtype, name
        assert torch.equal(_bits(out), _bits(expected)), name


def test_fp_modes_equal_mx_default_bfloat16_output():
    checkpoint = qtool.open_checkpoint(FIXTURES / "fp")
    default = load_file(FIXTURES / "fp" / "reference" / "default.safetensors")
    for weight in resolve(checkpoint):
        if weight.quantized:
            out = mlx_convention.decode(checkpoint, weight)
            assert out.dtype == torch.bfloat16 and torch.equal(_bits(out), _bits(default[weight.name])), weight.name


@pytest.mark.parametrize("fixture, dtype", [("affine", None), ("fp", "f32"), ("noconfig", "f32")])
def test_qtool_dequantize_writes_mx_dequantize(fixture, dtype, tmp_path):
    out = tmp_path / "out.safetensors"
    args = ["dequantize", str(FIXTURES / fixture), "-o", str(out)] + (["--dtype", dtype] if dtype else [])
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    written = load_file(out)
    reference = load_file(FIXTURES / fixture / "reference" / "weights.safetensors")
    for name, expected in reference.items():
        got = written[name]
        if fixture == "noconfig" and expected.dtype != torch.float32:
            expected = expected.float()  # f16 affine, written as f32: an exact widening
        assert got.dtype == expected.dtype and torch.equal(_bits(got), _bits(expected)), name
    for name in MANIFEST[fixture]["plain"]:
        assert name in written  # plain tensors are copied through


# -- by hand, without mlx ---------------------------------------------------------------------------


def test_a_hand_packed_3_bit_row_straddles_words(make_safetensors):
    # one row of 32 values 0..7 repeated, 3 bits each, LSB first: 96 bits = 3 little-endian words
    values = [k % 8 for k in range(32)]
    stream = sum(v << (3 * k) for k, v in enumerate(values))
    words = stream.to_bytes(12, "little")
    path = make_safetensors(
        {"m.weight": ("U32", [1, 3]), "m.scales": ("F32", [1, 1]), "m.biases": ("F32", [1, 1])},
        data={"m.weight": words, "m.scales": struct.pack("<f", 0.5), "m.biases": struct.pack("<f", -1.0)},
    )
    (path.parent / "config.json").write_text(json.dumps({"quantization": {"group_size": 32, "bits": 3}}))
    checkpoint = qtool.open_checkpoint(path.parent)
    [weight] = resolve(checkpoint, REGISTRY)
    assert weight.shape == (1, 32) and weight.scheme.label == "uint3 asym g32" and weight.notes == []
    out = mlx_convention.decode(checkpoint, weight)
    assert out.tolist() == [[0.5 * v - 1.0 for v in values]]


def test_hand_packed_mxfp4_and_nvfp4(make_safetensors):
    # 32 fp4 codes 0..15 twice, low nibble first; one E8M0 scale 2^1 / one pair of E4M3 scales
    codes = list(range(16)) * 2
    packed = bytes(codes[2 * i] | codes[2 * i + 1] << 4 for i in range(16))
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    table = e2m1 + [-v for v in e2m1]
    path = make_safetensors(
        {
            "a.weight": ("U32", [1, 4]),
            "a.scales": ("U8", [1, 1]),
            "b.weight": ("U32", [1, 4]),
            "b.scales": ("U8", [1, 2]),
        },
        data={
            "a.weight": packed,
            "a.scales": bytes([128]),
            "b.weight": packed,
            "b.scales": bytes([0x38, 0x40]),
        },  # e4m3 1.0, 2.0
    )
    checkpoint = qtool.open_checkpoint(path)
    weights = {w.name: w for w in resolve(checkpoint, REGISTRY)}
    assert weights["a.weight"].scheme.label == "mxfp4 g32" and weights["b.weight"].scheme.label == "nvfp4 g16"
    a = mlx_convention.decode(checkpoint, weights["a.weight"]).float()
    b = mlx_convention.decode(checkpoint, weights["b.weight"]).float()
    assert a.tolist() == [[2 * table[c] for c in codes]]
    assert b.tolist() == [[table[c] * (1 if k < 16 else 2) for k, c in enumerate(codes)]]


# -- ambiguity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", sorted(MANIFEST))
def test_no_plain_tensor_is_reported_as_quantized(fixture):
    report = qtool.inspect(FIXTURES / fixture)
    quantized = {w.name for w in report.weights if w.quantized}
    assert quantized == set(MANIFEST[fixture]["weights"])
    for weight in report.weights:
        if weight.name not in quantized:
            assert weight.scheme is None and list(weight.members) == ["data"], weight.name
    for name in MANIFEST[fixture]["plain"]:
        assert name in {w.name for w in report.weights}
    members = [t.name for w in report.weights for t in w.members.values()]
    assert sorted(members) == sorted(report.checkpoint.tensors)  # each tensor in exactly one weight


# -- the fixtures are the tool's own ------------------------------------------------------------------


def test_the_fixture_script_reproduces_the_committed_files(tmp_path):
    pytest.importorskip("mlx.core")
    from tests.fixtures import make_mlx_quanto_bnb_fixtures as maker

    maker.make_mlx(tmp_path / "mlx")
    for path in sorted(p for p in FIXTURES.rglob("*") if p.is_file()):
        regenerated = tmp_path / "mlx" / path.relative_to(FIXTURES)
        if path.name == "manifest.json":
            continue  # records the installed version
        assert regenerated.read_bytes() == path.read_bytes(), path
