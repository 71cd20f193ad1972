"""GGUF: the reader, the convention's decoders and the writer, against the real `gguf` package.

Every decoder is compared bit for bit (float32 bit patterns) with `gguf.quants.dequantize`:
on files the package itself quantized where it can quantize, and on random valid blocks where
it can only dequantize. The writer's output is read back with `gguf.GGUFReader`.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.conventions import decoder_for
from qtool.conventions.gguf import decode_blocks
from qtool.errors import CheckpointError, QtoolError, SchemeError, UsageError
from qtool.ggml_types import GGML_TYPES
from qtool.kernels.gguf_blocks import torch_decodable
from qtool.layouts.gguf import gguf_layout_bytes, gguf_type_for
from qtool.scheme_strings import parse_scheme

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "sample_models" / "tiny-llama"
runner = CliRunner()

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
QUANTIZABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"]
# the types gguf can dequantize but not quantize: tested on random valid blocks
DEQUANTIZE_ONLY = [
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ1_S",
    "IQ1_M",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ3_XXS",
    "IQ3_S",
    "IQ4_NL",
    "IQ4_XS",
    "NVFP4",
]
# byte offsets of each block's f16 scales, set to small finite values in random blocks
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "TQ1_0": [52],
    "TQ2_0": [64],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ2_XXS": [0],
    "IQ2_XS": [0],
    "IQ2_S": [0],
    "IQ3_XXS": [0],
    "IQ3_S": [0],
    "IQ1_S": [0],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
    "NVFP4": [],
    "IQ1_M": [],
    "MXFP4": [],
}


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("QTOOL_DEBUG", raising=False)


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    got = np.ascontiguousarray(got, dtype=np.float32)
    want = np.ascontiguousarray(want, dtype=np.float32)
    return got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def write_with_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]], kv: dict | None = None) -> Path:
    """A GGUF file written by the gguf package: {name: (numpy data, GGML type name)}."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (kv or {}).items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (data, type_name) in tensors.items():
        if type_name in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=T[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def qtool_decode(checkpoint, weight, device: str = "cpu") -> np.ndarray:
    if weight.quantized:
        return decoder_for(weight).decode(checkpoint, weight, device).cpu().numpy()
    return checkpoint.load(weight.data).float().numpy()


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in a valid layout: f16 scales set to small finite values, so nothing overflows."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[T[type_name]]
    count = rows * cols // block
    data = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        data[:, at : at + 2] = rng.uniform(-2, 2, size=(count, 1)).astype(np.float16).view(np.uint8)
    if type_name == "IQ1_M":  # its f16 scale is split over the top nibbles of four u16 words
        scale = rng.uniform(-2, 2, size=count).astype(np.float16).view(np.uint16)
        words = data[:, -8:].copy().view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((scale >> (4 * i)) & 0xF) << 12)
        data[:, -8:] = words.view(np.uint8)
    if type_name == "MXFP4":  # e8m0 exponents that keep 6 · 2^(e-127) finite
        data[:, 0] = rng.integers(100, 150, size=count, dtype=np.uint8)
    return data.reshape(rows, cols // block * size)


# -- the type table --------------------------------------------------------------------------------


def test_type_table_matches_the_gguf_package():
    for type_id, row in GGML_TYPES.items():
        member = T(type_id)
        assert member.name == row.name
        assert gguf.GGML_QUANT_SIZES[member] == (row.block_size, row.type_size), row.name


def test_scheme_mapping_reads_well():
    from qtool.conventions.gguf import scheme_for_type
    from qtool.ggml_types import ggml_type_named as named

    assert scheme_for_type(named("Q4_0"))[0] == parse_scheme("q4_0")
    # labels may gain the GGUF type as a prefix ("Q4_K uint4 asym g256"): compare the tail
    assert scheme_for_type(named("Q8_0"))[0].label.endswith("int8 sym g32")
    q4k, provenance, _ = scheme_for_type(named("Q4_K"))
    assert (
        q4k.label.endswith("uint4 asym g256") and q4k.rule == "Q4_K" and dict(provenance.details)["gguf_type"] == "Q4_K"
    )
    assert "8 × 32" in dict(provenance.details)["super_block"]
    assert scheme_for_type(named("MXFP4"))[0].label == "mxfp4 g32"
    assert scheme_for_type(named("NVFP4"))[0].label == "nvfp4 g16"
    assert scheme_for_type(named("IQ2_XXS"))[0].label == "iq2_xxs g256"
    assert scheme_for_type(named("TQ1_0"))[0].label.endswith("ternary sym g256")


# -- decoding, bit for bit against gguf.quants.dequantize ---------------------------------------


@pytest.fixture(scope="module")
def quantized_by_gguf(tmp_path_factory):
    """One file holding every type the package can quantize, written by the package itself."""
    rng = np.random.default_rng(0)
    tensors, originals = {}, {}
    for type_name in QUANTIZABLE:
        values = rng.standard_normal((2, 3, 512)).astype(np.float32)  # 3-D: checks the dim order
        values[0, 0, :32] = 0.0  # an all-zero block
        data = gguf.quants.quantize(values, T[type_name])
        tensors[f"w.{type_name}"] = (data, type_name)
        originals[type_name] = values
    path = write_with_gguf(tmp_path_factory.mktemp("gguf") / "all.gguf", tensors)
    return path, originals


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_decode_equals_gguf_on_files_gguf_quantized(quantized_by_gguf, type_name):
    path, _ = quantized_by_gguf
    reference = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}[f"w.{type_name}"]
    checkpoint = qtool.open_checkpoint(path)
    weight = next(w for w in qtool.inspect(path).weights if w.name == f"w.{type_name}")
    assert weight.shape == (2, 3, 512)
    want = gguf.quants.dequantize(reference.data, reference.tensor_type)
    for device in DEVICES:
        assert same_bits(qtool_decode(checkpoint, weight, device), want.reshape(2, 3, 512)), (type_name, device)


