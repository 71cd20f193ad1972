"""compressed-tensors detection, on fixtures written by the real compressed-tensors 0.20.1
(tests/fixtures/make_ct_fixtures.py) and on synthetic variants of its layout."""

from __future__ import annotations

import json
import math

import pytest

import qtool
from qtool.conventions import REGISTRY, resolve
from tests.conftest import CT_FIXTURES

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
DOWN_PROJ = "model.layers.0.mlp.down_proj.weight"

# fixture -> {weight: (logical shape, label, granularity, block, scale dtype, member roles)}
EXPECTED = {
    "W8A16": {
        Q_PROJ: ([16, 128], "int8 sym g128", "group", [1, 128], "BF16", {"data", "scale", "shape"}),
        DOWN_PROJ: ([12, 256], "int8 sym g128", "group", [1, 128], "BF16", {"data", "scale", "shape"}),
    },
    "W4A16": {
        Q_PROJ: ([16, 128], "int4 sym g128", "group", [1, 128], "BF16", {"data", "scale", "shape"}),
        DOWN_PROJ: ([12, 256], "int4 sym g128", "group", [1, 128], "BF16", {"data", "scale", "shape"}),
    },
    "W3A16": {DOWN_PROJ: ([12, 256], "int3 sym g128", "group", [1, 128], "BF16", {"data", "scale", "shape"})},
    "W4A16_ASYM": {
        DOWN_PROJ: ([12, 256], "int4 asym g128", "group", [1, 128], "BF16", {"data", "scale", "shape", "zero_point"})
    },
    "W4A16_naive": {DOWN_PROJ: ([12, 256], "int4 sym g128", "group", [1, 128], "BF16", {"data", "scale"})},
    "W8A8": {DOWN_PROJ: ([12, 256], "int8 sym channel", "channel", [1, 256], "BF16", {"data", "scale"})},
    "FP8": {DOWN_PROJ: ([12, 256], "fp8_e4m3 tensor", "tensor", None, "BF16", {"data", "scale", "input_scale"})},
    "FP8_DYNAMIC": {DOWN_PROJ: ([12, 256], "fp8_e4m3 channel", "channel", [1, 256], "BF16", {"data", "scale"})},
    "FP8_BLOCK": {
        Q_PROJ: ([256, 128], "fp8_e4m3 block128x128", "block", [128, 128], "BF16", {"data", "scale"}),
        DOWN_PROJ: ([136, 136], "fp8_e4m3 block128x128", "block", [128, 128], "BF16", {"data", "scale"}),
    },
    "NVFP4A16": {DOWN_PROJ: ([12, 256], "nvfp4 g16", "group", [1, 16], "F8_E4M3", {"data", "scale", "global_scale"})},
    "NVFP4": {
        DOWN_PROJ: (
            [12, 256],
            "nvfp4 g16",
            "group",
            [1, 16],
            "F8_E4M3",
            {"data", "scale", "global_scale", "input_global_scale"},
        )
    },
    "MXFP4A16": {DOWN_PROJ: ([12, 256], "mxfp4 g32", "group", [1, 32], "E8M0", {"data", "scale"})},
    "MXFP8A16": {DOWN_PROJ: ([12, 256], "mxfp8 g32", "group", [1, 32], "E8M0", {"data", "scale"})},
    "int4_asym_channel_odd": {
        Q_PROJ: ([20, 100], "int4 asym channel", "channel", [1, 100], "BF16", {"data", "scale", "shape", "zero_point"}),
        DOWN_PROJ: (
            [12, 132],
            "int4 asym channel",
            "channel",
            [1, 132],
            "BF16",
            {"data", "scale", "shape", "zero_point"},
        ),
    },
}


