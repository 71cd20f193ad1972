"""One definition of the error measures: `qtool quantize` (native and torch kernels) and
`qtool compare` of the same two checkpoints report the same digits, so a threshold copied from
one passes in the other; and `ErrorStats.update` is the float64 computation it claims to be."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import qtool
from qtool import native
from qtool.error_measures import ErrorStats

from .conftest import SAMPLES

TINY = SAMPLES / "tiny-llama"
MEASURES = ("sqnr_db", "rel_rmse", "max_abs_err", "cosine")
SCHEMES = ["W4A16", "int8", "W4A16_ASYM", "FP8", "NVFP4A16"]
NATIVE_SCHEMES = {"W4A16", "int8", "W4A16_ASYM"}  # what qtool.native encodes (qtool/encoders/native_int.py)


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    """tiny-llama in float32: the native kernel sums its terms in another order than torch
    (in bf16 most float64 sums happen to be exact), so this is where the paths could part."""
    folder = tmp_path_factory.mktemp("tiny-f32")
    save_file(
        {k: v.float() for k, v in load_file(str(TINY / "model.safetensors")).items()},
        str(folder / "model.safetensors"),
        {"format": "pt"},
    )
    config = json.loads((TINY / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    return folder


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("model", ["bf16", "f32"])
def test_quantize_and_compare_report_the_same_digits(tmp_path, monkeypatch, tiny_f32, model, scheme, path):
    if path == "native" and scheme in NATIVE_SCHEMES and not native.available():
        pytest.skip("qtool.native._kernels is not built")
    monkeypatch.setenv("QTOOL_NATIVE", "1" if path == "native" else "0")
    source = TINY if model == "bf16" else tiny_f32
    out = tmp_path / "out"
    result = qtool.quantize(source, out, scheme)
    comparison = qtool.compare(source, out)
    compared = {pair.name: pair.stats for pair in comparison.pairs if not pair.exact}
    assert len(result.errors) == 14 and set(compared) == set(result.errors)
    for name, stats in result.errors.items():
        quantized, measured = stats.to_json(), compared[name].to_json()
        assert all(math.isfinite(quantized[m]) for m in MEASURES), name
        assert {m: quantized[m] for m in MEASURES} == {m: measured[m] for m in MEASURES}, name
        assert stats.count == compared[name].count
    # and the figures summed over these weights (compare's model-wide one also counts the copies)
    total = ErrorStats()
    for name in result.errors:
        total = total.merge(compared[name])
    assert result.model_error().to_json() == total.to_json()
    # quantize's figure over all weights (copies exact) is compare's model-wide one
    assert result.to_json()["summary"]["all_weights"] == comparison.model_error().to_json()


def _exact(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float, float, float]:
    """signal, noise, recon, dot and max |e| from float64 terms, each sum exactly rounded."""
    a = x.double().reshape(-1).tolist()
    b = y.double().reshape(-1).tolist()
    errors = [p - q for p, q in zip(a, b)]
    return (
        math.fsum(p * p for p in a),
        math.fsum(e * e for e in errors),
        math.fsum(q * q for q in b),
        math.fsum(p * q for p, q in zip(a, b)),
        max((abs(e) for e in errors), default=0.0),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_update_is_float64_to_the_last_digits(dtype):
    g = torch.Generator().manual_seed(3)
    # magnitudes over 8 decades (float16 still finite), more elements than one slice, a ragged tail
    x = (torch.randn(70_001, generator=g) * torch.logspace(-4, 4, 70_001)).to(dtype)
    y = (x.double() * (1 + 0.01 * torch.randn(70_001, generator=g, dtype=torch.float64))).to(dtype)
    stats = ErrorStats().update(x, y)
    signal, noise, recon, dot, max_abs = _exact(x, y)
    assert stats.count == 70_001
    assert stats.max_abs == max_abs
    assert stats.signal == pytest.approx(signal, rel=1e-14)
    assert stats.noise == pytest.approx(noise, rel=1e-13)
    assert stats.recon == pytest.approx(recon, rel=1e-13)
    assert stats.dot == pytest.approx(dot, rel=1e-13)


def test_update_in_chunks_reports_the_digits_of_one_update():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 517, generator=g).to(torch.bfloat16)
    y = (x.float() + 0.02 * torch.randn(300, 517, generator=g)).to(torch.bfloat16)
    whole = ErrorStats().update(x, y)
    chunked = ErrorStats()
    for start in range(0, 300, 7):
        chunked.update(x[start : start + 7], y[start : start + 7])
    merged = ErrorStats().update(x[:100], y[:100]).merge(ErrorStats().update(x[100:], y[100:]))
    assert chunked.to_json() == whole.to_json() == merged.to_json()
    assert chunked.count == merged.count == whole.count == 300 * 517


def test_update_does_not_depend_on_torch_threads():
    x = torch.randn(1 << 17, generator=torch.Generator().manual_seed(5))
    y = x.to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ErrorStats().update(x, y)
        torch.set_num_threads(max(2, threads))
        many = ErrorStats().update(x, y)
    finally:
        torch.set_num_threads(threads)
    assert one == many  # every sum on the calling thread, in one order


def test_update_of_nothing_and_of_unequal_sizes():
    empty = ErrorStats().update(torch.empty(0), torch.empty(0))
    assert empty == ErrorStats() and empty.to_json() == {
        "sqnr_db": None,
        "rel_rmse": 0.0,
        "max_abs_err": 0.0,
        "cosine": 1.0,
    }
    with pytest.raises(ValueError, match="ErrorStats.update: 4 original values against 3 reconstructed"):
        ErrorStats().update(torch.zeros(4), torch.zeros(3))


@pytest.mark.parametrize(
    "scheme, out, ignore", [("q8_0", "x.gguf", ["re:.*q_proj.*"]), ("W4A16", "x", []), ("int8", "x", [])]
)
def test_quantize_over_all_weights_is_compares_model_figure(tmp_path, scheme, out, ignore):
    """Copies (also GGUF's q/k rows, permuted, and norms cast to F32) count as compare counts them."""
    result = qtool.quantize(TINY, tmp_path / out, scheme, ignore=ignore)
    assert result.to_json()["summary"]["all_weights"] == qtool.compare(TINY, tmp_path / out).model_error().to_json()
