"""qtool.native._kernels.decode_gguf against the torch decoders of qtool.conventions.gguf, bit
for bit: random valid blocks (every byte pattern is valid; only the f16 scales are restricted to
finite values, so no NaN payload can differ), decoded to bf16, f16 and f32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.conventions.gguf import decode_blocks

_kernels = pytest.importorskip("qtool.native._kernels")

# type -> (block size, type size, byte offsets of its f16 scales)
TYPES = {
    "Q8_0": (32, 34, [0]),
    "Q4_0": (32, 18, [0]),
    "Q4_1": (32, 20, [0, 2]),
    "Q5_0": (32, 22, [0]),
    "Q5_1": (32, 24, [0, 2]),
    "Q2_K": (256, 84, [80, 82]),
    "Q3_K": (256, 110, [108]),
    "Q4_K": (256, 144, [0, 2]),
    "Q5_K": (256, 176, [0, 2]),
    "Q6_K": (256, 210, [208]),
    "IQ4_NL": (32, 18, [0]),
    "MXFP4": (32, 17, []),  # every e8m0 and ue4m3 byte is valid (2^127 * 12 is inf on both paths)
    "NVFP4": (64, 36, []),
    "IQ4_XS": (256, 136, [0]),
}
DTYPES = {
    0: (torch.float32, np.float32, np.uint32),
    1: (torch.float16, np.float16, np.uint16),
    2: (torch.bfloat16, None, np.uint16),
}
# halves worth meeting: zeros, subnormals, the largest, ones, values whose products round
SPECIAL_HALVES = np.array(
    [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00, 0x3555, 0x2E66], dtype=np.uint16
)


def random_blocks(type_name: str, count: int, seed: int) -> np.ndarray:
    """[count, type_size] random bytes with finite f16 scales drawn over the whole half range."""
    _, size, fields = TYPES[type_name]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    for at in fields:
        halves = rng.integers(0, 1 << 16, size=count, dtype=np.uint16)
        mode = rng.integers(0, 3, size=count)
        small = (rng.uniform(-2, 2, size=count).astype(np.float16)).view(np.uint16)
        special = SPECIAL_HALVES[rng.integers(0, len(SPECIAL_HALVES), size=count)]
        halves = np.where(mode == 0, halves, np.where(mode == 1, small, special)).astype(np.uint16)
        halves = np.where((halves & 0x7C00) == 0x7C00, halves & 0xBFFF, halves).astype(np.uint16)  # no inf/NaN
        assert not np.any((halves & 0x7C00) == 0x7C00)
        data[:, at : at + 2] = halves.view(np.uint8).reshape(count, 2)
    return data


def reference(blocks: np.ndarray, type_name: str, dtype_code: int) -> np.ndarray:
    block, _, _ = TYPES[type_name]
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    decoded = decode_blocks(raw, type_name, (blocks.shape[0] * block,)).to(DTYPES[dtype_code][0])
    return decoded.view(torch.int32 if dtype_code == 0 else torch.int16).numpy().view(DTYPES[dtype_code][2])


def native(blocks: np.ndarray, type_name: str, dtype_code: int, ranges=None) -> np.ndarray:
    block, _, _ = TYPES[type_name]
    bits = DTYPES[dtype_code][2]
    out = np.full(blocks.shape[0] * block, 0xA5A5A5A5 & np.iinfo(bits).max, dtype=bits)
    src = np.ascontiguousarray(blocks).reshape(-1)
    for b0, b1 in ranges or [(0, blocks.shape[0])]:
        _kernels.decode_gguf(type_name, src, out, dtype_code, b0, b1)
    return out


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        i = int(bad[0])
        raise AssertionError(
            f"{len(bad)} of {len(want)} values differ; first at {i}: got {got[i]:#x}, want {want[i]:#x}"
        )


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("dtype_code", [0, 1, 2], ids=["f32", "f16", "bf16"])
def test_bit_exact_on_many_blocks(type_name, dtype_code):
    count = 8192 // TYPES[type_name][0] * 4  # 32Ki values
    blocks = random_blocks(type_name, count, seed=len(type_name) * 7 + dtype_code)
    assert_same_bits(native(blocks, type_name, dtype_code), reference(blocks, type_name, dtype_code))


@settings(max_examples=15, deadline=None)
@given(
    type_name=st.sampled_from(list(TYPES)),
    dtype_code=st.sampled_from([0, 1, 2]),
    count=st.integers(1, 19),
    seed=st.integers(0, 2**32 - 1),
    split=st.floats(0, 1),
)
def test_split_ranges_equal_one_call_and_the_reference(type_name, dtype_code, count, seed, split):
    blocks = random_blocks(type_name, count, seed)
    k = int(split * count)
    whole = native(blocks, type_name, dtype_code)
    assert_same_bits(native(blocks, type_name, dtype_code, [(k, count), (0, k)]), whole)
    assert_same_bits(whole, reference(blocks, type_name, dtype_code))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("dtype_code", [0, 1, 2], ids=["f32", "f16", "bf16"])
def test_range_writes_only_its_blocks(type_name, dtype_code):
    block = TYPES[type_name][0]
    blocks = random_blocks(type_name, 19, seed=1)
    sentinel = np.full(19 * block, 0x5A5A, dtype=DTYPES[dtype_code][2])
    out = sentinel.copy()
    _kernels.decode_gguf(type_name, blocks.reshape(-1), out, dtype_code, 3, 12)
    want = reference(blocks, type_name, dtype_code)
    assert_same_bits(out[: 3 * block], sentinel[: 3 * block])
    assert_same_bits(out[12 * block :], sentinel[12 * block :])
    assert_same_bits(out[3 * block : 12 * block], want[3 * block : 12 * block])


def test_accepts_bytes_and_bytearray():
    blocks = random_blocks("Q8_0", 3, seed=2)
    out = bytearray(3 * 32 * 2)
    _kernels.decode_gguf("Q8_0", blocks.tobytes(), out, 2, 0, 3)
    assert_same_bits(np.frombuffer(out, dtype=np.uint16), reference(blocks, "Q8_0", 2))


def test_errors():
    src = bytes(34 * 4)
    out = bytearray(4 * 32 * 4)
    with pytest.raises(ValueError, match="no native decoder for GGUF IQ1_S"):  # IQ2_XXS has one now (issue 21)
        _kernels.decode_gguf("IQ1_S", src, out, 0, 0, 4)
    with pytest.raises(ValueError, match="no native decoder for GGUF q8_0"):
        _kernels.decode_gguf("q8_0", src, out, 0, 0, 4)
    with pytest.raises(ValueError):  # src too short for block 4
        _kernels.decode_gguf("Q8_0", src[:-1], out, 0, 0, 4)
    with pytest.raises(ValueError):  # out too short
        _kernels.decode_gguf("Q8_0", src, out[:-1], 0, 0, 4)
    with pytest.raises(ValueError):  # f32 needs twice what bf16 does
        _kernels.decode_gguf("Q8_0", src, bytearray(4 * 32 * 2), 0, 0, 4)
    with pytest.raises(ValueError):  # unknown dtype code
        _kernels.decode_gguf("Q8_0", src, out, 3, 0, 4)
    for b0, b1 in [(-1, 2), (3, 2), (0, 5), (0, 1 << 62)]:
        with pytest.raises(ValueError):
            _kernels.decode_gguf("Q8_0", src, out, 0, b0, b1)
    with pytest.raises(TypeError):  # read-only out
        _kernels.decode_gguf("Q8_0", src, bytes(out), 0, 0, 4)
    _kernels.decode_gguf("Q8_0", src, out, 0, 2, 2)  # an empty range is fine
    _kernels.decode_gguf("Q8_0", b"", bytearray(), 0, 0, 0)


def test_threads_on_disjoint_ranges():
    from concurrent.futures import ThreadPoolExecutor

    blocks = random_blocks("Q4_K", 64, seed=3)
    src = blocks.reshape(-1)
    out = np.zeros(64 * 256, dtype=np.uint16)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: _kernels.decode_gguf("Q4_K", src, out, 2, *r), [(i, i + 8) for i in range(0, 64, 8)]))
    assert_same_bits(out, native(blocks, "Q4_K", 2))


# -- through the pipeline ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_dequantize_of_a_gguf_file_is_the_same_on_both_paths(tmp_path, monkeypatch, dtype):
    """`qtool dequantize` of a file written by the gguf package: the native kernels' output
    file equals the torch decoders' byte for byte, and gguf.quants.dequantize's values."""
    import gguf
    from safetensors.numpy import load_file

    from qtool import api, native

    from .test_gguf import random_blocks, write_with_gguf

    assert "Q4_K" in native.gguf_types()
    tensors = {
        f"blk.0.{t.lower()}.weight": (random_blocks(t, 64, 512, seed=i), t)
        for i, t in enumerate(["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
    }
    path = write_with_gguf(tmp_path / "m.gguf", tensors)
    calls = []
    decode = native.decode_gguf
    monkeypatch.setattr(native, "decode_gguf", lambda *args: calls.append(args[0]) or decode(*args))
    api.dequantize(str(path), str(tmp_path / "native.safetensors"), dtype=dtype)
    assert sorted(calls) == ["Q4_0", "Q4_K", "Q6_K", "Q8_0"]  # the native path did the work
    monkeypatch.setenv("QTOOL_NATIVE", "0")
    api.dequantize(str(path), str(tmp_path / "torch.safetensors"), dtype=dtype)
    assert (tmp_path / "native.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()
    if dtype == "f32":
        got = load_file(tmp_path / "native.safetensors")
        for name, (data, type_name) in tensors.items():
            want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
            assert np.array_equal(got[name].view(np.uint32), want.astype(np.float32).view(np.uint32)), name


def test_every_half_scale_widens_as_numpy_widens_it():
    """The decoders read their float16 scales by F16C (qt_f16_to_f32_hw) where the build has it:
    Q8_0 blocks of code 1 under each of the 65,536 halves decode to exactly the half's float32
    times 1, NaN payloads included (the multiply quiets a signalling NaN on both sides)."""
    blocks = np.zeros((65536, 34), dtype=np.uint8)
    blocks[:, :2] = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = 1
    out = np.zeros(65536 * 32, dtype=np.float32)
    _kernels.decode_gguf("Q8_0", blocks.tobytes(), out, 0, 0, 65536)
    with np.errstate(invalid="ignore"):
        expected = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32) * np.float32(1)
    assert np.array_equal(out.reshape(-1, 32).view(np.uint32), np.repeat(expected.view(np.uint32)[:, None], 32, axis=1))
