"""Benchmark `qtool quantize` and `qtool dequantize` against the baselines a user would otherwise run.

Issue 3, "Benchmark". DESIGN.md: quantize and dequantize stream one weight at a time, so peak
memory is a few times the largest weight plus a constant, whatever the model's size.

The script synthesizes a LLaMA-2-7B-shaped bf16 checkpoint, cut to as many decoder layers as fit
the requested size (default ~2 GB: 4 layers, 2.14 GB in 3 shards of at most 1 GB):
hidden 4096, intermediate 11008, vocab 32000, q/k/v/o 4096x4096, gate/up 11008x4096,
down 4096x11008, two RMSNorm vectors per layer plus the final norm, embed_tokens and lm_head
32000x4096. Weights are `randn * 0.02` (norms `1 + randn * 0.02`), seeded per tensor name, and
written tensor by tensor in row chunks by a child process, so nothing holds the model in memory.
The shards come with a `model.safetensors.index.json` and a LLaMA `config.json`.

It then runs, each as a whole child process with this interpreter:

  A  python -m qtool quantize MODEL -o A --scheme int8 -q
  B  the baseline a user would write: per shard, `safetensors.torch.load_file`, per-channel
     symmetric int8 in torch over the weights qtool selects by default (2-D `*_proj.weight`;
     not embed_tokens, lm_head or norms), the rest copied, `save_file`; the compressed-tensors
     int-quantized names (`X.weight` int8, `X.weight_scale`)
  C  python -m qtool quantize MODEL -o C --scheme W4A16 -q
  M  python -m qtool quantize MODEL -o M --scheme W4A16 --observer mse -q  (issue 19: what the
     mse scale search costs against C's min-max, whole process)
  D  compressed-tensors' own W4A16 (pack-quantized) through its public API: `load_file` the
     shards, an nn.Module tree built from the names and shapes (nn.Linear for each weight),
     `apply_quantization_config` with the W4A16 preset (lm_head ignored), scales from
     `compute_dynamic_scales_and_zp` (per-group min/max, what llm-compressor's MinMax observer
     computes), `ModelCompressor.compress_model`, `save_file` of the state dict, `update_config`
  E  python -m qtool dequantize A -o E.safetensors --dtype bf16 -q
  F  the baseline reverse of B: per shard, `load_file` B's output, `w = q.float() * scale` to
     bf16, `save_file`
  G  python -m qtool quantize MODEL -o G.gguf --scheme q4_0 --allow-incomplete-gguf -q  (the GGUF
     layout; no torch; the synthesized model has no tokenizer, hence the flag)
  H  the baseline a gguf-py user would write: per shard, `load_file`, `gguf.quants.quantize` of
     each 2-D `*_proj.weight` to Q4_0 (float32 numpy, the package's reference quantizer), the
     rest as they are (1-D as F32), every tensor added to one `gguf.GGUFWriter`, written at the end

and records each child's wall time (spawn to reap) and peak RSS (its own `ru_maxrss` from
`os.wait4`; that includes the touched pages of any mmap-ed file). Before every timed run the
output is removed, `sync` is called, and the run's input is read once with `cat > /dev/null`,
so every run starts from a warm page cache and no write-back from the run before. Runs go
A B C D E F, repeated --repeats times (E uses the A of the same round, F the B). The baselines
do not fsync their output; qtool writes atomically with fsync, so the comparison favours the
baselines. Each run's first output is checked in a separate, untimed child: tensor counts and
dtypes, and the relative error of layers.0.q_proj decoded (compressed-tensors' own decompressor
for pack-quantized) against the input.

Targets, as ratios of medians in this run: B/A >= 2.5, D/C >= 2.5, F/E >= 3, H/G >= 2.5, M/C <= 2
(the median of the rounds' M/C ratios; <= 1.5 would make mse the default for 4 bits); peak RSS
of A, C, E and G under 1 GB for the ~2 GB model and under 1.2 GB for a model of 3 GB or more (`--scale 2`).
GB here is 10^9 bytes. A qtool run that fails is reported as FAILED with its stderr tail; the
baselines are still run and reported. Exit status is 0 whatever the result, unless --strict.

The parent process uses the standard library only, so its own memory cannot leak into the
children's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import Measurement, in_work_dir, measure, print_environment

REPO = Path(__file__).resolve().parent.parent
GB = 10**9
BF16_BYTES = 2
MAX_SHARD_BYTES = 1 * GB

TARGET_SPEEDUPS = (("B", "A", 2.5), ("D", "C", 2.5), ("F", "E", 3.0), ("H", "G", 2.5))
TARGET_SLOWDOWNS = (("M", "C", 2.0),)  # at most this many times the other's wall, per round
RSS_RUNS = ("A", "C", "E", "G")
RSS_LIMIT_SMALL = 1.0 * GB  # the ~2 GB model
RSS_LIMIT_LARGE = 1.2 * GB  # the doubled model
LARGE_MODEL_BYTES = 3 * GB  # models at least this big get the larger limit

PROBE = "model.layers.0.self_attn.q_proj"


# ------------------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class Llama:
    layers: int
    vocab: int = 32000
    hidden: int = 4096
    intermediate: int = 11008
    heads: int = 32
    kv_heads: int = 32

    @staticmethod
    def layer_bytes(hidden: int = 4096, intermediate: int = 11008) -> int:
        return (4 * hidden * hidden + 3 * intermediate * hidden + 2 * hidden) * BF16_BYTES

    @staticmethod
    def fixed_bytes(vocab: int = 32000, hidden: int = 4096) -> int:
        return (2 * vocab * hidden + hidden) * BF16_BYTES

    @classmethod
    def for_size(cls, size_bytes: float) -> Llama:
        n = round((size_bytes - cls.fixed_bytes()) / cls.layer_bytes())
        return cls(layers=max(1, n))

    def tensors(self) -> list[tuple[str, list[int]]]:
        """Names and shapes in state-dict order."""
        h, i = self.hidden, self.intermediate
        kv = self.kv_heads * (h // self.heads)
        out = [("model.embed_tokens.weight", [self.vocab, h])]
        for n in range(self.layers):
            p = f"model.layers.{n}"
            out += [
                (f"{p}.self_attn.q_proj.weight", [h, h]),
                (f"{p}.self_attn.k_proj.weight", [kv, h]),
                (f"{p}.self_attn.v_proj.weight", [kv, h]),
                (f"{p}.self_attn.o_proj.weight", [h, h]),
                (f"{p}.mlp.gate_proj.weight", [i, h]),
                (f"{p}.mlp.up_proj.weight", [i, h]),
                (f"{p}.mlp.down_proj.weight", [h, i]),
                (f"{p}.input_layernorm.weight", [h]),
                (f"{p}.post_attention_layernorm.weight", [h]),
            ]
        out += [("model.norm.weight", [h]), ("lm_head.weight", [self.vocab, h])]
        return out

    @property
    def n_quantized(self) -> int:
        """How many weights qtool selects by default: the 7 linear projections per layer."""
        return sum(1 for name, shape in self.tensors() if name.endswith("_proj.weight") and len(shape) == 2)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors()) * BF16_BYTES

    def shards(self) -> list[list[tuple[str, list[int]]]]:
        """Split in state-dict order, starting a new shard when the next tensor would overflow."""
        groups: list[list[tuple[str, list[int]]]] = [[]]
        size = 0
        for name, shape in self.tensors():
            nbytes = math.prod(shape) * BF16_BYTES
            if groups[-1] and size + nbytes > MAX_SHARD_BYTES:
                groups.append([])
                size = 0
            groups[-1].append((name, shape))
            size += nbytes
        return groups

    def config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "head_dim": self.hidden // self.heads,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate,
            "max_position_embeddings": 4096,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": self.heads,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.44.0",
            "use_cache": True,
            "vocab_size": self.vocab,
        }


SYNTH_CODE = r"""
import json, math, struct, sys, zlib
import torch
from safetensors import safe_open

