"""Seed checkpoints for every container qtool reads: small, deterministic, built here or copied
from the repository's fixtures (which the real toolchains wrote). No network.

A seed is a folder of files; `target` is what qtool is given (a file in it, or the folder) and
`mutable` the files a mutator may change. The containers:

- safetensors  one file, plain and every quantized convention (compressed-tensors int4 packed
               with quantization_config in config.json, GPTQ, AWQ, bitsandbytes, quanto, fp8
               scales, mlx, torchao, gpt-oss mxfp4)
- sharded      a folder with model.safetensors.index.json and two shards
- gguf         written by gguf-py's GGUFWriter, float and quantized block types
- burnpack     burn's .bpk (the fixtures, built from burn-pack's layout)
- pt           torch.save's zip format (written here by torch, and the fixtures)
- pt_legacy    torch.save(_use_new_zipfile_serialization=False)
- side_json    config.json, quantize_config.json, quanto maps and index files beside valid weights
- imatrix      llama.cpp importance matrices, GGUF and legacy .dat, as llama-imatrix wrote them
               (tests/fixtures/imatrix)
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CONTAINERS", "Seed", "build_seeds"]

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
SAMPLES = REPO / "sample_models"
CONTAINERS = ("safetensors", "sharded", "gguf", "burnpack", "pt", "pt_legacy", "side_json", "imatrix")
SIDE_NAMES = ("config.json", "quantize_config.json", "quanto_qmap.json", "quantization_map.json")


@dataclass(frozen=True)
class Seed:
    container: str
    name: str
    root: Path  # a folder holding the seed's files
    target: str  # relative to root: the path given to qtool ("." for the folder)
    mutable: tuple[str, ...]  # relative paths a mutator may change


# -- safetensors written byte by byte ------------------------------------------------------------


def safetensors_bytes(tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict | None = None) -> bytes:
    header: dict = {}
    blobs = []
    offset = 0
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def _floats(count: int, start: float = -1.0, step: float = 0.125) -> bytes:
    return struct.pack(f"<{count}f", *(start + step * i for i in range(count)))


def _plain_tensors(prefix: str = "model.") -> dict[str, tuple[str, list[int], bytes]]:
    import numpy as np

    f16 = (np.arange(32, dtype=np.float16) / 8).tobytes()
    bf16 = (np.arange(16, dtype=np.float32) / 4).view(np.uint32).__rshift__(16).astype(np.uint16).tobytes()
    return {
        f"{prefix}embed_tokens.weight": ("F32", [4, 8], _floats(32)),
        f"{prefix}layers.0.self_attn.q_proj.weight": ("F16", [4, 8], f16),
        f"{prefix}layers.0.mlp.up_proj.weight": ("BF16", [2, 8], bf16),
        f"{prefix}layers.0.input_layernorm.weight": ("F32", [8], _floats(8, 1.0, 0.0)),
        f"{prefix}lm_head.weight": ("F8_E4M3", [4, 8], bytes(range(0, 64, 2))),
        f"{prefix}counts": ("I64", [2], struct.pack("<2q", 3, -4)),
        f"{prefix}mask": ("BOOL", [4], b"\x01\x00\x01\x01"),
    }


def _write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)


def _copy_fixture(source: Path, dest: Path) -> list[str]:
    """Copy a fixture folder's weights and side files (never its reference/ outputs)."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for item in sorted(source.iterdir()):
        if (
            item.is_file()
            and (item.suffix in (".safetensors", ".json", ".pt", ".pth", ".bin", ".bpk", ".gguf"))
            and item.name != "manifest.json"
        ):
            shutil.copyfile(item, dest / item.name)
            copied.append(item.name)
    return copied


# safetensors conventions from the fixtures, each (seed name, fixture folder)
_SAFETENSORS_FIXTURES = (
    ("ct-w4a16-packed", FIXTURES / "compressed_tensors" / "W4A16"),
    ("ct-w4a16-asym", FIXTURES / "compressed_tensors" / "W4A16_ASYM"),
    ("ct-fp8-block", FIXTURES / "compressed_tensors" / "FP8_BLOCK"),
    ("ct-nvfp4", FIXTURES / "compressed_tensors" / "NVFP4"),
    ("ct-mxfp4", FIXTURES / "compressed_tensors" / "MXFP4A16"),
    ("gptq-4bit", FIXTURES / "gptq" / "gptq_4bit_sym_g128"),
    ("gptq-3bit-asym", FIXTURES / "gptq" / "gptq_3bit_asym_g128"),
    ("awq-gemm", FIXTURES / "awq" / "awq_gemm_g128"),
    ("bnb-nf4", FIXTURES / "bnb" / "nf4_nested"),
    ("bnb-int8", FIXTURES / "bnb" / "int8"),
    ("quanto-f32", FIXTURES / "quanto" / "f32"),
    ("quanto-bf16", FIXTURES / "quanto" / "bf16"),
    ("mlx-affine", FIXTURES / "mlx" / "affine"),
    ("mlx-fp", FIXTURES / "mlx" / "fp"),
    ("torchao", FIXTURES / "torchao"),
    ("gptoss-mxfp4", FIXTURES / "gptoss"),
    ("traps", SAMPLES / "traps"),
)


