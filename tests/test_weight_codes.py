"""The read side of exact moves (issue 39): each convention's `codes` gives the weight's integer
grid as stored, and `IntCodes.dequantized()` of it equals the convention's own `decode` bit for
bit, on real toolchain output: auto-gptq and autoawq fixtures, compressed-tensors fixtures
written by the package, and GGUF files written by gguf-py (its quantizer, its writer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import qtool
from qtool.conventions import awq, compressed_tensors, decoder_for, gguf, gptq, resolve
from qtool.errors import UsageError
from qtool.weight_codes import IntCodes

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GPTQ_AWQ = sorted(
    f"{kind}/{path.name}" for kind in ("gptq", "awq") for path in (FIXTURES / kind).iterdir() if path.is_dir()
)
CT_INT = ("W4A16", "W4A16_ASYM", "W3A16", "W8A16", "int4_asym_channel_odd")
MODULES = {"gptq": gptq, "awq": awq, "compressed-tensors": compressed_tensors, "gguf": gguf}


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns: -0.0 and 0.0 differ, NaNs compare by payload."""
    return t.to(torch.float32).contiguous().view(torch.int32)


def quantized_weights(path: Path):
    checkpoint = qtool.open_checkpoint(path)
    return checkpoint, [w for w in resolve(checkpoint) if w.quantized]


def assert_codes_decode_alike(checkpoint, weights) -> list[IntCodes]:
    found = []
    for weight in weights:
        grid = MODULES[weight.convention].codes(checkpoint, weight)
        rows, cols = weight.shape
        assert grid.codes.shape == (rows, cols) and grid.codes.dtype == torch.int16
        assert int(grid.codes.min()) >= 0 and int(grid.codes.max()) < 1 << grid.bits
        decoded = decoder_for(weight).decode(checkpoint, weight, "cpu")
        assert torch.equal(bits_of(grid.dequantized()), bits_of(decoded)), weight.name
        found.append(grid)
    return found


@pytest.mark.parametrize("fixture", GPTQ_AWQ)
def test_gptq_and_awq_codes_dequantize_to_decode_bit_for_bit(fixture):
    checkpoint, weights = quantized_weights(FIXTURES / fixture)
    assert weights
    grids = assert_codes_decode_alike(checkpoint, weights)
    if "desc_act" in fixture:
        assert all(g.g_idx is not None for g in grids)  # a real permutation is kept
    elif fixture.startswith("gptq"):
        assert all(g.g_idx is None for g in grids)
    if "sym" in fixture and "asym" not in fixture:
        assert all(bool((g.zero == 1 << (g.bits - 1)).all()) for g in grids)


@pytest.mark.parametrize("fixture", CT_INT)
def test_compressed_tensors_codes_dequantize_to_decode_bit_for_bit(fixture):
    checkpoint, weights = quantized_weights(FIXTURES / "compressed_tensors" / fixture)
    assert weights
    grids = assert_codes_decode_alike(checkpoint, weights)
    symmetric = "ASYM" not in fixture and "asym" not in fixture
    assert all(bool((g.zero == 1 << (g.bits - 1)).all()) == symmetric for g in grids)


def test_compressed_tensors_float_layouts_have_no_integer_codes():
    checkpoint, weights = quantized_weights(FIXTURES / "compressed_tensors" / "FP8")
    with pytest.raises(UsageError, match="pack-quantized int"):
        compressed_tensors.codes(checkpoint, weights[0])


def write_gguf_with_gguf_py(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    import gguf as gguf_py

    writer = gguf_py.GGUFWriter(str(path), "llama")
    for name, (data, type_name) in tensors.items():
        quantized = gguf_py.quants.quantize(data, gguf_py.GGMLQuantizationType[type_name])
        writer.add_tensor(name, quantized, raw_dtype=gguf_py.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_codes_dequantize_to_decode_and_to_gguf_py_bit_for_bit(tmp_path, type_name):
    pytest.importorskip("gguf")
    from gguf.quants import dequantize

    rng = np.random.default_rng(3)
    data = (rng.standard_normal((24, 96)) * 0.05).astype(np.float32)
    path = write_gguf_with_gguf_py(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (data, type_name)})
    checkpoint, weights = quantized_weights(path)
    (grid,) = assert_codes_decode_alike(checkpoint, weights)
    assert grid.group == 32 and grid.scale.dtype == torch.float16 and grid.arithmetic == torch.float32
    assert (grid.minimum is not None) == (type_name == "Q4_1") and (grid.zero is None) == (type_name == "Q4_1")
    import gguf as gguf_py

    raw = checkpoint.load(weights[0].data).numpy().reshape(24, -1)
    reference = torch.from_numpy(dequantize(raw, gguf_py.GGMLQuantizationType[type_name]))
    assert torch.equal(bits_of(grid.dequantized()), bits_of(reference))


def test_gguf_codes_refuse_types_without_one_scale_per_32(tmp_path):
    pytest.importorskip("gguf")
    rng = np.random.default_rng(4)
    path = write_gguf_with_gguf_py(
        tmp_path / "m.gguf", {"w": (rng.standard_normal((4, 256)).astype(np.float32), "Q5_0")}
    )
    checkpoint, weights = quantized_weights(path)
    with pytest.raises(UsageError, match="Q4_0, Q4_1, Q8_0"):
        gguf.codes(checkpoint, weights[0])


# -- hostile tensors: codes refuses them as decode does, in one line -----------------------------


def _loaded(path: Path) -> tuple[dict, dict]:
    import json

    from safetensors.torch import load_file

    side = {p.name: json.loads(p.read_text()) for p in path.glob("*.json") if p.name != "manifest.json"}
    return load_file(str(path / "model.safetensors")), side


def test_a_gptq_g_idx_naming_a_missing_group_is_one_checkpoint_error():
    from qtool.errors import CheckpointError
    from qtool.formats.memory import MemoryCheckpoint

    tensors, side = _loaded(FIXTURES / "gptq/gptq_4bit_desc_act_g64")
    key = next(k for k in tensors if k.endswith("g_idx"))
    tensors[key] = tensors[key].clone()
    tensors[key][3] = 999
    checkpoint = MemoryCheckpoint(tensors, side)
    weight = next(w for w in resolve(checkpoint) if w.quantized and w.name == key.replace("g_idx", "weight"))
    with pytest.raises(CheckpointError, match="g_idx holds groups 0..999"):
        gptq.codes(checkpoint, weight)


def test_take_rows_moves_each_row_with_its_scales(tmp_path):
    pytest.importorskip("gguf")
    rng = np.random.default_rng(6)
    path = write_gguf_with_gguf_py(
        tmp_path / "m.gguf", {"w": ((rng.standard_normal((8, 64)) * 0.1).astype(np.float32), "Q4_1")}
    )
    checkpoint, weights = quantized_weights(path)
    grid = gguf.codes(checkpoint, weights[0])
    order = torch.tensor([3, 1, 7, 0, 2, 6, 5, 4])
    moved = grid.take_rows(order)
    assert torch.equal(bits_of(moved.dequantized()), bits_of(grid.dequantized()[order]))
    assert torch.equal(bits_of(moved.take_rows(torch.argsort(order)).dequantized()), bits_of(grid.dequantized()))
