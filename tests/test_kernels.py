"""qtool.kernels: block shapes, qparams, quantize/dequantize, small floats, codebooks, packing.

Reference values are computed by hand from the published formulas; round trips are checked
against each format's error bound with hypothesis; packing against a bit-by-bit reference
and, where installed, compressed-tensors' own packer.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool import kernels as K
from qtool.errors import KernelError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FAST = settings(max_examples=40, deadline=None)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


# -- block shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, block, resolved, grid",
    [
        ((4096, 11008), (None, None), (4096, 11008), (1, 1)),  # per-tensor
        ((4096, 11008), (1, None), (1, 11008), (4096, 1)),  # per-channel
        ((4096, 11008), (1, 128), (1, 128), (4096, 86)),  # g128
        ((200, 300), (128, 128), (128, 128), (2, 3)),  # 2-D blocks with partial edges
        ((64, 300), (128, 128), (64, 128), (1, 3)),  # a block larger than the dim is the dim
        ((8, 16, 64), (1, 32), (1, 1, 32), (8, 16, 2)),  # leading dims get 1 (MoE experts)
        ((100,), (64,), (64,), (2,)),  # flat blocks (bitsandbytes)
        ((12, 100), (1, 1, 32), (1, 32), (12, 4)),  # extra leading 1s are dropped
    ],
    ids=["tensor", "channel", "group", "block-edges", "block-clamped", "3d-group", "flat", "extra-lead"],
)
def test_block_resolution(shape, block, resolved, grid):
    assert K.resolve_block(shape, block) == resolved
    assert K.grid_shape(shape, block) == grid


def test_block_with_more_real_dims_than_the_tensor_is_refused():
    with pytest.raises(KernelError, match=r"block \[2, 1, 32\] has more dims than the tensor's shape \[12, 100\]"):
        K.resolve_block((12, 100), (2, 1, 32))


# -- hand-computed references -----------------------------------------------------------------


def test_int8_symmetric_per_tensor_by_hand(device):
    x = torch.tensor([[-1.0, 0.5], [0.25, 2.0]], device=device)
    scale, zero_point = K.choose_qparams(x, (None, None), "int8", True, "F32")
    # scale = amax / ((127 - -128) / 2) = 2 / 127.5
    assert zero_point is None and scale.shape == (1, 1)
    assert scale.item() == pytest.approx(2 / 127.5, rel=1e-7)
    q = K.quantize(x, scale, None, (None, None), "int8")
    # x / scale = -63.75, 31.875, 15.9375, 127.5 -> round, and 127.5 clamps to 127
    assert q.dtype == torch.int8 and q.tolist() == [[-64, 32], [16, 127]]
    step = 2 / 127.5
    assert K.dequantize(q, scale, None, (None, None)).flatten().tolist() == pytest.approx(
        [-64 * step, 32 * step, 16 * step, 127 * step]
    )


def test_int4_asymmetric_by_hand(device):
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]], device=device)
    scale, zero_point = K.choose_qparams(x, (1, 4), "int4", False, "F32")
    # scale = (3 - 0) / 15, zero_point = -8 - 0 / scale = -8
    assert scale.item() == pytest.approx(0.2) and zero_point.dtype == torch.int8 and zero_point.item() == -8
    q = K.quantize(x, scale, zero_point, (1, 4), "int4")
    assert q.tolist() == [[-8, -3, 2, 7]]
    assert K.dequantize(q, scale, zero_point, (1, 4)).flatten().tolist() == pytest.approx(
        [0.0, 1.0, 2.0, 3.0], abs=1e-6
    )


def test_integer_rounding_is_half_to_even(device):
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5], device=device)
    q = K.quantize(x, torch.ones(1, device=device), None, (None,), "int8")
    assert q.tolist() == [0, 2, 2, 0, -2]


def test_per_group_scales_and_a_zero_group(device):
    x = torch.tensor([[0.0, 0.0, 1.0, -3.0], [7.5, 1.0, 0.0, 0.75]], device=device)
    scale, _ = K.choose_qparams(x, (1, 2), "int4", True, "F32")
    eps = torch.finfo(torch.float32).eps  # an all-zero group gets eps, as compressed-tensors
    assert scale.flatten().tolist() == pytest.approx([eps, 3 / 7.5, 7.5 / 7.5, 0.75 / 7.5])
    assert K.quantize(x, scale, None, (1, 2), "int4").tolist() == [[0, 0, 2, -8], [7, 1, 0, 7]]


def test_fp8_cast_saturates_and_rounds_half_to_even(device):
    x = torch.tensor([1000.0, -1000.0, 0.1, 17.0, 19.0], device=device)
    q = K.quantize(x, torch.ones(1, device=device), None, (None,), "fp8_e4m3")
    # e4m3 at 16..32 has a step of 2: 17 is a tie -> 16 (even mantissa), 19 -> 20
    assert q.dtype == torch.float8_e4m3fn and q.float().tolist() == [448.0, -448.0, 0.1015625, 16.0, 20.0]
    assert K.quantize(x, torch.ones(1, device=device), None, (None,), "fp8_e5m2").float().tolist()[:2] == [
        1024.0,
        -1024.0,
    ]


def test_fp4_e2m1_codes_by_hand(device):
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, -0.1, -0.0, -3.0], device=device)
    codes = K.fp4_e2m1_encode(x)
    # ties to even on the grid 0 .5 1 1.5 2 3 4 6; tiny negatives keep the sign bit, -0.0 does not
    assert codes.tolist() == [0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 8, 0, 8 | 5]
    assert K.fp4_e2m1_decode(codes).tolist() == [0, 0.5, 1, 1, 2, 2, 4, 4, 6, 6, -0.0, 0, -3]
    assert math.copysign(1, K.fp4_e2m1_decode(torch.tensor([8], dtype=torch.uint8)).item()) == -1


def test_mx_scale_exponent_by_hand(device):
    # 127 + floor(log2(round_to_power_2(amax))) - 2; 1.75 and above round up to the next power
    amax = torch.tensor([1.0, 1.74, 1.75, 6.0, 0.0], device=device)
    assert K.mx_scale_exponent(amax, "fp4_e2m1").tolist() == [125, 125, 126, 127, 0]
    # fp8: offset 8, and 448 = 1.75 * 2^8 rounds up to 2^9 (compressed-tensors uses fp4's mantissa)
    assert K.mx_scale_exponent(torch.tensor([448.0, 256.0]), "fp8_e4m3").tolist() == [128, 127]
    assert K.e8m0_decode(torch.tensor([0, 1, 127, 130, 254, 255], dtype=torch.uint8)).tolist() == [
        2.0**-127, 2.0**-126, 1.0, 8.0, 2.0**127, math.inf,
    ]  # fmt: skip


def test_mxfp4_group_clamps_at_six(device):
    x = torch.tensor([[1.74] + [0.0] * 31], device=device)
    scale, _ = K.choose_qparams(x, (1, 32), "fp4_e2m1", True, "E8M0")
    assert scale.dtype == torch.uint8 and scale.item() == 125  # 2^-2: 1.74 / 0.25 = 6.96 -> 6
    q = K.quantize(x, scale, None, (1, 32), "fp4_e2m1")
    assert K.dequantize(q, scale, None, (1, 32), qtype="fp4_e2m1")[0, 0].item() == 1.5


def test_nvfp4_two_level_scales_by_hand(device):
    x = torch.zeros(1, 32, device=device)
    x[0, 0], x[0, 16] = 12.0, 3.0
    global_scale = K.choose_global_scale(x)
    assert global_scale.tolist() == [pytest.approx(448 * 6 / 12)]  # 224, exact
    scale, _ = K.choose_qparams(x, (1, 16), "fp4_e2m1", True, "E4M3", global_scale=global_scale)
    # local = amax / 6 * global: 2 * 224 = 448 and 0.5 * 224 = 112, both exact in e4m3
    assert scale.dtype == torch.float8_e4m3fn and scale.float().tolist() == [[448.0, 112.0]]
    q = K.quantize(x, scale, None, (1, 16), "fp4_e2m1", global_scale=global_scale)
    out = K.dequantize(q, scale, None, (1, 16), qtype="fp4_e2m1", global_scale=global_scale)
    assert out[0, 0].item() == 12.0 and out[0, 16].item() == 3.0 and out.abs().sum().item() == 15.0


def test_nf4_codebook_by_hand(device):
    x = torch.tensor([[2.0, -2.0, 0.0, 1.0]], device=device)
    absmax, zero_point = K.choose_qparams(x, (1, 4), "nf4", True, "F32")
    assert zero_point is None and absmax.tolist() == [[2.0]]
    q = K.quantize(x, absmax, None, (1, 4), "nf4")
    # 0.5 lies below the midpoint 0.5016634 of entries 12 (0.4407) and 13 (0.5626)
    assert q.tolist() == [[15, 0, 7, 12]]
    assert K.dequantize(q, absmax, None, (1, 4), qtype="nf4").flatten().tolist() == pytest.approx(
        [2.0, -2.0, 0.0, 2 * 0.44070982933044434]
    )


def test_codebook_ties_go_to_the_lower_entry():
    table = K.codebook("nf4")
    midpoint = ((table[12] + table[13]) / 2).reshape(1)  # float32, as bitsandbytes computes it
    assert K.codebook_encode(midpoint, "nf4").tolist() == [12]
    assert K.codebook_encode(torch.nextafter(midpoint, torch.ones(1)), "nf4").tolist() == [13]


def test_bnb_fp4_codebook_is_the_bitsandbytes_table():
    table = K.codebook("fp4_bnb")
    assert (
        table[3].item() == 1.0
        and table[2].item() == pytest.approx(8 / 12)
        and table[1].item() == pytest.approx(0.0625 / 12)
    )
    assert math.copysign(1, table[8].item()) == 1  # bitsandbytes' `-0` is an int: +0.0 at index 8


def test_round_to_power_2_in_each_dtype():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        x = torch.tensor([1.0, 1.5, 1.74, 1.75, 3.0, 3.5, 0.3], dtype=dtype)
        assert K.round_to_power_2(x).tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 4.0, 0.25], dtype


def test_errors_name_what_to_do():
    x = torch.ones(4, 4)
    with pytest.raises(KernelError, match="fp8_e4m3 is symmetric only"):
        K.choose_qparams(x, (1, 4), "fp8_e4m3", False)
    with pytest.raises(KernelError, match="uint4 is unsigned: symmetric quantization needs a signed type such as int4"):
        K.choose_qparams(x, (1, 4), "uint4", True)
    with pytest.raises(KernelError, match=r"unknown scale dtype 'F64'"):
        K.choose_qparams(x, (1, 4), "int4", True, "F64")
    with pytest.raises(KernelError, match="uint8 data is ambiguous"):
        K.dequantize(torch.zeros(4, dtype=torch.uint8), torch.ones(1), None, (None,))
    with pytest.raises(KernelError, match="scale has 3 values, the block grid \\[4, 1\\] needs 4"):
        K.quantize(x, torch.ones(3), None, (1, 4), "int8")


# -- round trips within each format's error bound -------------------------------------------


def _tensor(draw, rows, cols, dtype=torch.float32):
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    spread = draw(st.sampled_from([1e-3, 1.0, 300.0]))
    x = torch.randn(rows, cols, generator=generator) * spread
    if draw(st.booleans()):
        x[0] = 0.0  # an all-zero row: zero-scale handling
    return x.to(dtype)


@st.composite
def _blocked_tensor(draw):
    rows, cols = draw(st.integers(1, 24)), draw(st.integers(1, 70))
    block = draw(st.sampled_from([(None, None), (1, None), (1, 8), (1, 32), (4, 16), (16, 16), (3, 7)]))
    return _tensor(draw, rows, cols), block


@FAST
@given(_blocked_tensor(), st.integers(2, 8), st.booleans())
def test_int_round_trip_is_within_half_a_step(case, bits, symmetric):
    x, block = case
    scale, zero_point = K.choose_qparams(x, block, f"int{bits}", symmetric, "F32")
    q = K.quantize(x, scale, zero_point, block, f"int{bits}")
    assert q.dtype == torch.int8 and q.min() >= -(2 ** (bits - 1)) and q.max() <= 2 ** (bits - 1) - 1
    x_hat = K.dequantize(q, scale, zero_point, block)
    step = K.dequantize(torch.ones_like(q), scale, None, block)  # the scale of each element's block
    # half a step, plus float32 rounding of x / scale (relative to |x|)
    assert torch.all((x - x_hat).abs() <= step / 2 + x.abs() * 2.0**-20 + 1e-30)


@FAST
@given(_blocked_tensor())
def test_fp8_round_trip_is_within_half_an_ulp(case):
    x, block = case
    scale, _ = K.choose_qparams(x, block, "fp8_e4m3", True, "F32")
    q = K.quantize(x, scale, None, block, "fp8_e4m3")
    x_hat = K.dequantize(q, scale, None, block)
    step = K.dequantize(torch.ones(x.shape, dtype=torch.float8_e4m3fn), scale, None, block)
    # 3 mantissa bits: half an ulp is 2^-4 relative; subnormals: half of 2^-9 absolute
    bound = torch.maximum(x.abs() * 2.0**-4, step * 2.0**-10) * (1 + 1e-5) + 1e-30
    assert torch.all((x - x_hat).abs() <= bound)


@FAST
@given(st.integers(1, 12), st.integers(1, 4), st.sampled_from(["nvfp4", "mxfp4"]), st.data())
def test_fp4_round_trip_is_within_half_a_grid_step(rows, groups, family, data):
    group = 16 if family == "nvfp4" else 32
    x = _tensor(data.draw, rows, groups * group)
    if family == "nvfp4":
        global_scale = K.choose_global_scale(x)
        scale, _ = K.choose_qparams(x, (1, group), "fp4_e2m1", True, "E4M3", global_scale=global_scale)
    else:
        global_scale = None
        scale, _ = K.choose_qparams(x, (1, group), "fp4_e2m1", True, "E8M0")
    q = K.quantize(x, scale, None, (1, group), "fp4_e2m1", global_scale=global_scale)
    x_hat = K.dequantize(q, scale, None, (1, group), qtype="fp4_e2m1", global_scale=global_scale)
    step = K.scale_to_float(scale, global_scale).float().repeat_interleave(group, dim=1)
    scaled = (x / step).abs()
    # grid steps: 0.5 below 2, 1 below 4, 2 up to 6 -> half a step is at most max(0.25, |x/s| / 4);
    # nvfp4's fp8 block scale rounds, so an element may sit up to 6 * 2^-4 past the top of the grid
    bound = torch.maximum(torch.full_like(scaled, 0.25), scaled / 4) + (0.4 if family == "nvfp4" else 0)
    assert torch.all((x - x_hat).abs() <= bound * step * (1 + 1e-5) + 1e-30)


@FAST
@given(st.integers(1, 300), st.sampled_from([32, 64, 128]), st.sampled_from(["nf4", "fp4_bnb"]), st.data())
def test_codebook_round_trip_is_within_half_the_widest_gap(numel, blocksize, name, data):
    x = _tensor(data.draw, 1, numel).reshape(-1)
    absmax, _ = K.choose_qparams(x, (blocksize,), name, True, "F32")
    q = K.quantize(x, absmax, None, (blocksize,), name)
    x_hat = K.dequantize(q, absmax, None, (blocksize,), qtype=name)
    table = K.codebook(name).sort().values
    half_gap = ((table[1:] - table[:-1]).max() / 2).item()
    bound = absmax.repeat_interleave(blocksize)[:numel] * half_gap * (1 + 1e-5) + 1e-30
    assert torch.all((x - x_hat).abs() <= bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("scale_dtype", ["auto", "F32", "BF16", "F16"])
def test_scale_dtypes(device, dtype, scale_dtype):
    x = torch.randn(8, 64, device=device).to(dtype)
    scale, _ = K.choose_qparams(x, (1, 32), "int4", True, scale_dtype)
    expected = (
        dtype
        if scale_dtype == "auto"
        else {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[scale_dtype]
    )
    assert scale.dtype == expected and scale.shape == (8, 2) and scale.device.type == device
    q = K.quantize(x, scale, None, (1, 32), "int4")
    assert K.dequantize(q, scale, None, (1, 32), dtype).dtype == dtype


def test_partial_fp8_blocks_on_200_by_300(device):
    x = torch.randn(200, 300, device=device, generator=None)
    scale, _ = K.choose_qparams(x, (128, 128), "fp8_e4m3", True, "F32")
    assert scale.shape == (2, 3)
    # each block's scale comes from that block alone, edge blocks included
    assert scale[1, 2].item() == pytest.approx(x[128:, 256:].abs().max().item() / 448)
    assert scale[0, 0].item() == pytest.approx(x[:128, :128].abs().max().item() / 448)
    q = K.quantize(x, scale, None, (128, 128), "fp8_e4m3")
    assert q.shape == (200, 300)
    x_hat = K.dequantize(q, scale, None, (128, 128))
    step = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert ((x - x_hat).abs() <= torch.maximum(x.abs() * 2.0**-4, step * 2.0**-10) * (1 + 1e-6)).all()


# -- packing -----------------------------------------------------------------------------------


def _reference_pack(values: list[int], bits: int) -> list[int]:
    """Bit by bit: element e occupies bits [e*b, e*b + b) of the row's stream, LSB first."""
    words = [0] * math.ceil(len(values) * bits / 32)
    for element, value in enumerate(values):
        for bit in range(bits):
            if value >> bit & 1:
                position = element * bits + bit
                words[position // 32] |= 1 << (position % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def test_pack_int32_by_hand():
    assert K.pack_int32(torch.tensor([1, 2, 3]), 4).tolist() == [0x321]
    values = torch.zeros(32, dtype=torch.int32)
    values[10] = 0b101  # 3-bit element 10 starts at bit 30 and spills one bit into word 1
    assert K.pack_int32(values, 3).tolist() == [1 << 30, 1, 0]
    assert K.pack_int32(torch.full((32,), 7), 3).tolist() == [-1, -1, -1]


@FAST
@given(st.integers(1, 8), st.integers(1, 5), st.integers(1, 100), st.integers(0, 1), st.data())
def test_pack_int32_round_trip_and_reference(bits, rows, cols, dim, data):
    values = data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=rows * cols, max_size=rows * cols))
    tensor = torch.tensor(values, dtype=torch.int32).reshape(rows, cols)
    packed = K.pack_int32(tensor, bits, dim=dim)
    size = tensor.shape[dim]
    lines = tensor if dim == 1 else tensor.T
    expected = torch.tensor([_reference_pack(line.tolist(), bits) for line in lines], dtype=torch.int32)
    assert torch.equal(packed, expected if dim == 1 else expected.T)
    unpacked = K.unpack_int32(packed, bits, size, dim=dim)
    assert unpacked.dtype == torch.uint8 and torch.equal(unpacked.to(torch.int32), tensor)