def _safetensors_seeds(out: Path) -> list[Seed]:
    seeds = []
    plain = out / "safetensors" / "plain"
    _write(plain / "model.safetensors", safetensors_bytes(_plain_tensors(), {"format": "pt"}))
    seeds.append(Seed("safetensors", "plain", plain, "model.safetensors", ("model.safetensors",)))
    fp8 = out / "safetensors" / "fp8-scale-inv"  # DeepSeek-style block fp8: weight + weight_scale_inv
    _write(
        fp8 / "model.safetensors",
        safetensors_bytes(
            {
                "model.layers.0.mlp.down_proj.weight": ("F8_E4M3", [4, 8], bytes((i * 7) % 0x7E for i in range(32))),
                "model.layers.0.mlp.down_proj.weight_scale_inv": ("F32", [1, 1], _floats(1, 0.5)),
                "model.norm.weight": ("BF16", [8], bytes(16)),
            }
        ),
    )
    _write(
        fp8 / "config.json",
        json.dumps(
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "fmt": "e4m3",
                    "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128],
                }
            }
        ),
    )
    seeds.append(Seed("safetensors", "fp8-scale-inv", fp8, "model.safetensors", ("model.safetensors",)))
    for name, source in _SAFETENSORS_FIXTURES:
        if not (source / "model.safetensors").is_file():
            continue
        folder = out / "safetensors" / name
        _copy_fixture(source, folder)
        for extra in ("model.pt",):  # the torchao folder also holds a .pt: keep one container per seed
            (folder / extra).unlink(missing_ok=True)
        seeds.append(Seed("safetensors", name, folder, "model.safetensors", ("model.safetensors",)))
    return seeds


def _sharded_seeds(out: Path) -> list[Seed]:
    folder = out / "sharded" / "two-shards"
    tensors = _plain_tensors()
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    weight_map = {}
    total = 0
    for shard, members in shards.items():
        _write(folder / shard, safetensors_bytes({n: tensors[n] for n in members}, {"format": "pt"}))
        for n in members:
            weight_map[n] = shard
            total += len(tensors[n][2])
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write(folder / "model.safetensors.index.json", json.dumps(index, indent=2))
    _write(folder / "config.json", json.dumps({"architectures": ["LlamaForCausalLM"], "torch_dtype": "float16"}))
    every = tuple(sorted(p.name for p in folder.iterdir()))
    return [
        Seed("sharded", "two-shards", folder, ".", every),
        Seed("sharded", "two-shards-index", folder, "model.safetensors.index.json", every),
    ]