plan = json.load(open(sys.argv[1]))
seed, chunk_rows = plan["seed"], plan["chunk_rows"]
for shard in plan["shards"]:
    tensors = sorted(shard["tensors"])  # safetensors lays same-dtype tensors out by name
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        end = offset + math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(shard["path"], "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in tensors:
            g = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
            norm = name.endswith("norm.weight")
            for r0 in range(0, shape[0], chunk_rows):
                rows = min(chunk_rows, shape[0] - r0)
                x = torch.randn(rows, *shape[1:], generator=g).mul_(0.02)
                if norm:
                    x.add_(1.0)
                f.write(x.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
        if f.tell() != 8 + len(blob) + offset:
            sys.exit(f"{shard['path']}: wrote {f.tell()} bytes, expected {8 + len(blob) + offset}")
    with safe_open(shard["path"], framework="pt") as f:  # safetensors accepts the file
        assert sorted(f.keys()) == [n for n, _ in tensors]
        first = tensors[0][0]
        assert list(f.get_slice(first).get_shape()) == tensors[0][1]
        assert f.get_slice(first)[:1].dtype == torch.bfloat16
    print(shard["path"], len(tensors), "tensors", offset, "bytes", flush=True)
"""


def synthesize(model: Llama, directory: Path, seed: int, log_dir: Path) -> float:
    """Write the checkpoint in a child process; returns its wall time."""
    directory.mkdir(parents=True)
    shards = model.shards()
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    plan = {
        "seed": seed,
        "chunk_rows": 2048,  # 2048 x 11008 f32 = 90 MB per chunk
        "shards": [{"path": str(directory / n), "tensors": g} for n, g in zip(names, shards)],
    }
    plan_path = log_dir / "synth-plan.json"
    plan_path.write_text(json.dumps(plan))
    m = measure([sys.executable, "-c", SYNTH_CODE, str(plan_path)], log_stem=log_dir / "synth", cwd=REPO)
    if not m.ok:
        raise SystemExit(f"error: synthesizing the checkpoint failed:\n{indent(m.stderr_tail())}")
    weight_map = {name: fname for fname, group in zip(names, shards) for name, _ in group}
    index = {"metadata": {"total_size": model.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(model.config(), indent=2) + "\n")
    os.sync()
    return m.wall_s


# ------------------------------------------------------------------------------ baseline code

B_CODE = r"""
import json, os, shutil, sys
import torch
from safetensors.torch import load_file, save_file

src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
with open(os.path.join(src, "model.safetensors.index.json")) as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
weight_map = {}
for shard in shards:
    sd = load_file(os.path.join(src, shard))
    out = {}
    for name, w in sd.items():
        if name.endswith("_proj.weight") and w.ndim == 2:  # the linear layers
            scale = w.abs().amax(dim=1, keepdim=True).float() / 127
            q = (w.float() / scale).round().clamp(-128, 127).to(torch.int8)
            out[name] = q
            out[name + "_scale"] = scale.to(w.dtype)  # X.weight_scale, (O, 1)
        else:
            out[name] = w
    del sd
    save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(out, shard))
    del out
with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
config["quantization_config"] = {
    "quant_method": "compressed-tensors", "format": "int-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
        "group_size": None, "dynamic": False}}},
}
with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
"""

D_CODE = r"""
import json, os, shutil, sys
import torch
from safetensors.torch import load_file, save_file
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig, apply_quantization_config, preset_name_to_scheme)
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