def _weights(path):
    return {w["name"]: w for w in qtool.inspect(path).to_json()["weights"]}


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_real_compressed_tensors_fixture(fixture):
    weights = _weights(CT_FIXTURES / fixture)
    for name, (shape, label, granularity, block, scale_dtype, roles) in EXPECTED[fixture].items():
        w = weights[name]
        assert w["shape"] == shape
        assert w["parameters"] == math.prod(shape)
        assert w["quantized"] is True
        assert w["scheme"]["label"] == label
        assert w["scheme"]["granularity"] == granularity
        assert w["scheme"]["block"] == block
        assert w["scheme"]["scale_dtype"] == scale_dtype
        assert w["scheme"]["convention"] == "compressed-tensors"
        assert {t["role"] for t in w["tensors"]} == roles
        assert w["notes"] == [], w["notes"]
        assert w["dtype"] == "BF16"  # the original dtype, recorded by the scale / config
    # the ignored lm_head and the norms stay plain, one stored tensor each
    for name in ("lm_head.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert weights[name]["scheme"] is None and len(weights[name]["tensors"]) == 1


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_every_stored_tensor_belongs_to_exactly_one_weight(fixture):
    report = qtool.inspect(CT_FIXTURES / fixture)
    members = [t.name for w in report.weights for t in w.members.values()]
    assert sorted(members) == sorted(report.checkpoint.tensors)
    assert report.conventions == ["compressed-tensors", "plain"]


def test_true_bits_per_weight_counts_scales_and_zero_points():
    w = _weights(CT_FIXTURES / "W4A16_ASYM")[DOWN_PROJ]
    # 12x256 int4 = 1536 B, bf16 scales 12x2 = 48 B, packed zp I32 [ceil(12*4/32)=2, 2] = 16 B, shape I64[2] = 16 B
    assert w["bytes"] == 1536 + 48 + 16 + 16
    assert w["bits_per_weight"] == pytest.approx((1536 + 48 + 16 + 16) * 8 / (12 * 256), abs=1e-4)


def test_weight_shape_is_read_for_in_features_that_do_not_fill_words():
    # q_proj is [20, 100]: packed [20, 13] could be 101..104 inputs; weight_shape says 100
    w = _weights(CT_FIXTURES / "int4_asym_channel_odd")[Q_PROJ]
    assert w["shape"] == [20, 100]


# -- synthetic variants ------------------------------------------------------------------------


def _packed_int4(
    make_safetensors, config=None, *, shape=(16, 256), group=128, shape_dtype="I64", metadata=None, extra=None
):
    out_f, in_f = shape
    tensors = {
        "m.layers.0.proj.weight_packed": ("I32", [out_f, math.ceil(in_f * 4 / 32)]),
        "m.layers.0.proj.weight_scale": ("BF16", [out_f, math.ceil(in_f / group)]),
        "m.layers.0.proj.weight_shape": (shape_dtype, [2]),
        "m.layers.0.norm.weight": ("BF16", [in_f]),
    }
    tensors.update(extra or {})
    width = 8 if shape_dtype == "I64" else 4
    data = {"m.layers.0.proj.weight_shape": out_f.to_bytes(width, "little") + in_f.to_bytes(width, "little")}
    path = make_safetensors(tensors, data=data, metadata=metadata)
    if config is not None:
        (path.parent / "config.json").write_text(json.dumps({"quantization_config": config}))
    return path


def _ct_config(**weights):
    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    args.update(weights)
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}},
        "ignore": ["lm_head"],
    }


def test_without_any_config_the_scheme_comes_from_names_and_shapes(make_safetensors):
    path = _packed_int4(make_safetensors)
    w = _weights(path)["m.layers.0.proj.weight"]
    assert w["scheme"]["label"] == "int4 sym g128" and w["shape"] == [16, 256]


def test_old_files_store_weight_shape_as_i32(make_safetensors):
    w = _weights(_packed_int4(make_safetensors, shape_dtype="I32"))["m.layers.0.proj.weight"]
    assert w["shape"] == [16, 256]


def test_single_file_config_in_safetensors_metadata(make_safetensors):
    config = _ct_config(num_bits=4)
    path = _packed_int4(make_safetensors, metadata={"quantization_config": json.dumps(config)})
    w = _weights(path)["m.layers.0.proj.weight"]
    assert w["scheme"]["label"] == "int4 sym g128"


