"""The layout registry: every layout × every scheme it can store round-trips through the reading
convention, and the choice of layout follows from the schemes and the output, never from a
string on the scheme."""

from __future__ import annotations

import math

import pytest

import qtool
from qtool.conventions import decoder_for
from qtool.errors import SchemeError
from qtool.layouts import LAYOUTS, choose_layout, layout_named
from qtool.scheme_strings import parse_scheme, scheme_names
from tests.conftest import SAMPLES

TINY = SAMPLES / "tiny-llama"
WRITERS = [name for name in LAYOUTS if name != "safetensors"]
# the K-quants' 256-value blocks do not fit this model's 128-value rows: tests/test_gguf_mix.py writes them
CASES = [
    (layout, name)
    for layout in WRITERS
    for name in scheme_names()
    if LAYOUTS[layout].refusal(parse_scheme(name)) is None and not name.endswith("_k")
]


def test_every_scheme_has_a_layout_and_every_writer_stores_something():
    for name in scheme_names():
        assert choose_layout({parse_scheme(name)}, None).name in WRITERS, name
    assert {layout for layout, _ in CASES} == set(WRITERS)


@pytest.mark.parametrize("layout, name", CASES, ids=[f"{layout}-{name}" for layout, name in CASES])
def test_each_layout_round_trips_each_scheme_through_its_reader(tmp_path, layout, name):
    scheme = parse_scheme(name)
    out = tmp_path / ("model.gguf" if LAYOUTS[layout].container == "gguf" else "out")
    report = qtool.quantize(TINY, out, name, layout=layout)
    back = qtool.inspect(out)
    quantized = [w for w in back.weights if w.quantized]
    assert len(quantized) == len(report.errors) == 14
    for weight in quantized:
        got = weight.require_scheme()
        assert (got.qtype.name, got.symmetric, got.block_for(weight.shape)) == (
            scheme.qtype.name,
            scheme.symmetric,
            scheme.block_for(weight.shape),
        ), weight.name
        decoded = decoder_for(weight).decode(back.checkpoint, weight, "cpu")
        assert tuple(decoded.shape) == tuple(weight.shape) and bool(decoded.isfinite().all())
    worst = min(stats.sqnr_db for stats in report.errors.values())
    assert worst > {2: 3.0, 4: 8.0}.get(scheme.bits, 15.0), worst


def test_the_layout_follows_the_scheme_or_the_output():
    assert choose_layout({parse_scheme("W4A16")}, None).name == "compressed-tensors"
    assert choose_layout({parse_scheme("nf4:g64")}, None).name == "bitsandbytes"
    assert choose_layout({parse_scheme("q4_0")}, None).name == "gguf"
    assert choose_layout({parse_scheme("mxfp4")}, "gguf").name == "gguf"
    with pytest.raises(SchemeError, match="cannot store") as refused:
        choose_layout({parse_scheme("W4A16")}, "gguf")
    assert "compressed-tensors" in refused.value.hint
    with pytest.raises(SchemeError, match="no one layout stores"):
        choose_layout({parse_scheme("q4_0"), parse_scheme("nf4:g64")}, None)
    with pytest.raises(SchemeError, match="unknown layout 'ggfu'") as unknown:
        layout_named("ggfu")
    assert "did you mean 'gguf'" in unknown.value.hint


def test_a_group_that_does_not_divide_the_rows_says_what_is_allowed(tmp_path):
    with pytest.raises(SchemeError) as refused:
        qtool.api.prepare_quantize(TINY, tmp_path / "out", "int4:g100")
    assert "100" in refused.value.message and "divides 128" in refused.value.hint  # down_proj has 128 inputs


def test_dry_run_plans_are_the_bytes_written(tmp_path):
    for name, out in (("W4A16_ASYM", "a"), ("nf4:g64", "b"), ("q5_1", "c.gguf")):
        task = qtool.api.prepare_quantize(TINY, tmp_path / out, name)
        planned = task.to_json()["summary"]["bytes_after"]
        qtool.api.run(task)
        target = tmp_path / out
        files = [target] if target.is_file() else [p for p in target.iterdir() if p.suffix in (".safetensors", ".gguf")]
        written = sum(p.stat().st_size for p in files)
        assert planned <= written <= planned + 64 * 1024 * math.ceil(len(files)), (
            name,
            planned,
            written,
        )  # headers on top


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"])
@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_gguf_native_kernels_write_gguf_pys_bytes(tmp_path, monkeypatch, make_safetensors, scheme, dtype):
    """The GGUF layout's two backends (qtool.native, gguf-py's numpy quantize) write the same file."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    values = {f"m.{i}.weight": (rng.standard_t(3, (64, 256)) * 0.02).astype(np.float32) for i in range(3)}
    values["m.0.weight"][3, :32] = 0.0  # an all-zero block
    values["m.1.weight"][5, 32:64] = 1e-30  # subnormal scales
    source = tmp_path / "model.safetensors"
    if dtype == "BF16":
        bf16 = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in values.items()}
        make_safetensors(
            {k: ("BF16", list(v.shape)) for k, v in bf16.items()}, data={k: v.tobytes() for k, v in bf16.items()}
        )
    else:
        save_file({k: v.astype(np.float16 if dtype == "F16" else np.float32) for k, v in values.items()}, str(source))
    qtool.quantize(source, tmp_path / "native.gguf", scheme, allow_incomplete_gguf=True)
    monkeypatch.setenv("QTOOL_NATIVE", "0")
    qtool.quantize(source, tmp_path / "numpy.gguf", scheme, allow_incomplete_gguf=True)
    assert (tmp_path / "native.gguf").read_bytes() == (tmp_path / "numpy.gguf").read_bytes()
