"""Bit packing, with the axis and the order explicit for every layout qtool writes.

    pack_int32      dense LSB-first bit stream of b-bit unsigned values along one dim, in
                    int32 words: element e starts at bit e*b of its row and may spill into
                    the next word; ceil(n*b/32) words. compressed-tensors' pack-quantized
                    (values stored as q + 2^(b-1); weights along in, zero points along dim 0).
                    For b in {1, 2, 4, 8} this equals 32/b values per word.
    pack_nibbles    two 4-bit codes per byte over the last dim. low_first: byte = c[2k] |
                    c[2k+1] << 4 (compressed-tensors fp4, OCP MX); high_first: byte =
                    c[2k] << 4 | c[2k+1] (bitsandbytes 4-bit).
    pack_fp6        four 6-bit codes in three bytes, little-endian over the last dim
                    (compressed-tensors mxfp6).

Every pack has its unpack; round trips are exact. No Python loop touches data: loops run
over the <= 8 value slots of a byte or of an 8-value unit, each one vectorized.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from qtool.errors import KernelError

__all__ = ["pack_int32", "unpack_int32", "pack_nibbles", "unpack_nibbles", "pack_fp6", "unpack_fp6"]


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise KernelError(f"bit width must be 1..8, got {bits!r}")


# An LSB-first bit stream of b-bit values is a byte stream in which every 8 values fill
# exactly b bytes (8b bits), and every 32 values exactly b little-endian int32 words. So
# values are packed eight at a time into one integer (at most 56 bits for b <= 7; for
# b in 1, 2, 4, 8 into single bytes), cut into bytes, and the bytes are viewed as int32.
# The loops below run over the <= 8 value slots of such a unit, never over data.


def _to_bytes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., 8k] values -> [..., k * bits] bytes of their LSB-first bit stream."""
    if 8 % bits == 0:
        slots = values.to(torch.uint8).reshape(*values.shape[:-1], -1, 8 // bits)
        stream = slots[..., 0].clone()
        for slot in range(1, 8 // bits):
            stream |= slots[..., slot] << (slot * bits)
        return stream
    slots = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)
    unit = slots[..., 0].clone()
    for slot in range(1, 8):
        unit |= slots[..., slot] << (slot * bits)
    stream = torch.stack([(unit >> (8 * byte)) & 0xFF for byte in range(bits)], dim=-1)
    return stream.to(torch.uint8).reshape(*values.shape[:-1], -1)


def _from_bytes(stream: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., k * bits] bytes -> [..., 8k] uint8 values."""
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        if bits == 8:
            return stream
        return torch.stack([(stream >> (slot * bits)) & mask for slot in range(8 // bits)], dim=-1).reshape(
            *stream.shape[:-1], -1
        )
    units = stream.to(torch.int64).reshape(*stream.shape[:-1], -1, bits)
    unit = units[..., 0].clone()
    for byte in range(1, bits):
        unit |= units[..., byte] << (8 * byte)
    values = torch.stack([(unit >> (slot * bits)) & mask for slot in range(8)], dim=-1)
    return values.to(torch.uint8).reshape(*stream.shape[:-1], -1)


def _little_endian(t: torch.Tensor) -> bool:
    # accelerators are little-endian; only a CPU can be big-endian (compressed-tensors checks the same)
    return t.device.type != "cpu" or sys.byteorder == "little"


def pack_int32(values: torch.Tensor, bits: int, dim: int = -1, *, check: bool = True) -> torch.Tensor:
    """int32 words holding `values` (unsigned, each < 2^bits) as a dense LSB-first bit stream
    along `dim`. The packed dim has ceil(n * bits / 32) words; other dims are unchanged.
    `check=False` skips the range check (a full pass) for values a quantizer just clamped."""
    _check_bits(bits)
    if check and values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << bits):
        raise KernelError(
            f"{bits}-bit packing takes values in [0, {(1 << bits) - 1}], got [{int(values.min())}, {int(values.max())}]"
        )
    moved = values.movedim(dim, -1)
    count = moved.shape[-1]
    words = math.ceil(count * bits / 32)
    padded = math.ceil(count / 32) * 32
    if padded != count:
        moved = F.pad(moved.to(torch.int32), (0, padded - count))
    stream = _to_bytes(moved, bits)  # [..., padded * bits / 8], a multiple of 4
    if not _little_endian(stream):
        stream = stream.reshape(*stream.shape[:-1], -1, 4).flip(-1).reshape(stream.shape)
    packed = stream.contiguous().view(torch.int32)[..., :words]
    return packed.movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, size: int, dim: int = -1) -> torch.Tensor:
    """uint8 values, `size` of them along `dim`, from a `pack_int32` stream."""
    _check_bits(bits)
    if packed.dtype != torch.int32:
        raise KernelError(f"packed words must be int32, got {packed.dtype}")
    moved = packed.movedim(dim, -1)
    words = moved.shape[-1]
    if words < math.ceil(size * bits / 32):
        raise KernelError(f"{words} int32 words cannot hold {size} values of {bits} bits")
    whole = math.ceil(size / 32) * bits  # words of whole 32-value groups
    moved = F.pad(moved, (0, whole - words)) if whole > words else moved[..., :whole]
    stream = moved.contiguous().view(torch.uint8)
    if not _little_endian(stream):
        stream = stream.reshape(*stream.shape[:-1], -1, 4).flip(-1).reshape(stream.shape)
    values = _from_bytes(stream, bits)[..., :size]
    return values.movedim(-1, dim).contiguous()


def pack_nibbles(codes: torch.Tensor, *, high_first: bool = False) -> torch.Tensor:
    """uint8 bytes of 4-bit codes paired along the last dim, which must be even."""
    if codes.shape[-1] % 2:
        raise KernelError(f"nibble packing pairs elements: the last dim must be even, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2) & 0xF
    first, second = pairs[..., 0], pairs[..., 1]
    return (first << 4 | second) if high_first else (first | second << 4)


def unpack_nibbles(packed: torch.Tensor, *, high_first: bool = False) -> torch.Tensor:
    """uint8 codes, twice as many along the last dim as `packed` bytes."""
    packed = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    high, low = packed >> 4, packed & 0xF
    pairs = torch.stack((high, low) if high_first else (low, high), dim=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_fp6(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 3n/4]: four 6-bit codes per 24-bit little-endian word over the last dim."""
    if codes.shape[-1] % 4:
        raise KernelError(f"fp6 packing takes groups of 4: the last dim must be a multiple of 4, got {codes.shape[-1]}")
    quads = (codes.to(torch.int32) & 0x3F).reshape(*codes.shape[:-1], -1, 4)
    word = quads[..., 0] | quads[..., 1] << 6 | quads[..., 2] << 12 | quads[..., 3] << 18
    out = torch.stack((word, word >> 8, word >> 16), dim=-1) & 0xFF
    return out.to(torch.uint8).reshape(*codes.shape[:-1], -1)


def unpack_fp6(packed: torch.Tensor) -> torch.Tensor:
    """uint8 6-bit codes, 4/3 as many along the last dim as `packed` bytes."""
    if packed.shape[-1] % 3:
        raise KernelError(
            f"fp6 data comes in 3-byte groups: the last dim must be a multiple of 3, got {packed.shape[-1]}"
        )
    triples = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 3)
    word = triples[..., 0] | triples[..., 1] << 8 | triples[..., 2] << 16
    codes = torch.stack([(word >> shift) & 0x3F for shift in (0, 6, 12, 18)], dim=-1)
    return codes.to(torch.uint8).reshape(*packed.shape[:-1], -1)
