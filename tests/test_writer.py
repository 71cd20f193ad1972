"""The streaming safetensors writer: layout from a plan, pieces in any order, atomic outputs."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import qtool
from qtool.errors import CheckpointError, UsageError
from qtool.formats.writer import Output, OutTensor, ShardWriter


def test_shard_writer_matches_the_reference_reader(tmp_path):
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.tensor([1, -2, 3], dtype=torch.int8)
    path = tmp_path / "x.safetensors"
    writer = ShardWriter(str(path), [OutTensor("a", "F32", (3, 4)), OutTensor("b", "I8", (3,))], {"k": "v"})
    raw = a.numpy().tobytes()
    writer.write("b", b.numpy().tobytes())
    writer.write("a", raw[24:], at=24)  # pieces, out of order
    writer.write("a", raw[:24])
    writer.finish()
    loaded = load_file(str(path))
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["b"], b)
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == {"k": "v"}
    assert qtool.open_checkpoint(path).tensors["a"].shape == (3, 4)


def test_shard_writer_refuses_overruns_and_short_tensors(tmp_path):
    writer = ShardWriter(str(tmp_path / "x.safetensors"), [OutTensor("a", "U8", (4,))])
    with pytest.raises(RuntimeError, match="overruns"):
        writer.write("a", b"12345")
    writer.write("a", b"12")
    with pytest.raises(RuntimeError, match="got 2 of its 4 bytes"):
        writer.finish()


def test_existing_output_is_refused_without_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(UsageError, match="already exists"):
        Output(str(tmp_path / "out"), single_file=False, overwrite=False)


def test_abort_leaves_nothing_behind(tmp_path):
    out = Output(str(tmp_path / "out"), single_file=False, overwrite=False)
    out.shard("model.safetensors", [OutTensor("a", "U8", (4,))], None).write("a", b"12")
    out.abort()
    assert os.listdir(tmp_path) == []


def test_overwrite_replaces_a_folder_only_when_complete(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "config.json").write_text("{}")  # --overwrite replaces only a previous checkpoint
    out = Output(str(target), single_file=False, overwrite=True)
    out.shard("model.safetensors", [OutTensor("a", "U8", (2,))], None).write("a", b"ab")
    assert (target / "config.json").exists()  # untouched until commit
    out.commit()
    assert sorted(os.listdir(target)) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert oct(os.stat(target).st_mode & 0o777) != oct(0o700)


def test_disk_full_mid_write_is_a_clean_error(tmp_path, monkeypatch):
    out = Output(str(tmp_path / "out.safetensors"), single_file=True, overwrite=False)
    writer = out.shard("model.safetensors", [OutTensor("a", "U8", (4,))], None)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        writer.write("a", b"1234")
    out.abort()
    assert os.listdir(tmp_path) == []
