"""Write the small sample checkpoints that qtool's tests, docs and demos use.

Run from anywhere: ``python sample_models/make_samples.py``. The outputs are written next to this
script and are byte-identical from run to run (fixed seed, fixed tensor order).

- ``tiny-llama/``          a LLaMA-shaped bf16 checkpoint in one ``model.safetensors``, with a
                           tokenizer, so its GGUF runs in llama.cpp
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


def tokenizer_files() -> dict[str, dict]:
    """A real LLaMA tokenizer cut to the model's 256 tokens: the first 256 entries of LLaMA's
    sentencepiece vocabulary (llama.cpp's models/ggml-vocab-llama-spm.gguf, MIT), which are
    <unk>, <s>, </s> and the byte tokens <0x00>..<0xFC>. Without merges every text is spelled
    in bytes (valid UTF-8 never holds 0xFD..0xFF), so llama.cpp and transformers tokenize any
    text. Written as a Hugging Face fast tokenizer (BPE with byte fallback, as LLaMA 2's)."""
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: index for index, token in enumerate(specials)}
    vocab.update({f"<0x{byte:02X}>": len(specials) + byte for byte in range(VOCAB - len(specials))})
    added = [
        {"id": index, "content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        for index, token in enumerate(specials)
    ]

    def special(token: str, type_id: int) -> dict:
        return {"SpecialToken": {"id": token, "type_id": type_id}}

    def sequence(name: str, type_id: int) -> dict:
        return {"Sequence": {"id": name, "type_id": type_id}}

    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {
            "type": "Sequence",
            "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}],
        },
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [special("<s>", 0), sequence("A", 0)],
            "pair": [special("<s>", 0), sequence("A", 0), sequence("B", 1)],  # no <s> between: gguf-py warns of one
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": True, "byte_fallback": True, "ignore_merges": False, "vocab": vocab, "merges": [],
        },
    }  # fmt: skip
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": 2048,
        "tokenizer_class": "LlamaTokenizerFast",
        "chat_template": (
            "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}"
        ),
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


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


def write_single(directory: Path, tensors: dict[str, torch.Tensor], config: dict, side: dict[str, dict] | None = None) -> list[Path]:
    clean(directory)
    save_file(tensors, str(directory / "model.safetensors"), metadata=METADATA)
    write_json(directory / "config.json", config)
    for name, content in (side or {}).items():
        write_json(directory / name, content)
    return [directory / "model.safetensors", directory / "config.json", *(directory / name for name in side or {})]


def write_sharded(directory: Path, tensors: dict[str, torch.Tensor], config: dict,
                  num_shards: int, side: dict[str, dict] | None = None) -> list[Path]:
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
    for name, content in (side or {}).items():
        write_json(directory / name, content)
    return written + [directory / "model.safetensors.index.json", directory / "config.json", *(directory / name for name in side or {})]


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
    written += write_single(HERE / "tiny-llama", llama, LLAMA_CONFIG, tokenizer_files())
    written += write_sharded(HERE / "tiny-llama-sharded", llama, LLAMA_CONFIG, num_shards=2, side=tokenizer_files())
    written += write_single(HERE / "traps", traps, {"model_type": "traps"})
    written += quantized_copies(HERE / "tiny-llama")

    for path in written:
        print(f"{path.stat().st_size:>10,d}  {path.relative_to(HERE.parent)}")
    print(f"{sum(p.stat().st_size for p in written):>10,d}  total")


if __name__ == "__main__":
    main()
