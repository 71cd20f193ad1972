"""The `mse` observer for integer schemes: per block, the scale (and zero point) whose codes
reconstruct the block with the least squared error, searched without calibration data. The
torch reference; qtool/native/src/mse.c is the same search fused into the CPU encode, and
both give the same codes, scales and zero points bit for bit (tests/test_mse_observer.py).

    symmetric    candidates: the absmax shrunk by p_k = 1 - k / 100, k = 0 .. 39
                 (the shrink search of GPTQ's `find_params(mse=True)` and llm-compressor's
                 `mse` observer, there 1 - i/100 for i < maxshrink * grid = 20; 40 here)
                 scale_k = dt(f32(amax * p_k) / ((qmax - qmin) / 2)),
                 searched in three steps: k = 0, 10, 20; then the best one's k - 3, k + 3; then
                 the best one's k - 1, k + 1 (7 trials instead of 40; on MiniLM W4A16 19.253 dB
                 against 19.259 for all 40 and 19.258 for the 12 of k = 0, 5, .., 35 then +-2)
    asymmetric   candidates: the low and high clip points shrunk independently,
                 lo_i = dt(min * p_i), hi_j = dt(max * p_j), p_i = 1 - i * step, i, j = 0 .. 6,
                 step 0.05 (down to 0.7), 0.1 for int2 (down to 0.4: four levels clip harder;
                 on MiniLM 8.81 dB with 0.05, 8.88 with 0.1)
                 (a 7 x 7 grid over both ends, the two-sided form of the same search),
                 searched coarse to fine: i, j in {0, 3, 6}, then the best one's 8 neighbours
                 (17 trials instead of 49; MiniLM int4 asym 19.940 dB against 19.950, int2 8.878
                 against 8.880)
                 scale, zero point: min-max's formula on (lo_i, hi_j)
    then twice   a least-squares refit of the scale with the codes (and zero point) fixed:
                 w = q - zp, scale = dt(f32(sum(x * w) / sum(w * w)))  (llama.cpp's
                 `make_qkx2_quants` refit, ggml-quants.c; there with a weighted min as well)
                 the codes requantized with the new scale; kept only if the error falls

A candidate replaces the best so far only when strictly better, in the order above; each later
step's candidates are each row's own (around that row's best so far).

Every candidate's error is the one min-max's output would be measured by: the codes of
`affine.quantize` (x / scale in the weight's dtype, + zp, clamp, round half to even) and the
value the decoder returns (dt((q - zp) * scale)), summed as (x - x^)^2 in float64. Candidate
k = 0 (i = j = 0) is exactly min-max's scale and zero point, and a later candidate wins only
with a strictly smaller error, so no block ever gets worse than min-max. Refit sums are
float64, their quotient rounded once to float32, then to the scale's dtype.

Cost: 7 (symmetric) or 17 (asymmetric) trial quantizations of each block plus up to two
refits, in one pass over the weight (see BENCHMARKS.md for what it costs end to end). The C
kernel skips work that cannot change the choice: the refits after one that changed nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from qtool.errors import KernelError
from qtool.qtypes import QType
from qtool.qtypes import qtype as lookup_qtype

__all__ = ["SHRINK_STEPS", "GRID_STEPS", "shrink_factors", "grid_factors", "choose_qparams_mse", "block_errors"]

SHRINK_STEPS, SHRINK_STEP = 40, 0.01  # symmetric: p_k = 1 - k * 0.01
SHRINK_START, SHRINK_REFINE = (0, 10, 20), (3, 1)  # k = 0, 10, 20, then the best's k -+ 3, then k -+ 1
GRID_STEPS, GRID_STEP, GRID_STEP_INT2 = 7, 0.05, 0.1  # asymmetric: p_i = 1 - i * step at each end
GRID_COARSE = 3  # i, j in {0, 3, 6}, then the best's 8 neighbours
REFITS = 2


def shrink_factors() -> list[float]:
    """float32 values of 1 - k * step (computed in double, rounded once: mse.c does the same)."""
    return [
        float(torch.tensor(1.0 - k * SHRINK_STEP, dtype=torch.float64).to(torch.float32)) for k in range(SHRINK_STEPS)
    ]


def grid_factors(bits: int) -> list[float]:
    step = GRID_STEP_INT2 if bits <= 2 else GRID_STEP
    return [float(torch.tensor(1.0 - i * step, dtype=torch.float64).to(torch.float32)) for i in range(GRID_STEPS)]


def _to_rows(x: torch.Tensor, block: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """[G, n]: one row per block (zero padded), and the block grid."""
    from qtool.kernels.affine import _to_blocks

    blocks = _to_blocks(x, block)
    ndim = x.dim()
    grid = tuple(blocks.shape[0::2])
    order = [*range(0, 2 * ndim, 2), *range(1, 2 * ndim, 2)]
    size = math.prod(blocks.shape[1::2])  # named, not -1: a tensor with no rows has no blocks to infer it from
    return blocks.permute(order).reshape(math.prod(grid), size), grid


def _codes(rows: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, qt: QType) -> torch.Tensor:
    """affine.quantize's arithmetic, per row: [G, n] float codes (rounded, clamped)."""
    scaled = rows / scale
    if zero_point is not None:
        scaled = scaled + zero_point.to(rows.dtype)
    return scaled.clamp_(qt.qmin, qt.qmax).round_()


