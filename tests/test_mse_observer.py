"""The `mse` observer (issue 19): never worse than min-max on any group, the C search bit for
bit the torch reference, and the flag and scheme suffix through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool import kernels, native
from qtool.kernels import mse
from qtool.kernels.affine import resolve_block
from qtool.layouts import compressed_tensors as ct
from qtool.qtypes import qtype
from qtool.scheme_strings import parse_scheme
from tests.conftest import SAMPLES

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _group_errors(
    x: torch.Tensor, group: int, bits: int, symmetric: bool, observer: str, scale_dtype: str
) -> torch.Tensor:
    """float64 [rows * groups]: each group's squared error as the decoder sees it."""
    choose = kernels.choose_qparams_mse if observer == "mse" else kernels.choose_qparams
    block = (1, group)
    value_type = qtype(f"int{bits}")
    scale, zero_point = choose(x, block, value_type, symmetric, scale_dtype)
    codes = kernels.quantize(x, scale, zero_point, block, value_type)
    decoded = kernels.dequantize(codes, scale, zero_point, block, x.dtype)
    rows, _ = mse._to_rows(x, resolve_block(x.shape, block))
    decoded_rows, _ = mse._to_rows(decoded, resolve_block(x.shape, block))
    return mse.block_errors(rows, decoded_rows)


def _heavy_tailed(seed: int, rows: int, cols: int, tail: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, cols, generator=generator)
    return normal * torch.exp(tail * torch.randn(rows, cols, generator=generator))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    tail=st.floats(0.0, 2.0),
    bits=st.sampled_from([2, 3, 4, 8]),
    symmetric=st.booleans(),
    dtype=st.sampled_from(list(DTYPES)),
    group=st.sampled_from([8, 32, 64]),
)
def test_mse_never_worse_than_minmax_on_any_group(seed, tail, bits, symmetric, dtype, group):
    x = _heavy_tailed(seed, 4, 128, tail).to(DTYPES[dtype])
    x[0, :group] = 0  # an all-zero group
    x[1, :group] = x[1, 0]  # a constant one
    minmax = _group_errors(x, group, bits, symmetric, "minmax", dtype)
    searched = _group_errors(x, group, bits, symmetric, "mse", dtype)
    assert bool((searched <= minmax).all()), (searched - minmax).max()


def _minilm_weights(count: int = 4) -> list[torch.Tensor]:
    from safetensors import safe_open

    from sample_models.real_models import Unavailable, minilm

    try:
        folder = minilm()
    except Unavailable as exc:
        pytest.skip(str(exc))
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        names = [
            name
            for name in handle.keys()
            if name.startswith("encoder.layer.0.") and name.endswith(".weight") and "LayerNorm" not in name
        ]
        return [handle.get_tensor(name)[:96] for name in names[:count]]


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits,group", [(4, 128), (2, 64), (8, 384)], ids=["int4-g128", "int2-g64", "int8-channel"])
def test_mse_never_worse_than_minmax_on_real_rows(symmetric, bits, group):
    for weight in _minilm_weights():
        minmax = _group_errors(weight, group, bits, symmetric, "minmax", "F32")
        searched = _group_errors(weight, group, bits, symmetric, "mse", "F32")
        assert bool((searched <= minmax).all())
        if bits < 8:
            assert float(searched.sum()) < float(minmax.sum())


def _native_vs_torch(x: torch.Tensor, dtype: str, bits: int, group: int, symmetric: bool) -> None:
    rows, cols = x.shape
    raw = x.contiguous().view(torch.uint8).numpy().tobytes()
    encoded = native.encode_int(raw, dtype, rows, cols, group, bits, symmetric=symmetric, observer="mse")
    scheme = parse_scheme(f"int{bits}:g{group}:{'sym' if symmetric else 'asym'}:mse")
    ours = ct.encode("m.weight", x, scheme)
    scale = torch.frombuffer(bytearray(encoded.scale), dtype=DTYPES[dtype]).reshape(rows, cols // group)
    assert torch.equal(scale.view(torch.uint8), ours["m.weight_scale"].contiguous().view(torch.uint8)), "scales differ"
    packed = torch.frombuffer(bytearray(encoded.packed), dtype=torch.int32).reshape(ours["m.weight_packed"].shape)
    assert torch.equal(packed, ours["m.weight_packed"]), "codes differ"
    if not symmetric:
        zero_point = torch.frombuffer(bytearray(encoded.zero_point), dtype=torch.int32).reshape(
            ours["m.weight_zero_point"].shape
        )
        assert torch.equal(zero_point, ours["m.weight_zero_point"]), "zero points differ"


needs_native = pytest.mark.skipif(not native.available(), reason="qtool's C kernels are not built")


@needs_native
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    tail=st.floats(0.0, 2.0),
    bits=st.sampled_from([2, 3, 4, 8]),
    symmetric=st.booleans(),
    dtype=st.sampled_from(list(DTYPES)),
    group=st.sampled_from([32, 64, 128]),
)
def test_native_mse_is_the_torch_search_bit_for_bit(seed, tail, bits, symmetric, dtype, group):
    x = _heavy_tailed(seed, 24, 256, tail).to(DTYPES[dtype])
    x[0, :group] = 0
    _native_vs_torch(x, dtype, bits, group, symmetric)


