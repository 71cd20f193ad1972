"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): quantize a Linear's weight column by column, each column's rounding
error spread over the columns not yet quantized through the inverse Hessian of the layer's
inputs, H = X^T X.

Defaults are llm-compressor's `GPTQModifier`: dampening 1% of the mean diagonal, blocks of 128
columns with lazy batch updates, and the upper Cholesky factor of H^-1 in place of the
explicit inverse (the paper's numerically stable form; `factor` takes it from one Cholesky
of H, where llm-compressor inverts H and factors the inverse again). A group's scale (and zero
point) is chosen by the min-max observer when the sweep reaches the group's first column, on
the values as they are then (earlier columns' errors already spread into them), so the scales
follow the updated weights rather than the original ones. With the scheme's `mse` observer the
scale is qtool.kernels.mse's search on those same values instead (GPTQ's own `find_params(mse=True)`
idea; at 3 bits it is most of the quality, BENCHMARKS.md).

With activation ordering (`actorder` "weight", compressed-tensors' alias "static"; llm-compressor's
`actorder`), the columns are swept in decreasing order of the Hessian's diagonal (the inputs
with the most energy first, while the most columns remain to absorb their error), each still in
its own group: the group scales are then chosen up front on the original weight, since a group's
columns are spread over the sweep. The output format is unchanged (no `g_idx`).

