"""`Inspection`: a filter is a parameter of the API, every summary figure comes from the weights
reported, and an Inspection cannot be changed after it is made."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import qtool
from qtool.inspection import Inspection, inspect_checkpoint
from qtool.value_stats import collect_stats
from tests.conftest import SAMPLES, tensor_bytes, write_safetensors

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "inspect_summaries.json"  # summary() of 2458d0a, unfiltered


def _inspect(path, filter: str | None = None) -> Inspection:
    return inspect_checkpoint(qtool.open_checkpoint(path), filter=filter)


@pytest.fixture
def bert(tmp_path) -> Path:
    """A BERT-shaped bf16 checkpoint: the pooler is 0.4% of the file's bytes."""
    tensors = {
        "embeddings.word_embeddings.weight": ("BF16", (3000, 64)),
        "embeddings.position_embeddings.weight": ("BF16", (512, 64)),
        "embeddings.LayerNorm.weight": ("BF16", (64,)),
        **{
            f"encoder.layer.{i}.attention.self.{p}.weight": ("BF16", (64, 64))
            for i in range(2)
            for p in ("query", "key", "value")
        },
        **{f"encoder.layer.{i}.intermediate.dense.weight": ("BF16", (256, 64)) for i in range(2)},
        "pooler.dense.weight": ("F32", (64, 64)),
        "pooler.dense.bias": ("F32", (64,)),
    }
    return write_safetensors(tmp_path / "bert.safetensors", tensors)


def test_a_filtered_summary_counts_only_the_weights_reported(bert):
    report = _inspect(bert, "pooler*")
    assert [w.name for w in report.weights] == ["pooler.dense.bias", "pooler.dense.weight"]
    summary = report.summary()
    parameters = 64 * 64 + 64
    assert summary["parameters"] == parameters
    assert (
        summary["bytes"]
        == sum(w.nbytes for w in report.weights)
        == tensor_bytes("F32", (64, 64)) + tensor_bytes("F32", (64,))
    )
    assert summary["bits_per_weight"] == round(sum(w.nbytes * 8 for w in report.weights) / parameters, 4) == 32.0
    assert summary["tensors"] == 2 and summary["weights"] == 2 and summary["quantized_weights"] == 0
    assert summary["by_dtype"] == {"F32": {"tensors": 2, "bytes": summary["bytes"]}}
    assert summary["by_scheme"] == {"plain": {"weights": 2, "parameters": parameters}}
    assert report.filter == "pooler*" and report.to_json()["filter"] == "pooler*"
    # the same weights by regex; and no weight at all is an empty report, not a division by zero
    assert [w.name for w in _inspect(bert, r"re:pooler\.").weights] == [w.name for w in report.weights]
    empty = _inspect(bert, "nothing*").summary()
    assert (empty["weights"], empty["tensors"], empty["bytes"], empty["bits_per_weight"], empty["by_dtype"]) == (
        0,
        0,
        0,
        0.0,
        {},
    )


def test_a_filtered_quantized_summary_counts_every_member_of_its_weights():
    report = _inspect(SAMPLES / "tiny-llama-w4a16", "*.q_proj.*")
    assert len(report.weights) == 2 and all(w.quantized for w in report.weights)
    members = [t for w in report.weights for t in w.members.values()]
    summary = report.summary()
    assert summary["tensors"] == len(members) == len(report.tensors) == 6  # weight_packed, weight_scale, weight_shape
    assert summary["bytes"] == sum(t.nbytes for t in members)
    assert summary["bits_per_weight"] == round(summary["bytes"] * 8 / summary["parameters"], 4)
    assert summary["by_dtype"] == {
        dtype: {
            "tensors": sum(1 for t in members if t.dtype.name == dtype),
            "bytes": sum(t.nbytes for t in members if t.dtype.name == dtype),
        }
        for dtype in ("I32", "BF16", "I64")
    }
    assert summary["by_scheme"] == {"int4 sym g128": {"weights": 2, "parameters": 2 * 256 * 256}}
    assert [t.name for t in report.tensors] == [
        name for name in report.checkpoint.tensors if name in {t.name for t in members}
    ]


@pytest.mark.parametrize("model", sorted(json.loads(GOLDEN.read_text())))
def test_an_unfiltered_summary_is_what_it_was(model):
    """Unfiltered, the weights' members are every stored tensor: the figures (and their order)
    are those the whole-file summary of 2458d0a gave."""
    report = _inspect(SAMPLES / model)
    expected = json.loads(GOLDEN.read_text())[model]
    assert json.dumps(report.summary()) == json.dumps(expected)
    assert report.filter is None and "filter" not in report.to_json()


def test_an_inspection_cannot_be_changed():
    report = _inspect(SAMPLES / "tiny-llama")
    assert isinstance(report.weights, tuple)
    for name, value in (("weights", ()), ("stats", {}), ("filter", "x"), ("checkpoint", None)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(report, name, value)
    with pytest.raises(AttributeError):
        report.weights.append(report.weights[0])  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        report.stats["lm_head.weight"] = None  # type: ignore[index]
    given = {"lm_head.weight": {"min": 0.0}}
    with_stats = report.with_stats(given)
    given["lm_head.weight"]["min"] = 5.0  # the caller's dicts are copied, not kept
    assert with_stats is not report and dict(report.stats) == {}
    assert dict(with_stats.stats["lm_head.weight"]) == {"min": 0.0}
    with pytest.raises(TypeError):
        with_stats.stats["lm_head.weight"]["min"] = 1.0  # type: ignore[index]


def test_collect_stats_returns_a_new_inspection_of_the_weights_reported():
    report = _inspect(SAMPLES / "tiny-llama", "re:model\\.layers\\.0\\.mlp\\.")
    read: list[int] = []
    filled = collect_stats(report, read.append)
    assert dict(report.stats) == {}
    assert set(filled.stats) == {w.name for w in report.weights} and len(filled.stats) == 3
    assert sum(read) == sum(w.nbytes for w in report.weights)
    assert filled.weights == report.weights and filled.filter == report.filter
    document = filled.to_json()
    assert all(set(w["stats"]) == {"min", "max", "mean", "std", "absmax", "nan", "inf"} for w in document["weights"])
    json.dumps(document)  # plain dicts, not read-only views