@pytest.mark.parametrize("type_name", DEQUANTIZE_ONLY)
def test_decode_equals_gguf_on_random_blocks(tmp_path, type_name):
    blocks = random_blocks(type_name, 3, 1024)
    path = write_with_gguf(tmp_path / "m.gguf", {"w": (blocks, type_name)})
    inspection = qtool.inspect(path)
    (weight,) = inspection.weights
    assert weight.quantized and weight.shape == (3, 1024)
    want = gguf.quants.dequantize(blocks, T[type_name])
    for device in DEVICES:
        assert same_bits(qtool_decode(inspection.checkpoint, weight, device), want), (type_name, device)


def test_torch_decoders_cover_the_common_types():
    assert {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "Q4_K", "Q6_K", "NVFP4"} <= torch_decodable()


@pytest.mark.parametrize("type_name", sorted(torch_decodable() - {"Q8_K"}))
def test_chunked_decode_equals_one_pass(monkeypatch, type_name):
    """The CPU decodes in chunks; a chunk edge inside a tensor changes nothing."""
    import qtool.kernels.gguf_blocks as kernel

    blocks = torch.from_numpy(random_blocks(type_name, 8, 1024, seed=3).reshape(-1))
    whole = decode_blocks(blocks, type_name, (8, 1024))
    monkeypatch.setattr(kernel, "CHUNK_ELEMENTS", 768)
    assert torch.equal(decode_blocks(blocks, type_name, (8, 1024)).view(torch.int32), whole.view(torch.int32))


def test_q8_k_decodes_by_its_formula():
    """gguf can't dequantize Q8_K: ggml's dequantize_row_q8_K is x = d · q."""
    block = struct.pack("<f", 0.5) + bytes(range(256)) + bytes(32)
    got = decode_blocks(torch.frombuffer(bytearray(block), dtype=torch.uint8), "Q8_K", (256,))
    want = np.frombuffer(bytes(range(256)), dtype=np.int8).astype(np.float32) * 0.5
    assert same_bits(got.numpy(), want)


@pytest.mark.parametrize("type_name", ["Q8_1", "Q1_0"])
def test_types_nobody_here_decodes_are_listed_and_refused(tmp_path, type_name):
    block, size = gguf.GGML_QUANT_SIZES[T[type_name]]
    path = write_with_gguf(tmp_path / "m.gguf", {"w": (np.zeros((2, 2 * size), np.uint8), type_name)})
    inspection = qtool.inspect(path)
    (weight,) = inspection.weights
    assert weight.quantized and weight.shape == (2, 2 * block)
    with pytest.raises(QtoolError, match=f"cannot decode GGUF {type_name}"):
        decoder_for(weight).decode(inspection.checkpoint, weight, "cpu")