Shapes: weight [out, in]; hessian [in, in]; codes [out, in] int8 (signed, zero point added:
what compressed-tensors packs); scale [out, in // group] in the scale dtype; zero_point the same
shape, int8, or None when symmetric. The sweep computes in the weight's dtype (float32 for real
runs; float64 in the tests that compare it with the paper's equations).

Where the time goes: inside a block the sweep is sequential in the columns, ~12 small ops per
column in torch, whose dispatch (not their arithmetic) was most of a layer's GPTQ time. Each row
is independent of the others, so for float32 on the CPU the in-block sweep is qtool.native's
`gptq_sweep` (C, rows split over the kernels' threads, bit for bit these torch ops; `_sweep_torch`
is the reference and the path on CUDA and in float64); the lazy updates between blocks are one
matmul each. Linears that share an input (q/k/v, gate/up) share the Hessian's `factor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qtool.errors import KernelError

if TYPE_CHECKING:
    import torch

__all__ = ["GptqResult", "Factor", "factor", "gptq", "DAMPENING", "BLOCK", "ACTORDERS"]

DAMPENING = 0.01  # llm-compressor's dampening_frac
BLOCK = 128  # llm-compressor's block_size: columns per lazy batch
ACTORDERS = ("weight", "static")  # compressed-tensors' names; "static" is its alias of "weight"
MSE_CHUNK = 1 << 16  # values per call of the mse observer's search


@dataclass
class GptqResult:
    codes: torch.Tensor  # [out, in] int8, qmin..qmax
    scale: torch.Tensor  # [out, groups]
    zero_point: torch.Tensor | None  # [out, groups] int8, or None (symmetric)
    loss: float  # the paper's sum of err^2 / [H^-1]_qq / 2, the objective's estimate

    def dequantized(self, dtype=None) -> torch.Tensor:
        """(codes - zero_point) * scale, as compressed-tensors decompresses, [out, in]."""
        import torch

        group = self.codes.shape[1] // self.scale.shape[1]
        scale = self.scale.to(dtype or torch.float32).repeat_interleave(group, dim=1)
        codes = self.codes.to(scale.dtype)
        if self.zero_point is not None:
            codes = codes - self.zero_point.to(scale.dtype).repeat_interleave(group, dim=1)
        return codes * scale


def observe(columns: torch.Tensor, bits: int, symmetric: bool, scale_dtype: torch.dtype, observer: str = "minmax"):
    """Min-max scale (and zero point) of each row of `columns` [out, g], 0 included, as
    compressed-tensors' observer chooses them, the scale rounded to its stored dtype:
    (scale [out], zero_point [out] int8 or None). `observer` "mse": the scale (and zero point)
    of qtool.kernels.mse's search instead, whose first candidate is this one and which keeps
    another only where it reconstructs the row with less squared error."""
    import torch

    if observer == "mse":
        from qtool.kernels.mse import choose_qparams_mse

        # rows are searched independently: a bounded number at a time keeps the search's trial
        # tensors small beside a whole weight's groups (activation order observes them at once)
        step = max(1, MSE_CHUNK // max(1, columns.shape[1]))
        scales, zeros = [], []
        for start in range(0, max(1, columns.shape[0]), step):  # one call at least: no rows, empty results
            scale, zero_point = choose_qparams_mse(
                columns[start : start + step], (1, columns.shape[1]), f"int{bits}", symmetric, scale_dtype
            )
            scales.append(scale.reshape(-1))
            zeros.append(None if zero_point is None else zero_point.reshape(-1).to(torch.int8))
        return torch.cat(scales), None if symmetric else torch.cat(zeros)
    if observer != "minmax":
        raise KernelError(f"gptq: unknown observer {observer!r}")

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


def quantize_column(column: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bits: int):
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


@dataclass
class Factor:
    """What GPTQ needs of a Hessian, whatever the weight: the column order (None: as they are),
    the dead inputs (never seen) in that order, and U, the upper Cholesky factor of the damped
    H^-1 in that order. Linears that read the same input (q/k/v, gate/up) share one."""

    order: torch.Tensor | None
    dead: torch.Tensor
    U: torch.Tensor
    dampening: float
    actorder: str | None


def factor(
    hessian: torch.Tensor, *, dtype: torch.dtype, dampening: float = DAMPENING, actorder: str | None = None
) -> Factor:
    """The `Factor` of `hessian` [in, in] for weights of `dtype`."""
    import torch

    if hessian.dim() != 2 or hessian.shape[0] != hessian.shape[1]:
        raise KernelError(f"gptq needs a square hessian, got {list(hessian.shape)}")
    if actorder is not None and actorder not in ACTORDERS:
        raise KernelError(f"gptq: activation order {actorder!r} is not one of {', '.join(ACTORDERS)}")
    H = hessian.to(dtype)
    order = None
    if actorder is not None:  # a permuted copy (index_select: 3x faster than H[order][:, order])
        order = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        H = H.index_select(0, order).index_select(1, order)
    else:
        H = H.clone()  # the caller's Hessian stays as it was
    dead = torch.diagonal(H) == 0  # inputs never seen: their columns carry no error
    H[dead, dead] = 1
    damp = dampening * torch.mean(torch.diagonal(H))
    H.diagonal().add_(damp)
    # U, the upper Cholesky factor of H^-1 (its rows: the elimination's H^-1 rows, scaled),
    # without forming H^-1 and factoring it again: with J the reversal, J H J = L L^T gives
    # H^-1 = (J L^-1 J)^T (J L^-1 J), and J L^-1 J is upper with a positive diagonal
    H = H.flip(0, 1)  # each [in, in] matrix freed once the next is made: two alive at once
    L = _cholesky(H)
    del H
    U = _lower_inverse(L).flip(0, 1)
    return Factor(order, dead, U, dampening, actorder)


CHOLESKY_BASE = 384  # a matrix this wide or narrower is factored by one LAPACK call


def _half(size: int) -> int:
    """Where `_cholesky` and `_lower_inverse` split a matrix: about half, a multiple of 64 for
    the products' tiles."""
    return -(-size // 2 // 64) * 64


def _cholesky(H: torch.Tensor) -> torch.Tensor:
    """The lower Cholesky factor of H, by halves: [[A, B^T], [B, C]] = L L^T with L11 = chol(A),
    L21 = B L11^-T and L22 = chol(C - L21 L21^T), so most of the work is matrix products. One
    thread of MKL's potrf ran at a third of the core's matmul speed: 1536 columns 32 -> 15 ms.
    A matrix that is not positive definite fails as torch.linalg.cholesky fails."""
    import torch

    size = H.shape[0]
    if size <= CHOLESKY_BASE:
        return torch.linalg.cholesky(H)
    half = _half(size)
    L = torch.zeros_like(H)
    L[:half, :half] = _cholesky(H[:half, :half])
    L[half:, :half] = torch.linalg.solve_triangular(L[:half, :half], H[half:, :half].T, upper=False).T
    L[half:, half:] = _cholesky(torch.addmm(H[half:, half:], L[half:, :half], L[half:, :half].T, alpha=-1))
    return L


INVERSE_BASE = 128  # a triangle this wide or narrower is inverted by one triangular solve


def _lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """L^-1 of a lower-triangular L, by halves: [[A, 0], [B, C]]^-1 is [[A^-1, 0], [-C^-1 B A^-1, C^-1]],
    so a third of the cube's multiply-adds, nearly all in matrix products (one triangular
    solve against the identity would take them all: llm-compressor's inverse and second
    Cholesky took four thirds)."""
    import torch

    size = L.shape[0]
    if size <= INVERSE_BASE:
        return torch.linalg.solve_triangular(L, torch.eye(size, dtype=L.dtype, device=L.device), upper=False)
    half = _half(size)
    inverse = torch.zeros_like(L)
    inverse[:half, :half] = _lower_inverse(L[:half, :half])
    inverse[half:, half:] = _lower_inverse(L[half:, half:])
    inverse[half:, :half] = -(inverse[half:, half:] @ L[half:, :half]) @ inverse[:half, :half]
    return inverse


def gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor | None,
    *,
    bits: int,
    group_size: int | None,
    symmetric: bool,
    scale_dtype: torch.dtype,
    dampening: float = DAMPENING,
    block: int = BLOCK,
    actorder: str | None = None,
    prepared: Factor | None = None,
    observer: str = "minmax",
) -> GptqResult:
    """GPTQ codes of `weight` [out, in] given `hessian` [in, in] (X^T X of the inputs; any
    positive multiple gives the same codes), or its `prepared` factor (`factor`, made with the
    same dampening and order; `hessian` then unused). `group_size` None: one scale per row
    (channel). `actorder` "weight"/"static": sweep the columns by decreasing H diagonal.
    `observer` ("minmax", "mse"): how each group's scale is chosen (`observe`), when the sweep
    reaches the group or, in activation order, up front."""
    import torch

    cols_expected = weight.shape[1] if weight.dim() == 2 else -1
    if prepared is None and (hessian is None or hessian.shape != (cols_expected, cols_expected)):
        raise KernelError(
            f"gptq needs weight [out, in] and hessian [in, in], got {list(weight.shape)} and {None if hessian is None else list(hessian.shape)}"
        )
    if prepared is not None and (
        tuple(prepared.U.shape) != (cols_expected, cols_expected)
        or prepared.dampening != dampening
        or prepared.actorder != actorder
    ):
        raise KernelError(
            f"gptq: the prepared factor ({list(prepared.U.shape)}, dampening {prepared.dampening}, order {prepared.actorder}) does not fit weight {list(weight.shape)} (dampening {dampening}, order {actorder})"
        )
    if not 2 <= bits <= 8:
        raise KernelError(f"gptq quantizes to int2..int8, not int{bits}")
    rows, cols = weight.shape
    group = group_size or cols
    if cols % group:
        raise KernelError(f"gptq: group size {group} does not divide in_features {cols}")
    if actorder is not None and actorder not in ACTORDERS:
        raise KernelError(f"gptq: activation order {actorder!r} is not one of {', '.join(ACTORDERS)}")
    if block % group and group % block:  # a group starts only at a block's start or inside it
        block = math.gcd(block, group)
    dtype = weight.dtype
    if prepared is None:
        prepared = factor(hessian, dtype=dtype, dampening=dampening, actorder=actorder)
    order, U = prepared.order, prepared.U.to(dtype)
    W = weight.clone() if order is None else weight[:, order]
    W[:, prepared.dead] = 0

    codes = torch.empty((rows, cols), dtype=torch.int8, device=W.device)
    scales = torch.empty((rows, cols // group), dtype=scale_dtype, device=W.device)
    zero_points = None if symmetric else torch.empty((rows, cols // group), dtype=torch.int8, device=W.device)
    # the scales and zero points as the sweep uses them: in the weight's dtype, as quantize_column converts them
    scale_values = torch.empty((rows, cols // group), dtype=dtype, device=W.device)
    zero_values = None if symmetric else torch.empty_like(scale_values)
    if order is not None:  # each group's scale chosen up front on the original weight (llm-compressor's observer)
        scale_all, zero_all = observe(
            weight.reshape(rows * (cols // group), group), bits, symmetric, scale_dtype, observer
        )
        scales.copy_(scale_all.reshape(rows, cols // group))
        scale_values.copy_(scales)
        if zero_points is not None:
            zero_points.copy_(zero_all.reshape(rows, cols // group))
            zero_values.copy_(zero_points)
        columns = order
    else:
        columns = torch.arange(cols, device=W.device)
    group_of = (columns // group).to(torch.int32)  # each swept column's group
    sweep = _sweep_native if _native_sweep(W) else _sweep_torch
    loss = 0.0
    for start in range(0, cols, block):
        end = min(start + block, cols)
        W_block = W[:, start:end].clone()
        U_block = U[start:end, start:end].contiguous()
        errors = torch.zeros_like(W_block)
        block_codes = torch.empty((rows, end - start), dtype=torch.int8, device=W.device)
        groups = group_of[start:end].contiguous()
        i = 0
        while i < end - start:
            column = start + i
            stop = end - start
            if order is None:  # plain order: a group's scale is chosen when the sweep reaches its first column
                stop = min(stop, (column // group + 1) * group - start)
                if column % group == 0:
                    # the group's values as they are now: this block's columns carry the in-block
                    # updates; a group reaching past the block starts at its first column, where
                    # the lazy updates of every earlier block are already in W
                    current = W_block[:, i : i + group]
                    if column + group > end:
                        current = torch.cat([current, W[:, end : column + group]], dim=1)
                    scale, zero_point = observe(current, bits, symmetric, scale_dtype, observer)
                    scales[:, column // group] = scale
                    scale_values[:, column // group] = scale
                    if zero_points is not None:
                        zero_points[:, column // group] = zero_point
                        zero_values[:, column // group] = zero_point
            sweep(W_block, U_block, scale_values, zero_values, groups, bits, block_codes, errors, i, stop)
            i = stop
        codes[:, columns[start:end]] = block_codes
        loss += float((errors**2).sum())
        W[:, end:] -= errors @ U[start:end, end:]  # the lazy batch update of the columns after the block
    return GptqResult(codes, scales, zero_points, loss / 2)


def _native_sweep(W) -> bool:
    """The C sweep (qtool.native) for float32 weights on the CPU, where it is built."""
    import torch

    from qtool import native

    return W.dtype == torch.float32 and W.device.type == "cpu" and native.available()


def _sweep_native(
    W_block, U_block, scale_values, zero_values, groups, bits, codes, errors, col0: int, col1: int
) -> None:
    from qtool import native

    native.gptq_sweep(W_block, U_block, scale_values, zero_values, groups, bits, codes, errors, col0, col1)


def _sweep_torch(
    W_block, U_block, scale_values, zero_values, groups, bits, codes, errors, col0: int, col1: int
) -> None:
    """GPTQ's sweep of block columns [col0, col1), in place: each column rounded with its group's
    scale and zero point, its error (scaled by the factor's diagonal) spread over the block's
    later columns. The reference the C sweep reproduces bit for bit."""
    for i in range(col0, col1):
        index = int(groups[i])
        w = W_block[:, i]
        q, values = quantize_column(
            w, scale_values[:, index], None if zero_values is None else zero_values[:, index], bits
        )
        codes[:, i] = q
        error = (w - values) / U_block[i, i]
        W_block[:, i:] -= error.unsqueeze(1) * U_block[i, i:].unsqueeze(0)
        errors[:, i] = error