@needs_native
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_native_mse_is_the_torch_search_on_real_rows(dtype):
    for weight in _minilm_weights():
        for bits, group, symmetric in [
            (4, 128, True),
            (4, 128, False),
            (3, 128, False),
            (2, 64, False),
            (8, 384, True),
        ]:
            _native_vs_torch(weight.to(DTYPES[dtype]), dtype, bits, group, symmetric)


def _encode_bytes(x: torch.Tensor, dtype: str, bits: int, group: int, symmetric: bool) -> tuple[bytes, bytes, bytes]:
    rows, cols = x.shape
    raw = x.contiguous().view(torch.uint8).numpy().tobytes()
    encoded = native.encode_int(raw, dtype, rows, cols, group, bits, symmetric=symmetric, observer="mse")
    return bytes(encoded.packed), bytes(encoded.scale), bytes(encoded.zero_point or b"")


@needs_native
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    tail=st.floats(0.0, 3.0),
    magnitude=st.sampled_from([1.0, 1e-3, 1e-30, 1e4]),
    bits=st.sampled_from([2, 3, 4, 8]),
    symmetric=st.booleans(),
    dtype=st.sampled_from(list(DTYPES)),
    group=st.sampled_from([8, 12, 36, 64, 128, 256]),
)
def test_native_mse_avx2_kernels_are_the_portable_ones(seed, tail, magnitude, bits, symmetric, dtype, group):
    """mse.c's AVX2 trials (x * 1/scale for bf16 and f16, a table for bf16 codes of <= 4 bits,
    F16C roundings, float32 differences) choose exactly what its portable kernels choose."""
    x = (_heavy_tailed(seed, 6, 2304, tail) * magnitude).to(DTYPES[dtype])
    x[0, :group] = 0
    x[1, :group] = x[1, 0]
    try:
        native._kernels.mse_set_x86(False)
        portable = _encode_bytes(x, dtype, bits, group, symmetric)
    finally:
        native._kernels.mse_set_x86(True)
    assert _encode_bytes(x, dtype, bits, group, symmetric) == portable


def test_minmax_candidate_is_min_max_itself():
    """Candidate 0 of each search is min-max's scale: the factors start at exactly 1."""
    assert mse.shrink_factors()[0] == 1.0 and mse.grid_factors(4)[0] == 1.0 and mse.grid_factors(2)[0] == 1.0
    assert len(mse.shrink_factors()) == 40 and len(mse.grid_factors(4)) == 7


def _qtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qtool", *args], capture_output=True, text=True, timeout=600)


def test_cli_observer_flag_records_mse_in_the_config(tmp_path):
    out = tmp_path / "out"
    done = _qtool("quantize", str(SAMPLES / "tiny-llama"), "-o", str(out), "--scheme", "W4A16", "--observer", "mse",
                  "--tensor-scheme", "re:.*down_proj.*=int8:channel:minmax", "-q")  # fmt: skip
    assert done.returncode == 0, done.stderr
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    observers = sorted((group["weights"]["num_bits"], group["weights"].get("observer")) for group in groups)
    assert observers == [(4, "mse"), (8, None)]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--scheme", "Q4_K_M", "--observer", "mse"], "error: observer mse: Q4_K_M is a llama.cpp file type"),
        (
            ["--scheme", "q4_0:mse"],
            "error: scheme: the mse observer searches int scales only: Q4_0 is a GGUF block type",
        ),
        (
            ["--scheme", "nvfp4", "--observer", "mse"],
            "error: scheme 'nvfp4' with observer mse: the mse observer searches int scales only",
        ),
        (["--scheme", "W4A16", "--observer", "psychic"], "error: unknown observer 'psychic'"),
    ],
)
def test_cli_refuses_mse_where_it_does_not_apply(tmp_path, args, message):
    done = _qtool("quantize", str(SAMPLES / "tiny-llama"), "-o", str(tmp_path / "out"), *args)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0].startswith(message), done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
