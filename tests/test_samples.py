"""sample_models/ is what make_samples.py makes: the quantized copies are qtool's own output."""

from __future__ import annotations

import pytest

import qtool
from tests.conftest import SAMPLES


@pytest.mark.parametrize(
    "folder, scheme, label",
    [
        ("tiny-llama-w4a16", "W4A16", "int4 sym g128"),
        ("tiny-llama-w8a16", "W8A16", "int8 sym g128"),
        ("tiny-llama-fp8", "FP8", "fp8_e4m3 tensor"),
    ],
)
def test_committed_quantized_samples_are_what_qtool_writes_now(tmp_path, folder, scheme, label):
    qtool.quantize(SAMPLES / "tiny-llama", tmp_path / "out", scheme)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        SAMPLES / folder / "model.safetensors"
    ).read_bytes()
    labels = {w.scheme.label for w in qtool.inspect(SAMPLES / folder).weights if w.quantized}
    assert labels == {label}


def test_samples_stay_small():
    total = sum(p.stat().st_size for p in SAMPLES.rglob("*") if p.is_file())
    assert total < 6_000_000
