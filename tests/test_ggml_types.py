"""The rows of qtool/ggml_types.py and the kernels agree: each kernel has exactly the types
whose rows name one of its entries, with the rows' sizes, and the C encoders behave as the rows
say (a type made only with importance weights, rows with inf/NaN written as llama.cpp does).
The rows' importance rule is llama.cpp's."""

from __future__ import annotations

import numpy as np
import pytest

from qtool import native
from qtool.ggml_types import GGML_TYPES, IGNORED, LLAMA_CPP, LLAMA_QUANTIZE, REQUIRED
from qtool.kernels.gguf_blocks import torch_decodable

ROWS = list(GGML_TYPES.values())
ENCODED = [row for row in ROWS if row.native_encoder is not None]
needs_kernels = pytest.mark.skipif(native._kernels is None, reason="qtool's C kernels are not built")


@needs_kernels
def test_the_c_kernels_have_the_types_their_rows_name_with_their_sizes():
    assert native.gguf_encode_types() == {row.native_encoder for row in ENCODED}
    assert native.gguf_types() == {row.native_decoder for row in ROWS if row.native_decoder is not None}
    for row in ENCODED:
        assert native._gguf_encoders()[row.native_encoder] == (row.block_size, row.type_size), row.name
    for row in ROWS:
        if row.native_decoder is not None:
            assert native._gguf_sizes(row.native_decoder) == (row.block_size, row.type_size), row.name


def test_the_torch_kernels_have_the_types_their_rows_name():
    assert torch_decodable() == {row.torch_decoder for row in ROWS if row.torch_decoder is not None}


@needs_kernels
@pytest.mark.parametrize("row", ENCODED, ids=lambda row: row.name)
def test_the_c_encoder_refuses_without_importance_what_the_row_requires(row):
    try:
        native._kernels.encode_gguf(row.native_encoder, b"", 0, 0, bytearray(), 0, 0)
        refused = False
    except ValueError as exc:
        assert "needs importance weights" in str(exc)
        refused = True
    assert refused == row.quantizer_needs_imatrix


def _writes_rows_after_a_nan_row(row, importance: bool) -> bool:
    """Whether the C encoder writes a finite row that follows a row holding NaN (and so every
    row): it stops at the first such row where gguf-py's bytes are the reference."""
    cols = row.block_size
    x = np.tile(np.linspace(-1.0, 1.0, cols, dtype=np.float32), (3, 1))
    x[1, 3] = np.nan
    weights = np.ones(cols, np.float32).tobytes() if importance else None
    out = bytearray(3 * row.type_size)
    args = (row.native_encoder, x.tobytes(), 0, cols, out, 0, 3) + ((weights,) if importance else ())
    native._kernels.encode_gguf(*args)
    alone = bytearray(row.type_size)
    native._kernels.encode_gguf(
        row.native_encoder, x[2].tobytes(), 0, cols, alone, 0, 1, *((weights,) if importance else ())
    )
    return bytes(out[2 * row.type_size :]) == bytes(alone)


@needs_kernels
@pytest.mark.parametrize("row", ENCODED, ids=lambda row: row.name)
def test_rows_with_inf_or_nan_are_written_where_the_row_says_llama_cpp(row):
    """What the GGUF block encoder reads from the row to keep the kernel's bytes of such rows
    (else it encodes the weight with gguf-py)."""
    if not row.quantizer_needs_imatrix:
        assert _writes_rows_after_a_nan_row(row, importance=False) == (row.quantizer == LLAMA_CPP)
    assert _writes_rows_after_a_nan_row(row, importance=True) == (row.quantizer == LLAMA_CPP or row.takes_imatrix)


def test_the_importance_rule_is_llama_cpp_s():
    """ggml_quantize_requires_imatrix (ggml/src/ggml.c) and tensor_requires_imatrix
    (src/llama-quant.cpp), read at llama.cpp master; quantize_q8_0 ignores its quant_weights."""
    by_rule = {rule: {row.name for row in ROWS if row.imatrix == rule} for rule in (REQUIRED, LLAMA_QUANTIZE, IGNORED)}
    assert by_rule[REQUIRED] == {"IQ2_XXS", "IQ2_XS", "IQ1_S"}
    assert by_rule[LLAMA_QUANTIZE] == {"IQ3_XXS", "IQ2_S", "IQ1_M"}
    assert "Q8_0" in by_rule[IGNORED]
    assert {row.name for row in ROWS if row.llama_quantize_needs_imatrix} == by_rule[REQUIRED] | by_rule[LLAMA_QUANTIZE]