src, dst = sys.argv[1], sys.argv[2]
with open(os.path.join(src, "model.safetensors.index.json")) as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
state = {}
for shard in shards:
    state.update(load_file(os.path.join(src, shard)))

# An nn.Module tree with the checkpoint's names: nn.Linear for every 2-D linear weight.
root = torch.nn.Module()
def module_at(path):
    m = root
    for part in filter(None, path.split(".")):
        if part not in m._modules:
            m.add_module(part, torch.nn.Module())
        m = m._modules[part]
    return m
for name, t in state.items():
    path, _, leaf = name.rpartition(".")
    parent, _, child = path.rpartition(".")
    if leaf == "weight" and t.ndim == 2 and (child.endswith("_proj") or child == "lm_head"):
        linear = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, device="meta")
        linear.weight = torch.nn.Parameter(t, requires_grad=False)
        module_at(parent).add_module(child, linear)
    else:
        module_at(path).register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
del state

config = QuantizationConfig(
    config_groups={"group_0": preset_name_to_scheme("W4A16", ["Linear"])}, ignore=["lm_head"])
apply_quantization_config(root, config, show_progress=False)
with torch.no_grad():
    for name, m in root.named_modules():  # calibrate: per-group min/max of the weight
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        scale, zp = compute_dynamic_scales_and_zp(m.weight, scheme.weights, m)
        m.weight_scale.copy_(scale)
        m.weight_zero_point.copy_(zp)

compressor = ModelCompressor.from_pretrained_model(root, quantization_format="pack-quantized")
compressor.compress_model(root)
os.makedirs(dst)
save_file(root.state_dict(), os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
compressor.update_config(dst)
"""

F_CODE = r"""
import json, os, sys
import torch
from safetensors.torch import load_file, save_file

src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
with open(os.path.join(src, "model.safetensors.index.json")) as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
weight_map = {}
for shard in shards:
    sd = load_file(os.path.join(src, shard))
    out = {}
    for name, t in sd.items():
        if name.endswith(".weight_scale"):
            continue
        scale = sd.get(name + "_scale")
        out[name] = t if scale is None else (t.float() * scale.float()).to(torch.bfloat16)
    del sd
    save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(out, shard))
    del out
