"""Write the small sample checkpoints that qtool's tests, docs and demos use.

Run from anywhere: ``python sample_models/make_samples.py``. The outputs are written next to this
script and are byte-identical from run to run (fixed seed, fixed tensor order).

- ``tiny-llama/``          a LLaMA-shaped bf16 checkpoint in one ``model.safetensors``
- ``tiny-llama-sharded/``  the same tensors in two shards plus ``model.safetensors.index.json``
- ``traps/``               tensors that look quantized at a glance but are plain (see DESIGN.md)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
SEED = 0
METADATA = {"format": "pt"}

VOCAB = 256
HIDDEN = 256
INTERMEDIATE = 128  # kept small: both copies of the model stay under 3 MB in git
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
KV_DIM = KV_HEADS * HEAD_DIM  # 128: k_proj and v_proj are [128, 256]

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": INTERMEDIATE,
    "max_position_embeddings": 2048,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": KV_HEADS,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.0",
    "use_cache": True,
    "vocab_size": VOCAB,
}


def llama_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes in HF ``LlamaForCausalLM.state_dict()`` order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
            (f"{p}.self_attn.k_proj.weight", (KV_DIM, HIDDEN)),
            (f"{p}.self_attn.v_proj.weight", (KV_DIM, HIDDEN)),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
            (f"{p}.mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
            (f"{p}.input_layernorm.weight", (HIDDEN,)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return shapes


def llama_tensors(gen: torch.Generator) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, shape in llama_shapes():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.01 * torch.randn(shape, generator=gen)  # RMSNorm gains: ones-ish
        else:
            t = 0.02 * torch.randn(shape, generator=gen)
        tensors[name] = t.to(torch.bfloat16).contiguous()
    return tensors


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def clean(directory: Path) -> None:
    """Remove what an earlier run wrote, so a changed shard count leaves no stale file."""
    directory.mkdir(parents=True, exist_ok=True)
    for f in directory.iterdir():
        if f.is_file() and (f.suffix == ".safetensors" or f.name.endswith(".json")):
            f.unlink()


def write_single(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> list[Path]:
    clean(directory)
    save_file(tensors, str(directory / "model.safetensors"), metadata=METADATA)
    write_json(directory / "config.json", config)
    return [directory / "model.safetensors", directory / "config.json"]


def write_sharded(directory: Path, tensors: dict[str, torch.Tensor], config: dict,
                  num_shards: int) -> list[Path]:
    """Split in state-dict order, filling each shard to about total/num_shards bytes, as HF does."""
    clean(directory)
    total = sum(nbytes(t) for t in tensors.values())
    budget = -(-total // num_shards)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if groups[-1] and size + nbytes(t) > budget and len(groups) < num_shards:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes(t)
    if len(groups) != num_shards:
        raise RuntimeError(f"split into {len(groups)} shards, wanted {num_shards}")

    written = []
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{num_shards:05d}.safetensors"
        save_file(group, str(directory / fname), metadata=METADATA)
        weight_map.update({name: fname for name in group})
        written.append(directory / fname)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(directory / "model.safetensors.index.json", index)
    write_json(directory / "config.json", config)
    return written + [directory / "model.safetensors.index.json", directory / "config.json"]


def trap_tensors(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every one of these must be reported as PLAIN: none has a companion scale."""
    return {
        "position_ids": torch.arange(64, dtype=torch.int64).unsqueeze(0),
        "attention_mask": torch.tril(torch.ones(8, 8, dtype=torch.uint8)),
        "lookup.table": torch.randint(-128, 128, (16, 32), generator=gen, dtype=torch.int8),
        "fp8.bare.weight": torch.randn(32, 32, generator=gen).to(torch.float8_e4m3fn),
        "flags": torch.rand(10, generator=gen) > 0.5,
        "head.weight": 0.02 * torch.randn(8, 32, generator=gen),
        "head.bias": torch.zeros(8, dtype=torch.float16),
        "counts": torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32),
    }


# (folder, scheme): the tiny model quantized by qtool itself, for the README's examples
QUANTIZED = (("tiny-llama-w4a16", "W4A16"), ("tiny-llama-w8a16", "W8A16"), ("tiny-llama-fp8", "FP8"))


def quantized_copies(source: Path) -> list[Path]:
    """Quantize the tiny model with qtool (deterministic: same input, same bytes)."""
    import qtool

    written = []
    for folder, scheme in QUANTIZED:
        target = HERE / folder
        qtool.quantize(source, target, scheme, overwrite=True)
        written += sorted(target.iterdir())
    return written


def main() -> None:
    gen = torch.Generator().manual_seed(SEED)
    llama = llama_tensors(gen)
    traps = trap_tensors(gen)

    written = []
    written += write_single(HERE / "tiny-llama", llama, LLAMA_CONFIG)
    written += write_sharded(HERE / "tiny-llama-sharded", llama, LLAMA_CONFIG, num_shards=2)
    written += write_single(HERE / "traps", traps, {"model_type": "traps"})
    written += quantized_copies(HERE / "tiny-llama")

    for path in written:
        print(f"{path.stat().st_size:>10,d}  {path.relative_to(HERE.parent)}")
    print(f"{sum(p.stat().st_size for p in written):>10,d}  total")


if __name__ == "__main__":
    main()
