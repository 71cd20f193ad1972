"""Sharded LLaMA-shaped checkpoints for the `--workers` / `--executor ray` tests and benchmark.

`reshard` cuts sample_models/tiny-llama into N safetensors shards (the real tensors, byte for
byte, with an index, config and tokenizer), so every layout qtool writes (GGUF needs the
tokenizer) runs on a many-shard input. `llama_shaped` writes a bigger random one, for jobs that
take long enough to be killed in the middle.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "sample_models" / "tiny-llama"


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as handle:
        size = struct.unpack("<Q", handle.read(8))[0]
        return json.loads(handle.read(size)), 8 + size


def write_shards(
    folder: Path,
    groups,
    count: int,
    config: dict | None = None,
    side_from: Path | None = TINY,
) -> Path:
    """`groups` yields shard i's tensors {name: (dtype, shape, bytes)}, `count` of them, each
    written before the next is made; an index beside them."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for index, tensors in enumerate(groups):
        name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        header, offset, blobs = {}, 0, []
        for tensor, (dtype, shape, data) in tensors.items():
            header[tensor] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + len(data)],
            }
            blobs.append(data)
            offset += len(data)
            weight_map[tensor] = name
        total += offset
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / name, "wb") as handle:
            handle.write(struct.pack("<Q", len(raw)) + raw)
            handle.writelines(blobs)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    if side_from is not None:
        for side in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(side_from / side, folder / side)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def reshard(folder: Path, shards: int = 4) -> Path:
    """sample_models/tiny-llama as `shards` shards, tensors in file order, about equal bytes."""
    source = TINY / "model.safetensors"
    header, start = _read_header(source)
    header.pop("__metadata__", None)
    data = source.read_bytes()
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    total = sum(e["data_offsets"][1] - e["data_offsets"][0] for _, e in entries)
    groups: list[dict] = [{} for _ in range(shards)]
    done = 0
    for name, entry in entries:
        begin, end = entry["data_offsets"]
        group = min(shards - 1, done * shards // total)
        groups[group][name] = (
            entry["dtype"],
            entry["shape"],
            data[start + begin : start + end],
        )
        done += end - begin
    return write_shards(folder, groups, shards)


def llama_shaped(
    folder: Path,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    vocab: int,
    shards: int,
    seed: int = 0,
) -> Path:
    """A LLaMA-shaped bf16 checkpoint of random weights in `shards` shards (layers spread
    evenly), with tiny-llama's tokenizer and a config of these sizes. Written shard by shard:
    memory holds one tensor at a time."""
    rng = np.random.default_rng(seed)
    heads = max(1, hidden // 64)

    def bf16(shape) -> bytes:
        values = (rng.standard_normal(shape, dtype=np.float32) * 0.02).view(np.uint32)
        return ((values + 0x7FFF + ((values >> 16) & 1)) >> 16).astype(np.uint16).tobytes()

    config = json.loads((TINY / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
    )
    per_shard = -(-layers // shards)
    folder.mkdir(parents=True, exist_ok=True)

    def groups():
        for shard in range(shards):
            yield shard_tensors(shard)

    def shard_tensors(shard: int) -> dict:
        tensors: dict = {}
        if shard == 0:
            tensors["model.embed_tokens.weight"] = (
                "BF16",
                [vocab, hidden],
                bf16((vocab, hidden)),
            )
        for layer in range(shard * per_shard, min(layers, (shard + 1) * per_shard)):
            prefix = f"model.layers.{layer}"
            for proj, shape in (
                ("self_attn.q_proj", (hidden, hidden)),
                ("self_attn.k_proj", (hidden, hidden)),
                ("self_attn.v_proj", (hidden, hidden)),
                ("self_attn.o_proj", (hidden, hidden)),
                ("mlp.gate_proj", (intermediate, hidden)),
                ("mlp.up_proj", (intermediate, hidden)),
                ("mlp.down_proj", (hidden, intermediate)),
            ):
                tensors[f"{prefix}.{proj}.weight"] = ("BF16", list(shape), bf16(shape))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"{prefix}.{norm}.weight"] = (
                    "BF16",
                    [hidden],
                    np.full(hidden, 0x3F80, np.uint16).tobytes(),
                )
        if shard == shards - 1:
            tensors["model.norm.weight"] = (
                "BF16",
                [hidden],
                np.full(hidden, 0x3F80, np.uint16).tobytes(),
            )
            tensors["lm_head.weight"] = ("BF16", [vocab, hidden], bf16((vocab, hidden)))
        return tensors

    write_shards(folder, groups(), shards, config=config)
    return folder
