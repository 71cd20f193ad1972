"""Exact moves (issue 39): a weight's codes, scales and zero points written into another
format as they are. Each exact move is checked with the target toolchain's own code:
compressed-tensors' decompressor (`ModelCompressor.decompress_model`) and gguf-py's
`dequantize`, against the source's decode, bit for bit; each refusal names its reason."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.conventions import compressed_tensors, decoder_for, resolve
from qtool.formats.memory import MemoryCheckpoint
from qtool.kernels.gguf_blocks import block_codes
from qtool.layouts import compressed_tensors as ct_layout
from qtool.layouts.moves import in_column_groups, to_compressed_tensors, to_gguf
from qtool.weight_codes import IntCodes
from tests.test_weight_codes import MODULES, bits_of, quantized_weights, write_gguf_with_gguf_py

FIXTURES = Path(__file__).resolve().parent / "fixtures"
gguf_py = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def package():
    pytest.importorskip("compressed_tensors")
    try:
        from loguru import logger

        logger.remove()
    except ImportError:  # pragma: no cover
        pass
    import compressed_tensors

    assert compressed_tensors.__version__.startswith("0.20"), compressed_tensors.__version__
    return compressed_tensors


def package_decompress(tensors: dict, config: dict, shapes: dict[str, tuple[int, int]], dtype) -> dict:
    """compressed-tensors' own decompression of these stored tensors (tests/test_ct_codec.py's way)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from torch import nn

    config = QuantizationConfig.model_validate(config)
    model = nn.Module()
    for module, (rows, cols) in shapes.items():
        setattr(model, module, nn.Linear(cols, rows, bias=False))
    model = model.to(dtype)
    apply_quantization_config(model, config, show_progress=False)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)  # creates the compressed parameters with the file's shapes
    model.load_state_dict({k: v.contiguous() for k, v in tensors.items()}, strict=True)
    with contextlib.redirect_stderr(io.StringIO()):
        compressor.decompress_model(model)
    return {module: getattr(model, module).weight.detach() for module in shapes}


def move_to_ct(grids: dict[str, IntCodes], dtype: str = "F16"):
    """Every grid moved into a `dtype` model, as {module: (scheme, tensors)}, or the reasons."""
    moved, reasons = {}, {}
    for module, grid in grids.items():
        result = to_compressed_tensors(grid, f"{module}.weight", dtype)
        (reasons if isinstance(result, str) else moved)[module] = result
    return moved, reasons


def assert_package_decompresses_to(package, grids: dict[str, IntCodes], expected: dict[str, torch.Tensor]):
    moved, reasons = move_to_ct(grids)
    assert not reasons, reasons
    tensors = {k: v for _, stored in moved.values() for k, v in stored.items()}
    config = ct_layout.config_for({m: scheme for m, (scheme, _) in moved.items()}, [], "F16")
    shapes = {m: g.shape for m, g in grids.items()}
    decompressed = package_decompress(tensors, config, shapes, torch.float16)
    for module, reference in expected.items():
        assert torch.equal(bits_of(decompressed[module]), bits_of(reference)), module
    return moved


def fixture_grids(path: Path):
    checkpoint, weights = quantized_weights(path)
    grids, decoded = {}, {}
    for i, weight in enumerate(weights):
        grids[f"m{i}"] = MODULES[weight.convention].codes(checkpoint, weight)
        decoded[f"m{i}"] = decoder_for(weight).decode(checkpoint, weight, "cpu")
    return grids, decoded


# -- GPTQ and AWQ to compressed-tensors ----------------------------------------------------------

EXACT_TO_CT = [
    "gptq/gptq_4bit_sym_g128",
    "gptq/gptq_4bit_asym_g128",
    "gptq/gptq_v2_4bit_asym_g128",
    "gptq/gptq_4bit_sym_channel",
    "gptq/gptq_2bit_asym_g64",
    "gptq/gptq_3bit_asym_g128",
    "gptq/gptq_8bit_sym_g128",
    "awq/awq_gemm_g128",
    "awq/awq_gemv_g64",
]


@pytest.mark.parametrize("fixture", EXACT_TO_CT)
def test_gptq_and_awq_move_to_compressed_tensors_bit_for_bit(package, fixture):
    grids, decoded = fixture_grids(FIXTURES / fixture)
    moved = assert_package_decompresses_to(package, grids, decoded)
    symmetric = "_sym_" in fixture
    assert all(scheme.symmetric == symmetric for scheme, _ in moved.values())
    assert all(scheme.scale_dtype == "F16" for scheme, _ in moved.values())