# -- inspect ----------------------------------------------------------------------------------------


def test_inspect_json(tmp_path):
    rng = np.random.default_rng(1)
    path = write_with_gguf(
        tmp_path / "m.gguf",
        {
            "blk.0.attn_q.weight": (
                gguf.quants.quantize(rng.standard_normal((64, 96)).astype(np.float32), T.Q4_0),
                "Q4_0",
            ),
            "blk.0.ffn_down.weight": (random_blocks("Q4_K", 4, 512), "Q4_K"),
            "blk.0.attn_norm.weight": (np.ones(96, np.float32), "F32"),
            "token_embd.weight": (np.zeros((10, 96), np.float16), "F16"),
        },
        kv={
            "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.block_count": 1,
            "general.name": "tiny\ttest",
            "tokenizer.ggml.tokens": [f"t{i}" for i in range(300)],
            "general.tags": ["a", "b"],
        },
    )
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["format"] == "gguf"
    assert "gguf" in document["conventions"]
    weights = {w["name"]: w for w in document["weights"]}
    q = weights["blk.0.attn_q.weight"]
    assert (q["shape"], q["parameters"], q["bits_per_weight"], q["quantized"]) == ([64, 96], 6144, 4.5, True)
    assert q["scheme"]["label"].endswith("int4 sym g32")
    assert (q["scheme"]["qtype"], q["scheme"]["group_size"], q["scheme"]["convention"]) == ("int4", 32, "gguf")
    k = weights["blk.0.ffn_down.weight"]
    assert (k["shape"], k["bits_per_weight"], k["scheme"]["qtype"]) == ([4, 512], 4.5, "uint4")
    assert weights["blk.0.attn_norm.weight"]["scheme"] is None and weights["blk.0.attn_norm.weight"]["dtype"] == "F32"
    assert q["dtype"] == "U8"  # GGUF records no pre-quantization dtype: the storage dtype
    assert weights["token_embd.weight"]["shape"] == [10, 96] and not weights["token_embd.weight"]["quantized"]
    metadata = document["metadata"]
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.attention.layer_norm_rms_epsilon"] == "1e-05"
    assert metadata["llama.block_count"] == "1"
    assert metadata["tokenizer.ggml.tokens"] == "[300 × str]"
    assert metadata["general.tags"] == '["a", "b"]'
    assert metadata["general.name"] == "tiny\ttest"  # the CLI escapes it when printing a table
    assert document["summary"]["parameters"] == 6144 + 2048 + 96 + 960


def test_offsets_sizes_and_keys_agree_with_gguf_reader(quantized_by_gguf):
    path, _ = quantized_by_gguf
    reader = gguf.GGUFReader(str(path))
    checkpoint = qtool.open_checkpoint(path)
    for tensor in reader.tensors:
        stored = checkpoint.tensors[tensor.name]
        assert (stored.begin, stored.nbytes) == (tensor.data_offset, tensor.n_bytes), tensor.name
    assert set(checkpoint.metadata) == set(reader.fields) - {"GGUF.tensor_count", "GGUF.kv_count"}