with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
config.pop("quantization_config", None)
with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
"""

H_CODE = r"""
import json, os, sys
import gguf, torch
from safetensors.torch import load_file

src, dst = sys.argv[1], sys.argv[2]
with open(os.path.join(src, "model.safetensors.index.json")) as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
writer = gguf.GGUFWriter(dst, "llama")
Q4_0 = gguf.GGMLQuantizationType.Q4_0
for shard in shards:
    for name, t in load_file(os.path.join(src, shard)).items():
        module = name.rpartition(".")[0]
        if t.ndim == 2 and module.endswith("_proj"):
            writer.add_tensor(name, gguf.quants.quantize(t.float().numpy(), Q4_0), raw_dtype=Q4_0)
        elif t.ndim == 1:
            writer.add_tensor(name, t.float().numpy())
        else:  # bf16 bytes as they are
            writer.add_tensor(name, t.view(torch.int16).numpy(), raw_shape=list(t.shape), raw_dtype=gguf.GGMLQuantizationType.BF16)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
"""

# Untimed: does a qtool command run without importing torch? Prints True or False.
TORCH_FREE_CODE = r"""
import runpy, sys
sys.argv = ["qtool", *sys.argv[1:]]
try:
    runpy.run_module("qtool", run_name="__main__")
except SystemExit as exc:
    if exc.code:
        raise
print("torch" not in sys.modules)
"""

# Untimed check of one output: counts, dtypes, and layers.0.q_proj decoded against the input.
CHECK_CODE = r"""
import collections, glob, json, os, sys
import torch
from safetensors import safe_open

inp, outp, label, expect, n_quant, probe = sys.argv[1:7]
n_quant = int(n_quant)

def files(p):
    return [p] if os.path.isfile(p) else sorted(glob.glob(os.path.join(p, "*.safetensors")))

def index(p):
    where, dtypes = {}, {}
    for fn in files(p):
        with safe_open(fn, framework="pt") as f:
            for k in f.keys():
                where[k] = fn
                dtypes[k] = f.get_slice(k).get_dtype()
    return where, dtypes

def get(where, k):
    with safe_open(where[k], framework="pt") as f:
        return f.get_tensor(k)

src, src_dt = index(inp)
out, out_dt = index(outp) if not outp.endswith(".gguf") else ({}, {})
problems = []
nbytes = sum(os.path.getsize(fn) for fn in files(outp))
hist = collections.Counter(out_dt.values())
packed = [k for k in out if k.endswith(".weight_packed")]
int8 = [k for k in out if k.endswith(".weight") and out_dt[k] == "I8"]

if outp.endswith(".gguf"):
    import gguf, numpy as np
    reader = gguf.GGUFReader(outp)
    tensors = {t.name: t for t in reader.tensors}
    names = {"blk.0.attn_q.weight": probe + ".weight"}
    tensor = tensors.get("blk.0.attn_q.weight") or tensors[probe + ".weight"]
    w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type)))
    if tensor.name == "blk.0.attn_q.weight":  # qtool writes llama.cpp's rotary row order: undo it
        heads = int(reader.fields["llama.attention.head_count"].contents())
        w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
    how = f"{tensor.tensor_type.name}, decoded by gguf-py"
    q4 = sum(1 for t in reader.tensors if t.tensor_type.name == "Q4_0")
    if q4 != n_quant:
        problems.append(f"{q4} Q4_0 tensors, expected {n_quant}")
    out, out_dt, nbytes, hist = {}, {}, os.path.getsize(outp), collections.Counter(t.tensor_type.name for t in reader.tensors)
elif probe + ".weight_packed" in out:
    cfg_dir = outp if os.path.isdir(outp) else os.path.dirname(outp)
    with open(os.path.join(cfg_dir, "config.json")) as f:
        qcfg = json.load(f)["quantization_config"]
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    qc = QuantizationConfig.model_validate(qcfg)
    scheme = next(iter(qc.config_groups.values()))
    fmt = scheme.format or qc.format
    local = {k[len(probe) + 1:]: get(out, k) for k in out if k.startswith(probe + ".")}
    w = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"]
    how = f"{fmt}, decoded by compressed-tensors"
    if len(packed) != n_quant:
        problems.append(f"{len(packed)} weight_packed tensors, expected {n_quant}")
    if any(out_dt[k] != "I32" for k in packed):
        problems.append("a weight_packed tensor is not int32")
