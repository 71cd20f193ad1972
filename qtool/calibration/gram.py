"""X^T X of a Linear's inputs as the calibration steps take it (GPTQ's Hessian, AWQ's search
and clipping): only the blocks on and above the diagonal computed as the inputs arrive, the
lower half mirrored once at the end; X^T X is symmetric, so at 1536 columns 36 of 64 blocks
are never computed."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["upper_gram", "mirror", "hessian", "GRAM_STEP", "NARROW_GRAM_STEP", "NARROW", "MIRROR_STEP"]

GRAM_STEP = (
    192  # columns per block of X^T X: small enough to skip most of the lower half, large enough for a fast matmul
)
NARROW_GRAM_STEP = (
    64  # ... and for inputs this narrow or narrower: 0.92x the time of 192 at 576 columns, one thread (BENCHMARKS.md)
)
NARROW = 768  # columns: at 576 the step of 64 wins, at 1536 192 does


def upper_gram(x: torch.Tensor, out: torch.Tensor, *, add: bool = False) -> torch.Tensor:
    """X^T X's blocks on and above the diagonal (of `GRAM_STEP` columns) into `out` [in, in]
    (`add`: added to it), each block's matmul written in place; the blocks below stay as they
    are (zeros): X^T X is symmetric, so they are never computed (at 1536 columns, 36 of 64
    blocks) and `mirror` fills them at the end."""
    width = x.shape[1]
    step = NARROW_GRAM_STEP if width <= NARROW else GRAM_STEP
    for start in range(0, width, step):
        out[start : start + step, start:].addmm_(x[:, start : start + step].T, x[:, start:], beta=1 if add else 0)
    return out


MIRROR_STEP = 64  # columns per band: a band's transpose stays in cache


def mirror(total: torch.Tensor) -> None:
    """A sum of `upper_gram`s made symmetric: its upper triangle mirrored below the diagonal, a
    band of `MIRROR_STEP` columns at a time (one whole transpose at 1536 columns: 21 -> 1.5 ms)."""
    import torch

    width = total.shape[0]
    for start in range(0, width, MIRROR_STEP):
        end = min(start + MIRROR_STEP, width)
        block = total[start:end, start:end]
        block.copy_(torch.triu(block) + torch.triu(block, diagonal=1).T)
        total[end:, start:end].copy_(total[start:end, end:].T)


def hessian(inputs: list[torch.Tensor], taken: torch.Tensor | None = None) -> torch.Tensor:
    """X^T X in float32 of the inputs' rows, summed in their order (after `taken`'s, the upper
    blocks of a sum begun before), made symmetric."""
    import torch

    total = taken
    for x in inputs:
        width = x.shape[-1]
        if total is None:
            total = torch.zeros((width, width), dtype=torch.float32, device=x.device)
        upper_gram(x.reshape(-1, width).float(), total, add=True)
    mirror(total)
    return total
