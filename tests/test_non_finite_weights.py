"""One rule for every encoder (issue 18 #6, #7, #10): a finite weight never comes back inf or
NaN (a value whose scale overflows the scale type, 3e38 at Q8_0's f16 block scale, is refused
in one line, exit 2); a weight holding inf or NaN is encoded as its toolchain does and
reported, by name, in one warning line and in `--json`; numpy's RuntimeWarnings stay inside."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qtool import native
from qtool.error_measures import ErrorStats
from tests.conftest import REPO

NAME = "blk.0.attn_q.weight"


def gguf_holding(path, value) -> None:
    x = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    x[3, 5] = value
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor(NAME, x)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()


def quantize(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("QTOOL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "qtool", "quantize", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


def needs(gtype: str) -> None:
    if gtype in ("Q4_K", "Q6_K") and gtype not in native.gguf_encode_types():
        pytest.skip("native K-quant encoders not built")


SUMS = st.one_of(st.floats(min_value=0, allow_infinity=True), st.sampled_from([math.nan, math.inf]))


@given(SUMS, SUMS, st.floats(allow_nan=True, allow_infinity=True))
def test_error_figures_of_any_sums_are_numbers_never_exceptions(signal, noise, xe):
    """sqnr_db raised "math domain error" on an infinite noise (exit 70)."""
    stats = ErrorStats.from_sums(signal, xe, noise, 0.0, 1)
    for value in (stats.sqnr_db, stats.rel_rmse, stats.cosine):
        assert isinstance(value, float)
    document = stats.to_json()
    assert document["sqnr_db"] is None or math.isfinite(document["sqnr_db"])


def test_sqnr_of_an_infinite_noise_is_minus_infinity_and_of_nan_is_nan():
    assert ErrorStats(signal=1.0, noise=math.inf).sqnr_db == -math.inf
    assert math.isnan(ErrorStats(signal=1.0, noise=math.nan).sqnr_db)
    assert math.isnan(ErrorStats(signal=math.inf, noise=math.inf).sqnr_db)
    assert ErrorStats(signal=100.0, noise=1.0).sqnr_db == pytest.approx(20.0)


@pytest.mark.parametrize("scheme, gtype", [("Q8_0", "Q8_0"), ("Q4_0", "Q4_0"), ("q4_k", "Q4_K"), ("Q4_K_M", "Q4_K")])
def test_a_finite_weight_whose_scale_overflows_is_refused_in_one_line(tmp_path, scheme, gtype):
    """3e38 is a finite float32; Q8_0's f16 block scale is 3e38 / 127, past 65504: the output
    held inf/NaN (exit 0 at Q4_K_M, exit 70 from sqnr_db elsewhere)."""
    needs(gtype)
    source, out = tmp_path / "big.gguf", tmp_path / "out.gguf"
    gguf_holding(source, 3e38)
    done = quantize(source, "-o", out, "--scheme", scheme, "-q")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert (
        lines[0]
        == f"error: {NAME}: its values are finite but too large for {gtype}: a scale overflows its type, and the output would hold inf or NaN"
    )
    assert all(line.startswith("hint: ") for line in lines[1:]) and "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.parametrize("value, word", [(np.nan, "NaN"), (np.inf, "inf")])
@pytest.mark.parametrize("scheme, gtype", [("Q8_0", "Q8_0"), ("Q4_0", "Q4_0"), ("q6_k", "Q6_K"), ("Q4_K_M", "Q4_K")])
def test_a_weight_holding_inf_or_nan_is_reported_by_name_once(tmp_path, value, word, scheme, gtype):
    """Such weights exited 0 silently (q6_k even turns a NaN row finite), or with four lines of
    numpy RuntimeWarning from gguf-py (#10). Now: qtool's own warning line, and --json says so."""
    needs(gtype)
    source, out = tmp_path / "odd.gguf", tmp_path / "out.gguf"
    gguf_holding(source, value)
    done = quantize(source, "-o", out, "--scheme", scheme, "--json")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"warning: {NAME} holds {word} values: encoded as its toolchain does, no error figure (see `qtool check --no-nan`)"
    ]
    document = json.loads(done.stdout)
    assert document["summary"]["non_finite_weights"] == [NAME]
    assert [w["non_finite_input"] for w in document["weights"]] == [word]


def test_a_finite_weight_reports_no_non_finite_input(tmp_path):
    source, out = tmp_path / "fine.gguf", tmp_path / "out.gguf"
    gguf_holding(source, 1.5)
    done = quantize(source, "-o", out, "--scheme", "Q8_0", "--json")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    document = json.loads(done.stdout)
    assert document["summary"]["non_finite_weights"] == [] and document["weights"][0]["non_finite_input"] is None


def safetensors_holding(folder, value) -> None:
    import shutil

    import torch
    from safetensors.torch import save_file

    from tests.conftest import SAMPLES

    folder.mkdir()
    weight = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    weight[3, 5] = value
    save_file(
        {"model.layers.0.self_attn.q_proj.weight": weight, "model.norm.weight": torch.ones(256)},
        str(folder / "model.safetensors"),
    )
    shutil.copy(SAMPLES / "tiny-llama" / "config.json", folder / "config.json")


