"""GGUF (GGML) block types decoded in torch, on any device, bit for bit `gguf.quants.dequantize`.

    Q8_0    [d f16][32 × i8]                              x = d·q
    Q4_0    [d f16][16 B: low nibble j, high j+16]         x = d·(q − 8)
    Q4_1    [d f16][m f16][16 B]                          x = d·q + m
    Q5_0    [d f16][qh u32: bit j][16 B]                  x = d·(q − 16)
    Q5_1    [d f16][m f16][qh u32][16 B]                  x = d·q + m
    Q2_K    [16 B scales: lo 4 scale, hi 4 min][64 B 2-bit][d f16][dmin f16]  (d last)
    Q3_K    [32 B high-bit mask][64 B 2-bit][12 B 6-bit scales][d f16]       (d last)
    Q4_K    [d f16][dmin f16][12 B 6-bit scales, mins][128 B 4-bit]   x = d·sc·q − dmin·m
    Q5_K    [d f16][dmin f16][12 B][32 B high bits][128 B 4-bit]
    Q6_K    [128 B low 4 bits][64 B high 2 bits][16 × i8 scales][d f16]      (d last)
    Q8_K    [d f32][256 × i8][16 × i16 block sums]        x = d·q
    TQ1_0   [48 B base-3, 5 trits a byte][4 B, 4 a byte][d f16]  x = d·t, t ∈ {−1, 0, 1}
    TQ2_0   [64 B, 2 bits a trit][d f16]
    IQ4_NL  [d f16][16 B indexes into a 16-value non-linear table]
    IQ4_XS  [d f16][scales_h u16][4 B scales_l][128 B indexes]
    MXFP4   [e8m0][16 B e2m1 codes: low j, high j+16]     x = 2^(e−127)·e2m1
    NVFP4   [4 × ue4m3 scale per 16][32 B e2m1 codes]

The type table (sizes, and which types have a decoder here: a row's `torch_decoder`) is
`qtool.ggml_types`; validating a tensor's bytes is the GGUF convention's (`qtool.conventions.gguf`).
This module only does the math on blocks it is handed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["decode", "block_codes", "torch_decodable", "CHUNK_ELEMENTS"]

#
# Each decoder takes a chunk of blocks `b` [n, type_size] uint8 and writes `out` [n, block_size]
# float32 in place. Bit fields are cut from whole blocks with contiguous uint8 ops into scratch
# buffers that live for the whole tensor; the integer codes are converted once by `copy_` into
# `out`; scales (one per block or sub-block) are applied in place. Nothing chunk-sized is
# allocated per chunk: large short-lived allocations go to mmap, and their page faults would
# cost more than the arithmetic.
# Float operations are gguf.quants', in its order: `d * q + m` is two roundings, and integer
# offsets (q - 8) are exact either way. Tests compare float32 bit patterns.

# e2m1 values doubled, as ggml's kvalues_mxfp4 (the e8m0 and ue4m3 scales are halved to match)
_E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# Values per chunk on the CPU. Measured here (Q4_0, 64M values, 1 thread): 64Ki 606 ms, 1Mi 247,
# 4Mi 275, whole tensor 558. With 2 threads on a busy machine, small chunks lose most: each op
# waits for a descheduled worker (64Ki 3967 ms, 1Mi 2459, 4Mi 496). 4Mi holds up in both.
CHUNK_ELEMENTS = 1 << 22

# entry name (the GGML type's name, as a `qtool.ggml_types` row's `torch_decoder` names it) ->
# decoder(blocks [n, type_size] uint8, out [n, block_size] float32, scratch); each decoder
# registers itself below
_DECODERS: dict[str, Callable] = {}


def _decodes(entry: str) -> Callable[[Callable], Callable]:
    def register(decoder: Callable) -> Callable:
        _DECODERS[entry] = decoder
        return decoder

    return register


class _Scratch:
    """Buffers reused from chunk to chunk, keyed by role; a shorter last chunk takes a prefix."""

    def __init__(self, device) -> None:
        self.device = device
        self.buffers: dict[str, object] = {}

    def __call__(self, role: str, rows: int, *shape: int, dtype=None):
        import torch

        dtype = dtype or torch.uint8
        buffer = self.buffers.get(role)
        if buffer is None or buffer.shape[0] < rows or tuple(buffer.shape[1:]) != shape or buffer.dtype != dtype:
            count = rows * math.prod(shape)
            buffer = _empty(count * dtype.itemsize, self.device).view(dtype).view(rows, *shape)
            self.buffers[role] = buffer
        return buffer[:rows]


def _f16(b, at: int):  # [n, 1] float32 from the f16 at byte `at` of each block
    import torch

    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _u8(device, *values: int):
    import torch

    return torch.tensor(values, dtype=torch.uint8, device=device)


def _lo_hi(b, ws):  # whole-block low and high nibbles, contiguous
    import torch

    n, size = b.shape
    return torch.bitwise_and(b, 0x0F, out=ws("lo", n, size)), torch.bitwise_right_shift(b, 4, out=ws("hi", n, size))


def _nibbles(b, at: int, ws):  # [n, 2k]: low nibbles of b[:, at:], then their high nibbles (Q4_0 order)
    import torch

    lo, hi = _lo_hi(b, ws)
    return torch.cat((lo[:, at:], hi[:, at:]), dim=1, out=ws("codes", b.shape[0], 2 * (b.shape[1] - at)))


def _k_nibbles(b, at: int, stop: int, run: int, ws):  # per `run` bytes: the low nibbles, then the high ones
    import torch

    n = b.shape[0]
    lo, hi = _lo_hi(b, ws)
    runs = (stop - at) // run
    codes = ws("codes", n, runs, 2, run)
    torch.stack((lo[:, at:stop].reshape(n, runs, run), hi[:, at:stop].reshape(n, runs, run)), dim=2, out=codes)
    return codes.view(n, -1)


def _fields(qs, shifts: tuple[int, ...], mask: int, run: int, role: str, ws):
    """[n, k] -> [n, k·len(shifts)]: per `run` bytes, (bytes >> shift) & mask for each shift."""
    import torch

    n, k = qs.shape
    out = ws(role, n, k // run, len(shifts), run)
    torch.bitwise_right_shift(qs.reshape(n, k // run, 1, run), _u8(qs.device, *shifts).reshape(1, 1, -1, 1), out=out)
    return out.bitwise_and_(mask).view(n, -1)


def _crumbs(qs, ws, role: str = "crumbs"):  # 2-bit fields: per 32 bytes, shifts 0, 2, 4, 6
    return _fields(qs, (0, 2, 4, 6), 3, 32, role, ws)


def _bit_planes(qs, ws):  # [n, 32] -> [n, 256]: per bit i (LSB first), the 32 bytes' bit i
    return _fields(qs, tuple(range(8)), 1, 32, "bits", ws)


def _le_bits(qs, ws):  # [n, k] -> [n, 8k]: bit j of the little-endian word, j = 0 .. 8k-1
    import torch

    n, k = qs.shape
    out = ws("bits", n, k, 8)
    torch.bitwise_right_shift(qs.unsqueeze(-1), _u8(qs.device, *range(8)), out=out)
    return out.bitwise_and_(1).view(n, -1)


@_decodes("Q8_0")
def _q8_0(b, out, ws):
    import torch

    out.copy_(b[:, 2:].view(torch.int8))
    out.mul_(_f16(b, 0))


@_decodes("Q4_0")
def _q4_0(b, out, ws):
    out.copy_(_nibbles(b, 2, ws))
    out.sub_(8).mul_(_f16(b, 0))


@_decodes("Q4_1")
def _q4_1(b, out, ws):
    out.copy_(_nibbles(b, 4, ws))
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


@_decodes("Q5_0")
def _q5_0(b, out, ws):
    out.copy_(_nibbles(b, 6, ws).bitwise_or_(_le_bits(b[:, 2:6], ws).bitwise_left_shift_(4)))
    out.sub_(16).mul_(_f16(b, 0))


@_decodes("Q5_1")
def _q5_1(b, out, ws):
    out.copy_(_nibbles(b, 8, ws).bitwise_or_(_le_bits(b[:, 4:8], ws).bitwise_left_shift_(4)))
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _scale_min_k4(scales):  # [n, 12] -> two [n, 8, 1] float32 6-bit fields (ggml get_scale_min_k4)
    import torch

    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.float().unsqueeze(-1), mn.float().unsqueeze(-1)


@_decodes("Q2_K")
def _q2_k(b, out, ws):
    n = b.shape[0]
    scales = b[:, 0:16]
    out.copy_(_crumbs(b[:, 16:80], ws))
    out.view(n, 16, 16).mul_((_f16(b, 80) * (scales & 0x0F).float()).unsqueeze(-1)).sub_(
        (_f16(b, 82) * (scales >> 4).float()).unsqueeze(-1)
    )


@_decodes("Q3_K")
def _q3_k(b, out, ws):
    import torch

    n = b.shape[0]
    low = (b[:, 96:104].reshape(n, 1, 8) >> _u8(b.device, 0, 4).reshape(1, 2, 1)).reshape(n, 16)
    high = (b[:, 104:108].reshape(n, 1, 4) >> _u8(b.device, 0, 2, 4, 6).reshape(1, 4, 1)).reshape(n, 16)
    scales = ((low & 0x0F) | ((high & 3) << 4)).view(torch.int8) - 32
    low_bits = _crumbs(b[:, 32:96], ws).view(torch.int8)
    high_bit = (
        _bit_planes(b[:, 0:32], ws).bitwise_xor_(1).bitwise_left_shift_(2).view(torch.int8)
    )  # set mask bit: no -4
    out.copy_(low_bits.sub_(high_bit))
    out.view(n, 16, 16).mul_((_f16(b, 108) * scales.float()).unsqueeze(-1))


@_decodes("Q4_K")
def _q4_k(b, out, ws):
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    out.copy_(_k_nibbles(b, 16, 144, 32, ws))
    out.view(n, 8, 32).mul_(_f16(b, 0).unsqueeze(-1) * sc).sub_(_f16(b, 2).unsqueeze(-1) * mn)


@_decodes("Q5_K")
def _q5_k(b, out, ws):
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    out.copy_(_k_nibbles(b, 48, 176, 32, ws).bitwise_or_(_bit_planes(b[:, 16:48], ws).bitwise_left_shift_(4)))
    out.view(n, 8, 32).mul_(_f16(b, 0).unsqueeze(-1) * sc).sub_(_f16(b, 2).unsqueeze(-1) * mn)


@_decodes("Q6_K")
def _q6_k(b, out, ws):
    import torch

    n = b.shape[0]
    out.copy_(_k_nibbles(b, 0, 128, 64, ws).bitwise_or_(_crumbs(b[:, 128:192], ws).bitwise_left_shift_(4)))
    out.sub_(32)
    out.view(n, 16, 16).mul_((_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1))


@_decodes("Q8_K")
def _q8_k(b, out, ws):
    import torch

    out.copy_(b[:, 4:260].view(torch.int8))
    out.mul_(b[:, 0:4].contiguous().view(torch.float32))


@_decodes("TQ1_0")
def _tq1_0(b, out, ws):
    import torch

    n = b.shape[0]
    pow3 = _u8(b.device, 1, 3, 9, 27, 81)
    q0 = (b[:, 0:32].reshape(n, 1, 1, 32) * pow3.reshape(1, 1, 5, 1)).reshape(n, 160)  # wraps mod 256, as in uint8
    q1 = (b[:, 32:48].reshape(n, 1, 1, 16) * pow3.reshape(1, 1, 5, 1)).reshape(n, 80)
    qh = (b[:, 48:52].reshape(n, 1, 1, 4) * pow3[:4].reshape(1, 1, 4, 1)).reshape(n, 16)
    q = torch.cat((q0, q1, qh), dim=1).to(torch.int16)
    out.copy_((q * 3) >> 8)
    out.sub_(1).mul_(_f16(b, 52))


@_decodes("TQ2_0")
def _tq2_0(b, out, ws):
    out.copy_(_crumbs(b[:, 0:64], ws))
    out.sub_(1).mul_(_f16(b, 64))


def _lookup(out, codes, values, ws) -> None:  # out.flat[i] = values[codes.flat[i]]
    import torch

    table = torch.tensor(values, dtype=torch.float32, device=codes.device)
    index = ws("index", codes.shape[0], codes.shape[1], dtype=torch.int32)
    torch.index_select(table, 0, index.copy_(codes).view(-1), out=out.view(-1))


@_decodes("IQ4_NL")
def _iq4_nl(b, out, ws):
    _lookup(out, _nibbles(b, 2, ws), _IQ4NL, ws)
    out.mul_(_f16(b, 0))


@_decodes("IQ4_XS")
def _iq4_xs(b, out, ws):
    import torch

    n = b.shape[0]
    scales_h = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    high = (scales_h.unsqueeze(1) >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3
    low = (b[:, 4:8].reshape(n, 4, 1) >> _u8(b.device, 0, 4).reshape(1, 1, 2)).reshape(n, 8) & 0x0F
    scales = (low.to(torch.int32) | (high << 4)).to(torch.int8) - 32
    _lookup(out, _k_nibbles(b, 8, 136, 16, ws), _IQ4NL, ws)
    out.view(n, 8, 32).mul_((_f16(b, 0) * scales.float()).unsqueeze(-1))


def _e8m0_half(e):  # ggml_e8m0_to_fp32_half: 2^(e-127) / 2, exact, including e = 0 and 1
    import torch

    e = e.to(torch.int32)
    return torch.where(e < 2, (e + 1) * 0x00200000, (e - 1) << 23).view(torch.float32)


@_decodes("MXFP4")
def _mxfp4(b, out, ws):
    _lookup(out, _nibbles(b, 1, ws), _E2M1_X2, ws)
    out.mul_(_e8m0_half(b[:, 0:1]))


def _ue4m3_half(x):  # ggml's ue4m3 scale, times the 0.5 that matches the doubled e2m1 table
    import torch

    exp = ((x >> 3) & 0x0F).to(torch.int32)
    man = (x & 0x07).float()
    power = ((exp - 7 + 127) << 23).view(torch.float32)  # 2^(exp-7), exact
    raw = torch.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * power)
    return torch.where((x == 0) | (x == 0x7F), torch.zeros_like(raw), raw * 0.5)


@_decodes("NVFP4")
def _nvfp4(b, out, ws):
    n = b.shape[0]
    _lookup(out, _k_nibbles(b, 4, 36, 8, ws), _E2M1_X2, ws)
    out.view(n * 4, 16).mul_(_ue4m3_half(b[:, 0:4]).reshape(n * 4, 1))


def torch_decodable() -> frozenset[str]:
    """The entries of the GGML types qtool decodes in torch (their names); the rest go through
    `gguf.quants.dequantize`."""
    return frozenset(_DECODERS)


def decode(raw, type_name: str, block_size: int, type_size: int, shape: tuple[int, ...]):
    """uint8 blocks of a type `torch_decodable()` lists -> float32 of `shape`, on raw's device.
    On the CPU the blocks are decoded in chunks of about `CHUNK_ELEMENTS` values, straight into
    the output; on a GPU in one pass."""
    import torch

    decoder = _DECODERS[type_name]
    blocks = raw.reshape(-1, type_size)
    out = _empty(blocks.shape[0] * block_size * 4, blocks.device).view(torch.float32).view(blocks.shape[0], block_size)
    step = blocks.shape[0] if out.device.type != "cpu" else max(1, CHUNK_ELEMENTS // block_size)
    scratch = _Scratch(out.device)
    for start in range(0, blocks.shape[0], step):
        decoder(blocks[start : start + step], out[start : start + step], scratch)
    return out.reshape(shape)


def _empty(nbytes: int, device):
    """An uninitialized uint8 [nbytes] tensor; on the CPU a large one is backed by huge pages
    (qtool.buffers: first touching 256 MiB takes 128 page faults instead of 65536)."""
    import torch

    if device.type == "cpu":
        from qtool.buffers import allocate

        return torch.frombuffer(allocate(nbytes), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def block_codes(raw, type_size: int, bits: int, minimum: bool):
    """The fields of a plain-grid block type (`GgmlType.plain_grid`: Q4_0, Q4_1, Q8_0), cut as
    their decoders above cut them: [d f16][m f16 if `minimum`][codes], the codes one int8 a byte
    (`bits` 8) or nibbles, low nibble j then high nibble j + 16 (`bits` 4). Returns (codes int16
    [n, block] unsigned, d float16 [n], m float16 [n] or None); signed int8 codes come back
    plus 128, so every type's codes are unsigned and its offset is the caller's zero point."""
    import torch

    blocks = raw.reshape(-1, type_size)
    d = blocks[:, 0:2].contiguous().view(torch.float16).reshape(-1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).reshape(-1) if minimum else None
    at = 4 if minimum else 2
    if bits == 8:
        return blocks[:, at:].contiguous().view(torch.int8).to(torch.int16) + 128, d, m
    if bits != 4:
        raise ValueError(f"block_codes reads 4- and 8-bit codes, not {bits}-bit")
    return _nibbles(blocks, at, _Scratch(blocks.device)).to(torch.int16), d, m