elif out_dt.get(probe + ".weight") == "I8" and probe + ".weight_scale" in out:
    q, s = get(out, probe + ".weight").float(), get(out, probe + ".weight_scale").float()
    w = q * s.repeat_interleave(q.shape[1] // s.shape[1], dim=1) if s.shape[1] > 1 else q * s
    how = "int8 x weight_scale"
    if len(int8) != n_quant:
        problems.append(f"{len(int8)} int8 weights, expected {n_quant}")
else:
    w = get(out, probe + ".weight")
    how = f"plain {out_dt[probe + '.weight']}"
    if set(out) != set(src):
        problems.append(f"tensor names differ from the input ({len(out)} vs {len(src)})")
    if any(out_dt[k] != "BF16" for k in out):
        problems.append("not all tensors are bf16")

orig = get(src, probe + ".weight").float()
rel = ((w.float() - orig).norm() / orig.norm()).item()
bound = {"int8": 0.02, "int4": 0.15, "float": 0.02}[expect]
if not rel <= bound:
    problems.append(f"relative error {rel:.4f} > {bound}")
for k in ("model.embed_tokens.weight", "lm_head.weight") if not outp.endswith(".gguf") else ():
    if k in src and (k not in out or out_dt[k] != src_dt[k]):
        problems.append(f"{k} not carried through unchanged")
shape = tuple(w.shape)
print(f"{label}: {nbytes / 1e9:.2f} GB in {len(files(outp))} file(s), {sum(hist.values())} tensors "
      f"({', '.join(f'{n} {d}' for d, n in sorted(hist.items()))}); {probe} {how}, "
      f"{shape}, rel. error {rel:.4f} vs input: " + ("ok" if not problems else "; ".join(problems)))
sys.exit(1 if problems else 0)
"""


# ------------------------------------------------------------------------------------ the runs


@dataclass(frozen=True)
class Run:
    key: str
    what: str
    qtool: bool
    source: str  # "model" or the key of the run whose output this one reads
    expect: str  # for the check: "int8", "int4" or "float"
    output: str  # file name under out/


RUNS = {
    r.key: r
    for r in (
        Run("A", "qtool quantize --scheme int8", True, "model", "int8", "A"),
        Run("B", "baseline: load_file + torch int8 + save_file", False, "model", "int8", "B"),
        Run("C", "qtool quantize --scheme W4A16", True, "model", "int4", "C"),
        Run("M", "qtool quantize --scheme W4A16 --observer mse", True, "model", "int4", "M"),
        Run("D", "compressed-tensors W4A16 (pack-quantized)", False, "model", "int4", "D"),
        Run("E", "qtool dequantize A --dtype bf16", True, "A", "float", "E.safetensors"),
        Run("F", "baseline: reverse of B to bf16", False, "B", "float", "F"),
        Run("G", "qtool quantize --scheme q4_0 (GGUF)", True, "model", "int4", "G.gguf"),
        Run("H", "baseline: gguf-py quantize + GGUFWriter, Q4_0", False, "model", "int4", "H.gguf"),
    )
}


def command(run: Run, src: Path, dst: Path) -> list[str]:
    py = sys.executable
    return {
        "A": [py, "-m", "qtool", "quantize", str(src), "-o", str(dst), "--scheme", "int8", "-q"],
        "B": [py, "-c", B_CODE, str(src), str(dst)],
        "C": [py, "-m", "qtool", "quantize", str(src), "-o", str(dst), "--scheme", "W4A16", "-q"],
        "M": [py, "-m", "qtool", "quantize", str(src), "-o", str(dst), "--scheme", "W4A16", "--observer", "mse", "-q"],
        "D": [py, "-c", D_CODE, str(src), str(dst)],
        "E": [py, "-m", "qtool", "dequantize", str(src), "-o", str(dst), "--dtype", "bf16", "-q"],
        "F": [py, "-c", F_CODE, str(src), str(dst)],
        "G": [
            py,
            "-m",
            "qtool",
            "quantize",
            str(src),
            "-o",
            str(dst),
            "--scheme",
            "q4_0",
            "--allow-incomplete-gguf",
            "-q",
        ],
        "H": [py, "-c", H_CODE, str(src), str(dst)],
    }[run.key]


@dataclass
class Record:
    runs: list[Measurement] = field(default_factory=list)
    failure: str | None = None
    check: str | None = None  # the check's line
    check_ok: bool | None = None
    torch_free: bool | None = None  # G: the run never imported torch

    @property
    def walls(self) -> list[float]:
        return [m.wall_s for m in self.runs]

    @property
    def median(self) -> float:
        return statistics.median(self.walls)

    @property
    def median_cpu(self) -> float:
        return statistics.median(m.cpu_s for m in self.runs)

    @property
    def peak_rss(self) -> int:
        return max(m.peak_rss_bytes for m in self.runs)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def warm(path: Path) -> float:
    """`cat` the input to /dev/null so the run reads from a warm page cache. Returns seconds."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def indent(text: str) -> str:
    return "\n".join("    | " + line for line in text.splitlines())


# --------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time `qtool quantize` (int8, W4A16) and `qtool dequantize` against a naive "
        "torch baseline and compressed-tensors on a synthesized LLaMA-shaped bf16 checkpoint: "
        "whole-process wall time and peak RSS, median of --repeats runs.",
        epilog="Runs: " + "; ".join(f"{r.key} = {r.what}" for r in RUNS.values()),
    )
    p.add_argument("--runs", default=",".join(RUNS), help="comma list of runs (default A,B,C,M,D,E,F,G,H)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (default 3); the median is reported")
    p.add_argument(
        "--size-gb",
        type=float,
        default=2.0,
        help="model size before --scale, in GB (10^9 bytes); default 2 (4 layers, 2.14 GB)",
    )
    p.add_argument("--scale", type=int, default=1, help="multiply the layer count; 2 gives the doubled model (~4 GB)")
    p.add_argument("--layers", type=int, help="decoder layers before --scale (overrides --size-gb)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthesized weights (default 0)")
    p.add_argument("--workdir", type=Path, help="where to put the model and outputs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed (default 1800)")
    p.add_argument("--no-check", action="store_true", help="skip the untimed check of each run's output")
    p.add_argument("--strict", action="store_true", help="exit 1 if a target fails or a run fails")
    args = p.parse_args(argv)
    args.runs = [r.strip().upper() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in args.runs if r not in RUNS]
    if bad or not args.runs:
        p.error(f"unknown run(s) {bad}; choose from {','.join(RUNS)}")
    args.runs = [k for k in RUNS if k in args.runs]  # dependency order
    if args.repeats < 1 or args.scale < 1 or (args.layers is not None and args.layers < 1):
        p.error("--repeats, --scale and --layers must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print_environment(("torch", "safetensors", "compressed-tensors", "qtool"))
    return in_work_dir(args.workdir, "bench-quantize-", args.keep, lambda root: run(args, root))


def run(args: argparse.Namespace, root: Path) -> int:
    base = Llama(layers=args.layers) if args.layers else Llama.for_size(args.size_gb * GB)
    model = Llama(layers=base.layers * args.scale)
    rss_limit = RSS_LIMIT_LARGE if model.nbytes >= LARGE_MODEL_BYTES else RSS_LIMIT_SMALL
    logs, outs, model_dir = root / "logs", root / "out", root / "model"
    logs.mkdir()
    outs.mkdir()

    need = model.nbytes * 7  # the model, and A-H's outputs with room to spare
    free = shutil.disk_usage(root).free
    if free < need:
        raise SystemExit(f"error: {root} has {free / GB:.1f} GB free; this run needs about {need / GB:.0f} GB")

    shards = model.shards()
    print(
        f"\nmodel: LLaMA-2-7B shapes, {model.layers} layers, {len(model.tensors())} tensors, "
        f"{model.nbytes / GB:.2f} GB bf16 in {len(shards)} shards of <= {MAX_SHARD_BYTES / GB:.0f} GB; "
        f"{model.n_quantized} linear weights to quantize"
    )
    print(f"synthesizing in {model_dir} ...", flush=True)
    t = synthesize(model, model_dir, args.seed, logs)
    print(f"  written in {t:.1f} s")
    # pip compiles qtool's bytecode for users; time qtool, not the compiler.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "qtool")], check=False)

    # Runs whose output a selected run reads, made once, untimed, when not selected themselves.
    selected = args.runs
    prereqs = [k for k in RUNS if k not in selected and any(RUNS[s].source == k for s in selected)]
    records: dict[str, Record] = {k: Record() for k in selected}
    done: dict[str, bool] = {}  # did this round's run of K produce its output?

    def source_of(run: Run) -> Path:
        return model_dir if run.source == "model" else outs / RUNS[run.source].output

    def one(run: Run, label: str) -> Measurement | str:
        dst = outs / run.output
        remove(dst)
        if run.source != "model" and not done.get(run.source):
            return f"needs {run.source}'s output, and {run.source} failed"
        src = source_of(run)
        os.sync()
        warm(src)
        m = measure(command(run, src, dst), log_stem=logs / label, cwd=REPO, timeout_s=args.timeout)
        os.sync()  # write-back now, untimed, not in the next run
        done[run.key] = m.ok
        if m.ok:
            return m
        why = "timed out" if m.timed_out else f"exit status {m.returncode}"
        return f"{why}; stderr tail:\n{indent(m.stderr_tail())}"

    if prereqs:
        print(f"making {', '.join(prereqs)} once (untimed), as input to {', '.join(selected)} ...", flush=True)
        for k in prereqs:
            res = one(RUNS[k], f"{k}-prereq")
            if isinstance(res, str):
                print(f"  {k} FAILED: {res}")

    t_read = warm(model_dir)
    t_read = min(t_read, warm(model_dir))
    print(
        f"page cache: every run's input is read once (cat > /dev/null) just before it, so all runs "
        f"read from a warm page cache; reading the model that way takes {t_read:.2f} s "
        f"({model.nbytes / GB / t_read:.1f} GB/s)"
    )
    floors = {}
    probes = [("python -c pass", "pass"), ("python -c 'import torch'", "import torch")]
    if "D" in selected:  # what D pays before any work: compressed-tensors imports transformers
        probes.append(("import compressed_tensors.compressors", "import compressed_tensors.compressors"))
    if "E" in selected:  # E's output is the model's size again, written durably (fsync) as qtool does
        sink = outs / "floor.bin"
        probes.append(
            (
                f"write+fsync {model.nbytes / GB:.2f} GB",
                f"import os\nfd = os.open({str(sink)!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\nchunk = bytes(32 << 20)\n"
                f"left = {model.nbytes}\nwhile left > 0:\n    left -= os.write(fd, chunk[:min(left, len(chunk))])\n"
                f"os.fsync(fd)\nos.close(fd)\nos.remove({str(sink)!r})",
            )
        )
    for name, code in probes:
        ms = []
        for _ in range(args.repeats):
            os.sync()
            ms.append(measure([sys.executable, "-c", code], log_stem=logs / "floor", cwd=REPO))
        floors[name] = (statistics.median(m.wall_s for m in ms), max(m.peak_rss_bytes for m in ms))
    print("floors: " + ";  ".join(f"{n} {w:.2f} s, {r / GB:.2f} GB RSS" for n, (w, r) in floors.items()))

    print(f"timing {', '.join(selected)}: {args.repeats} rounds, in that order ...", flush=True)
    for r in range(1, args.repeats + 1):
        for key in selected:
            run_ = RUNS[key]
            rec = records[key]
            if rec.failure:
                continue
            res = one(run_, f"{key}-{r}")
            if isinstance(res, str):
                rec.failure = res
                last = res.splitlines()[-1].strip(" |") if "\n" in res else ""
                first = res.splitlines()[0].replace("; stderr tail:", "")
                print(f"  {key} round {r}: FAILED: {first}{': ' + last if last else ''}", flush=True)
                continue
            rec.runs.append(res)
            print(
                f"  {key} round {r}: {res.wall_s:7.2f} s  {res.peak_rss_bytes / GB:.2f} GB  "
                f"(cpu {res.cpu_s:.1f} s, load avg {os.getloadavg()[0]:.1f})",
                flush=True,
            )
            if rec.check is None and not args.no_check:
                m = measure(
                    [
                        sys.executable,
                        "-c",
                        CHECK_CODE,
                        str(model_dir),
                        str(outs / run_.output),
                        key,
                        run_.expect,
                        str(model.n_quantized),
                        PROBE,
                    ],
                    log_stem=logs / f"{key}-check",
                    cwd=REPO,
                    timeout_s=args.timeout,
                )
                rec.check_ok = m.ok
                text = m.stdout_path.read_text(errors="replace").strip()
                rec.check = text.splitlines()[-1] if text else f"{key}: check crashed:\n{indent(m.stderr_tail())}"
                if not m.ok and text:
                    rec.check += "\n" + indent(m.stderr_tail(8))
                print(f"    check {'ok' if m.ok else 'FAILED'}: {rec.check}", flush=True)
            if key == "G" and rec.torch_free is None:
                probe = outs / "G-torch-probe.gguf"
                remove(probe)
                m = measure(
                    [
                        sys.executable,
                        "-c",
                        TORCH_FREE_CODE,
                        "quantize",
                        str(model_dir),
                        "-o",
                        str(probe),
                        "--scheme",
                        "q4_0",
                        "--allow-incomplete-gguf",
                        "-q",
                    ],
                    log_stem=logs / "G-torch-probe",
                    cwd=REPO,
                    timeout_s=args.timeout,
                )
                rec.torch_free = m.ok and m.stdout_path.read_text().strip().endswith("True")
                remove(probe)
                print(f"    torch imported by G: {'no' if rec.torch_free else 'YES'}", flush=True)

    # -------------------------------------------------------------------------------- report
    print()
    for key in selected:
        if records[key].failure:
            print(f"{key} FAILED ({RUNS[key].what}): {records[key].failure}\n")

    head = f"{'run':<4} {'what':<46} {'median s':>9} {'peak RSS GB':>12} {'cpu s':>7}  all runs (wall s / peak RSS GB)"
    print(head)
    print("-" * len(head))
    med: dict[str, float] = {}
    rss: dict[str, int] = {}
    for key in selected:
        rec = records[key]
        if rec.failure or not rec.runs:
            print(f"{key:<4} {RUNS[key].what:<46} {'FAILED':>9}")
            continue
        med[key], rss[key] = rec.median, rec.peak_rss
        runs = "  ".join(f"{m.wall_s:.2f}/{m.peak_rss_bytes / GB:.2f}" for m in rec.runs)
        print(
            f"{key:<4} {RUNS[key].what:<46} {rec.median:>9.2f} {rec.peak_rss / GB:>12.2f} "
            f"{rec.median_cpu:>7.1f}  {runs}"
        )
    print(
        f"\nmodel {model.nbytes / GB:.2f} GB ({model.layers} layers); median of {args.repeats}; "
        "peak RSS is the largest of the runs (ru_maxrss, touched mmap-ed pages included); GB = 10^9 bytes;\n"
        "cpu s is the median user+system CPU time of the child, a cross-check that CPU contention from\n"
        f"outside does not inflate (this machine has {os.cpu_count()} cpus; load average now "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})"
    )

    print("\ntargets")
    results: list[bool] = []

    def verdict(ok: bool | None, text: str) -> None:
        if ok is not None:
            results.append(ok)
        print(f"  {'n/a ' if ok is None else 'PASS' if ok else 'FAIL'}  {text}")

    for base_key, qtool_key, target in TARGET_SPEEDUPS:
        if base_key not in selected or qtool_key not in selected:
            continue
        if base_key in med and qtool_key in med:
            ratio = med[base_key] / med[qtool_key]
            verdict(
                ratio >= target,
                f"{base_key}/{qtool_key} = {med[base_key]:.2f} s / {med[qtool_key]:.2f} s "
                f"= {ratio:.2f}x  (target >= {target}x)",
            )
        else:
            missing = " and ".join(k for k in (base_key, qtool_key) if k not in med)
            verdict(False if qtool_key not in med else None, f"{base_key}/{qtool_key} >= {target}x: {missing} FAILED")
    for slow_key, base_key, limit in TARGET_SLOWDOWNS:
        if slow_key not in selected or base_key not in selected:
            continue
        if slow_key in med and base_key in med:
            pairs = zip(records[slow_key].walls, records[base_key].walls)
            ratios = [slow / base for slow, base in pairs]
            ratio = statistics.median(ratios)
            verdict(
                ratio <= limit,
                f"{slow_key}/{base_key} = {ratio:.2f}x, the median of the rounds' ratios "
                f"({', '.join(f'{r:.2f}' for r in ratios)})  (target <= {limit}x)",
            )
        else:
            verdict(False, f"{slow_key}/{base_key} <= {limit}x: {slow_key if slow_key not in med else base_key} FAILED")
    for key in RSS_RUNS:
        if key not in selected:
            continue
        if key in rss:
            verdict(
                rss[key] < rss_limit,
                f"peak RSS {key} = {rss[key] / GB:.2f} GB  (target < {rss_limit / GB:.1f} GB "
                f"on this {model.nbytes / GB:.1f} GB model)",
            )
        else:
            verdict(False, f"peak RSS {key} < {rss_limit / GB:.1f} GB: {key} FAILED")
    if "G" in selected and records["G"].torch_free is not None:
        verdict(records["G"].torch_free, "G runs without importing torch")
    for key in selected:
        rec = records[key]
        if rec.check_ok is False:
            verdict(False, f"output check of {key}: {rec.check.splitlines()[0]}")

    assert not {"torch", "numpy", "safetensors"} & set(sys.modules), "the parent must stay stdlib-only"
    failed_any = any(r.failure for r in records.values()) or not all(results)
    return 1 if args.strict and failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
