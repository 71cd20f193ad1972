"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): quantize a Linear's weight column by column, each column's rounding
error spread over the columns not yet quantized through the inverse Hessian of the layer's
inputs, H = X^T X.

Defaults are llm-compressor's `GPTQModifier`: dampening 1% of the mean diagonal, blocks of 128
columns with lazy batch updates, and the upper Cholesky factor of H^-1 in place of the
explicit inverse (the paper's numerically stable form). A group's scale (and zero point) is
chosen by the min-max observer when the sweep reaches the group's first column, on the values
as they are then (earlier columns' errors already spread into them), so the scales follow the
updated weights rather than the original ones.

Shapes: weight [out, in]; hessian [in, in]; codes [out, in] int8 (signed, zero point added:
what compressed-tensors packs); scale [out, in // group] in the scale dtype; zero_point the same
shape, int8, or None when symmetric. The sweep computes in the weight's dtype (float32 for real
runs; float64 in the tests that compare it with the paper's equations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qtool.errors import KernelError

if TYPE_CHECKING:
    import torch

__all__ = ["GptqResult", "gptq", "DAMPENING", "BLOCK"]

DAMPENING = 0.01  # llm-compressor's dampening_frac
BLOCK = 128  # llm-compressor's block_size: columns per lazy batch


@dataclass
class GptqResult:
    codes: "torch.Tensor"  # [out, in] int8, qmin..qmax
    scale: "torch.Tensor"  # [out, groups]
    zero_point: "torch.Tensor | None"  # [out, groups] int8, or None (symmetric)
    loss: float  # the paper's sum of err^2 / [H^-1]_qq, the objective's estimate

    def dequantized(self, dtype=None) -> "torch.Tensor":
        """(codes - zero_point) * scale, as compressed-tensors decompresses, [out, in]."""
        import torch

        group = self.codes.shape[1] // self.scale.shape[1]
        scale = self.scale.to(dtype or torch.float32).repeat_interleave(group, dim=1)
        codes = self.codes.to(scale.dtype)
        if self.zero_point is not None:
            codes = codes - self.zero_point.to(scale.dtype).repeat_interleave(group, dim=1)
        return codes * scale


def observe(columns: "torch.Tensor", bits: int, symmetric: bool, scale_dtype: "torch.dtype"):
    """Min-max scale (and zero point) of each row of `columns` [out, g], 0 included, as
    compressed-tensors' observer chooses them, the scale rounded to its stored dtype:
    (scale [out], zero_point [out] int8 or None)."""
    import torch

    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    zero = torch.zeros((), dtype=columns.dtype, device=columns.device)
    minimum = torch.minimum(columns.amin(dim=1), zero).to(scale_dtype)
    maximum = torch.maximum(columns.amax(dim=1), zero).to(scale_dtype)
    eps = torch.finfo(scale_dtype).eps
    if symmetric:
        scale = torch.max(minimum.abs(), maximum.abs()) / ((qmax - qmin) / 2)
        return torch.where(scale == 0, torch.full_like(scale, eps), scale), None
    scale = (maximum - minimum) / (qmax - qmin)
    zero_point = torch.nan_to_num(torch.clamp(qmin - minimum / scale, qmin, qmax), nan=0.0).round().to(torch.int8)
    return torch.where(scale == 0, torch.full_like(scale, eps), scale), zero_point


def quantize_column(column: "torch.Tensor", scale: "torch.Tensor", zero_point: "torch.Tensor | None", bits: int):
    """(codes int8, dequantized values) of one column [out] with per-row scale and zero point:
    clamp(w / scale + zp) rounded half to even, the order compressed-tensors uses."""
    import torch

    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    scale = scale.to(column.dtype)
    scaled = column / scale
    if zero_point is not None:
        scaled = scaled + zero_point.to(column.dtype)
    codes = scaled.clamp(qmin, qmax).round()
    values = (codes - zero_point.to(column.dtype)) * scale if zero_point is not None else codes * scale
    return codes.to(torch.int8), values


def gptq(
    weight: "torch.Tensor",
    hessian: "torch.Tensor",
    *,
    bits: int,
    group_size: int | None,
    symmetric: bool,
    scale_dtype: "torch.dtype",
    dampening: float = DAMPENING,
    block: int = BLOCK,
) -> GptqResult:
    """GPTQ codes of `weight` [out, in] given `hessian` [in, in] (X^T X of the inputs; any
    positive multiple gives the same codes). `group_size` None: one scale per row (channel)."""
    import torch

    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise KernelError(f"gptq needs weight [out, in] and hessian [in, in], got {list(weight.shape)} and {list(hessian.shape)}")
    if not 2 <= bits <= 8:
        raise KernelError(f"gptq quantizes to int2..int8, not int{bits}")
    rows, cols = weight.shape
    group = group_size or cols
    if cols % group:
        raise KernelError(f"gptq: group size {group} does not divide in_features {cols}")
    if block % group and group % block:  # a group starts only at a block's start or inside it
        block = math.gcd(block, group)
    dtype = weight.dtype
    W = weight.clone()
    H = hessian.to(dtype).clone()
    dead = torch.diagonal(H) == 0  # inputs never seen: their columns carry no error
    H[dead, dead] = 1
    W[:, dead] = 0
    damp = dampening * torch.mean(torch.diagonal(H))
    H.diagonal().add_(damp)
    factor = torch.linalg.cholesky(H)
    H_inv = torch.cholesky_inverse(factor)
    U = torch.linalg.cholesky(H_inv, upper=True)  # rows of U: the elimination's H^-1 rows, scaled
    del H, H_inv, factor

    codes = torch.empty((rows, cols), dtype=torch.int8, device=W.device)
    scales = torch.empty((rows, cols // group), dtype=scale_dtype, device=W.device)
    zero_points = None if symmetric else torch.empty((rows, cols // group), dtype=torch.int8, device=W.device)
    loss = torch.zeros((), dtype=dtype, device=W.device)
    scale = zero_point = None
    for start in range(0, cols, block):
        end = min(start + block, cols)
        W_block = W[:, start:end].clone()
        errors = torch.zeros_like(W_block)
        U_block = U[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if column % group == 0:
                # the group's values as they are now: this block's columns carry the in-block
                # updates; a group reaching past the block starts at its first column, where
                # the lazy updates of every earlier block are already in W
                current = W_block[:, i : i + group]
                if column + group > end:
                    current = torch.cat([current, W[:, end : column + group]], dim=1)
                scale, zero_point = observe(current, bits, symmetric, scale_dtype)
                scales[:, column // group] = scale
                if zero_points is not None:
                    zero_points[:, column // group] = zero_point
            w = W_block[:, i]
            d = U_block[i, i]
            q, values = quantize_column(w, scale, zero_point, bits)
            codes[:, column] = q
            error = (w - values) / d
            loss += (error**2).sum()
            W_block[:, i:] -= error.unsqueeze(1) * U_block[i, i:].unsqueeze(0)
            errors[:, i] = error
        W[:, end:] -= errors @ U[start:end, end:]  # the lazy batch update of the columns after the block
    return GptqResult(codes, scales, zero_points, float(loss) / 2)