def test_gptq_desc_act_that_interleaves_groups_is_refused_with_the_reason():
    grids, _ = fixture_grids(FIXTURES / "gptq/gptq_4bit_desc_act_g64")
    _, reasons = move_to_ct(grids)
    assert set(reasons) == set(grids)
    assert all("g_idx interleaves groups" in why for why in reasons.values())


def test_a_grouped_g_idx_becomes_plain_groups_with_reordered_scales(package):
    """desc_act whose permutation keeps each group's inputs together: g_idx = [2]*32 + [0]*32 + [1]*32."""
    grids, _ = fixture_grids(FIXTURES / "gptq/gptq_4bit_asym_g128")
    grid = next(iter(grids.values()))
    rows, cols = grid.shape
    order = torch.tensor([2, 0, 1])
    g_idx = order.repeat_interleave(cols // 3 // 32 * 32)
    cols = g_idx.numel()
    scale = grid.scale[:, :1].repeat(1, 3) * torch.tensor([1.0, 0.5, 0.25], dtype=grid.scale.dtype)
    grouped = IntCodes(
        codes=grid.codes[:, :cols].contiguous(),
        scale=scale,
        zero=grid.zero[:, :1].repeat(1, 3).contiguous(),
        minimum=None,
        bits=4,
        group=cols // 3,
        g_idx=g_idx.to(torch.int32),
    )
    plain = in_column_groups(grouped)
    assert plain.g_idx is None and plain.group == cols // 3
    assert torch.equal(plain.scale[:, 0], scale[:, 2])
    assert torch.equal(bits_of(plain.dequantized()), bits_of(grouped.dequantized()))
    assert_package_decompresses_to(package, {"m0": grouped}, {"m0": grouped.dequantized().half()})


def test_a_v1_zero_point_of_16_has_no_compressed_tensors_code():
    grid = IntCodes(
        codes=torch.zeros(2, 32, dtype=torch.int16),
        scale=torch.ones(2, 1, dtype=torch.float16),
        zero=torch.tensor([[8], [16]], dtype=torch.int32),
        minimum=None,
        bits=4,
        group=32,
    )
    assert "zero points reach 16, outside the 4-bit range 0..15" in to_compressed_tensors(grid, "m.weight", "F16")


# -- compressed-tensors to GGUF ------------------------------------------------------------------


def qtool_ct_file(tmp_path: Path, scheme: str) -> Path:
    """A compressed-tensors checkpoint written by `qtool quantize --scheme <scheme>` from a
    float16 copy of sample_models/tiny-llama."""
    import shutil

    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from qtool.cli import app

    source, f16 = FIXTURES.parent.parent / "sample_models" / "tiny-llama", tmp_path / "f16"
    shutil.copytree(source, f16)
    tensors = load_file(str(f16 / "model.safetensors"))
    save_file({k: v.half() for k, v in tensors.items()}, str(f16 / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "ct"
    result = CliRunner().invoke(app, ["quantize", str(f16), "-o", str(out), "--scheme", scheme, "-q"])
    assert result.exit_code == 0, result.output
    return out


def gguf_py_dequantize(raw: bytes, type_name: str, shape: tuple[int, int]) -> torch.Tensor:
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(shape[0], -1)
    return torch.from_numpy(gguf_py.quants.dequantize(blocks, gguf_py.GGMLQuantizationType[type_name]).copy())


@pytest.mark.parametrize("label, type_name", [("int4:g32", "Q4_0"), ("int8:g32", "Q8_0")])
def test_compressed_tensors_to_gguf_keeps_the_grid_and_names_the_rounding(tmp_path, label, type_name):
    """The codes and float16 scales move as they are. compressed-tensors rounds each product to
    float16 and ggml computes it in float32, so the move is exact only where every product is
    a float16; where one is not, the strict move says so and `grid_only` writes the blocks,
    which gguf-py dequantizes to the exact float32 products."""
    checkpoint, weights = quantized_weights(qtool_ct_file(tmp_path, label))
    assert len(weights) == 14 and all(w.members["scale"].dtype.name == "F16" for w in weights)
    for weight in weights[:4]:
        grid = compressed_tensors.codes(checkpoint, weight)
        strict = to_gguf(grid, type_name)
        assert isinstance(strict, str) and strict.startswith("same grid, but the source rounds products to F16")
        raw = to_gguf(grid, type_name, grid_only=True)
        assert isinstance(raw, bytes)
        exact = dataclasses.replace(grid, arithmetic=torch.float32).dequantized()
        got = gguf_py_dequantize(raw, type_name, grid.shape)
        assert torch.equal(bits_of(got), bits_of(exact))
        decoded = decoder_for(weight).decode(checkpoint, weight, "cpu")
        assert torch.equal(bits_of(got.half()), bits_of(decoded))  # the same values, rounded once to float16


@pytest.mark.parametrize("type_name, bits", [("Q4_0", 4), ("Q8_0", 8)])
def test_a_grid_whose_products_are_float16_moves_to_gguf_bit_for_bit(type_name, bits):
    """Power-of-two scales: every product is a float16, so compressed-tensors' float16 result and
    ggml's float32 one agree, and the strict move writes the blocks."""
    generator = torch.Generator().manual_seed(1)
    rows, cols = 6, 128
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=generator, dtype=torch.int16)
    scale = torch.pow(2.0, torch.randint(-12, -2, (rows, cols // 32), generator=generator).float()).half()
    grid = IntCodes(codes, scale, torch.full((rows, cols // 32), 1 << (bits - 1), dtype=torch.int32), None, bits, 32)
    raw = to_gguf(grid, type_name)
    assert isinstance(raw, bytes)
    assert torch.equal(bits_of(gguf_py_dequantize(raw, type_name, (rows, cols))), bits_of(grid.dequantized()))


# -- GGUF to compressed-tensors and back ---------------------------------------------------------


def gguf_grid(tmp_path: Path, type_name: str, shape=(24, 128), seed: int = 5):
    rng = np.random.default_rng(seed)
    data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    path = write_gguf_with_gguf_py(tmp_path / f"{type_name}.gguf", {"blk.0.ffn_down.weight": (data, type_name)})
    checkpoint, (weight,) = quantized_weights(path)
    raw = checkpoint.load(weight.data).numpy().tobytes()
    return MODULES["gguf"].codes(checkpoint, weight), raw


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0"])
def test_gguf_moves_to_compressed_tensors_and_back_bit_for_bit(package, tmp_path, type_name):
    """Into a float32 model, where compressed-tensors computes as ggml does; a float16 model
    rounds the products, which the strict move names and `grid_only` accepts."""
    grid, raw = gguf_grid(tmp_path, type_name)
    expected = gguf_py_dequantize(raw, type_name, grid.shape)
    moved, reasons = move_to_ct({"m0": grid}, "F32")
    assert not reasons
    scheme, tensors = moved["m0"]
    assert scheme.scale_dtype == "F32" and scheme.symmetric
    config = ct_layout.config_for({"m0": scheme}, [], "F32")
    decompressed = package_decompress(tensors, config, {"m0": grid.shape}, torch.float32)["m0"]
    assert decompressed.dtype == torch.float32 and torch.equal(bits_of(decompressed), bits_of(expected))
    strict = to_compressed_tensors(grid, "m0.weight", "F16")
    assert isinstance(strict, str) and strict.startswith("same grid, but the source rounds products to F32")
    scheme16, tensors16 = to_compressed_tensors(grid, "m0.weight", "F16", grid_only=True)
    config16 = ct_layout.config_for({"m0": scheme16}, [], "F16")
    decompressed16 = package_decompress(tensors16, config16, {"m0": grid.shape}, torch.float16)["m0"]
    assert torch.equal(bits_of(decompressed16), bits_of(expected.half()))
    # and back: compressed-tensors' codes to the same GGUF type give the file's own bytes
    checkpoint = MemoryCheckpoint(tensors, {"config.json": {"quantization_config": config}})
    (weight,) = [w for w in resolve(checkpoint) if w.quantized]
    assert to_gguf(compressed_tensors.codes(checkpoint, weight), type_name) == raw


def test_gguf_q4_1_moves_to_compressed_tensors_only_where_its_minimum_is_an_integer_zero(package, tmp_path):
    grid, raw = gguf_grid(tmp_path, "Q4_1")
    reason = to_compressed_tensors(grid, "m.weight", "F16")
    assert isinstance(reason, str) and "float minimum is not -scale x an integer zero point" in reason
    # a Q4_1 grid whose m is -d * z for integer z (what an asymmetric integer grid gives):
    # scales of 6 significant bits, so that every d * z is a float16
    generator = torch.Generator().manual_seed(2)
    zero = torch.randint(0, 16, grid.scale.shape, generator=generator)
    scale = torch.ldexp(torch.randint(32, 64, grid.scale.shape, generator=generator).double(), torch.tensor(-11))
    integral = dataclasses.replace(grid, scale=scale.half(), minimum=(-scale * zero).half())
    assert torch.equal(integral.minimum.double(), -scale * zero)  # exact in float16
    raw = to_gguf(integral, "Q4_1")
    expected = gguf_py_dequantize(raw, "Q4_1", grid.shape)
    assert torch.equal(bits_of(expected), bits_of(integral.dequantized()))
    moved, reasons = move_to_ct({"m0": integral}, "F32")
    assert not reasons and not moved["m0"][0].symmetric
    scheme, tensors = moved["m0"]
    config = ct_layout.config_for({"m0": scheme}, [], "F32")
    decompressed = package_decompress(tensors, config, {"m0": grid.shape}, torch.float32)["m0"]
    assert torch.equal(bits_of(decompressed), bits_of(expected))
    assert to_gguf(integral, "Q4_0").startswith("asymmetric codes: Q4_0 has no zero point")


def test_an_asymmetric_integer_grid_moves_to_q8_0_and_to_q4_1_only_where_m_is_a_float16():
    """AWQ's 4-bit codes minus zero points span -15..15: Q8_0 holds them. Q4_1 needs m = -d*z
    as a float16, which a float16 d times a 4-bit z mostly is not."""
    grids, _ = fixture_grids(FIXTURES / "awq/awq_gemm_g128")
    grid = next(iter(grids.values()))
    raw = to_gguf(grid, "Q8_0", grid_only=True)
    assert isinstance(raw, bytes), raw
    exact = dataclasses.replace(grid, arithmetic=torch.float32).dequantized()
    assert torch.equal(bits_of(gguf_py_dequantize(raw, "Q8_0", grid.shape)), bits_of(exact))
    assert "is not a float16; Q4_1 stores m as float16" in to_gguf(grid, "Q4_1", grid_only=True)


# -- refusals ------------------------------------------------------------------------------------


def simple_grid(rows=4, cols=64, bits=4, group_size=32, zero=None, scale=None, scale_dtype=torch.float16):
    groups = -(-cols // group_size)
    codes = torch.arange(rows * cols, dtype=torch.int16).reshape(rows, cols) % (1 << bits)
    zero = torch.full((rows, groups), 1 << (bits - 1) if zero is None else zero, dtype=torch.int32)
    scale = torch.full((rows, groups), 0.25 if scale is None else scale, dtype=scale_dtype)
    return IntCodes(codes, scale, zero, None, bits, group_size)


@pytest.mark.parametrize(
    "grid, type_name, reason",
    [
        (
            simple_grid(group_size=16),
            "Q4_0",
            "group 16, Q4_0 blocks are 32 (one scale each): groups must be whole blocks",
        ),
        (simple_grid(cols=48, group_size=48), "Q4_0", "48 inputs: Q4_0 rows are whole blocks of 32"),
        (simple_grid(zero=3), "Q4_0", "asymmetric codes: Q4_0 has no zero point (codes minus zero points span -3..12"),
        (simple_grid(bits=8), "Q4_0", "8-bit codes (codes minus zero points span -128..127, Q4_0 holds -8..7)"),
        (simple_grid(scale=1e-9, scale_dtype=torch.float32), "Q4_0", "scale 1e-09 (row 0) is not a float16"),
        (simple_grid(scale=3e38, scale_dtype=torch.bfloat16), "Q8_0", "is not a float16; Q8_0 stores d as float16"),
        (
            simple_grid(scale=1.0 + 2**-7, scale_dtype=torch.bfloat16),
            "Q4_0",
            "same grid, but the source rounds products to BF16",
        ),
        (simple_grid(bits=8, zero=200), "Q4_1", "8-bit codes reach 255; Q4_1 holds 0..15"),
        (simple_grid(zero=3, scale=0.1), "Q4_1", "is not a float16; Q4_1 stores m as float16"),
        (simple_grid(), "Q4_K", "Q4_K is not a GGUF type of plain integer codes (Q4_0, Q4_1, Q8_0 are)"),
        (simple_grid(), "nonsense", "nonsense is not a GGUF type of plain integer codes"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_each_gguf_refusal_names_its_reason(grid, type_name, reason):
    got = to_gguf(grid, type_name)
    assert isinstance(got, str) and reason in got, got


def test_group_128_fills_four_q4_0_blocks_with_its_scale():
    grid = simple_grid(cols=256, group_size=128)
    raw = to_gguf(grid, "Q4_0")
    assert isinstance(raw, bytes) and len(raw) == 4 * 8 * 18
    assert torch.equal(bits_of(gguf_py_dequantize(raw, "Q4_0", grid.shape)), bits_of(grid.dequantized()))


def test_compressed_tensors_refusals_name_their_reason():
    assert "is not a BF16 value" in to_compressed_tensors(simple_grid(scale=1.0 + 2**-10), "m.weight", "BF16")
    assert "does not divide 48 inputs" in to_compressed_tensors(simple_grid(cols=48, group_size=32), "m.weight", "F16")
    assert "1 to 8 bits" in to_compressed_tensors(dataclasses.replace(simple_grid(), bits=9), "m.weight", "F16")
    interleaved = dataclasses.replace(simple_grid(), g_idx=(torch.arange(64) % 2).to(torch.int32))
    assert "g_idx interleaves groups" in to_compressed_tensors(interleaved, "m.weight", "F16")


# -- round trips over random grids ----------------------------------------------------------------


@st.composite
def random_grids(draw, symmetric_only: bool = False, bits_choices=(2, 3, 4, 5, 6, 7, 8)):
    bits = draw(st.sampled_from(bits_choices))
    group_size = draw(st.sampled_from([32, 64]))
    rows = draw(st.integers(1, 5))
    groups = draw(st.integers(1, 3))
    cols = group_size * groups
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=generator, dtype=torch.int16)
    if symmetric_only or draw(st.booleans()):
        zero = torch.full((rows, groups), 1 << (bits - 1), dtype=torch.int32)
    else:
        zero = torch.randint(0, 1 << bits, (rows, groups), generator=generator, dtype=torch.int32)
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    scale = (torch.rand(rows, groups, generator=generator) * 0.1 + 1e-4).to(dtype)
    return IntCodes(codes, scale, zero, None, bits, cols if groups == 1 and draw(st.booleans()) else group_size)


@settings(max_examples=60, deadline=None)
@given(random_grids())
def test_compressed_tensors_pack_and_unpack_give_back_the_grid(grid):
    dtype = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}[grid.scale.dtype]
    moved = to_compressed_tensors(grid, "m.weight", dtype)
    assert not isinstance(moved, str), moved
    scheme, tensors = moved
    config = ct_layout.config_for({"m": scheme}, [], dtype)
    checkpoint = MemoryCheckpoint(tensors, {"config.json": {"quantization_config": config}})
    (weight,) = [w for w in resolve(checkpoint) if w.quantized]
    back = compressed_tensors.codes(checkpoint, weight)
    assert torch.equal(back.codes, grid.codes) and torch.equal(back.zero, grid.zero)
    assert torch.equal(bits_of(back.scale), bits_of(grid.scale)) and back.group == grid.group
    assert torch.equal(bits_of(back.dequantized()), bits_of(grid.dequantized()))
    assert torch.equal(bits_of(decoder_for(weight).decode(checkpoint, weight, "cpu")), bits_of(grid.dequantized()))


@settings(max_examples=60, deadline=None)
@given(random_grids(symmetric_only=True, bits_choices=(2, 3, 4, 8)), st.sampled_from(["Q4_0", "Q8_0"]))
def test_gguf_pack_and_unpack_give_back_the_grid(grid, type_name):
    grid = dataclasses.replace(grid, scale=grid.scale.half())
    raw = to_gguf(grid, type_name, grid_only=True)
    if type_name == "Q4_0" and grid.bits == 8:
        assert isinstance(raw, str) and "8-bit codes" in raw
        return
    assert isinstance(raw, bytes), raw
    gtype_bits = 8 if type_name == "Q8_0" else 4
    codes, d, m = block_codes(
        torch.frombuffer(bytearray(raw), dtype=torch.uint8), 34 if gtype_bits == 8 else 18, gtype_bits, False
    )
    rows, cols = grid.shape
    offset = 1 << (gtype_bits - 1)
    assert m is None
    assert torch.equal(codes.reshape(rows, cols) - offset, grid.offsets())
    assert torch.equal(d.reshape(rows, -1), grid.scale.repeat_interleave(grid.group // 32, dim=1)[:, : cols // 32])
    exact = dataclasses.replace(grid, arithmetic=torch.float32).dequantized()
    assert torch.equal(bits_of(gguf_py_dequantize(raw, type_name, grid.shape)), bits_of(exact))


@settings(max_examples=40, deadline=None)
@given(random_grids(), st.randoms(use_true_random=False))
def test_a_g_idx_that_permutes_whole_groups_reads_as_plain_groups(grid, rng):
    """Any permutation of whole groups (desc_act that keeps each group's inputs together) is
    plain groups with the scale and zero columns reordered: the same values, bit for bit."""
    rows, cols = grid.shape
    groups = cols // grid.group
    order = list(range(groups))
    rng.shuffle(order)
    g_idx = torch.tensor(order, dtype=torch.int32).repeat_interleave(grid.group)
    permuted = dataclasses.replace(grid, g_idx=g_idx)
    plain = in_column_groups(permuted)
    assert not isinstance(plain, str) and plain.g_idx is None
    assert torch.equal(bits_of(plain.dequantized()), bits_of(permuted.dequantized()))
