"""Storage dtypes, value types and the block-shape granularity of `QScheme`."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qtool.conventions.base import block_from_scale, infer_block_size
from qtool.dtypes import DTYPES, nbytes_for, storage_dtype
from qtool.errors import SchemeError
from qtool.qtypes import qtype
from qtool.scheme import CHANNEL, TENSOR, QScheme, group

SAFETENSORS_DTYPES = (
    "BOOL U8 I8 U16 I16 U32 I32 U64 I64 F16 BF16 F32 F64 C64 F8_E4M3 F8_E5M2 F8_E8M0 F4 F6_E2M3 F6_E3M2 "
    "F8_E4M3FNUZ F8_E5M2FNUZ"
).split()


def test_the_dtype_table_covers_every_safetensors_dtype_with_its_bits():
    assert sorted(DTYPES) == sorted(SAFETENSORS_DTYPES)
    bits = {name: DTYPES[name].bits for name in SAFETENSORS_DTYPES}
    assert bits["F4"] == 4 and bits["F6_E2M3"] == bits["F6_E3M2"] == 6
    assert bits["C64"] == 64 and bits["BOOL"] == 8 and bits["BF16"] == 16
    assert nbytes_for(DTYPES["F4"], 3) is None and nbytes_for(DTYPES["F4"], 4) == 2
    assert nbytes_for(DTYPES["F6_E2M3"], 4) == 3


def test_unknown_dtype_lists_the_valid_names():
    with pytest.raises(KeyError, match="F12") as unknown:  # a KeyError, and a QtoolError (exit 2)
        storage_dtype("F12")
    assert "BF16" in unknown.value.hint and unknown.value.exit_code == 2


def test_torch_dtypes_resolve_where_torch_has_them():
    import torch

    assert DTYPES["BF16"].torch_dtype() is torch.bfloat16
    assert DTYPES["F8_E4M3"].torch_dtype() is torch.float8_e4m3fn
    with pytest.raises(TypeError):
        DTYPES["F6_E2M3"].torch_dtype()


@pytest.mark.parametrize(
    "block, granularity, resolved, label",
    [
        (TENSOR, "tensor", (4096, 11008), "int4 sym tensor"),
        (CHANNEL, "channel", (1, 11008), "int4 sym channel"),
        (group(128), "group", (1, 128), "int4 sym g128"),
        ((128, 128), "block", (128, 128), "int4 sym block128x128"),
        ((None, 1), "channel", (4096, 1), "int4 sym channel(axis=1)"),
        ((None, 128), "block", (4096, 128), "int4 sym block*x128"),
    ],
    ids=["per-tensor", "per-channel", "per-group", "2d-block", "per-channel-axis1", "column-block"],
)
def test_granularity_is_a_block_shape(block, granularity, resolved, label):
    scheme = QScheme(qtype("int4"), block)
    assert scheme.granularity == granularity
    assert scheme.block_for((4096, 11008)) == resolved
    assert scheme.label == label


def test_blocks_align_to_trailing_dims():
    assert QScheme(qtype("int8"), CHANNEL).block_for((8, 4096, 11008)) == (1, 1, 11008)
    assert QScheme(qtype("int8"), group(32)).block_for((64,)) == (32,)


def test_named_families_and_asymmetric_labels():
    assert QScheme(qtype("fp4_e2m1"), group(32), scale_dtype="E8M0").label == "mxfp4 g32"
    assert QScheme(qtype("fp8_e4m3"), group(32), scale_dtype="E8M0").label == "mxfp8 g32"
    assert QScheme(qtype("fp4_e2m1"), group(16), scale_dtype="F8_E4M3", global_scale=True).label == "nvfp4 g16"
    assert QScheme(qtype("int4"), group(64), symmetric=False, zero_point=True).label == "int4 asym g64"
    assert QScheme(qtype("fp8_e4m3"), TENSOR).label == "fp8_e4m3 tensor"


@pytest.mark.parametrize("block", [(), (0, 1), (1, -3), (1, 2.5), [1, 128]])
def test_impossible_blocks_cannot_be_constructed(block):
    with pytest.raises(SchemeError, match="block"):
        QScheme(qtype("int4"), block)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"scale_dtype": "bananas"}, "auto"),
        ({"observer": "psychic"}, "minmax"),
        ({"symmetric": False}, "int value type"),
    ],
)
def test_impossible_schemes_say_what_is_allowed(kwargs, says):
    with pytest.raises(SchemeError) as raised:
        QScheme(qtype("nf4"), group(64), **kwargs)
    assert says in f"{raised.value} {raised.value.hint}"
    assert raised.value.exit_code == 2  # a SchemeError is a QtoolError: one line, exit 2


def test_scale_spellings_fold_into_one_family():
    kinds = {
        spelling: QScheme(qtype("fp4_e2m1"), group(32), scale_dtype=spelling).scale_kind
        for spelling in ("E8M0", "F8_E8M0", "e8m0")
    }
    assert set(kinds.values()) == {"e8m0"}
    assert (
        QScheme(qtype("fp4_e2m1"), group(16), scale_dtype="UE4M3").scale_kind
        == QScheme(qtype("fp4_e2m1"), group(16), scale_dtype="F8_E4M3").scale_kind
        == "e4m3"
    )
    assert QScheme(qtype("int4"), group(128), scale_dtype="auto").scale_kind == "auto"
    assert QScheme(qtype("int4"), group(128), scale_dtype="BF16").scale_kind == "float"


def test_int_value_ranges():
    assert (qtype("int4").qmin, qtype("int4").qmax) == (-8, 7)
    assert (qtype("uint4").qmin, qtype("uint4").qmax) == (0, 15)
    assert qtype("int8").bits == 8 and qtype("nf4").kind == "codebook"
    with pytest.raises(SchemeError, match="int9") as raised:
        qtype("int9")
    assert "int4" in raised.value.hint


@given(dim=st.integers(1, 5000), size=st.sampled_from([16, 32, 64, 128, 256]))
def test_infer_block_size_recovers_power_of_two_blocks(dim, size):
    count = math.ceil(dim / size)
    inferred = infer_block_size(dim, count, hint=size)
    assert inferred == size
    unhinted = infer_block_size(dim, count)
    assert unhinted is not None and math.ceil(dim / unhinted) == count


@given(
    rows=st.integers(1, 600),
    cols=st.integers(1, 600),
    bh=st.sampled_from([1, 64, 128]),
    bw=st.sampled_from([16, 32, 128]),
)
def test_block_from_scale_round_trips_the_scale_grid(rows, cols, bh, bw):
    grid = (math.ceil(rows / bh), math.ceil(cols / bw))
    block = block_from_scale((rows, cols), grid, hint=(bh, bw))
    assert block is not None
    resolved = QScheme(qtype("int8"), block).block_for((rows, cols))
    assert (math.ceil(rows / resolved[0]), math.ceil(cols / resolved[1])) == grid
