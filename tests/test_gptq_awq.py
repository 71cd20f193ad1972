"""GPTQ and AWQ: detection, logical shapes, schemes and decoding.

Fixtures (tests/fixtures/make_gptq_awq_fixtures.py) are packed by the real auto-gptq 0.7.1
(`QuantLinear.pack`, widths 2/3/4/8, sym and asym, desc_act, group 128/64/-1) and autoawq
0.2.9 (`WQLinear_GEMM.from_linear`, `WQLinear_GEMV.from_linear`); each carries the tool's own
dequantized weights (auto-gptq's torch dequantization, AutoAWQ's `dequantize_gemm`, float16),
or for GEMV, which has no CPU path, the kernel's float32 formula computed by hand. Proofs:
- `qtool dequantize` and the conventions' `decode` equal those references bit for bit
  (float16, the tools' own precision; GEMV: float32 exact, and its float16 rounding);
- inspect reports the logical shape, parameter count, true bits per weight and scheme, with and
  without the config files;
- config/tensor disagreements are notes, lookalikes stay plain, and GPTQ tensors that fit no
  layout under a GPTQ config are listed by inspect and refused by dequantize with exit 2.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.conventions import REGISTRY, ClaimConflict, decoder_for, resolve
from qtool.conventions.awq import ORDER, Awq, zeros_width
from qtool.conventions.gptq import Gptq
from qtool.errors import CheckpointError
from qtool.formats.memory import MemoryCheckpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODULE = "model.layers.0.self_attn.q_proj"
WEIGHT = f"{MODULE}.weight"
O, I = 32, 256  # noqa: E741 - out and in features, as the byte formulas below name them
runner = CliRunner()

# fixture -> (label, bits, group_size, format | AWQ version, desc_act, settings source, stored bytes)
# Stored bytes, by hand: qweight I*b/32*O*4 + qzeros G*(O*b/32)*4 + scales G*O*2 + g_idx I*4.
GPTQ = {
    "gptq_4bit_sym_g128": ("int4 sym g128", 4, 128, "gptq", "no", "quantize_config.json", 4096 + 32 + 128 + 1024),
    "gptq_4bit_asym_g128": ("uint4 asym g128", 4, 128, "gptq", "no", "config.json", 4096 + 32 + 128 + 1024),
    "gptq_v2_4bit_asym_g128": ("uint4 asym g128", 4, 128, "gptq_v2", "no", "config.json", 4096 + 32 + 128 + 1024),
    "gptq_4bit_desc_act_g64": ("uint4 asym g64", 4, 64, "gptq", "yes", "quantize_config.json", 4096 + 64 + 256 + 1024),
    "gptq_4bit_sym_channel": ("int4 sym channel", 4, None, "gptq", "no", "quantize_config.json", 4096 + 16 + 64 + 1024),
    "gptq_2bit_asym_g64": ("uint2 asym g64", 2, 64, "gptq", "no", "quantize_config.json", 2048 + 32 + 256 + 1024),
    "gptq_3bit_asym_g128": ("uint3 asym g128", 3, 128, "gptq", "no", "quantize_config.json", 3072 + 24 + 128 + 1024),
    "gptq_8bit_sym_g128": ("int8 sym g128", 8, 128, "gptq", "no", "quantize_config.json", 8192 + 64 + 128 + 1024),
}
AWQ = {
    # GEMM: qweight I*O/8*4 + qzeros G*O/8*4 + scales G*O*2
    "awq_gemm_g128": ("uint4 asym g128", 4, 128, "gemm", None, "config.json", 4096 + 32 + 128),
    # GEMV g64 on 256 inputs: G = 4 groups, qzeros width W = roundup(ceil(4/8), 2) = 2, scales 8W = 16 columns
    "awq_gemv_g64": ("uint4 asym g64", 4, 64, "gemv", None, "config.json", 4096 + 2 * O * 4 + 16 * O * 2),
}
ALL = {**{f"gptq/{k}": v for k, v in GPTQ.items()}, **{f"awq/{k}": v for k, v in AWQ.items()}}
REFERENCE = {"gptq/gptq_v2_4bit_asym_g128": "gptq/gptq_4bit_asym_g128"}  # the same weights, v2 zero points


def _reference(fixture: str) -> torch.Tensor:
    source = REFERENCE.get(fixture, fixture)
    return load_file(str(FIXTURES / source / "reference" / "weights.safetensors"))[WEIGHT]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _weights(path) -> dict:
    return {w.name: w for w in resolve(qtool.open_checkpoint(path))}


def _json(path) -> dict:
    return {w["name"]: w for w in qtool.inspect(path).to_json()["weights"]}


def _copy(fixture: str, tmp_path: Path, *, keep_configs: bool = True) -> Path:
    target = tmp_path / fixture.replace("/", "_")
    target.mkdir()
    for item in (FIXTURES / fixture).iterdir():
        if item.is_file() and (keep_configs or item.suffix != ".json"):
            shutil.copy(item, target / item.name)
    return target


# -- inspect on the real fixtures -------------------------------------------------------------------


@pytest.mark.parametrize("fixture", sorted(ALL))
def test_inspect_reports_shape_parameters_bits_and_scheme(fixture):
    label, bits, group_size, layout, desc_act, source, stored = ALL[fixture]
    weights = _json(FIXTURES / fixture)
    w = weights[WEIGHT]
    assert w["shape"] == [O, I]
    assert w["parameters"] == O * I
    assert w["quantized"] is True
    assert w["dtype"] == "F16"
    assert w["scheme"]["label"] == label
    assert w["scheme"]["bits"] == bits
    assert w["scheme"]["group_size"] == group_size
    assert w["scheme"]["granularity"] == ("channel" if group_size is None else "group")
    assert w["scheme"]["zero_point"] is True
    assert w["scheme"]["convention"] == fixture.split("/")[0]
    assert w["bytes"] == stored
    assert w["bits_per_weight"] == pytest.approx(stored * 8 / (O * I), abs=1e-4)
    assert w["notes"] == []
    roles = {t["role"] for t in w["tensors"]}
    assert roles == (
        {"data", "scale", "zero_point", "g_idx"} if fixture.startswith("gptq") else {"data", "scale", "zero_point"}
    )
    extra = dict(_weights(FIXTURES / fixture)[WEIGHT].provenance.details)
    assert extra["settings"] == source
    if fixture.startswith("gptq"):
        assert (extra["format"], extra["desc_act"]) == (layout, desc_act)
    else:
        assert extra["version"] == layout


@pytest.mark.parametrize("fixture", sorted(ALL))
def test_no_plain_tensor_is_reported_as_quantized(fixture):
    """Every stored tensor belongs to exactly one weight; the only quantized weight is the
    packed Linear, and g_idx / bias / the norm are a member or plain weights, never quantized."""
    report = qtool.inspect(FIXTURES / fixture)
    members = sorted(t.name for w in report.weights for t in w.members.values())
    assert members == sorted(report.checkpoint.tensors)
    assert [w.name for w in report.weights if w.quantized] == [WEIGHT]
    for w in report.weights:
        if w.name != WEIGHT:
            assert w.scheme is None and len(w.members) == 1 and w.notes == [], w.name
    assert not any(w.name.endswith(("g_idx", "qzeros", "scales", "qweight")) for w in report.weights)
    assert report.weights[[w.name for w in report.weights].index(WEIGHT)].convention == fixture.split("/")[0]


# -- decoding against the tools' own references ------------------------------------------------------


@pytest.mark.parametrize("fixture", sorted(ALL))
def test_decode_equals_the_tools_own_dequantization_bit_for_bit(fixture):
    checkpoint = qtool.open_checkpoint(FIXTURES / fixture)
    weight = _weights(FIXTURES / fixture)[WEIGHT]
    decoded = decoder_for(weight).decode(checkpoint, weight, "cpu")
    reference = _reference(fixture)
    assert decoded.dtype == torch.float16 and decoded.shape == (O, I)
    if reference.dtype == torch.float32:  # GEMV: the kernel's float32 products
        assert torch.equal(_bits(decoded), _bits(reference.half()))
        exact = decoder_for(weight).decode(checkpoint, weight, "cpu", torch.float32)
        assert torch.equal(_bits(exact), _bits(reference))
    else:
        assert torch.equal(_bits(decoded), _bits(reference))


@pytest.mark.parametrize("fixture", sorted(ALL))
def test_qtool_dequantize_matches_the_reference(fixture, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["dequantize", str(FIXTURES / fixture), "-o", str(out)])
    assert result.exit_code == 0, result.output
    written = load_file(str(out / "model.safetensors"))
    reference = _reference(fixture)
    assert written[WEIGHT].dtype == torch.float16  # config.json's torch_dtype
    assert torch.equal(_bits(written[WEIGHT]), _bits(reference.half()))
    stored = load_file(str(FIXTURES / fixture / "model.safetensors"))
    plain = {name for name in stored if not name.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    assert set(written) == plain | {WEIGHT}  # the bias and the norm copied through


def test_desc_act_must_index_through_g_idx():
    """The act-order fixture's g_idx is a permutation; decoding by column // group_size is wrong."""
    path = FIXTURES / "gptq/gptq_4bit_desc_act_g64"
    tensors = load_file(str(path / "model.safetensors"))
    g_idx = tensors[f"{MODULE}.g_idx"]
    assert not torch.equal(g_idx, torch.arange(I, dtype=torch.int32) // 64)
    assert torch.equal(torch.bincount(g_idx), torch.full((4,), 64))
    without = {k: v for k, v in tensors.items() if not k.endswith("g_idx")}
    settings = {"bits": 4, "group_size": 64, "desc_act": False, "sym": False}
    checkpoint = MemoryCheckpoint(without, {"quantize_config.json": settings})
    weight = next(w for w in resolve(checkpoint) if w.quantized)
    wrong = decoder_for(weight).decode(checkpoint, weight, "cpu")
    assert not torch.equal(wrong, _reference("gptq/gptq_4bit_desc_act_g64"))


def test_gptq_v2_zero_points_are_not_offset():
    v1 = load_file(str(FIXTURES / "gptq/gptq_4bit_asym_g128/model.safetensors"))
    v2 = load_file(str(FIXTURES / "gptq/gptq_v2_4bit_asym_g128/model.safetensors"))
    assert not torch.equal(v1[f"{MODULE}.qzeros"], v2[f"{MODULE}.qzeros"])
    # the v2 file read as v1 (a config that forgets checkpoint_format) decodes one step off
    checkpoint = MemoryCheckpoint(v2, {"quantize_config.json": {"bits": 4, "group_size": 128, "sym": False}})
    weight = next(w for w in resolve(checkpoint) if w.quantized)
    assert dict(weight.provenance.details)["format"] == "gptq"
    assert not torch.equal(
        decoder_for(weight).decode(checkpoint, weight, "cpu"), _reference("gptq/gptq_4bit_asym_g128")
    )


# -- hand-computed layouts --------------------------------------------------------------------------


def _stream(values: list[int], bits: int, words: int) -> list[int]:
    """The published GPTQ packing: value j at bit j*bits of one LSB-first stream of int32 words."""
    stream = sum(v << (bits * j) for j, v in enumerate(values))
    out = [(stream >> (32 * k)) & 0xFFFFFFFF for k in range(words)]
    return [w - (1 << 32) if w >= 1 << 31 else w for w in out]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_packing_by_hand_every_width(bits):
    """One output column, 64 inputs, codes 0, 1, 2, ... mod 2^b; scale 0.5, v2 zero point 1.
    For 3 bits, inputs 10 and 21 of each 32 straddle words (bits 30-32 and 63-65)."""
    codes = [j * 7 % (1 << bits) for j in range(64)]
    words = 64 * bits // 32
    outputs = 32 // bits * 8 if bits != 3 else 32  # qzeros needs O*b/32 whole words
    qweight = torch.tensor([_stream(codes, bits, words)] * outputs, dtype=torch.int32).t().contiguous()  # [64b/32, O]
    qzeros = torch.tensor([_stream([1] * outputs, bits, outputs * bits // 32)], dtype=torch.int32)
    scales = torch.full((1, outputs), 0.5, dtype=torch.float16)
    tensors = {"m.qweight": qweight, "m.qzeros": qzeros, "m.scales": scales}
    checkpoint = MemoryCheckpoint(
        tensors,
        {"quantize_config.json": {"bits": bits, "group_size": -1, "sym": False, "checkpoint_format": "gptq_v2"}},
    )
    weight = next(w for w in resolve(checkpoint) if w.quantized)
    assert weight.shape == (outputs, 64) and weight.scheme.bits == bits
    decoded = decoder_for(weight).decode(checkpoint, weight, "cpu")
    expected = torch.tensor([(c - 1) * 0.5 for c in codes], dtype=torch.float16)
    assert torch.equal(decoded[0], expected) and torch.equal(decoded[-1], expected)


def test_awq_gemm_interleave_by_hand():
    """Word c's nibble k holds output 8c + [0, 2, 4, 6, 1, 3, 5, 7][k]: give output o the code o."""
    word = sum(ORDER[k] << (4 * k) for k in range(8))  # nibble k = the output it holds
    qweight = torch.full((128, 1), word, dtype=torch.int32)
    qzeros = torch.zeros(1, 1, dtype=torch.int32)
    scales = torch.ones(1, 8, dtype=torch.float16)
    checkpoint = MemoryCheckpoint({"m.qweight": qweight, "m.qzeros": qzeros, "m.scales": scales})
    weight = next(w for w in resolve(checkpoint) if w.quantized)
    assert weight.convention == "awq" and weight.shape == (8, 128)
    assert dict(weight.provenance.details)["version"] == "gemm"
    decoded = decoder_for(weight).decode(checkpoint, weight, "cpu")
    assert torch.equal(decoded, torch.arange(8, dtype=torch.float16)[:, None].expand(8, 128))


def test_awq_gemv_padding_by_hand():
    """GEMV g32 on 64 inputs: 2 groups, qzeros width roundup(ceil(2/8), 4) = 4, scales 32 columns
    of which 30 are padding; nonzero padding must not leak into the weight."""
    assert zeros_width(64, 32) == 4 and zeros_width(4096, 64) == 8 and zeros_width(4096, 128) == 4
    codes = [j % 16 for j in range(64)]
    qweight = torch.tensor([_stream(codes, 4, 8)] * 8, dtype=torch.int32)  # [O=8, I/8]
    qzeros = torch.tensor([_stream([3, 5], 4, 4)] * 8, dtype=torch.int32)  # zero 3 (group 0), 5 (group 1)
    scales = torch.full((8, 32), 7.0, dtype=torch.float16)
    scales[:, 0], scales[:, 1] = 0.25, 2.0
    tensors = {"m.qweight": qweight, "m.qzeros": qzeros, "m.scales": scales}
    config = {
        "config.json": {
            "quantization_config": {
                "quant_method": "awq",
                "version": "gemv",
                "group_size": 32,
                "bits": 4,
                "zero_point": True,
            }
        }
    }
    checkpoint = MemoryCheckpoint(tensors, config)
    weight = next(w for w in resolve(checkpoint) if w.quantized)
    assert weight.shape == (8, 64) and weight.scheme.label == "uint4 asym g32" and weight.notes == []
    decoded = decoder_for(weight).decode(checkpoint, weight, "cpu", torch.float32)
    expected = torch.tensor([(c - 3) * 0.25 for c in codes[:32]] + [(c - 5) * 2.0 for c in codes[32:]])
    assert torch.equal(decoded[0], expected)


# -- without config files: shapes (and small qzeros / g_idx reads) decide --------------------------


@pytest.mark.parametrize("fixture", sorted(set(ALL) - {"gptq/gptq_v2_4bit_asym_g128"}))
def test_without_config_files_the_shapes_decide(fixture, tmp_path):
    label, bits, _, layout, desc_act, _, _ = ALL[fixture]
    path = _copy(fixture, tmp_path, keep_configs=False)
    weight = _weights(path)[WEIGHT]
    assert weight.shape == (O, I) and weight.scheme.bits == bits
    assert weight.scheme.label == label  # sym from qzeros at the midpoint; g128 on 256 inputs
    extra = dict(weight.provenance.details)
    assert extra["settings"] == "shapes"
    if fixture.startswith("gptq"):
        assert extra["desc_act"] == desc_act  # read from the small g_idx
    else:
        assert extra["version"] == layout
    checkpoint = qtool.open_checkpoint(path)
    assert torch.equal(_bits(decoder_for(weight).decode(checkpoint, weight, "cpu")), _bits(_reference(fixture).half()))


def test_inspect_imports_no_torch_without_a_config(tmp_path):
    path = _copy("gptq/gptq_4bit_desc_act_g64", tmp_path, keep_configs=False)
    code = f"import sys, qtool; r = qtool.inspect({str(path)!r}); print([w.scheme.label for w in r.weights if w.quantized], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "['uint4 asym g64'] False"


# -- config and tensors disagree: the tensors win, with a note ----------------------------------------


def _with_config(fixture: str, tmp_path: Path, name: str, change: dict) -> Path:
    path = _copy(fixture, tmp_path)
    content = json.loads((path / name).read_text())
    target = content["quantization_config"] if name == "config.json" else content
    target.update(change)
    (path / name).write_text(json.dumps(content))
    return path


def test_config_says_4bit_tensors_show_8bit(tmp_path):
    path = _with_config("gptq/gptq_8bit_sym_g128", tmp_path, "quantize_config.json", {"bits": 4})
    w = _json(path)[WEIGHT]
    assert w["scheme"]["bits"] == 8 and w["shape"] == [O, I]
    assert w["notes"] == ["quantize_config.json says 4-bit, tensors show 8-bit"]


def test_config_group_size_disagrees(tmp_path):
    path = _with_config("gptq/gptq_4bit_asym_g128", tmp_path, "config.json", {"group_size": 64})
    w = _json(path)[WEIGHT]
    assert w["scheme"]["group_size"] == 128
    assert w["notes"] == ["config.json says group_size 64, tensors show 128"]


def test_awq_config_version_disagrees(tmp_path):
    path = _with_config("awq/awq_gemm_g128", tmp_path, "config.json", {"version": "gemv"})
    w = _json(path)[WEIGHT]
    assert w["scheme"]["label"] == "uint4 asym g128"
    assert w["notes"] == ["config.json says version gemv, tensors are laid out as gemm"]


# -- bad input and lookalikes -------------------------------------------------------------------------


def _bad_gptq(tmp_path: Path) -> Path:
    """quantize_config.json says 4-bit g128; scales has 3 rows, which no group size gives for 256 inputs."""
    path = tmp_path / "bad"
    path.mkdir()
    tensors = {
        f"{MODULE}.qweight": torch.zeros(32, O, dtype=torch.int32),
        f"{MODULE}.qzeros": torch.zeros(3, 4, dtype=torch.int32),
        f"{MODULE}.scales": torch.ones(3, O, dtype=torch.float16),
        f"{MODULE}.g_idx": torch.zeros(I, dtype=torch.int32),
    }
    save_file(tensors, str(path / "model.safetensors"))
    (path / "quantize_config.json").write_text(
        json.dumps({"bits": 4, "group_size": 128, "desc_act": False, "sym": True})
    )
    return path


def test_gptq_shapes_that_do_not_fit_their_config(tmp_path, monkeypatch):
    monkeypatch.delenv("QTOOL_DEBUG", raising=False)
    path = _bad_gptq(tmp_path)
    # inspect lists it, with the reason, and succeeds
    w = _json(path)[WEIGHT]
    assert w["shape"] == [O, I] and w["scheme"]["label"] == "int4 sym g128"
    assert w["notes"] == [
        (
            "tensors do not fit quantize_config.json (4-bit, group_size 128): scales has 3 rows, "
            "which no group size gives for 256 inputs; qtool cannot decode it"
        )
    ]
    assert runner.invoke(app, ["inspect", str(path)]).exit_code == 0
    # dequantize refuses: exit 2, one error line and one hint line at most, no traceback
    result = subprocess.run(
        [sys.executable, "-m", "qtool", "dequantize", str(path), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and "scales has 3 rows, which no group size gives for 256 inputs" in lines[0]
    assert len(lines) <= 2 and "Traceback" not in result.stderr
    assert result.stdout == ""
    with pytest.raises(CheckpointError):
        weight = _weights(path)[WEIGHT]
        decoder_for(weight).decode(qtool.open_checkpoint(path), weight, "cpu")


def test_g_idx_out_of_range_is_a_checkpoint_error(tmp_path):
    tensors = load_file(str(FIXTURES / "gptq/gptq_4bit_asym_g128/model.safetensors"))
    tensors[f"{MODULE}.g_idx"] = torch.full((I,), 5, dtype=torch.int32)
    checkpoint = MemoryCheckpoint(tensors, {"quantize_config.json": {"bits": 4, "group_size": 128, "sym": False}})
    weight = next(w for w in resolve(checkpoint) if w.quantized)
    with pytest.raises(CheckpointError, match="g_idx holds groups 5..5, scales has 2"):
        decoder_for(weight).decode(checkpoint, weight, "cpu")


def test_half_recognized_without_config_stays_plain_with_a_note(make_safetensors):
    path = make_safetensors({"a.qweight": ("I32", [32, 64]), "a.qzeros": ("I32", [2, 8]), "a.scales": ("F16", [2, 48])})
    weights = _json(path)
    assert set(weights) == {"a.qweight", "a.qzeros", "a.scales"}
    for w in weights.values():
        assert w["quantized"] is False
        assert w["notes"] == ["looks like GPTQ, but scales has 48 columns, qweight 64; left plain"]


def test_qweight_and_scales_without_qzeros_stay_plain(make_safetensors):
    path = make_safetensors({"a.qweight": ("I32", [32, 64]), "a.scales": ("F16", [2, 64])})
    for w in _json(path).values():
        assert w["quantized"] is False and "without qzeros" in w["notes"][0]


def test_lookalikes_stay_plain(make_safetensors):
    """An int32 g_idx with no GPTQ module, and an I8 tensor with no scale, are plain weights."""
    path = make_safetensors({
        "a.g_idx": ("I32", [256]),
        "b.weight": ("I8", [16, 16]),
        "c.qweight": ("I32", [32, 64]), "c.qzeros": ("I32", [2, 8]), "c.scales": ("F16", [2, 64]), "c.g_idx": ("I32", [256]),
    })  # fmt: skip
    weights = _json(path)
    assert weights["a.g_idx"]["quantized"] is False and weights["a.g_idx"]["notes"] == []
    assert weights["b.weight"]["quantized"] is False and weights["b.weight"]["notes"] == []
    assert (
        weights["c.weight"]["scheme"]["label"] == "uint4 asym g128"
    )  # qzeros all 0: v1 zero point 1, not the midpoint
    assert "c.g_idx" not in weights


def test_gptq_and_awq_modules_side_by_side_without_config(tmp_path):
    gptq = load_file(str(FIXTURES / "gptq/gptq_3bit_asym_g128/model.safetensors"))
    awq = load_file(str(FIXTURES / "awq/awq_gemm_g128/model.safetensors"))
    tensors = {**{k.replace("q_proj", "k_proj"): v for k, v in gptq.items() if "q_proj" in k}, **awq}
    checkpoint = MemoryCheckpoint(tensors)
    weights = {w.name: w for w in resolve(checkpoint)}
    assert weights["model.layers.0.self_attn.k_proj.weight"].convention == "gptq"
    assert weights[WEIGHT].convention == "awq"
    members = sorted(t.name for w in weights.values() for t in w.members.values())
    assert members == sorted(tensors)


def test_two_conventions_claiming_one_tensor_is_caught():
    tensors = load_file(str(FIXTURES / "gptq/gptq_4bit_sym_g128/model.safetensors"))
    checkpoint = MemoryCheckpoint(tensors, {"quantize_config.json": {"bits": 4, "group_size": 128, "sym": True}})

    class Greedy(Gptq):
        def detect(self, checkpoint, pool):  # ignores the pool: claims what GPTQ already took
            return super().detect(checkpoint, dict(checkpoint.tensors))

    with pytest.raises(ClaimConflict):
        resolve(checkpoint, registry=(Gptq(), Greedy(), REGISTRY[-1]))
    assert [c.name for c in REGISTRY].index("gptq") < [c.name for c in REGISTRY].index("plain")
    assert isinstance(next(c for c in REGISTRY if c.name == "awq"), Awq)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fixture", sorted(ALL))
def test_decode_on_cuda_equals_cpu(fixture):
    checkpoint = qtool.open_checkpoint(FIXTURES / fixture)
    weight = _weights(FIXTURES / fixture)[WEIGHT]
    cpu = decoder_for(weight).decode(checkpoint, weight, "cpu")
    cuda = decoder_for(weight).decode(checkpoint, weight, "cuda")
    assert cuda.device.type == "cuda" and torch.equal(_bits(cuda.cpu()), _bits(cpu))


def test_parameter_count_is_logical_not_stored():
    """The Hub's old counter summed stored elements: 32x256 int4 counted as 1024 int32 + scales."""
    report = qtool.inspect(FIXTURES / "gptq/gptq_4bit_sym_g128")
    assert report.summary()["parameters"] == O * I + O + I  # weight + bias + norm
    stored = sum(math.prod(t.shape) for t in report.checkpoint.tensors.values())
    assert stored != report.summary()["parameters"]
