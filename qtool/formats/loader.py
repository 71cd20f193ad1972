"""Find a checkpoint from what the user named: a file, a sharded index, or a directory.

Containers: safetensors, GGUF, PyTorch pickles (.pt/.pth/.bin) and burnpack (.bpk).
"""

from __future__ import annotations

import os
import re
from typing import Any

from qtool.errors import CheckpointError
from qtool.formats.checkpoint import SIDE_FILES, Checkpoint
from qtool.formats.regular_files import NotReadable, read_regular
from qtool.formats.safetensors import read_safetensors_file
from qtool.formats.shards import check_index, index_shards, merge_files
from qtool.formats.untrusted_json import MAX_JSON_BYTES, parse_json
from qtool.gcpause import paused_gc

__all__ = ["open_checkpoint", "input_paths"]

# Side files read from the checkpoint's directory when present. Conventions read their
# settings from these (quantization_config, GPTQ's quantize_config, quanto's map).
_INDEX_SUFFIX = ".safetensors.index.json"
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin")  # PyTorch pickles (qtool.formats.torch_pickle)
_PICKLE_INDEX_SUFFIXES = tuple(f"{s}.index.json" for s in _PICKLE_SUFFIXES)  # pytorch_model.bin.index.json
# In a folder of several pickles (a trainer checkpoint: optimizer.pt, rng_state.pth, ...) these
# hold the model.
_PICKLE_MODEL_NAMES = ("pytorch_model.bin", "model.pt", "model.pth", "model.bin")
_REMOTE_SCHEMES = ("hf://", "http://", "https://")
_TYPES_HINT = "pass a .safetensors, .gguf, .pt/.pth/.bin or .bpk file, a *.index.json, or a model folder"


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read the headers of a checkpoint. No tensor data is read. `hf://`, `http://` and
    `https://` locations are read by range requests (qtool.formats.remote_loader)."""
    with paused_gc():  # headers become many small objects and no cycles (qtool.gcpause)
        return _open(os.fspath(path))


def _open(path: str) -> Checkpoint:
    if path.startswith(_REMOTE_SCHEMES):
        from qtool.formats.remote_loader import open_remote

        return open_remote(path)
    if not os.path.exists(path):
        raise CheckpointError("no such file or directory", path=path, hint=_TYPES_HINT)
    if os.path.isdir(path):
        return _open_directory(path)
    if path.endswith(_INDEX_SUFFIX) or path.endswith(".index.json"):
        return _open_index(path, display=path)
    if path.endswith(".safetensors"):
        return _open_files(path, [path], base_dir=os.path.dirname(path) or ".")
    if path.endswith(".gguf"):
        return _open_gguf(path, path)
    if path.endswith(_PICKLE_SUFFIXES):
        return _open_torch(path, [path], base_dir=os.path.dirname(path) or ".")
    if path.endswith(".bpk"):
        return _open_burnpack(path, path)
    raise CheckpointError(
        f"unsupported file type {os.path.splitext(path)[1] or '(no extension)'!r}",
        path=path,
        hint="qtool reads .safetensors, .gguf, .pt/.pth/.bin (PyTorch) and .bpk (burn) files, *.index.json shards, and model folders",
    )


# A folder is resolved as transformers' `from_pretrained` resolves it (modeling_utils,
# `_get_resolved_checkpoint_files`): model.safetensors, then its index, then pytorch_model.bin,
# then its index. Anything else beside the chosen weights (a consolidated.safetensors of the
# Mistral format, a PEFT adapter, a reference copy) is not part of the model, and is named in a
# note. A folder with none of those names falls back to the one index or weights file it holds.
_TRANSFORMERS_ORDER = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_ADAPTERS = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT: loaded on top of a model, never merged into it
_MISTRAL = "consolidated.safetensors"  # mistral-inference's own layout: the model only when nothing else is
_SHARD = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.safetensors")


def _open_directory(path: str) -> Checkpoint:
    names = sorted(os.listdir(path))
    weights = [n for n in names if _is_weights_name(n) and os.path.isfile(os.path.join(path, n))]
    chosen = next((n for n in _TRANSFORMERS_ORDER if n in weights), None)
    if chosen is not None:
        checkpoint = _open_chosen(path, chosen)
    else:
        checkpoint = _open_fallback(path, names, weights)
        chosen = None
    used = {os.path.basename(f) for f in checkpoint.files}
    if chosen is not None and chosen.endswith(".index.json"):
        used.add(chosen)
    others = [n for n in weights if n not in used]
    if others:
        what = ", ".join(sorted(used)) if len(used) <= 3 else f"{len(used)} files ({chosen or 'numbered shards'})"
        why = " (transformers' order: model.safetensors, its index, pytorch_model.bin, its index)" if chosen else ""
        checkpoint.notes.append(f"read {what} as the model{why}; also in the folder, not read: {', '.join(others)}")
    return checkpoint


_TRAINER_STATE = ("optimizer", "scheduler", "rng_state", "training_args", "scaler", "trainer_state")


def _is_weights_name(name: str) -> bool:
    """A file that may hold a model's weights (a trainer's optimizer or RNG state does not)."""
    if name.endswith(_PICKLE_SUFFIXES):
        return not name.startswith(_TRAINER_STATE)
    return name.endswith((".safetensors", ".gguf", ".bpk", ".index.json"))


def _open_chosen(path: str, name: str) -> Checkpoint:
    full = os.path.join(path, name)
    if name.endswith(".index.json"):
        return _open_index(full, display=path)
    if name.endswith(".safetensors"):
        return _open_files(path, [full], base_dir=path)
    return _open_torch(path, [full], base_dir=path)


def _open_fallback(path: str, names: list[str], weights: list[str]) -> Checkpoint:
    """A folder without transformers' file names: the one safetensors index, else the one
    model file (adapters and a Mistral consolidated file only when they are all there is), else
    one set of numbered shards; GGUF, burnpack and pickles after that."""
    indexes = [n for n in names if n.endswith(_INDEX_SUFFIX)]
    if len(indexes) > 1:
        raise CheckpointError(
            f"holds {len(indexes)} safetensors indexes ({', '.join(indexes)})",
            path=path,
            hint="pass the index you mean",
        )
    if indexes:
        return _open_index(os.path.join(path, indexes[0]), display=path)
    files = [n for n in weights if n.endswith(".safetensors")]
    main = [n for n in files if n not in _ADAPTERS and n != _MISTRAL] or [n for n in files if n == _MISTRAL] or files
    if len(main) == 1:
        return _open_files(path, [os.path.join(path, main[0])], base_dir=path)
    if main:
        shards = [_SHARD.fullmatch(n) for n in main]
        if all(shards) and len({(m[1], m[3]) for m in shards}) == 1 and int(shards[0][3]) == len(main):
            return _open_files(path, [os.path.join(path, n) for n in main], base_dir=path)
        raise CheckpointError(
            f"holds {len(main)} .safetensors files ({', '.join(main)}) and no model.safetensors or index saying which make up the model",
            path=path,
            hint="pass the file you mean, or add a model.safetensors.index.json",
        )
    ggufs = [os.path.join(path, n) for n in names if n.endswith(".gguf") and os.path.isfile(os.path.join(path, n))]
    if len(ggufs) == 1:
        return _open_gguf(path, ggufs[0])
    if ggufs:
        raise CheckpointError(
            f"holds {len(ggufs)} GGUF files ({', '.join(os.path.basename(g) for g in ggufs)})",
            path=path,
            hint="pass the .gguf file you mean",
        )
    found = _open_other_directory(path, names)
    if found is not None:
        return found
    raise CheckpointError(
        "directory holds no checkpoint (no *.safetensors, *.gguf, *.bpk, PyTorch pickle or *.index.json)",
        path=path,
        hint="pass a folder with model weights, or the weights file itself",
    )


def _open_other_directory(path: str, names: list[str]) -> Checkpoint | None:
    """A folder with no safetensors or GGUF: a burnpack file, or PyTorch pickles (sharded with
    an index, one known model file, or a single pickle)."""

    def files_ending(suffixes: tuple[str, ...]) -> list[str]:
        return [n for n in names if n.endswith(suffixes) and os.path.isfile(os.path.join(path, n))]

    bpks = files_ending((".bpk",))
    if len(bpks) == 1:
        return _open_burnpack(path, os.path.join(path, bpks[0]))
    if len(bpks) > 1:
        raise CheckpointError(
            f"holds {len(bpks)} burnpack files ({', '.join(bpks)})", path=path, hint="pass the .bpk file you mean"
        )
    indexes = files_ending(_PICKLE_INDEX_SUFFIXES)
    if indexes:
        return _open_index(os.path.join(path, indexes[0]), display=path)
    pickles = [n for n in files_ending(_PICKLE_SUFFIXES) if _looks_like_pickle(os.path.join(path, n))]
    chosen = [n for n in _PICKLE_MODEL_NAMES if n in pickles][:1] or (pickles if len(pickles) == 1 else [])
    if chosen:
        return _open_torch(path, [os.path.join(path, chosen[0])], base_dir=path)
    if pickles:
        raise CheckpointError(
            f"holds {len(pickles)} PyTorch pickles ({', '.join(pickles)}) and no index naming the model's",
            path=path,
            hint="pass the pickle that holds the model weights",
        )
    return None


def _looks_like_pickle(path: str) -> bool:
    """A zip archive (torch.save since 1.6) or a bare pickle (PROTO opcode first): a folder's
    other .bin files (tokenizer blobs, placeholders) are not taken for checkpoints."""
    try:
        head = read_regular(path, 4)[:4]  # a FIFO is never waited on
    except (NotReadable, OSError):
        return False
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def _open_index(index_path: str, display: str) -> Checkpoint:
    weight_map, shards = index_shards(_read_json(index_path), index_path)
    base_dir = os.path.dirname(index_path) or "."
    files = []
    for shard in shards:
        shard_path = os.path.join(base_dir, shard)
        if not os.path.isfile(shard_path):
            raise CheckpointError(
                f"index names shard {shard!r}, which does not exist",
                path=index_path,
                hint="the download may be incomplete; fetch the missing shard",
            )
        files.append(shard_path)
    if files and all(f.endswith(_PICKLE_SUFFIXES) for f in files):
        checkpoint = _open_torch(display, files, base_dir=base_dir)
    else:
        checkpoint = _open_files(display, files, base_dir=base_dir)
    check_index(checkpoint, weight_map, dict(zip(shards, files)), index_path)
    return checkpoint


def _open_files(display: str, files: list[str], base_dir: str) -> Checkpoint:
    tensors, metadata = merge_files([(file, *read_safetensors_file(file)) for file in files])
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
    return Checkpoint(
        path=display, format="gguf", files=[file], tensors={t.name: t for t in tensors}, metadata=metadata
    )


def _open_torch(display: str, files: list[str], base_dir: str) -> Checkpoint:
    """PyTorch pickles, read by qtool's own restricted unpickler: no torch, no code run."""
    from qtool.formats.torch_pickle import read_torch_files

    return read_torch_files(display, files, _read_side_files(base_dir))