# where each K type keeps its f16 super-block scales (d, dmin): set to small finite values
_K_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _gguf_blocks(rng, type_name: str, shape: tuple[int, int]):
    """Quantized by gguf-py where it quantizes the type, else random blocks with finite scales."""
    import gguf
    import numpy as np

    T = gguf.GGMLQuantizationType
    try:
        return gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), T[type_name])
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[T[type_name]]
        count = shape[0] * shape[1] // block
        data = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
        for at in _K_F16_FIELDS.get(type_name, ()):
            data[:, at : at + 2] = rng.uniform(-2, 2, size=(count, 1)).astype(np.float16).view(np.uint8)
        return data.reshape(shape[0], shape[1] // block * size)


def _gguf_seeds(out: Path) -> list[Seed]:
    import gguf
    import numpy as np

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    folder = out / "gguf" / "mixed"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("general.name", "fuzz-seed")
    writer.add_bool("general.flag", True)
    writer.add_int64("general.count", -5)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "a", "b"])
    writer.add_array("tokenizer.ggml.scores", [0.0, 0.5, -1.0, 2.0])
    writer.add_tensor("token_embd.weight", rng.standard_normal((4, 32)).astype(np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float16))
    for type_name, shape in (
        ("Q8_0", (2, 32)),
        ("Q4_0", (2, 32)),
        ("Q4_1", (2, 32)),
        ("Q5_0", (1, 32)),
        ("Q4_K", (1, 256)),
        ("Q6_K", (1, 256)),
        ("Q2_K", (1, 256)),
    ):
        data = _gguf_blocks(rng, type_name, shape)
        writer.add_tensor(f"blk.0.{type_name.lower()}.weight", data, raw_dtype=T[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    seeds = [Seed("gguf", "mixed", folder, "model.gguf", ("model.gguf",))]
    small = out / "gguf" / "f32-only"
    small.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(small / "model.gguf"), "llama")
    writer.add_tensor("output.weight", np.arange(16, dtype=np.float32).reshape(2, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    seeds.append(Seed("gguf", "f32-only", small, "model.gguf", ("model.gguf",)))
    return seeds


def _burnpack_seeds(out: Path) -> list[Seed]:
    seeds = []
    for name in ("model.bpk", "legacy.bpk"):
        source = FIXTURES / "burn" / name
        if source.is_file():
            folder = out / "burnpack" / name.removesuffix(".bpk")
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, folder / name)
            seeds.append(Seed("burnpack", name.removesuffix(".bpk"), folder, name, (name,)))
    return seeds


def _state_dict():
    import torch

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 8
    return {
        "layer.weight": base,
        "layer.weight_t": base.t(),  # a transposed view of the same storage
        "layer.bias": base[1, 2:5],  # a slice with a storage offset
        "norm.weight": torch.ones(6, dtype=torch.bfloat16),
        "emb.weight": torch.arange(8, dtype=torch.float16).reshape(2, 4),
        "steps": torch.tensor([3], dtype=torch.int64),
    }


def _pt_seeds(out: Path) -> list[Seed]:
    import torch

    seeds = []
    folder = out / "pt" / "state-dict"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(_state_dict(), folder / "model.pt")
    seeds.append(Seed("pt", "state-dict", folder, "model.pt", ("model.pt",)))
    nested = out / "pt" / "trainer"
    nested.mkdir(parents=True, exist_ok=True)
    torch.save({"model": _state_dict(), "epoch": 3, "names": ["a", "b"]}, nested / "pytorch_model.bin")
    seeds.append(Seed("pt", "trainer", nested, "pytorch_model.bin", ("pytorch_model.bin",)))
    for name, source, file in (
        ("native-quantized", FIXTURES / "torch", "native.pt"),
        ("dynamic-packed", FIXTURES / "torch", "dynamic.pth"),
        ("hf-bin", FIXTURES / "torch" / "hf", "pytorch_model.bin"),
        ("torchao", FIXTURES / "torchao", "model.pt"),
    ):
        if (source / file).is_file():
            folder = out / "pt" / name
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / file, folder / file)
            if (source / "config.json").is_file():
                shutil.copyfile(source / "config.json", folder / "config.json")
            seeds.append(Seed("pt", name, folder, file, (file,)))
    sharded = FIXTURES / "torch" / "sharded"
    if sharded.is_dir():
        folder = out / "pt" / "sharded-bin"
        names = _copy_fixture(sharded, folder)
        seeds.append(Seed("pt", "sharded-bin", folder, ".", tuple(names)))
    return seeds


def _pt_legacy_seeds(out: Path) -> list[Seed]:
    import torch

    folder = out / "pt_legacy" / "state-dict"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(_state_dict(), folder / "model.pt", _use_new_zipfile_serialization=False)
    trainer = out / "pt_legacy" / "trainer"
    trainer.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"state_dict": _state_dict(), "epoch": 1}, trainer / "pytorch_model.bin", _use_new_zipfile_serialization=False
    )
    return [
        Seed("pt_legacy", "state-dict", folder, "model.pt", ("model.pt",)),
        Seed("pt_legacy", "trainer", trainer, "pytorch_model.bin", ("pytorch_model.bin",)),
    ]


def _side_json_seeds(out: Path, built: list[Seed]) -> list[Seed]:
    """The same folders as the safetensors and sharded seeds that carry side files, with only
    their JSON files mutable (the weights stay valid, so the JSON readers are what is tested)."""
    seeds = []
    for seed in built:
        if seed.container not in ("safetensors", "sharded") or seed.name == "two-shards-index":
            continue
        side = tuple(sorted(p.name for p in seed.root.iterdir() if p.suffix == ".json"))
        if not side:
            continue
        folder = out / "side_json" / seed.name
        shutil.copytree(seed.root, folder)
        seeds.append(Seed("side_json", seed.name, folder, ".", side))
    return seeds


def _imatrix_seeds(out: Path) -> list[Seed]:
    seeds = []
    for name in ("tiny-imatrix.gguf", "tiny-imatrix.dat"):
        folder = out / "imatrix" / name.rpartition(".")[2]
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(FIXTURES / "imatrix" / name, folder / name)
        seeds.append(Seed("imatrix", name, folder, name, (name,)))
    return seeds


def build_seeds(out: Path, containers: tuple[str, ...] = CONTAINERS) -> list[Seed]:
    """Write every seed under `out` (created fresh) and return them, in a fixed order."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    seeds: list[Seed] = []
    seeds += _safetensors_seeds(out)
    seeds += _sharded_seeds(out)
    seeds += _gguf_seeds(out)
    seeds += _burnpack_seeds(out)
    seeds += _pt_seeds(out)
    seeds += _pt_legacy_seeds(out)
    seeds += _side_json_seeds(out, seeds)
    seeds += _imatrix_seeds(out)
    return [s for s in seeds if s.container in containers]
