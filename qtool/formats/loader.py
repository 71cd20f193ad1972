"""Find a checkpoint from what the user named: a file, a sharded index, or a directory."""

from __future__ import annotations

import json
import os
from typing import Any

from qtool.errors import CheckpointError
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.formats.safetensors import read_safetensors_file

__all__ = ["open_checkpoint", "SIDE_FILES"]

# Side files read from the checkpoint's directory when present. Conventions read their
# settings from these (quantization_config, GPTQ's quantize_config, quanto's map).
SIDE_FILES = ("config.json", "quantize_config.json", "quanto_qmap.json", "quantization_map.json")
_INDEX_SUFFIX = ".safetensors.index.json"


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read the headers of a checkpoint. No tensor data is read."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(
            "no such file or directory", path=path, hint="pass a .safetensors or .gguf file, a *.safetensors.index.json, or a model folder"
        )
    if os.path.isdir(path):
        return _open_directory(path)
    if path.endswith(_INDEX_SUFFIX) or path.endswith(".index.json"):
        return _open_index(path, display=path)
    if path.endswith(".safetensors"):
        return _open_files(path, [path], base_dir=os.path.dirname(path) or ".")
    if path.endswith(".gguf"):
        return _open_gguf(path, path)
    raise CheckpointError(
        f"unsupported file type {os.path.splitext(path)[1] or '(no extension)'!r}",
        path=path,
        hint="qtool reads .safetensors and .gguf files, *.safetensors.index.json shards, and model folders",
    )


def _open_directory(path: str) -> Checkpoint:
    names = sorted(os.listdir(path))
    indexes = [n for n in names if n.endswith(_INDEX_SUFFIX)]
    if len(indexes) > 1:
        preferred = [n for n in indexes if n == "model.safetensors.index.json"]
        if not preferred:
            raise CheckpointError(
                f"holds {len(indexes)} safetensors indexes ({', '.join(indexes)})",
                path=path,
                hint="pass the index you mean",
            )
        indexes = preferred
    if indexes:
        return _open_index(os.path.join(path, indexes[0]), display=path)
    files = [os.path.join(path, n) for n in names if n.endswith(".safetensors") and os.path.isfile(os.path.join(path, n))]
    ggufs = [os.path.join(path, n) for n in names if n.endswith(".gguf") and os.path.isfile(os.path.join(path, n))]
    if not files and len(ggufs) == 1:
        return _open_gguf(path, ggufs[0])
    if not files and ggufs:
        raise CheckpointError(
            f"holds {len(ggufs)} GGUF files ({', '.join(os.path.basename(g) for g in ggufs)})",
            path=path,
            hint="pass the .gguf file you mean",
        )
    if not files:
        raise CheckpointError(
            "directory holds no checkpoint (no *.safetensors or *.safetensors.index.json)",
            path=path,
            hint="pass a folder with model weights, or the weights file itself",
        )
    # Several files without an index (diffusers-style folders) read as one checkpoint.
    return _open_files(path, files, base_dir=path)


def _open_index(index_path: str, display: str) -> Checkpoint:
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            'index has no "weight_map" object of tensor name to shard file',
            path=index_path,
            hint="a sharded index looks like {\"metadata\": {...}, \"weight_map\": {tensor: file}}",
        )
    base_dir = os.path.dirname(index_path) or "."
    shards: list[str] = []
    for shard in weight_map.values():
        if shard not in shards:
            shards.append(shard)
    files = []
    for shard in shards:
        if os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            raise CheckpointError(f"index names shard {shard!r} outside its folder", path=index_path)
        shard_path = os.path.join(base_dir, shard)
        if not os.path.isfile(shard_path):
            raise CheckpointError(
                f"index names shard {shard!r}, which does not exist",
                path=index_path,
                hint="the download may be incomplete; fetch the missing shard",
            )
        files.append(shard_path)
    checkpoint = _open_files(display, files, base_dir=base_dir)
    shard_paths = dict(zip(shards, files))
    for name, shard in weight_map.items():
        tensor = checkpoint.tensors.get(name)
        if tensor is None or tensor.file != shard_paths[shard]:
            raise CheckpointError(
                f"index maps tensor {name!r} to {shard!r}, but that shard does not hold it",
                path=index_path,
                hint="the index and the shards disagree; re-export or re-download the checkpoint",
            )
    return checkpoint


def _open_files(display: str, files: list[str], base_dir: str) -> Checkpoint:
    tensors: dict[str, StoredTensor] = {}
    metadata: dict[str, str] = {}
    for file in files:
        file_tensors, file_metadata = read_safetensors_file(file)
        for tensor in file_tensors:
            if tensor.name in tensors:
                raise CheckpointError(
                    f"tensor {tensor.name!r} is stored in both {tensors[tensor.name].file} and {file}",
                    path=file,
                )
            tensors[tensor.name] = tensor
        for key, value in file_metadata.items():
            metadata.setdefault(key, value)
    return Checkpoint(
        path=display,
        format="safetensors",
        files=files,
        tensors=tensors,
        metadata=metadata,
        side_files=_read_side_files(base_dir),
    )


def _open_gguf(display: str, file: str) -> Checkpoint:
    """A GGUF file describes itself: no side files are read (a config.json beside it may belong
    to another checkpoint in the same folder)."""
    from qtool.formats.gguf import read_gguf_file

    tensors, metadata = read_gguf_file(file)
    return Checkpoint(path=display, format="gguf", files=[file], tensors={t.name: t for t in tensors}, metadata=metadata)


def _read_side_files(base_dir: str) -> dict[str, Any]:
    found = {}
    for name in SIDE_FILES:
        side_path = os.path.join(base_dir, name)
        if os.path.isfile(side_path):
            found[name] = _read_json(side_path)
    return found


def _read_json(path: str) -> Any:
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror}", path=path) from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"is not UTF-8 (byte {exc.start})", path=path, hint="fix or remove the file") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise CheckpointError(f"is not valid JSON{where}", path=path, hint="fix or remove the file") from None
