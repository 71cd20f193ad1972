"""The math, in torch: the same code on CPU and CUDA, vectorized, knowing no file format.

    affine    choose_qparams / quantize / dequantize over a block shape (every granularity)
    mse       choose_qparams_mse: the `mse` observer's search for int scales and zero points
    floats    fp8 casts, fp4 e2m1 and fp6 e2m3 codes, e8m0 exponents, 4-bit codebooks
    packing   bit packing with an explicit axis and order for every layout qtool writes
    gguf_blocks  GGML block types (Q8_0 .. Q6_K, IQ4, TQ, MXFP4, NVFP4) to float32: the
              blocks' math only; the GGUF container is read in formats/ and conventions/

Importing this package imports torch; nothing above `conventions/` should.
"""

from __future__ import annotations

from qtool.kernels.affine import (
    choose_global_scale,
    choose_qparams,
    dequantize,
    grid_shape,
    quantize,
    resolve_block,
    scale_to_float,
)
from qtool.kernels.floats import (
    FP4_BNB_CODEBOOK,
    FP4_E2M1_MAGNITUDES,
    FP6_E2M3_MAGNITUDES,
    NF4_CODEBOOK,
    codebook,
    codebook_decode,
    codebook_encode,
    e8m0_decode,
    float8_dtype,
    fp4_e2m1_decode,
    fp4_e2m1_encode,
    fp6_e2m3_decode,
    mx_scale_exponent,
    round_to_power_2,
    to_float8,
)
from qtool.kernels.mse import choose_qparams_mse
from qtool.kernels.packing import pack_fp6, pack_int32, pack_nibbles, unpack_fp6, unpack_int32, unpack_nibbles

__all__ = [
    # one primitive for every granularity
    "resolve_block",
    "grid_shape",
    "choose_qparams",
    "choose_global_scale",
    "choose_qparams_mse",
    "quantize",
    "dequantize",
    "scale_to_float",
    # small floats and codebooks
    "FP4_E2M1_MAGNITUDES",
    "FP6_E2M3_MAGNITUDES",
    "NF4_CODEBOOK",
    "FP4_BNB_CODEBOOK",
    "float8_dtype",
    "to_float8",
    "fp4_e2m1_encode",
    "fp4_e2m1_decode",
    "fp6_e2m3_decode",
    "round_to_power_2",
    "mx_scale_exponent",
    "e8m0_decode",
    "codebook",
    "codebook_encode",
    "codebook_decode",
    # packing
    "pack_int32",
    "unpack_int32",
    "pack_nibbles",
    "unpack_nibbles",
    "pack_fp6",
    "unpack_fp6",
]