def test_config_and_tensors_disagree_tensors_win_with_a_note(make_safetensors):
    # the config says 8-bit, but 32 words per row of 256 inputs is 4-bit
    path = _packed_int4(make_safetensors, _ct_config(num_bits=8))
    w = _weights(path)["m.layers.0.proj.weight"]
    assert w["scheme"]["bits"] == 4
    assert any("config says 8-bit, tensors show 4-bit" in n for n in w["notes"])


def test_ignore_regex_matches_like_compressed_tensors(make_safetensors):
    # re: is re.match on the module name; the module is quantized anyway, so qtool says so
    path = _packed_int4(make_safetensors, dict(_ct_config(), ignore=["re:.*layers\\.0\\.proj$"]))
    w = _weights(path)["m.layers.0.proj.weight"]
    assert w["quantized"] and any("ignore" in n for n in w["notes"])
    # a plain substring is not a regex and does not match
    path = _packed_int4(make_safetensors, dict(_ct_config(), ignore=["proj"]))
    assert _weights(path)["m.layers.0.proj.weight"]["notes"] == []


def test_scale_that_does_not_fit_leaves_the_tensors_plain_with_a_note(make_safetensors):
    path = make_safetensors(
        {
            "a.weight_packed": ("I32", [16, 32]),
            "a.weight_scale": ("BF16", [7, 3]),
            "a.weight_shape": ("I64", [2]),
        },
        data={"a.weight_shape": (16).to_bytes(8, "little") + (256).to_bytes(8, "little")},
    )
    weights = _weights(path)
    assert set(weights) == {"a.weight_packed", "a.weight_scale", "a.weight_shape"}
    for w in weights.values():
        assert w["scheme"] is None
        assert any("does not fit" in n for n in w["notes"])


def test_packed_width_that_no_bit_width_fits_is_plain(make_safetensors):
    path = make_safetensors(
        {"a.weight_packed": ("I32", [16, 41]), "a.weight_scale": ("BF16", [16, 2]), "a.weight_shape": ("I64", [2])},
        data={"a.weight_shape": (16).to_bytes(8, "little") + (256).to_bytes(8, "little")},
    )
    assert all(w["scheme"] is None for w in _weights(path).values())


def test_unpacked_int8_with_scale_is_int_quantized(make_safetensors):
    path = make_safetensors({"a.weight": ("I8", [8, 64]), "a.weight_scale": ("F32", [8, 1])})
    w = _weights(path)["a.weight"]
    assert w["scheme"]["label"] == "int8 sym channel"


def test_registry_has_plain_last_and_two_conventions_never_claim_one_tensor(make_safetensors):
    assert REGISTRY[-1].name == "plain"
    path = _packed_int4(make_safetensors, _ct_config())

    class Greedy:
        name = "greedy"

        def detect(self, checkpoint, pool):
            from qtool.conventions.base import plain_weight

            return [plain_weight(t) for t in checkpoint.tensors.values()]  # claims what is gone

    from qtool.conventions import ClaimConflict

    with pytest.raises(ClaimConflict):
        resolve(qtool.open_checkpoint(path), registry=(REGISTRY[0], Greedy()))


def test_a_config_regex_that_backtracks_is_refused_not_run_for_hours(make_safetensors):
    """Configs come from strangers: an `ignore` entry of `re:(a|aa)+$` met a module of 40 a's
    and ran for hours in Python's re. Now every match is bounded (qtool.patterns), exit 2."""
    import subprocess
    import sys

    from tests.conftest import REPO

    module = "a" * 40 + "!"
    tensors = {
        f"{module}.weight_packed": ("I32", [16, 32]),
        f"{module}.weight_scale": ("BF16", [16, 2]),
        f"{module}.weight_shape": ("I64", [2]),
    }
    path = make_safetensors(
        tensors, data={f"{module}.weight_shape": (16).to_bytes(8, "little") + (256).to_bytes(8, "little")}
    )
    (path.parent / "config.json").write_text(
        json.dumps({"quantization_config": dict(_ct_config(), ignore=["re:(a|aa)+$"])})
    )
    done = subprocess.run(
        [sys.executable, "-m", "qtool", "inspect", str(path)], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "(a|aa)+$" in done.stderr and "quantization_config" in done.stderr and "backtracks" in done.stderr
