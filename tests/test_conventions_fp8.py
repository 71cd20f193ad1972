"""FP8 checkpoints outside compressed-tensors, and the lookalikes that must stay plain."""

from __future__ import annotations

import json

import pytest

import qtool


def _weights(path):
    return {w["name"]: w for w in qtool.inspect(path).to_json()["weights"]}


def test_deepseek_block_scales_with_edge_blocks(make_safetensors):
    # [200, 300] in 128x128 blocks: a 2x3 grid whose last row and column are partial
    path = make_safetensors({"l.weight": ("F8_E4M3", [200, 300]), "l.weight_scale_inv": ("F32", [2, 3])})
    (path.parent / "config.json").write_text(
        json.dumps(
            {
                "torch_dtype": "bfloat16",
                "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
            }
        )
    )
    w = _weights(path)["l.weight"]
    assert w["scheme"]["label"] == "fp8_e4m3 block128x128"
    assert w["scheme"]["block"] == [128, 128]
    assert w["scheme"]["convention"] == "fp8"
    assert w["dtype"] == "BF16"
    assert w["parameters"] == 200 * 300


def test_block_size_is_inferred_without_a_config(make_safetensors):
    path = make_safetensors({"l.weight": ("F8_E4M3", [256, 384]), "l.weight_scale_inv": ("F32", [2, 3])})
    assert _weights(path)["l.weight"]["scheme"]["block"] == [128, 128]


@pytest.mark.parametrize(
    "scale_shape, granularity",
    [([], "tensor"), ([1], "tensor"), ([64], "channel"), ([64, 1], "channel")],
)
def test_per_tensor_and_per_channel_weight_scale(make_safetensors, scale_shape, granularity):
    path = make_safetensors(
        {"l.weight": ("F8_E4M3", [64, 32]), "l.weight_scale": ("F32", scale_shape), "l.input_scale": ("F32", [])}
    )
    w = _weights(path)["l.weight"]
    assert w["scheme"]["granularity"] == granularity
    assert {t["role"] for t in w["tensors"]} == {"data", "scale", "input_scale"}


def test_e5m2_weights(make_safetensors):
    path = make_safetensors({"l.weight": ("F8_E5M2", [8, 8]), "l.weight_scale": ("F32", [1])})
    assert _weights(path)["l.weight"]["scheme"]["qtype"] == "fp8_e5m2"


def test_a_bare_fp8_tensor_is_a_plain_float(make_safetensors):
    path = make_safetensors({"l.weight": ("F8_E4M3", [8, 8])})
    w = _weights(path)["l.weight"]
    assert w["scheme"] is None and w["dtype"] == "F8_E4M3" and w["notes"] == []


def test_an_int8_tensor_without_a_scale_is_plain(make_safetensors):
    path = make_safetensors({"table.weight": ("I8", [16, 32]), "mask": ("U8", [4, 4])})
    assert all(w["scheme"] is None for w in _weights(path).values())


def test_fp8_scale_that_does_not_fit_is_plain_with_a_note(make_safetensors):
    path = make_safetensors({"l.weight": ("F8_E4M3", [64, 32]), "l.weight_scale": ("F32", [3, 5, 7])})
    weights = _weights(path)
    assert weights["l.weight"]["scheme"] is None
    assert "does not fit" in weights["l.weight"]["notes"][0]