def _decoded(
    codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """affine.dequantize's arithmetic: float32 (q - zp) * scale, cast once to the weight's dtype."""
    values = codes.to(torch.float32)
    if zero_point is not None:
        values = values - zero_point.to(torch.float32)
    return (values * scale.to(torch.float32)).to(dtype)


def block_errors(rows: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """float64 [G]: sum over each row of (x - x^)^2."""
    error = rows.double() - decoded.double()
    return (error * error).sum(dim=-1)


def _replace_zero(scale: torch.Tensor) -> torch.Tensor:
    eps = torch.finfo(scale.dtype).eps
    return torch.where(scale == 0, torch.tensor(eps, dtype=scale.dtype, device=scale.device), scale)


def _asym_params(lo: torch.Tensor, hi: torch.Tensor, qt: QType, scale_dtype: torch.dtype, value_dtype: torch.dtype):
    """affine.choose_qparams' asymmetric formula on a clip range (lo <= 0 <= hi, scale dtype)."""
    scale = (hi - lo) / torch.tensor(float(qt.qmax) - float(qt.qmin), device=lo.device).to(scale_dtype)
    zero_point = torch.tensor(float(qt.qmin), device=lo.device) - (lo / scale)
    zero_point = torch.nan_to_num(torch.clamp(zero_point, qt.qmin, qt.qmax), nan=0.0)
    info = torch.iinfo(value_dtype)
    zero_point = torch.round(torch.clamp(zero_point, info.min, info.max)).to(value_dtype)
    return _replace_zero(scale), zero_point


def choose_qparams_mse(
    x: torch.Tensor,
    block: Sequence[int | None],
    qtype: QType | str,
    symmetric: bool = True,
    scale_dtype: str | torch.dtype = "F32",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero_point or None) of the block-grid shape, as `affine.choose_qparams` returns
    them, chosen by the search above. Int value types with float scales only."""
    from qtool.kernels.affine import _int_dtype, _scale_kind, resolve_block

    qt = lookup_qtype(qtype) if isinstance(qtype, str) else qtype
    if qt.kind != "int" or qt.qmin is None or qt.qmax is None:
        raise KernelError(f"the mse observer searches int scales, not {qt.name}")
    if not x.dtype.is_floating_point:
        raise KernelError(f"choose_qparams_mse needs a float tensor, got {x.dtype}")
    if symmetric and not qt.signed:
        raise KernelError(f"{qt.name} is unsigned: symmetric quantization needs a signed type such as int{qt.bits}")
    kind, sdt = _scale_kind(scale_dtype, x)
    if kind != "float" or sdt is None:
        raise KernelError(f"the mse observer stores float scales, not {scale_dtype}")
    resolved = resolve_block(x.shape, block)
    rows, grid = _to_rows(x, resolved)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    lo = torch.minimum(rows.amin(dim=-1, keepdim=True), zero).to(sdt)
    hi = torch.maximum(rows.amax(dim=-1, keepdim=True), zero).to(sdt)
    half = (torch.tensor(float(qt.qmax) - float(qt.qmin), device=x.device).to(sdt)) / 2
    value_dtype = _int_dtype(qt)

    def trial(scale: torch.Tensor, zero_point: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        codes = _codes(rows, scale, zero_point, qt)
        return codes, block_errors(rows, _decoded(codes, scale, zero_point, x.dtype))

    best: list = []  # [scale, zero point or None, codes, error, i, j] of each row's best so far

    def consider(scale: torch.Tensor, zero_point: torch.Tensor | None, i, j, valid: torch.Tensor | None = None) -> None:
        """C's `consider`: a row takes the candidate only when strictly better (the first: always)."""
        codes, error = trial(scale, zero_point)
        i = torch.as_tensor(i, device=x.device).expand(error.shape)
        j = torch.as_tensor(j, device=x.device).expand(error.shape)
        if not best:
            best.extend([scale, zero_point, codes, error, i, j])
            return
        better = error < best[3] if valid is None else (error < best[3]) & valid
        column = better[:, None]
        best[0] = torch.where(column, scale, best[0])
        if zero_point is not None:
            best[1] = torch.where(column, zero_point, best[1])
        best[2] = torch.where(column, codes, best[2])
        best[3] = torch.where(better, error, best[3])
        best[4] = torch.where(better, i, best[4])
        best[5] = torch.where(better, j, best[5])

    if symmetric:
        amax = torch.max(lo.abs(), hi.abs()).to(torch.float32)
        shrinks = torch.tensor(shrink_factors(), dtype=torch.float32, device=x.device)

        def shrunk_scale(factor: torch.Tensor) -> torch.Tensor:
            return _replace_zero(((amax * factor) / half.to(torch.float32)).to(sdt))

        for k in SHRINK_START:
            consider(shrunk_scale(shrinks[k]), None, k, 0)
        for step in SHRINK_REFINE:
            centre = best[4]
            for k in (centre - step, centre + step):
                valid = (k >= 0) & (k < SHRINK_STEPS)
                consider(shrunk_scale(shrinks[k.clamp(0, SHRINK_STEPS - 1)][:, None]), None, k, 0, valid)
    else:
        lo32, hi32 = lo.to(torch.float32), hi.to(torch.float32)
        clips = torch.tensor(grid_factors(qt.bits), dtype=torch.float32, device=x.device)

        def clipped(i, j) -> tuple[torch.Tensor, torch.Tensor]:
            low, high = clips[i], clips[j]
            if low.dim():
                low, high = low[:, None], high[:, None]
            return _asym_params((lo32 * low).to(sdt), (hi32 * high).to(sdt), qt, sdt, value_dtype)

        for i in range(0, GRID_STEPS, GRID_COARSE):
            for j in range(0, GRID_STEPS, GRID_COARSE):
                consider(*clipped(i, j), i, j)
        centre_i, centre_j = best[4], best[5]
        for di in (-1, 0, 1):
            for dj in (-1, 0, 1):
                i, j = centre_i + di, centre_j + dj
                inside = (i >= 0) & (j >= 0) & (i < GRID_STEPS) & (j < GRID_STEPS)
                valid = inside & ((i % GRID_COARSE != 0) | (j % GRID_COARSE != 0))
                consider(*clipped(i.clamp(0, GRID_STEPS - 1), j.clamp(0, GRID_STEPS - 1)), i, j, valid)

    best_scale, best_zp, best_codes, best_error = best[:4]
    for _ in range(REFITS):
        weights = best_codes.double()
        if best_zp is not None:
            weights = weights - best_zp.double()
        numerator = (rows.double() * weights).sum(dim=-1, keepdim=True)
        denominator = (weights * weights).sum(dim=-1, keepdim=True)
        refit = (numerator / denominator).to(torch.float32).to(sdt)
        usable = (denominator > 0) & (refit > 0) & torch.isfinite(refit)
        refit = torch.where(usable, refit, best_scale)
        codes, error = trial(refit, best_zp)
        better = (error < best_error) & usable[:, 0]
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better[:, None], refit, best_scale)
        best_codes = torch.where(better[:, None], codes, best_codes)

    scale = best_scale.reshape(grid)
    return scale, (best_zp.reshape(grid) if best_zp is not None else None)
