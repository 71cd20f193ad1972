"""A .pt state dict naming one memoized tensor many times (issue 18 #5): 7 bytes of pickle a
name, a stored-tensor record each in memory. 1.2M names (8.4 MB) took 174 s and 2 GB to
inspect. Now the pickle machine allows MAX_ALIASES memo references beyond 16 per call (a tensor
needs about 5), and the describer MAX_ALIASES names of already-listed tensors; a tied weight's
few names are copied from the first, not rebuilt."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qtool.errors import CheckpointError
from qtool.formats.torch_pickle import MAX_ALIASES, read_torch_files
from tests.conftest import REPO


def inspect(path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("QTOOL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "qtool", "inspect", str(path), "-q"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_one_tensor_under_a_million_names_is_refused_in_one_line(tmp_path, legacy):
    path = tmp_path / "aliased.pt"
    one = torch.zeros(4)
    torch.save({index: one for index in range(1_200_000)}, path, _use_new_zipfile_serialization=not legacy)
    done = inspect(path)
    assert done.returncode == 2, done.stderr[-2000:]
    first = done.stderr.splitlines()[0]
    assert first.startswith(
        f"error: {path}: is over qtool's limits: the pickle refers back to earlier objects more often than qtool reads"
    )
    assert "Traceback" not in done.stderr


def test_aliases_beside_many_tensors_stop_at_the_describer_limit(tmp_path):
    """Ten tensors' calls lift the machine's allowance past the aliases: the describer's own cap refuses."""
    path = tmp_path / "mixed.pt"
    one = torch.zeros(2)
    state = {f"t{index}": torch.zeros(1) for index in range(10)}
    state.update({index: one for index in range(MAX_ALIASES + 2)})  # the first is no alias
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=f"names already-listed tensors more than {MAX_ALIASES} times"):
        read_torch_files(str(path), [str(path)], {})


def test_tied_weights_keep_every_name_with_the_first_ones_bytes(tmp_path):
    path = tmp_path / "tied.pt"
    embed = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = embed.t()  # a strided view: read by gathering
    torch.save(
        {
            "embed.weight": embed,
            "lm_head.weight": embed,
            "t": view,
            "t2": view,
            **{f"alias{i}": embed for i in range(1000)},
        },
        path,
    )
    checkpoint = read_torch_files(str(path), [str(path)], {})
    assert len(checkpoint.tensors) == 1004
    first = checkpoint.tensors["embed.weight"]
    for name in ("lm_head.weight", "alias0", "alias999"):
        tensor = checkpoint.tensors[name]
        assert (tensor.name, tensor.begin, tensor.end, tensor.shape, tensor.dtype) == (
            name,
            first.begin,
            first.end,
            first.shape,
            first.dtype,
        )
    assert torch.equal(checkpoint.load(checkpoint.tensors["t2"]), view)
    assert torch.equal(checkpoint.load(checkpoint.tensors["alias7"]), embed)
