"""gpt-oss MXFP4 (`*_blocks` U8 (..., G, B) + `*_scales` U8 (..., G)): one weight each, decoded
as transformers' `convert_moe_packed_tensors` does, bit for bit, and checked by hand.

Fixtures: tests/fixtures/gptoss/ (random codes, scales 0..254 including 0, 1, 127 and 254);
the reference is transformers' function, run on CPU when the fixtures were made.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import qtool
from qtool.conventions import decoder_for
from tests.conftest import write_safetensors

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gptoss"
MODEL = FIXTURES / "model.safetensors"
EXPERTS = "model.layers.0.mlp.experts"
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def float_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def inspected():
    inspection = qtool.inspect(FIXTURES)
    return inspection, {w.name: w for w in inspection.weights}


def test_blocks_and_scales_are_one_weight_in_the_models_layout():
    _, found = inspected()
    assert {n for n, w in found.items() if w.quantized} == {f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.down_proj"}
    gate_up = found[f"{EXPERTS}.gate_up_proj"]
    # stored (E=2, N=8, G=2, B=16): 2 x 8 x 64 values, held by transformers as [E, in, out]
    assert gate_up.shape == (2, 64, 8) and gate_up.parameters == 1024
    assert gate_up.dtype == "BF16"  # the config's torch_dtype
    assert gate_up.convention == "gpt-oss"
    assert gate_up.scheme.label == "mxfp4 block32x1"
    assert gate_up.scheme.scale_dtype == "E8M0" and gate_up.scheme.qtype.name == "fp4_e2m1"
    assert gate_up.bits_per_weight == (2 * 8 * 2 * 16 + 2 * 8 * 2) * 8 / 1024  # 4.25
    assert {role: t.name for role, t in gate_up.members.items()} == {
        "data": f"{EXPERTS}.gate_up_proj_blocks",
        "scale": f"{EXPERTS}.gate_up_proj_scales",
    }
    assert found[f"{EXPERTS}.down_proj"].shape == (2, 32, 4)
    assert found[f"{EXPERTS}.gate_up_proj_bias"].scheme is None


def test_lookalikes_stay_plain():
    _, found = inspected()
    assert found["model.layers.0.lookalike_blocks"].scheme is None  # U8 blocks without scales
    assert found["model.layers.0.mlp.router.weight"].scheme is None


@pytest.mark.parametrize("dtype, suffix", [("BF16", ""), ("F32", ".f32")])
def test_decoding_matches_transformers_bit_for_bit(dtype, suffix):
    inspection, found = inspected()
    reference = load_file(FIXTURES / "reference" / "weights.safetensors")
    for name in (f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.down_proj"):
        weight = dataclasses.replace(found[name], dtype=dtype)
        out = decoder_for(weight).decode(inspection.checkpoint, weight, "cpu")
        expected = reference[name + suffix]
        assert out.dtype == expected.dtype and out.shape == expected.shape
        assert torch.equal(float_bits(out), float_bits(expected)), name


def test_decoding_matches_transformers_live():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    inspection, found = inspected()
    blocks = load_file(MODEL)
    weight = found[f"{EXPERTS}.gate_up_proj"]
    expected = mxfp4.convert_moe_packed_tensors(
        blocks[f"{EXPERTS}.gate_up_proj_blocks"], blocks[f"{EXPERTS}.gate_up_proj_scales"], dtype=torch.bfloat16
    )
    out = decoder_for(weight).decode(inspection.checkpoint, weight, "cpu")
    assert torch.equal(float_bits(out), float_bits(expected))


def test_hand_computed_values():
    """w[e, n, g*32 + 2k] = e2m1(byte & 0xF) * 2^(scale - 127), w[.., 2k+1] from the high
    nibble; the weight holds it at [e, g*32 + 2k, n]."""
    inspection, found = inspected()
    stored = load_file(MODEL)
    blocks, scales = stored[f"{EXPERTS}.gate_up_proj_blocks"], stored[f"{EXPERTS}.gate_up_proj_scales"]
    weight = dataclasses.replace(found[f"{EXPERTS}.gate_up_proj"], dtype="F32")
    out = decoder_for(weight).decode(inspection.checkpoint, weight, "cpu")
    for e, n, g, k in [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 15), (1, 7, 1, 3), (1, 3, 0, 9)]:
        byte, scale = int(blocks[e, n, g, k]), int(scales[e, n, g])
        assert out[e, g * 32 + 2 * k, n].item() == E2M1[byte & 0xF] * 2.0 ** (scale - 127)
        assert out[e, g * 32 + 2 * k + 1, n].item() == E2M1[byte >> 4] * 2.0 ** (scale - 127)
    assert [int(s) for s in scales.reshape(-1)[:4]] == [0, 1, 127, 254]  # 2^-127 (an f32 subnormal) .. 2^127


def test_a_two_dimensional_weight_keeps_its_order(tmp_path):
    blocks = bytes([0x21, 0xF9] * 8 * 2)  # two rows of one 32-value block
    path = write_safetensors(
        tmp_path / "model.safetensors",
        {"w_blocks": ("U8", [2, 1, 16]), "w_scales": ("U8", [2, 1])},
        data={"w_blocks": blocks, "w_scales": bytes([127, 128])},
    )
    inspection = qtool.inspect(path)
    (weight,) = [w for w in inspection.weights if w.quantized]
    assert weight.name == "w" and weight.shape == (2, 32) and weight.scheme.label == "mxfp4 g32"
    out = decoder_for(weight).decode(inspection.checkpoint, dataclasses.replace(weight, dtype="F32"), "cpu")
    assert out[0, :4].tolist() == [0.5, 1.0, -0.5, -6.0]  # 0x21: 1 then 2; 0xF9: 9 then 15
    assert out[1, :4].tolist() == [1.0, 2.0, -1.0, -12.0]  # scale 2^1


def test_shapes_that_do_not_fit_are_plain_with_a_note(make_safetensors):
    path = make_safetensors({"w_blocks": ("U8", [2, 3, 16]), "w_scales": ("U8", [2, 4])})
    found = {w.name: w for w in qtool.inspect(path).weights}
    assert all(w.scheme is None for w in found.values())
    assert "looks like gpt-oss MXFP4" in found["w_blocks"].notes[0]


def test_no_plain_tensor_is_reported_as_quantized():
    _, found = inspected()
    for weight in found.values():
        paired = (
            weight.data.name.endswith("_blocks")
            and weight.data.name.replace("_blocks", "_scales") in qtool.open_checkpoint(MODEL).tensors
        )
        assert weight.quantized == paired, weight.name
        if not weight.quantized:
            assert weight.dtype in ("BF16", "F32", "U8") and weight.notes == [], weight.name


def test_dequantize_writes_what_transformers_computes(tmp_path):
    qtool.dequantize(FIXTURES, tmp_path / "out.safetensors")
    out = load_file(tmp_path / "out.safetensors")
    reference = load_file(FIXTURES / "reference" / "weights.safetensors")
    for name in (f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.down_proj"):
        assert torch.equal(float_bits(out[name]), float_bits(reference[name])), name
    assert f"{EXPERTS}.gate_up_proj_bias" in out and f"{EXPERTS}.gate_up_proj_blocks" not in out
