"""Affine dequantization through a group index, the way GPTQ and AWQ store it.

    out[r, c] = (q[r, c] - zero_point[r, g_idx[c]]) * scale[r, g_idx[c]]

`q` holds unsigned codes (uint8), `scale` and `zero_point` one value per (row, group), and
`g_idx[c]` names the group of column `c`. GPTQ with `desc_act` permutes the columns, so
`g_idx` is not monotonic and a column's group is *not* `c // group_size`: the general path
gathers through `g_idx`. When `g_idx` is exactly `arange(C) // group_size` (checked by
`uniform_group_size`, C comparisons), the same result comes from a broadcast over
`[R, G, group_size]`, which reads and writes nothing but the codes and the output.

Precision: `q - zero_point` is a small integer, exact in any float type, and the product with
a float16/bfloat16 scale is rounded once to the scale's type, as the toolchains do it
(AutoGPTQ's torch path and AutoAWQ's `dequantize_gemm` multiply an int tensor by a float16
scale). Asking for float32 gives the exact product (it fits a float32 significand), which is
what the float32 CUDA kernels (AWQ GEMV, exllama) compute. Cast that to float16 and the bits
equal the float16 result.

Everything is vectorized; no loop touches a row, a group or an element.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_grouped", "uniform_group_size"]


def uniform_group_size(g_idx: torch.Tensor, groups: int) -> int | None:
    """The group size g when `g_idx == arange(len(g_idx)) // g` with every group full, else None."""
    columns = g_idx.numel()
    if groups < 1 or columns % groups:
        return None
    size = columns // groups
    expected = torch.arange(columns, device=g_idx.device, dtype=g_idx.dtype) // size
    return size if torch.equal(g_idx, expected) else None


def dequantize_grouped(
    values: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    group_size: int | None = None,
    bits: int = 8,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`values` [R, C] uint8 codes of `bits` bits; `scale` [R, G] float; `zero_point` [R, G]
    integers (any int dtype, already offset as the layout requires). Pass `group_size` for
    contiguous full groups (see `uniform_group_size`), else `g_idx` [C]. Returns [R, C] in
    `dtype` (default: the scale's dtype), written into `out` when given. `bits` is accepted
    for the callers' symmetry; the arithmetic is exact for every width up to 8."""
    rows, columns = values.shape
    dtype = dtype or scale.dtype
    if out is None:
        out = torch.empty(rows, columns, dtype=dtype, device=values.device)
    # Codes and zero points are small integers, exact in the output's float type (bf16 holds
    # every integer up to 256, enough for 8-bit codes and GPTQ's zero points up to 2^b), so
    # `q - z` is exact there and the product with the scale is the one rounding.
    scale = scale.to(dtype)
    zero_point = zero_point.to(dtype)
    if group_size is not None:
        groups = columns // group_size
        shape = (rows, groups, group_size)
        work = values.view(shape).to(dtype)
        work.sub_(zero_point.reshape(rows, groups, 1))
        torch.mul(work, scale.reshape(rows, groups, 1), out=out.view(shape))
        return out
    if g_idx is None:
        raise ValueError("dequantize_grouped needs g_idx or group_size")
    index = g_idx.to(device=values.device, dtype=torch.long)
    work = values.to(dtype)
    work.sub_(zero_point.index_select(1, index))
    torch.mul(work, scale.index_select(1, index), out=out)
    return out