def test_the_rule_holds_for_the_safetensors_encoders_too(tmp_path):
    """MXFP4's E8M0 block scale of a 3e38 weight overflows (it was an exit 70, a scheme label
    called as a function); a NaN weight at W4A16 (the fused int encoder) is reported."""
    big, odd = tmp_path / "big", tmp_path / "odd"
    safetensors_holding(big, 3e38)
    safetensors_holding(odd, math.nan)
    done = quantize(big, "-o", tmp_path / "big-out", "--scheme", "MXFP4A16", "-q")
    assert done.returncode == 2 and done.stderr.splitlines()[0] == (
        "error: model.layers.0.self_attn.q_proj.weight: its values are finite but too large for mxfp4 g32: a scale overflows its type, and the output would hold inf or NaN"
    ), done.stderr
    assert not (tmp_path / "big-out").exists()
    done = quantize(odd, "-o", tmp_path / "odd-out", "--scheme", "W4A16", "-q")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "warning: model.layers.0.self_attn.q_proj.weight holds NaN values: encoded as its toolchain does, no error figure (see `qtool check --no-nan`)"
    ]


@pytest.mark.parametrize("scheme", ["Q8_0", "Q4_0"])
def test_the_overflow_check_holds_without_measuring(tmp_path, scheme):
    """issue 42 item 17: `api.run(measure=False)` skipped the check (it read the error sums only
    when measuring) and committed an output holding inf/NaN. The report stays unmeasured."""
    from qtool import api
    from qtool.errors import SchemeError

    source, out = tmp_path / "big.gguf", tmp_path / "out.gguf"
    gguf_holding(source, 3e38)
    with pytest.raises(SchemeError, match="too large for"):
        api.run(api.prepare_quantize(source, out, scheme), measure=False)
    assert not out.exists()
    fine = tmp_path / "fine.gguf"
    gguf_holding(fine, 1.5)
    report = api.run(api.prepare_quantize(fine, tmp_path / "fine-out.gguf", scheme), measure=False)
    assert report.to_json()["summary"]["sqnr_db"] is None  # measured for the check, not reported


# -- issue 42 #11: the same rule when decoding ------------------------------------------------------


def dequantize(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("QTOOL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "qtool", "dequantize", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


def _word(path) -> str | None:
    from safetensors.numpy import load_file

    values = load_file(str(path))["model.layers.0.self_attn.q_proj.weight"]  # NAME, written under its Hugging Face name
    return "NaN" if np.isnan(values).any() else "inf" if np.isinf(values).any() else None


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ3_S"])
def test_a_decoded_block_with_a_non_finite_scale_is_reported_by_name(tmp_path, type_name, value):
    """An IQ block whose f16 scale is NaN or inf decoded to NaN/inf silently (exit 0, no word):
    now the write side's rule, one warning naming the weight, and --json says so."""
    from tests.fuzz.handmade import gguf_iq_scaled

    source, out = tmp_path / "odd.gguf", tmp_path / "back.safetensors"
    gguf_iq_scaled(source, type_name, value)
    done = dequantize(source, "-o", out, "--dtype", "f32", "--json", "-q")
    assert done.returncode == 0, done.stderr
    word = _word(out)
    assert word is not None  # the decoder writes what the block says, as llama.cpp does
    assert done.stderr.splitlines() == [
        f"warning: {NAME} decodes to {word} values: written as they decode (see `qtool check --no-nan`)"
    ]
    document = json.loads(done.stdout)
    assert document["summary"]["non_finite_weights"] == [NAME]
    assert [w["non_finite_decoded"] for w in document["weights"]] == [word]


@pytest.mark.parametrize("extra", [(), ("--workers", "2")], ids=["one-process", "workers"])
def test_bf16_output_and_spread_runs_report_it_too(tmp_path, extra):
    from tests.fuzz.handmade import gguf_iq_scaled

    source, out = tmp_path / "odd.gguf", tmp_path / "back.safetensors"
    gguf_iq_scaled(source, "IQ4_NL", math.nan)
    done = dequantize(source, "-o", out, "--json", "-q", *extra)
    assert done.returncode == 0, done.stderr
    capped = (
        ["warning: --workers 2: starting 1 worker process, one per shard job"] if extra else []
    )  # one weight, one shard job
    assert done.stderr.splitlines() == [
        *capped,
        f"warning: {NAME} decodes to NaN values: written as they decode (see `qtool check --no-nan`)",
    ]
    assert json.loads(done.stdout)["summary"]["non_finite_weights"] == [NAME]


def test_finite_decoded_weights_report_nothing(tmp_path):
    from tests.fuzz.handmade import gguf_iq_scaled

    source, out = tmp_path / "fine.gguf", tmp_path / "back.safetensors"
    gguf_iq_scaled(source, "IQ4_NL", 0.02)
    done = dequantize(source, "-o", out, "--json", "-q")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    document = json.loads(done.stdout)
    assert document["summary"]["non_finite_weights"] == [] and document["weights"][0]["non_finite_decoded"] is None


@given(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=64),
    st.sampled_from(["F32", "F16", "BF16"]),
)
def test_counting_non_finite_bits_agrees_with_torch(values, dtype):
    """The numpy count of a decoded weight's NaN and inf (a native decode imports no torch) is
    torch's count of the same bytes."""
    import torch

    from qtool.buffers import tensor_bytes
    from qtool.dtypes import storage_dtype
    from qtool.error_measures import count_non_finite, count_non_finite_bytes

    tensor = torch.tensor(values, dtype=torch.float32).to(storage_dtype(dtype).torch_dtype())
    assert count_non_finite_bytes(tensor_bytes(tensor), dtype) == count_non_finite(tensor)
