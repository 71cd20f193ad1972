"""The lazy convention registry: `resolve` skips a convention only when it could claim nothing,
and `qtool inspect` of a plain checkpoint imports none of them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import qtool
from qtool.conventions import _ENTRIES, REGISTRY, resolve
from qtool.errors import CheckpointError
from tests.conftest import REPO
from tests.test_fixture_walk import FIXTURES, PLAIN_MODELS, _checkpoints

SINGLE_FILES = sorted(p for p in FIXTURES.rglob("*.safetensors") if "reference" not in p.parts)


def test_the_lazy_registry_lists_every_convention_in_order():
    assert [c.name for c in REGISTRY] == [e.name for e in _ENTRIES] + ["plain"]


def _open(path):
    try:
        return qtool.open_checkpoint(path)
    except CheckpointError:
        pytest.skip("a deliberately malformed fixture")


@pytest.mark.parametrize("path", _checkpoints() + SINGLE_FILES + PLAIN_MODELS, ids=lambda p: str(p.relative_to(REPO)))
def test_skipping_conventions_changes_no_weight(path):
    """Every fixture, as shipped and stripped of its configs (so the cheap signals decide), reads
    the same as when every convention runs."""
    checkpoint = _open(path)
    variants = [checkpoint]
    if type(checkpoint) is qtool.formats.Checkpoint:
        variants.append(dataclasses.replace(checkpoint, side_files={}, metadata={}))
    for variant in variants:
        try:
            everything = resolve(variant, REGISTRY)
        except CheckpointError as exc:
            with pytest.raises(CheckpointError, match=None) as got:
                resolve(variant)
            assert str(got.value) == str(exc)
            continue
        assert resolve(variant) == everything


def test_inspect_of_a_plain_checkpoint_imports_no_convention():
    code = (
        "import sys, qtool; qtool.inspect(sys.argv[1]).to_json();"
        "print(sorted(m for m in sys.modules if m.startswith('qtool.conventions.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "sample_models" / "tiny-llama")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['qtool.conventions.base', 'qtool.conventions.plain']"