def test_metadata_values_are_shown_as_strings(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_bool("a.bool", True)
    writer.add_int8("a.i8", -3)
    writer.add_uint64("a.u64", 2**40)
    writer.add_float64("a.f64", 0.1)
    writer.add_float32("a.f32", 10000.0)
    writer.add_array("a.short", [1, 2, 3])
    writer.add_array("a.long", list(range(100)))
    writer.add_array("a.nested", [[1, 2], [3]])
    writer.add_tensor("w", np.ones(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = qtool.open_checkpoint(tmp_path / "m.gguf").metadata
    assert {k: v for k, v in metadata.items() if k.startswith("a.")} == {
        "a.bool": "true",
        "a.i8": "-3",
        "a.u64": str(2**40),
        "a.f64": "0.1",
        "a.f32": "10000",
        "a.short": "[1, 2, 3]",
        "a.long": "[100 × i32]",
        "a.nested": "[2 × array]",
    }
    assert metadata["GGUF.version"] == "3"


def test_inspect_reads_the_header_only(tmp_path):
    path = write_with_gguf(tmp_path / "m.gguf", {"w": (random_blocks("Q4_K", 2, 256), "Q4_K")})
    code = f"import sys, qtool; qtool.inspect({str(path)!r}); print('torch' in sys.modules, 'numpy' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.stdout.split() == ["False", "False"], done.stderr


def test_a_folder_with_one_gguf_opens_and_two_is_an_error(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    write_with_gguf(folder / "a.gguf", {"w": (np.ones(32, np.float32), "F32")})
    assert qtool.open_checkpoint(folder).format == "gguf"
    write_with_gguf(folder / "b.gguf", {"w": (np.ones(32, np.float32), "F32")})
    with pytest.raises(CheckpointError, match="holds 2 GGUF files"):
        qtool.open_checkpoint(folder)


# -- hand-built files: unknown types and bad input -------------------------------------------------


def gguf_bytes(
    tensors: list[tuple[str, list[int], int, bytes]], kv: bytes = b"", kv_count: int = 0, version: int = 3
) -> bytes:
    """A GGUF file built byte by byte: tensors are (name, ne dims, type id, data)."""

    def string(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    infos, blobs, offset = b"", b"", 0
    for name, dims, type_id, data in tensors:
        infos += string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        infos += struct.pack("<IQ", type_id, offset)
        padded = data + bytes(-len(data) % 32)
        blobs += padded
        offset += len(padded)
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), kv_count) + kv + infos
    return head + bytes(-len(head) % 32) + blobs


def test_an_unknown_type_id_is_listed_not_a_crash(tmp_path):
    path = tmp_path / "new.gguf"
    norm = np.arange(4, dtype=np.float32)
    path.write_bytes(gguf_bytes([("mystery", [64, 2], 99, bytes(range(40))), ("norm", [4], 0, norm.tobytes())]))
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    weights = {w["name"]: w for w in json.loads(result.stdout)["weights"]}
    mystery = weights["mystery"]
    assert (mystery["shape"], mystery["quantized"], mystery["scheme"]["qtype"]) == ([2, 64], True, "unknown(99)")
    assert mystery["bytes"] == 64  # sized by where the next tensor starts, padding included
    assert "unknown to qtool" in mystery["notes"][0]
    inspection = qtool.inspect(path)
    by_name = {w.name: w for w in inspection.weights}
    assert np.array_equal(qtool_decode(inspection.checkpoint, by_name["norm"]), norm)
    with pytest.raises(QtoolError, match="GGML type unknown\\(99\\) is unknown"):
        qtool_decode(inspection.checkpoint, by_name["mystery"])
    assert runner.invoke(app, ["inspect", str(path)]).exit_code == 0


def _valid(tmp: Path) -> bytes:
    return gguf_bytes([("w", [32, 2], 8, bytes(68))])


BAD = {
    "zero-byte": (lambda tmp: b"", "file is empty (0 bytes)"),
    "bad magic": (lambda tmp: b"PK\x03\x04" + bytes(60), "bad magic 'PK..': not a GGUF file (expected 'GGUF')"),
    "truncated data": (lambda tmp: _valid(tmp)[:-40], "file is truncated: tensor 'w' ends at byte"),
    "truncated header": (
        lambda tmp: _valid(tmp)[:30],
        "file is cut short: 1 entries of the tensor infos need at least 24 bytes, 6 are left",
    ),
    "version 1": (lambda tmp: b"GGUF" + struct.pack("<I", 1) + bytes(16), "GGUF version 1 is no longer supported"),
    "big-endian": (lambda tmp: b"GGUF" + struct.pack(">I", 3) + bytes(16), "file is big-endian GGUF"),
    "too many dims": (lambda tmp: gguf_bytes([("w", [1, 1, 1, 1, 1], 0, bytes(4))]), "tensor 'w' has 5 dims"),
    "row not a block multiple": (
        lambda tmp: gguf_bytes([("w", [33], 8, bytes(34))]),
        "has 33 elements per row, not a multiple of its block size 32",
    ),
    "duplicate tensor": (
        lambda tmp: gguf_bytes([("w", [1], 0, bytes(4)), ("w", [1], 0, bytes(4))]),
        "duplicate tensor name 'w'",
    ),
    "bad value type": (
        lambda tmp: gguf_bytes([], kv=struct.pack("<Q", 1) + b"k" + struct.pack("<I", 77), kv_count=1),
        "key 'k' has invalid GGUF value type 77",
    ),
    "absurd tensor count": (
        lambda tmp: b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0) + bytes(40),
        "1152921504606846976 entries of the tensor infos need at least",
    ),
    "absurd array length": (
        lambda tmp: gguf_bytes([], kv=struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2**50), kv_count=1),
        "1125899906842624 entries of the array 'k' need at least",
    ),
    "arrays nested too deep": (
        lambda tmp: gguf_bytes(
            [],
            kv=struct.pack("<Q", 1)
            + b"k"
            + struct.pack("<I", 9)
            + struct.pack("<IQ", 9, 1) * 20
            + struct.pack("<IQ", 4, 0),
            kv_count=1,
        ),
        "array 'k' nests deeper than 8 levels",
    ),
    "dims overflow 64 bits": (
        lambda tmp: gguf_bytes([("w", [0, 64, 2**62], 0, b"")]),
        "tensor 'w' has dims [0, 64, 4611686018427387904] whose product overflows 64 bits",
    ),
    "string past the end": (
        lambda tmp: gguf_bytes([], kv=struct.pack("<Q", 1) + b"k" + struct.pack("<IQ", 8, 10**12), kv_count=1),
        "file is cut short: the value of 'k'",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    build, message = BAD[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(build(tmp_path))
    with pytest.raises(CheckpointError, match=None):
        qtool.open_checkpoint(path)
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2
    assert result.stdout == ""
    first, *rest = result.stderr.splitlines()
    assert first.startswith(f"error: {path}: "), first
    assert message in first, first
    assert all(line.startswith("hint: ") for line in rest) and len(rest) <= 1
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [["inspect", "--stats"], ["check", "--no-nan"]])
def test_dims_that_overflow_are_exit_2_in_the_data_readers_too(tmp_path, command):
    """[0, 64, 2^62] is an empty tensor whose dims still overflow torch's and numpy's stride
    arithmetic: `--stats` and `check --no-nan` died in torch with exit 70."""
    path = tmp_path / "overflow.gguf"
    path.write_bytes(gguf_bytes([("w", [0, 64, 2**62], 0, b""), ("n", [4], 0, bytes(16))]))
    result = runner.invoke(app, [command[0], str(path), command[1]])
    assert result.exit_code == 2, result.output
    assert (
        result.stderr.splitlines()[0]
        == f"error: {path}: tensor 'w' has dims [0, 64, 4611686018427387904] whose product overflows 64 bits"
    )


def test_many_tensors_of_an_unknown_type_list_in_linear_time(tmp_path):
    """Each tensor of an unknown type is sized by where the next one starts; that lookup
    scanned every start (32k tensors took 30 s)."""
    import time

    from qtool.formats.gguf import read_gguf_file

    path = tmp_path / "unknown.gguf"
    path.write_bytes(gguf_bytes([(f"t{i}", [32], 99, bytes(4)) for i in range(30_000)]))
    started = time.perf_counter()
    tensors, _ = read_gguf_file(str(path))
    assert time.perf_counter() - started < 6.0  # ~0.3 s linear; the scan per tensor took ~26 s
    assert len(tensors) == 30_000 and {t.nbytes for t in tensors[:-1]} == {32}


# -- the writer ---------------------------------------------------------------------------------------


def plan_gguf(checkpoint, weights, chosen, output, allow_incomplete=False):
    """`chosen`: weight name -> scheme, or None to keep it."""
    from qtool.layouts import LAYOUTS
    from qtool.plan import Chosen, PlanOptions

    options = PlanOptions(single_file=True, file_name=os.path.basename(output), allow_incomplete_gguf=allow_incomplete)
    return LAYOUTS["gguf"].plan(
        checkpoint, weights, Chosen({n: s for n, s in chosen.items() if s is not None}), options
    )


def write_gguf(checkpoint, weights, chosen, output, *, overwrite, device, allow_incomplete=False):
    """The GGUF layout's plan for exactly these choices, run by the one executor."""
    from qtool.planning.paths import check_paths
    from qtool.formats.writer import Output
    from qtool.pipeline import ExecOptions, execute

    check_paths(checkpoint, output, None, container="gguf")
    plan = plan_gguf(checkpoint, weights, chosen, output, allow_incomplete)
    return execute(plan, Output(output, single_file=True, overwrite=overwrite), ExecOptions(device=device))


def chosen_for(inspection, scheme_text: str) -> dict:
    scheme = parse_scheme(scheme_text)
    return {w.name: scheme if w.name.endswith("_proj.weight") else None for w in inspection.weights}


@pytest.mark.parametrize("scheme_text", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"])
def test_write_tiny_llama_reads_back_with_gguf(tmp_path, scheme_text):
    inspection = qtool.inspect(TINY)
    out = tmp_path / "tiny.gguf"
    result = write_gguf(
        inspection.checkpoint,
        inspection.weights,
        chosen_for(inspection, scheme_text),
        str(out),
        overwrite=False,
        device="cpu",
    )
    expected_type = gguf_type_for(parse_scheme(scheme_text)).name

    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == expected_type
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    assert types["token_embd.weight"] == types["output.weight"] == "BF16"
    assert len(types) == len(inspection.weights)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == 2 and fields["llama.attention.head_count_kv"] == 2
    assert fields["general.file_type"] == int(
        gguf.LlamaFileType[{"MXFP4": "MOSTLY_MXFP4_MOE"}.get(expected_type, f"MOSTLY_{expected_type}")]
    )
    assert fields["general.quantization_version"] == gguf.GGML_QUANT_VERSION

    back = qtool.inspect(out)
    assert back.checkpoint.format == "gguf"
    by_name = {w.name: w for w in back.weights}
    for tensor in reader.tensors:
        want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weight = by_name[tensor.name]
        assert weight.quantized == (tensor.tensor_type.name == expected_type)
        assert same_bits(qtool_decode(back.checkpoint, weight), want.reshape(weight.shape)), tensor.name

    assert set(result.errors) == {w.name for w in inspection.weights if w.name.endswith("_proj.weight")}
    for stats in result.errors.values():
        assert 10 < stats.sqnr_db < 60 and 0.9 < stats.cosine <= 1.0
    assert result.bytes_written == out.stat().st_size


def test_q_and_k_rows_are_permuted_as_llama_cpp_does(tmp_path):
    """convert_hf_to_gguf.py's LlamaModel.permute, restated in numpy."""
    inspection = qtool.inspect(TINY)
    chosen = {w.name: None for w in inspection.weights}
    out = tmp_path / "f.gguf"
    write_gguf(inspection.checkpoint, inspection.weights, chosen, str(out), overwrite=False, device="cpu")
    reader = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}

    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    source = {w.name: w for w in inspection.weights}
    for hf, gg, heads in (
        ("self_attn.q_proj", "attn_q", 4),
        ("self_attn.k_proj", "attn_k", 2),
        ("self_attn.v_proj", "attn_v", None),
    ):
        original = inspection.checkpoint.load(source[f"model.layers.1.{hf}.weight"].data).view(torch.int16).numpy()
        written = reader[f"blk.1.{gg}.weight"].data.view(np.int16)
        assert np.array_equal(written, permute(original, heads) if heads else original), hf


def test_error_on_random_normal_weights(tmp_path, make_safetensors):
    rng = np.random.default_rng(2)
    data = {name: rng.standard_normal((64, 256)).astype(np.float32).tobytes() for name in ("a.weight", "b.weight")}
    path = make_safetensors({"a.weight": ("F32", [64, 256]), "b.weight": ("F32", [64, 256])}, data=data)
    inspection = qtool.inspect(path)
    floors = {"q8_0": 35.0, "q4_0": 15.0, "q5_0": 20.0, "mxfp4": 12.0}
    for scheme_text, floor in floors.items():
        out = tmp_path / f"{scheme_text}.gguf"
        result = write_gguf(
            inspection.checkpoint,
            inspection.weights,
            chosen_for_all(inspection, scheme_text),
            str(out),
            overwrite=False,
            device="cpu",
            allow_incomplete=True,
        )
        assert min(s.sqnr_db for s in result.errors.values()) > floor, scheme_text
        names = {t.name for t in gguf.GGUFReader(str(out)).tensors}
        assert names == {"a.weight", "b.weight"}  # no config.json: names kept, architecture unknown
        assert gguf.GGUFReader(str(out)).fields["general.architecture"].contents() == "unknown"


def chosen_for_all(inspection, scheme_text: str) -> dict:
    return {w.name: parse_scheme(scheme_text) for w in inspection.weights}


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    inspection = qtool.inspect(TINY)
    out = tmp_path / "tiny.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(UsageError, match="already exists"):
        write_gguf(
            inspection.checkpoint,
            inspection.weights,
            chosen_for(inspection, "q8_0"),
            str(out),
            overwrite=False,
            device="cpu",
        )
    assert out.read_bytes() == b"keep me"
    write_gguf(
        inspection.checkpoint,
        inspection.weights,
        chosen_for(inspection, "q8_0"),
        str(out),
        overwrite=True,
        device="cpu",
    )
    assert out.read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_a_failing_write_leaves_nothing_behind(tmp_path, monkeypatch, exc):
    inspection = qtool.inspect(TINY)
    from qtool.formats.writer import LaidOutFile

    calls = []
    original = LaidOutFile.write

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise exc
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LaidOutFile, "write", failing)
    with pytest.raises(type(exc)):
        write_gguf(
            inspection.checkpoint,
            inspection.weights,
            chosen_for(inspection, "q4_0"),
            str(tmp_path / "t.gguf"),
            overwrite=False,
            device="cpu",
        )
    assert os.listdir(tmp_path) == []


def test_rows_not_a_multiple_of_32_are_refused_before_writing(tmp_path, make_safetensors):
    path = make_safetensors({"ok.weight": ("F32", [8, 64]), "odd.weight": ("F32", [8, 48])})
    inspection = qtool.inspect(path)
    with pytest.raises(
        UsageError, match=r"odd\.weight: rows of 48 values are not a multiple of the Q4_0 block size 32"
    ):
        write_gguf(
            inspection.checkpoint,
            inspection.weights,
            chosen_for_all(inspection, "q4_0"),
            str(tmp_path / "o.gguf"),
            overwrite=False,
            device="cpu",
            allow_incomplete=True,
        )
    assert not (tmp_path / "o.gguf").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_schemes_gguf_cannot_write_are_refused():
    with pytest.raises(UsageError, match="GGUF has no block type"):
        gguf_type_for(parse_scheme("W4A16"))
    assert gguf_type_for(parse_scheme("MXFP4A16")).name == "MXFP4"


def test_layout_bytes_and_dry_run_plan():
    assert gguf_layout_bytes((4096, 4096), "Q4_0") == 4096 * 4096 // 32 * 18
    assert gguf_layout_bytes((11008, 4096), "MXFP4") == 11008 * 4096 // 32 * 17
    assert gguf_layout_bytes((7, 256), "F32") == 7 * 256 * 4
    with pytest.raises(SchemeError, match="rows of 100 values"):
        gguf_layout_bytes((4, 100), "Q8_0")
    inspection = qtool.inspect(TINY)
    plan = plan_gguf(
        inspection.checkpoint, inspection.weights, chosen_for(inspection, "q4_0"), "out/tiny.gguf"
    ).to_json()
    assert plan["format"] == "gguf" and plan["files"] == ["tiny.gguf"]
    by_name = {w["name"]: w for w in plan["weights"]}
    q = by_name["model.layers.0.self_attn.q_proj.weight"]
    assert q["tensors"] == [{"name": "blk.0.attn_q.weight", "dtype": "Q4_0", "shape": [256, 256]}]
    assert (q["action"], q["bytes_after"], q["bits_per_weight"]) == ("quantize", 256 * 256 // 32 * 18, 4.5)
    assert by_name["model.norm.weight"]["tensors"][0]["dtype"] == "F32"
    assert plan["metadata"]["llama.context_length"] == 2048
    assert plan["summary"]["quantized_weights"] == 14


def test_requantizing_a_gguf_decodes_first_and_never_overwrites_the_input(tmp_path):
    rng = np.random.default_rng(4)
    values = rng.standard_normal((16, 64)).astype(np.float32)
    source = write_with_gguf(
        tmp_path / "in.gguf",
        {"w.weight": (gguf.quants.quantize(values, T.Q8_0), "Q8_0"), "n.weight": (np.ones(64, np.float32), "F32")},
    )
    inspection = qtool.inspect(source)
    chosen = {"w.weight": parse_scheme("q4_0"), "n.weight": None}
    with pytest.raises(UsageError, match="is the input"):
        write_gguf(inspection.checkpoint, inspection.weights, chosen, str(source), overwrite=True, device="cpu")
    out = tmp_path / "out.gguf"
    result = write_gguf(inspection.checkpoint, inspection.weights, chosen, str(out), overwrite=False, device="cpu")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types == {"w.weight": "Q4_0", "n.weight": "F32"}
    assert result.errors["w.weight"].sqnr_db > 15