@FAST
@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 80), st.data())
def test_pack_int32_equals_compressed_tensors(bits, rows, cols, data):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    offset = 1 << (bits - 1)
    values = data.draw(st.lists(st.integers(-offset, offset - 1), min_size=rows * cols, max_size=rows * cols))
    q = torch.tensor(values, dtype=torch.int8).reshape(rows, cols)
    for dim in (1, 0):
        assert torch.equal(
            K.pack_int32(q.to(torch.int32) + offset, bits, dim=dim), helpers.pack_to_int32(q, bits, packed_dim=dim)
        )


def test_nibble_order_by_hand():
    codes = torch.tensor([1, 2, 0xF, 0x3], dtype=torch.uint8)
    assert K.pack_nibbles(codes).tolist() == [0x21, 0x3F]  # compressed-tensors / MX: low = even
    assert K.pack_nibbles(codes, high_first=True).tolist() == [0x12, 0xF3]  # bitsandbytes: high = even


@FAST
@given(st.lists(st.integers(0, 15), min_size=0, max_size=64).filter(lambda v: len(v) % 2 == 0), st.booleans())
def test_nibble_round_trip(values, high_first):
    codes = torch.tensor(values, dtype=torch.uint8).reshape(1, -1)
    assert torch.equal(K.unpack_nibbles(K.pack_nibbles(codes, high_first=high_first), high_first=high_first), codes)


