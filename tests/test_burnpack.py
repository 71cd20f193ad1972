"""burn's burnpack (.bpk): the container, QFloat schemes mapped onto qtool's, and decoding
checked against hand-computed values and an independent scalar decoder written from burn's
rules (burn 0.22.0-pre.2: `QuantizedBytes`, `unpack_q_to_i8s`, `BlockLayout::block_of`,
burn-flex's `dequantize`).

Fixtures: tests/fixtures/burn/, built byte by byte from burn-pack's published layout.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import cbor2
import pytest
import torch
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.conventions import decoder_for
from qtool.conventions.burn import BurnScheme, parse_scheme
from qtool.formats.burnpack import data_section_start, qfloat_scheme

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "burn"
MODEL = FIXTURES / "model.bpk"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("QTOOL_DEBUG", raising=False)


def weights(path) -> dict:
    return {w.name: w for w in qtool.inspect(path).weights}


def decoded(path) -> dict[str, torch.Tensor]:
    inspection = qtool.inspect(path)
    return {w.name: decoder_for(w).decode(inspection.checkpoint, w, "cpu") for w in inspection.weights if w.quantized}


# -- an independent scalar decoder, element by element, from burn's rules -------------------------------


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _minifloat(bits: int, exponent_bits: int, mantissa_bits: int, bias: int) -> float:
    sign = -1.0 if bits >> (exponent_bits + mantissa_bits) & 1 else 1.0
    exponent = bits >> mantissa_bits & ((1 << exponent_bits) - 1)
    mantissa = bits & ((1 << mantissa_bits) - 1)
    if exponent == 0:
        return sign * mantissa / (1 << mantissa_bits) * 2.0 ** (1 - bias)
    return sign * (1 + mantissa / (1 << mantissa_bits)) * 2.0 ** (exponent - bias)


def _scale_values(raw: bytes, dtype: str) -> list[float]:
    if dtype == "F32":
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if dtype == "F16":
        return list(struct.unpack(f"<{len(raw) // 2}e", raw))
    if dtype == "BF16":
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in struct.unpack(f"<{len(raw) // 2}H", raw)]
    if dtype == "UE4M3":
        return [_minifloat(b, 4, 3, 7) for b in raw]
    return [2.0 ** (b - 127) for b in raw]


def _value(code: int, value: str) -> float:
    if value == "E4M3":
        return _minifloat(code, 4, 3, 7)
    if value == "E5M2":
        return _minifloat(code, 5, 2, 15)
    if value == "E2M1":
        return [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][code & 7] * (-1 if code & 8 else 1)
    bits = {"Q8F": 8, "Q8S": 8, "Q4F": 4, "Q4S": 4, "Q2F": 2, "Q2S": 2}[value]
    return float(code - (1 << bits) if code >= 1 << (bits - 1) else code)  # two's complement


def scalar_decode(raw: bytes, scheme: BurnScheme, shape: tuple[int, ...]) -> list[float]:
    """Walk every element: find its code in the packed storage, its block, its scale."""
    bits = scheme.bits
    rank = len(shape)
    numel = math.prod(shape)
    per = scheme.per_word
    dim = rank - scheme.store_dim - 1
    storage = list(shape)
    storage[dim] = math.ceil(shape[dim] / per) if scheme.store != "Native" else shape[dim]
    width = 4 if scheme.store == "PackedU32" else 1
    value_end = math.prod(storage) * width
    grid = scheme.grid(shape)
    block = scheme.full_block(shape)
    scales = _scale_values(
        raw[value_end : value_end + math.prod(grid) * {"F32": 4, "F16": 2, "BF16": 2}.get(scheme.scale_dtype, 1)],
        scheme.scale_dtype,
    )
    global_scale = struct.unpack("<f", raw[-4:])[0] if scheme.global_scale else None
    out = []
    for flat in range(numel):
        index, rest = [], flat
        for size in reversed(shape):
            index.append(rest % size)
            rest //= size
        index.reverse()
        if scheme.store == "Native":
            code = raw[flat]
        else:
            word_index = list(index)
            word_index[dim] //= per
            offset = 0
            for i, size in zip(word_index, storage):
                offset = offset * size + i
            word = int.from_bytes(raw[offset * width : offset * width + width], "little")
            code = word >> ((index[dim] % per) * bits) & ((1 << bits) - 1)
        block_index = 0
        for i, size, count in zip(index, block, grid) if scheme.block else ():
            block_index = block_index * count + i // size
        scale = scales[block_index if scheme.block else 0]
        if global_scale is not None:
            scale = _f32(global_scale * scale)
        out.append(_f32(scale * _value(code, scheme.value)))
    return out


# -- the container -------------------------------------------------------------------------------------


def test_the_header_cbor_and_alignment_are_burn_packs():
    raw = MODEL.read_bytes()
    assert raw[:4] == b"NRUB"
    version, size = struct.unpack("<HI", raw[4:10])
    assert version == 1
    document = cbor2.loads(raw[10 : 10 + size])
    assert document["tensors"]["q4s_block"]["dtype"] == {
        "QFloat": {
            "value": "Q4S",
            "store": {"PackedU32": 0},
            "mode": "Symmetric",
            "tensor": None,
            "block": {"size": {"storage": [16, 1, 1, 1, 1], "len": 1}, "dtype": "F16"},
        }
    }
    assert document["tensors"]["mask"]["dtype"] == {"Bool": "Native"}
    checkpoint = qtool.open_checkpoint(MODEL)
    assert checkpoint.format == "burnpack"
    assert checkpoint.metadata == {"burnpack.version": "1", "producer": "qtool fixtures", "burn": "0.22.0-pre.2"}
    start = data_section_start(size)
    assert start % 256 == 0
    for tensor in checkpoint.tensors.values():
        assert tensor.begin % 256 == 0, tensor.name
        offsets = document["tensors"][tensor.name]["data_offsets"]
        assert (tensor.begin, tensor.end) == (start + offsets[0], start + offsets[1])


def test_plain_tensors_read_as_they_are():
    checkpoint = qtool.open_checkpoint(MODEL)
    assert checkpoint.load(checkpoint.tensors["bias"]).tolist() == [0.5 * i - 2 for i in range(8)]
    assert checkpoint.load(checkpoint.tensors["embed"]).dtype == torch.float16
    assert checkpoint.load(checkpoint.tensors["mask"]).tolist() == [True, False, True, True]


# -- schemes --------------------------------------------------------------------------------------------

# name -> (label, burn value, store, scale dtype, shape, bits per weight)
EXPECTED = {
    "q8s_tensor": ("int8 sym tensor", "Q8S", "Native", "F32", (4, 8), (32 + 4) * 8 / 32),
    "q4s_block": ("int4 sym g16", "Q4S", "PackedU32(0)", "F16", (4, 40), (4 * 5 * 4 + 12 * 2) * 8 / 160),
    "q2f_rows": ("int2 sym block2x8", "Q2F", "PackedU32(1)", "BF16", (6, 8), (8 * 4 + 3 * 2) * 8 / 48),
    "e4m3_block": ("fp8_e4m3 g8", "E4M3", "Native", "F32", (4, 16), (64 + 8 * 4) * 8 / 64),
    "e2m1_two_level": ("nvfp4 g16", "E2M1", "PackedNative(0)", "UE4M3", (2, 32), (32 + 4 + 4) * 8 / 64),
    "q8f_u32": ("int8 sym tensor", "Q8F", "PackedU32(0)", "F32", (3, 5), (3 * 2 * 4 + 4) * 8 / 15),
}


def test_qfloat_tensors_report_burns_scheme_mapped_onto_qtools():
    found = weights(MODEL)
    assert {n for n, w in found.items() if w.quantized} == set(EXPECTED)
    for name, (label, value, store, scale, shape, bits) in EXPECTED.items():
        weight = found[name]
        extra = dict(weight.provenance.details)
        assert weight.convention == "burn" and weight.scheme.label == label, name
        assert (extra["burn_value"], extra["store"], extra["scale"]) == (value, store, scale), name
        assert weight.shape == shape and weight.parameters == math.prod(shape), name
        assert weight.bits_per_weight == pytest.approx(bits), name
        assert weight.notes[0].startswith(f"burn QFloat: value {value} ("), name
    assert found["e2m1_two_level"].scheme.global_scale and found["e2m1_two_level"].scheme.scale_dtype == "UE4M3"
    assert found["q2f_rows"].scheme.block == (2, 8)
    assert found["e4m3_block"].scheme.qtype.name == "fp8_e4m3"


def test_the_legacy_scheme_form_reads_the_same():
    found = weights(FIXTURES / "legacy.bpk")
    assert found["old_q8s_block"].scheme.label == "int8 sym g8"
    assert found["old_e5m2_tensor"].scheme.label == "fp8_e5m2 tensor"
    assert found["weight"].scheme is None
    old = parse_scheme(
        {
            "value": "Q8S",
            "param": "F16",
            "store": "Native",
            "level": {"Block": {"storage": [1, 8, 1, 1, 1], "len": 2}},
            "mode": "Symmetric",
        },
        2,
    )
    new = parse_scheme(
        {
            "value": "Q8S",
            "store": "Native",
            "mode": "Symmetric",
            "tensor": None,
            "block": {"size": {"storage": [8, 1, 1, 1, 1], "len": 1}, "dtype": "F16"},
        },
        2,
    )
    assert (old.full_block((4, 16)), old.scale_dtype) == (new.full_block((4, 16)), new.scale_dtype) == ((1, 8), "F16")


def test_inspect_json_says_burnpack():
    result = runner.invoke(app, ["inspect", str(MODEL), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["format"] == "burnpack"
    by_name = {w["name"]: w for w in doc["weights"]}
    assert by_name["q4s_block"]["scheme"]["group_size"] == 16
    assert by_name["q4s_block"]["scheme"]["scale_dtype"] == "F16"
    assert by_name["q4s_block"]["tensors"] == [
        {"name": "q4s_block", "role": "data", "dtype": "U8", "shape": [4 * 5 * 4 + 24]}
    ]


# -- decoding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["model.bpk", "legacy.bpk"])
def test_decoding_matches_the_scalar_decoder_bit_for_bit(fixture):
    inspection = qtool.inspect(FIXTURES / fixture)
    for weight in inspection.weights:
        if not weight.quantized:
            continue
        out = decoder_for(weight).decode(inspection.checkpoint, weight, "cpu")
        assert out.dtype == torch.float32 and tuple(out.shape) == weight.shape
        scheme = parse_scheme(qfloat_scheme(weight.data), len(weight.shape))
        expected = scalar_decode(bytes(inspection.checkpoint.read_small(weight.data)), scheme, weight.shape)
        assert out.reshape(-1).tolist() == expected, weight.name


def test_hand_computed_values():
    out = decoded(MODEL)
    assert out["q8s_tensor"][0, 0] == -127 * 0.5 and out["q8s_tensor"][3, 7] == 121 * 0.5
    assert out["q4s_block"][0, 0] == -7.0  # q -7, scale 2^0
    assert out["q4s_block"][1, 16] == 0.25  # row 1, block 1: q (7 + 16) % 15 - 7 = 1, scale 2^-2
    assert out["q4s_block"][3, 39] == ((21 + 39) % 15 - 7) * 2.0**-5  # the partial last block
    assert out["q2f_rows"][5, 3] == 1 * 3.0  # packed along rows: q (5 + 6) % 4 - 2, rows 4-5 scale 3
    assert out["q2f_rows"][0, 0] == -2 * 1.0
    assert out["e4m3_block"][0, 6] == 448.0 and out["e4m3_block"][3, 15] == -0.015625 * 1.0
    assert out["e4m3_block"][0, 13] == -3.0 * 0.5  # second block of row 0, scale 0.5
    assert out["e2m1_two_level"][1, 17] == 1.0 * (0.5 * 0.375)  # global 0.5 times block scale 0.375
    assert out["e2m1_two_level"][0, 3] == -1.5 * 0.5 * 1.0
    assert out["q8f_u32"][0].tolist() == [-32.0, 31.75, -0.25, 0.0, 16.0]  # the fifth value is in a second word
    assert out["q8f_u32"][2, 4] == -0.25
    legacy = decoded(FIXTURES / "legacy.bpk")
    assert legacy["old_q8s_block"][1, 7] == 7 * 2.0 and legacy["old_q8s_block"][0, 0] == -8 * 0.5
    assert legacy["old_e5m2_tensor"].tolist() == [0.5, -1.0, 0.125, 28672.0]


def test_no_plain_tensor_is_reported_as_quantized():
    for fixture, quantized in (("model.bpk", set(EXPECTED)), ("legacy.bpk", {"old_q8s_block", "old_e5m2_tensor"})):
        found = weights(FIXTURES / fixture)
        assert {n for n, w in found.items() if w.quantized} == quantized
        for weight in found.values():
            assert weight.quantized == (weight.data.encoding is not None), weight.name


# -- layouts qtool half-recognizes stay plain, with a note -------------------------------------------------


def write_bpk(path: Path, entries: dict, data: bytes) -> Path:
    raw = cbor2.dumps({"tensors": entries})
    head = b"NRUB" + struct.pack("<HI", 1, len(raw)) + raw
    path.write_bytes(head + bytes(data_section_start(len(raw)) - len(head)) + data)
    return path


def qfloat(scheme: dict, shape: list[int], size: int) -> dict:
    return {"dtype": {"QFloat": scheme}, "shape": shape, "data_offsets": [0, size]}


Q8 = {"value": "Q8S", "store": "Native", "mode": "Symmetric", "tensor": "F32", "block": None}


@pytest.mark.parametrize(
    "scheme, size, note",
    [
        (Q8, 10, "burn QFloat Q8S Native of shape [2, 4] needs 12 bytes, the tensor has 10; left plain"),
        (
            {**Q8, "mode": "Lookup"},
            12,
            "burn QFloat in Lookup mode: its lookup table is not in the tensor's bytes, so qtool cannot decode it; left plain",
        ),
        (
            {**Q8, "value": "Q3S"},
            12,
            "burn QFloat tensor: unknown burn quant value 'Q3S' (known: Q8F Q8S Q4F Q4S Q2F Q2S E4M3 E5M2 E2M1); left plain",
        ),
        (
            {**Q8, "store": {"PackedNative": 0}},
            12,
            "burn QFloat tensor: burn packs only E2M1 natively, not Q8S; left plain",
        ),
    ],
    ids=["size", "lookup", "value", "store"],
)
def test_a_qfloat_tensor_qtool_cannot_read_stays_plain(tmp_path, scheme, size, note):
    path = write_bpk(tmp_path / "m.bpk", {"w": qfloat(scheme, [2, 4], size)}, bytes(size))
    (weight,) = qtool.inspect(path).weights
    assert weight.scheme is None and weight.notes == [note]
    assert weight.shape == (size,) and weight.dtype == "U8"


# -- malformed files: exit 2, one error line ---------------------------------------------------------------


def _exit_2(path: Path, text: str) -> None:
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: {path}:") and text in lines[0], lines
    assert "Traceback" not in result.stderr


def _patched(tmp_path: Path, edit) -> Path:
    raw = bytearray(MODEL.read_bytes())
    edited = edit(raw)
    raw = raw if edited is None else edited
    path = tmp_path / "bad.bpk"
    path.write_bytes(bytes(raw))
    return path


def _metadata_size() -> int:
    return struct.unpack("<I", MODEL.read_bytes()[6:10])[0]


@pytest.mark.parametrize(
    "edit, text",
    [
        (lambda raw: raw.__setitem__(slice(0, 4), b"BURN"), "bad magic 'BURN': not a burnpack file (expected 'NRUB')"),
        (
            lambda raw: raw.__setitem__(slice(4, 6), struct.pack("<H", 2)),
            "burnpack version 2 is newer than qtool reads (version 1)",
        ),
        (
            lambda raw: raw.__setitem__(slice(6, 10), struct.pack("<I", 10**6)),
            "file is cut short: 1000000 bytes of metadata run past the end",
        ),
        (
            lambda raw: raw.__setitem__(slice(6, 10), struct.pack("<I", 200 * 2**20)),
            "metadata size 209715200 is over the 104857600-byte limit",
        ),
        (lambda raw: raw.__setitem__(slice(10, 14), b"\xff\xff\xff\xff"), "metadata is not valid CBOR"),
        (lambda raw: raw[: len(raw) - 300], "file is truncated: tensor"),
        (lambda raw: raw[:7], "shorter than the 10-byte burnpack header"),
        (lambda raw: bytearray(), "file is empty (0 bytes)"),
    ],
    ids=["magic", "version", "metadata-past-eof", "metadata-limit", "cbor", "truncated", "short", "empty"],
)
def test_a_malformed_burnpack_is_refused(tmp_path, edit, text):
    _exit_2(_patched(tmp_path, edit), text)


@pytest.mark.parametrize(
    "entries, text",
    [
        ({"w": {"dtype": "F8", "shape": [2], "data_offsets": [0, 2]}}, "tensor 'w' has unknown burn dtype 'F8'"),
        (
            {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            "tensor 'w' is 8 bytes but shape [3] of F32 needs 12",
        ),
        (
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
            "tensor 'w' data_offsets [8, 0) end before they begin",
        ),
        (
            {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
            "tensor 'w' shape [-1] is not a list of non-negative integers",
        ),
        (
            {"w": {"dtype": {"QFloat": 3}, "shape": [2], "data_offsets": [0, 4]}},
            "tensor 'w' QFloat scheme is not a map",
        ),
    ],
    ids=["dtype", "size", "offsets", "shape", "scheme"],
)
def test_a_bad_tensor_entry_is_refused(tmp_path, entries, text):
    _exit_2(write_bpk(tmp_path / "bad.bpk", entries, bytes(16)), text)


def test_metadata_that_is_not_a_tensor_map_is_refused(tmp_path):
    raw = cbor2.dumps([1, 2, 3])
    path = tmp_path / "bad.bpk"
    path.write_bytes(b"NRUB" + struct.pack("<HI", 1, len(raw)) + raw)
    _exit_2(path, 'metadata is not a map with a "tensors" map')


def test_dequantize_writes_the_decoded_values(tmp_path):
    qtool.dequantize(MODEL, tmp_path / "out.safetensors", dtype="f32")
    from safetensors.torch import load_file

    out = load_file(tmp_path / "out.safetensors")
    expected = decoded(MODEL)
    for name, tensor in expected.items():
        assert torch.equal(out[name], tensor), name
    assert out["bias"].tolist() == [0.5 * i - 2 for i in range(8)]
    assert out["mask"].dtype == torch.bool
