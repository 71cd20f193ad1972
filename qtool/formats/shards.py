"""A checkpoint in several files: a sharded index's weight map, checked the same way for a
local folder and a remote repository, and the files' headers merged into one checkpoint."""

from __future__ import annotations

import os
from typing import Any

from qtool.errors import CheckpointError
from qtool.formats.checkpoint import Checkpoint, StoredTensor

__all__ = ["index_shards", "check_index", "merge_files"]


def index_shards(index: Any, index_path: str) -> tuple[dict[str, str], list[str]]:
    """A sharded index's weight map and its shard names in first-mention order, each checked to
    name a file beside the index (also for a remote index)."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            'index has no "weight_map" object of tensor name to shard file',
            path=index_path,
            hint='a sharded index looks like {"metadata": {...}, "weight_map": {tensor: file}}',
        )
    shards: list[str] = []
    for shard in weight_map.values():
        if shard not in shards:
            shards.append(shard)
    for shard in shards:
        if os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            raise CheckpointError(f"index names shard {shard!r} outside its folder", path=index_path)
    return weight_map, shards


def check_index(
    checkpoint: Checkpoint, weight_map: dict[str, str], shard_files: dict[str, str], index_path: str
) -> None:
    """Every tensor the index maps is in the shard it names."""
    for name, shard in weight_map.items():
        tensor = checkpoint.tensors.get(name)
        if tensor is None or tensor.file != shard_files[shard]:
            raise CheckpointError(
                f"index maps tensor {name!r} to {shard!r}, but that shard does not hold it",
                path=index_path,
                hint="the index and the shards disagree; re-export or re-download the checkpoint",
            )


def merge_files(
    per_file: list[tuple[str, list[StoredTensor], dict[str, str]]],
) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """One checkpoint's tensors and metadata from its files' headers; a name in two files is refused."""
    tensors: dict[str, StoredTensor] = {}
    metadata: dict[str, str] = {}
    for file, file_tensors, file_metadata in per_file:
        for tensor in file_tensors:
            if tensor.name in tensors:
                raise CheckpointError(
                    f"tensor {tensor.name!r} is stored in both {tensors[tensor.name].file} and {file}",
                    path=file,
                )
            tensors[tensor.name] = tensor
        for key, value in file_metadata.items():
            metadata.setdefault(key, value)
    return tensors, metadata