def test_fp6_packing_by_hand():
    # word = 1 | 2 << 6 | 3 << 12 | 4 << 18 = 0x103081, stored little-endian
    assert K.pack_fp6(torch.tensor([[1, 2, 3, 4]])).tolist() == [[0x81, 0x30, 0x10]]
    assert K.fp6_e2m3_decode(torch.tensor([0, 7, 8, 31, 32 | 8])).tolist() == [0, 0.875, 1.0, 7.5, -1.0]


@FAST
@given(st.lists(st.integers(0, 63), min_size=0, max_size=48).filter(lambda v: len(v) % 4 == 0))
def test_fp6_round_trip(values):
    codes = torch.tensor(values, dtype=torch.uint8).reshape(1, -1)
    assert torch.equal(K.unpack_fp6(K.pack_fp6(codes)), codes)


def test_packing_errors():
    with pytest.raises(KernelError, match="bit width must be 1..8, got 9"):
        K.pack_int32(torch.zeros(4, dtype=torch.int32), 9)
    with pytest.raises(KernelError, match="the last dim must be even, got 3"):
        K.pack_nibbles(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(KernelError, match="2 int32 words cannot hold 100 values of 4 bits"):
        K.unpack_int32(torch.zeros(2, dtype=torch.int32), 4, 100)
