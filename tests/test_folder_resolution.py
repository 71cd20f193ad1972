"""A model folder is resolved as transformers' `from_pretrained` resolves it: model.safetensors,
then model.safetensors.index.json, then pytorch_model.bin, then its index. Other weights files
beside them (a Mistral consolidated.safetensors, a PEFT adapter, a reference copy) are never
merged in; when there are some, inspect's JSON notes which file was read and every command
warns on stderr."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.errors import CheckpointError
from tests.conftest import SAMPLES, write_safetensors

runner = CliRunner()


def _model(folder, name="model.safetensors", tensors=None):
    folder.mkdir(exist_ok=True)
    return write_safetensors(folder / name, tensors or {"w": ("F32", (4, 4)), "b": ("F32", (4,))})


def _inspect(folder):
    result = runner.invoke(app, ["inspect", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


@pytest.mark.parametrize(
    "other",
    ["consolidated.safetensors", "adapter_model.safetensors", "model.fp32-copy.safetensors", "pytorch_model.bin"],
)
def test_model_safetensors_wins_and_the_others_are_named(tmp_path, other):
    folder = tmp_path / "m"
    _model(folder)
    _model(folder, other, {"w": ("F32", (4, 4)), "lora_A": ("F32", (2, 4))})  # same names: merging refused before
    document, stderr = _inspect(folder)
    assert document["files"] == [str(folder / "model.safetensors")]
    assert {w["name"] for w in document["weights"]} == {"w", "b"}
    [note] = document["notes"]
    assert note.startswith("read model.safetensors as the model (transformers' order") and note.endswith(
        f"not read: {other}"
    )
    assert stderr.splitlines() == [f"warning: {note}"]


def test_a_folder_with_only_the_model_has_no_note(tmp_path):
    folder = tmp_path / "m"
    _model(folder)
    document, stderr = _inspect(folder)
    assert "notes" not in document and stderr == ""


def test_model_safetensors_comes_before_the_index(tmp_path):
    folder = tmp_path / "m"
    _model(folder)
    _model(folder, "model-00001-of-00001.safetensors", {"x": ("F32", (2,))})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00001.safetensors"}})
    )
    document, _ = _inspect(folder)
    assert document["files"] == [str(folder / "model.safetensors")]
    assert "model-00001-of-00001.safetensors, model.safetensors.index.json" in document["notes"][0]


def test_the_index_beside_a_consolidated_file(tmp_path):
    folder = tmp_path / "m"
    _model(folder, "model-00001-of-00002.safetensors", {"a": ("F32", (2,))})
    _model(folder, "model-00002-of-00002.safetensors", {"b": ("F32", (2,))})
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _model(folder, "consolidated.safetensors", {"a": ("F32", (2,)), "b": ("F32", (2,))})
    document, _ = _inspect(folder)
    assert len(document["files"]) == 2 and {w["name"] for w in document["weights"]} == {"a", "b"}
    assert document["notes"][0].endswith("not read: consolidated.safetensors")


def test_consolidated_is_the_model_when_nothing_else_is(tmp_path):
    folder = tmp_path / "m"
    _model(folder, "consolidated.safetensors")
    _model(folder, "adapter_model.safetensors", {"lora_A": ("F32", (2, 4))})
    document, _ = _inspect(folder)
    assert document["files"] == [str(folder / "consolidated.safetensors")]
    assert document["notes"][0].endswith("not read: adapter_model.safetensors")


def test_numbered_shards_without_an_index_are_one_model(tmp_path):
    folder = tmp_path / "m"
    _model(folder, "model-00001-of-00002.safetensors", {"a": ("F32", (2,))})
    _model(folder, "model-00002-of-00002.safetensors", {"b": ("F32", (2,))})
    document, stderr = _inspect(folder)
    assert len(document["files"]) == 2 and "notes" not in document and stderr == ""


def test_unrelated_files_are_not_merged(tmp_path):
    folder = tmp_path / "m"
    _model(folder, "a.safetensors")
    _model(folder, "b.safetensors", {"x": ("F32", (2,))})
    with pytest.raises(CheckpointError, match="holds 2 .safetensors files"):
        qtool.open_checkpoint(folder)
    result = runner.invoke(app, ["inspect", str(folder)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines()[0] == (
        f"error: {folder}: holds 2 .safetensors files (a.safetensors, b.safetensors) and no model.safetensors or index saying which make up the model"
    )


@pytest.fixture
def llama_and_copy(tmp_path):
    folder = tmp_path / "tiny"
    shutil.copytree(SAMPLES / "tiny-llama", folder)
    shutil.copy(folder / "model.safetensors", folder / "consolidated.safetensors")
    return folder


def test_quantize_dequantize_check_and_compare_read_the_model_only(tmp_path, llama_and_copy):
    result = runner.invoke(app, ["quantize", str(llama_and_copy), "-o", str(tmp_path / "q"), "--scheme", "int8", "-q"])
    assert result.exit_code == 0, result.output
    assert "not read: consolidated.safetensors" in result.stderr
    assert sorted(p.name for p in (tmp_path / "q").glob("*.safetensors")) == ["model.safetensors"]
    result = runner.invoke(app, ["dequantize", str(tmp_path / "q"), "-o", str(tmp_path / "d.safetensors"), "-q"])
    assert result.exit_code == 0, result.output
    for command in (
        ["check", str(llama_and_copy)],
        ["compare", str(llama_and_copy), str(tmp_path / "d.safetensors"), "-q"],
    ):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
        assert "warning: read model.safetensors as the model" in result.stderr, command
