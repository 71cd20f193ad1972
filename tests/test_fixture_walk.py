"""Across every checkpoint the repo ships: float references are never reported as quantized,
and every stored tensor belongs to exactly one weight."""

from __future__ import annotations

from pathlib import Path

import pytest

import qtool
from qtool.errors import CheckpointError
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures"
# each file on its own: some reference folders hold one file per output dtype
REFERENCES = sorted(f for p in FIXTURES.rglob("reference") if p.is_dir() for f in p.glob("*.safetensors"))
PLAIN_MODELS = [
    REPO / "sample_models" / "tiny-llama",
    REPO / "sample_models" / "tiny-llama-sharded",
    REPO / "sample_models" / "traps",
]


def _checkpoints() -> list[Path]:
    found = []
    for path in sorted(FIXTURES.rglob("*")):
        if "reference" in path.parts:
            continue
        if path.is_dir() and any(
            c.suffix in (".safetensors", ".gguf", ".pt", ".bin", ".bpk") for c in path.iterdir() if c.is_file()
        ):
            found.append(path)
    return found


@pytest.mark.parametrize("path", REFERENCES + PLAIN_MODELS, ids=lambda p: str(p.relative_to(REPO)))
def test_float_checkpoints_are_all_plain(path):
    report = qtool.inspect(path)
    assert report.weights
    quantized = [w.name for w in report.weights if w.quantized]
    assert quantized == []


@pytest.mark.parametrize("path", _checkpoints(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_stored_tensor_belongs_to_one_weight(path):
    try:
        report = qtool.inspect(path)
    except CheckpointError as exc:  # a deliberately malformed fixture: refused cleanly, never a crash
        assert exc.exit_code == 2
        return
    members = [t.name for w in report.weights for t in w.members.values()]
    assert sorted(members) == sorted(report.checkpoint.tensors)
    for weight in report.weights:
        if weight.quantized:
            assert weight.parameters > 0 and weight.bits_per_weight > 0