def _open_burnpack(display: str, file: str) -> Checkpoint:
    """A burnpack file describes itself, as a GGUF file does: no side files are read."""
    from qtool.formats.burnpack import read_burnpack_file

    tensors, metadata = read_burnpack_file(file)
    return Checkpoint(
        path=display, format="burnpack", files=[file], tensors={t.name: t for t in tensors}, metadata=metadata
    )


def input_paths(checkpoint: Checkpoint) -> list[str]:
    """Every path a run reads, resolved: what the user named (a folder, a file, an index), each
    weights file, and the side files beside them. No path qtool writes may be, or lie inside,
    one of these."""
    paths = {os.path.realpath(checkpoint.path)}
    for file in checkpoint.files:
        paths.add(os.path.realpath(file))
        for name in SIDE_FILES:
            side = os.path.join(os.path.dirname(file), name)
            if os.path.lexists(side):
                paths.add(os.path.realpath(side))
    return sorted(paths)


def _read_side_files(base_dir: str) -> dict[str, Any]:
    found = {}
    for name in SIDE_FILES:
        side_path = os.path.join(base_dir, name)
        if os.path.isfile(side_path):
            found[name] = _read_json(side_path)
    return found


def _read_json(path: str) -> Any:
    """A side file's or an index's JSON, read with qtool.formats.untrusted_json's limits."""
    try:  # one checked descriptor: a FIFO swapped in cannot hang the run, nor /dev/zero grow it
        raw = read_regular(path, MAX_JSON_BYTES)  # one byte over: parse_json says it is too large
    except NotReadable as exc:
        raise CheckpointError(f"cannot read: {exc}", path=path) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror}", path=path) from None
    return parse_json(raw, path)
