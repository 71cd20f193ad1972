"""A quantized weight's integer codes, read out of its file without decoding them to floats.

Moving a weight from one toolchain's format to another exactly (issue 39) needs the codes,
scales and zero points themselves, not their float product: `IntCodes` is that value, one per
weight, shared by the read side (each convention's `codes`, on the integer grids it reads) and
the write side (`qtool.layouts.moves`). It holds one grid model, wide enough for every source:

    W[o, i] = scale[o, g] * (codes[o, i] - zero[o, g])  (+ minimum[o, g])
    g = g_idx[i] if g_idx is not None else i // group

    source                          codes (unsigned)      zero               minimum   arithmetic
    GPTQ v1 / v2                    q                     stored (+1 in v1)  None      scale dtype
    AutoAWQ GEMM / GEMV             q                     stored             None      scale dtype
    compressed-tensors int, sym     q + 2^(b-1)           2^(b-1)            None      scale dtype
    compressed-tensors int, asym    q + 2^(b-1)           zp + 2^(b-1)       None      scale dtype
    GGUF Q8_0                       q + 128               128                None      float32
    GGUF Q4_0                       nibble                8                  None      float32
    GGUF Q4_1                       nibble                None               m         float32

Codes are unsigned so that one range check (0 .. 2^bits - 1) and one packer serve every target;
a signed format's offset lives in `zero`. `zero` is None only where the format has no integer
zero point at all (Q4_1's float minimum). `arithmetic` is the one thing the grid alone does not
say: the float type in which the source toolchain forms the product, because that decides the
bits of the result. GPTQ (AutoGPTQ's torch path), AutoAWQ's `dequantize_gemm` and
compressed-tensors' `_dequantize` round `(q - z) * s` once to the scale's dtype; gguf-py and
llama.cpp convert the float16 `d` to float32 and compute there, where the product is exact.
Two formats with the same grid but different arithmetic agree only where every product is
exactly representable in the narrower type: the writers in `qtool.layouts.moves` check that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    import torch

__all__ = ["IntCodes"]


@dataclass(frozen=True)
class IntCodes:
    """A weight on an integer grid: W[o, i] = scale[o, g] * (codes[o, i] - zero[o, g])
    (+ minimum[o, g] where the format adds a float minimum), g = g_idx[i] if g_idx is not None
    else i // group. The table in the module docstring says what each source stores here.

    `arithmetic` (None: the scale's dtype) is the float dtype the source toolchain computes
    the product in; `dequantized` computes in it and returns float32, which holds every
    float16 / bfloat16 / float32 value exactly."""

    codes: torch.Tensor  # int16 [O, I], unsigned 0 .. 2**bits - 1, logical (Hugging Face) order
    scale: torch.Tensor  # [O, G] in the dtype the file stores it (float16 / bfloat16 / float32)
    zero: torch.Tensor | None  # int32 [O, G] integer zero points (None: no integer zero point)
    minimum: torch.Tensor | None  # [O, G] float minimum added (GGUF Q4_1's m: W = d*q + m); None elsewhere
    bits: int
    group: int  # inputs per group (I for one group per row); the last group may be partial
    g_idx: torch.Tensor | None = None  # int32 [I] group of each input (GPTQ desc_act); None: i // group
    arithmetic: torch.dtype | None = None  # the product's float type; None: the scale's dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.arithmetic or self.scale.dtype

    def take_rows(self, index: torch.Tensor) -> IntCodes:
        """The weight with its output rows reordered, `new[r] = old[index[r]]` for the codes and
        every per-row grid alike: how a GGUF's permuted llama q/k rows are put back in Hugging
        Face order (or the other way)."""
        import dataclasses

        def rows(grid: torch.Tensor | None) -> torch.Tensor | None:
            return None if grid is None else grid.index_select(0, index.to(grid.device)).contiguous()

        return dataclasses.replace(
            self, codes=rows(self.codes), scale=rows(self.scale), zero=rows(self.zero), minimum=rows(self.minimum)
        )

    def group_index(self) -> torch.Tensor:
        """int64 [I]: the group of each input."""
        import torch

        if self.g_idx is not None:
            return self.g_idx.to(torch.int64)
        return torch.arange(self.shape[1], device=self.codes.device) // self.group

    def per_input(self, grid: torch.Tensor) -> torch.Tensor:
        """A [O, G] grid spread to [O, I] through the group index."""
        return grid.index_select(1, self.group_index().to(grid.device))

    def offsets(self) -> torch.Tensor | None:
        """int16 [O, I] codes minus their zero points (None where there is no integer zero point)."""
        import torch

        if self.zero is None:
            return None
        return self.codes.to(torch.int16) - self.per_input(self.zero).to(torch.int16)

    def dequantized(self) -> torch.Tensor:
        """float32 [O, I], bit for bit what the source toolchain computes: `codes - zero` (an
        exact small integer in any float type), times `scale`, rounded once to `compute_dtype`,
        then `+ minimum` rounded again (Q4_1: gguf-py's `d * q + m`), then widened to float32
        (exact)."""
        import torch

        dtype = self.compute_dtype
        offsets = self.offsets()
        values = (offsets if offsets is not None else self.codes).to(dtype)
        out = values * self.per_input(self.scale).to(dtype)
        if self.minimum is not None:
            out = out + self.per_input(self.minimum).to(dtype)
        return out.to(torch.float32)
