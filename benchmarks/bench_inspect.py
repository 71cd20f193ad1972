"""Benchmark `qtool inspect` against safetensors' own way of listing a checkpoint.

DESIGN.md: "`inspect` costs the header, not the file: a 100 GB sharded checkpoint lists as fast as
a 1 MB one", and `inspect` never imports torch.

The script synthesizes LLaMA-2-7B- and LLaMA-2-70B-shaped sharded bf16 checkpoints whose headers
are real and whose data is a sparse hole (the file is truncated to its full length without writing
a byte of data), so 150 GB of checkpoints take a few hundred KB of disk. It then times, as whole
processes with the same interpreter, round-robin so that noise hits every variant alike:

  qtool            python -m qtool inspect DIR --json
  safe_open(pt)    for each shard: safe_open(f, framework="pt"), get_slice(k) dtype and shape
  safe_open(numpy) the same with framework="numpy"

Targets:
  1. qtool <= 1.0x safe_open(numpy), the cheaper baseline, which pays no torch import;
     the ratio against safe_open(pt) is printed too;
  2. qtool on 70B <= 1.5x qtool on 7B (inspect costs the header, not the file);
  3. `python -X importtime -m qtool inspect 7B --json` imports no `torch` (numpy reported too).

The `.pt` case (issue 10; skip it with --no-pt) writes the 7B model once more as one zip-format
PyTorch checkpoint, `pytorch_model.bin`, as torch.save lays it out (data.pkl, then one STORED,
64-byte-aligned record per storage, zip64 directory), its records holes, and times:

  qtool(pt)        python -m qtool inspect pytorch_model.bin --json
  torch.load(mmap) torch.load(f, weights_only=True, mmap=True), then each name, dtype and shape

  4. qtool(pt) <= 1.5x qtool on the same model as safetensors;
  5. torch.load(mmap) >= 10x qtool(pt);
  6. `python -X importtime -m qtool inspect pytorch_model.bin --json` imports no `torch`.

Then, for issue 10, headers of 100k and 1.6M zero-size tensors (a fuzzer's resource bomb: the
1.6M one is 95 MB, under the 100 MB limit): `qtool inspect x.safetensors --json` against
safe_open(numpy) listing the same names, with wall, CPU and peak RSS. Target: 100k under 2 s.

The parent process uses the standard library only: it imports neither torch, numpy nor
safetensors. Exit status is 0 whatever the result, unless --strict is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import in_work_dir, print_environment

REPO = Path(__file__).resolve().parent.parent
BF16_BYTES = 2
TARGET_VS_BASELINE = 1.0
TARGET_70B_OVER_7B = 1.5
TARGET_PT_OVER_SAFETENSORS = 1.5
TARGET_TORCH_OVER_PT = 10.0
BASELINE = "safe_open(numpy)"  # the named baseline of target 1


@dataclass(frozen=True)
class LlamaShape:
    """The shapes of a HF LlamaForCausalLM checkpoint, and how HF shards it."""

    key: str
    title: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    max_shard_bytes: int
    rms_norm_eps: float

    def tensors(self) -> list[tuple[str, list[int]]]:
        """Names and shapes in state-dict order."""
        h, kv = self.hidden, self.kv_heads * (self.hidden // self.heads)
        out = [("model.embed_tokens.weight", [self.vocab, h])]
        for i in range(self.layers):
            p = f"model.layers.{i}"
            out += [
                (f"{p}.self_attn.q_proj.weight", [h, h]),
                (f"{p}.self_attn.k_proj.weight", [kv, h]),
                (f"{p}.self_attn.v_proj.weight", [kv, h]),
                (f"{p}.self_attn.o_proj.weight", [h, h]),
                (f"{p}.mlp.gate_proj.weight", [self.intermediate, h]),
                (f"{p}.mlp.up_proj.weight", [self.intermediate, h]),
                (f"{p}.mlp.down_proj.weight", [h, self.intermediate]),
                (f"{p}.input_layernorm.weight", [h]),
                (f"{p}.post_attention_layernorm.weight", [h]),
            ]
        out += [("model.norm.weight", [h]), ("lm_head.weight", [self.vocab, h])]
        return out

    def shards(self) -> list[list[tuple[str, list[int]]]]:
        """Split in state-dict order, starting a new shard when the next tensor would overflow."""
        groups: list[list[tuple[str, list[int]]]] = [[]]
        size = 0
        for name, shape in self.tensors():
            nbytes = math.prod(shape) * BF16_BYTES
            if groups[-1] and size + nbytes > self.max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, shape))
            size += nbytes
        return groups

    def config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate,
            "max_position_embeddings": 4096,
            "model_type": "llama",
            "num_attention_heads": self.heads,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "pretraining_tp": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.31.0.dev0",
            "use_cache": True,
            "vocab_size": self.vocab,
        }


MODELS = {
    m.key: m
    for m in (
        LlamaShape("7b", "LLaMA-2-7B", 32000, 4096, 11008, 32, 32, 32, 10 * 10**9, 1e-5),
        LlamaShape("70b", "LLaMA-2-70B", 32000, 8192, 28672, 80, 64, 8, 5 * 10**9, 1e-5),
    )
}


# ---------------------------------------------------------------------------------- synthesis


def write_sparse_shard(path: Path, tensors: list[tuple[str, list[int]]]) -> int:
    """Write a real safetensors header, then extend the file over a hole. Returns data bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in sorted(tensors):  # safetensors lays same-dtype tensors out by name
        end = offset + math.prod(shape) * BF16_BYTES
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
    os.truncate(path, 8 + len(blob) + offset)
    return offset


def synthesize(model: LlamaShape, root: Path) -> Path:
    directory = root / f"llama-2-{model.key}-sparse"
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    shards = model.shards()
    weight_map = {}
    total = 0
    for i, group in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += write_sparse_shard(directory / fname, group)
        weight_map.update({name: fname for name, _ in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(model.config(), indent=2) + "\n")

    apparent = sum(p.stat().st_size for p in directory.iterdir())
    on_disk = sum(p.stat().st_blocks * 512 for p in directory.iterdir())
    if on_disk > 64 * 2**20:
        raise SystemExit(
            f"error: {directory} takes {on_disk / 2**20:.0f} MiB on disk for {apparent / 1e9:.1f} GB "
            "apparent: this filesystem does not keep sparse files sparse.\n"
            "hint: pass --workdir on a filesystem that does (ext4, xfs, btrfs, tmpfs)."
        )
    print(
        f"  {model.title:<12} {len(weight_map)} tensors, {len(shards)} shards, "
        f"{total / 1e9:.1f} GB bf16 apparent, {on_disk / 2**10:.0f} KiB on disk  ({directory})"
    )
    return directory


# ------------------------------------------------------------------- the same model as a .pt


def crc32_of_zeros(count: int) -> int:
    """zlib.crc32(bytes(count)) in O(log count): the CRC register's update for a zero bit is
    linear over GF(2), so n zero bytes are that 32x32 matrix to the power 8n."""

    def apply(matrix: list[int], vector: int) -> int:
        out = 0
        for column in matrix:
            if vector & 1:
                out ^= column
            vector >>= 1
        return out

    def square(matrix: list[int]) -> list[int]:
        return [apply(matrix, column) for column in matrix]

    bit = [0xEDB88320] + [1 << i for i in range(31)]  # one zero bit: shift right, xor the polynomial on a carry
    crc = 0xFFFFFFFF
    power = square(square(square(bit)))  # one zero byte
    while count:
        if count & 1:
            crc = apply(power, crc)
        power = square(power)
        count >>= 1
    return crc ^ 0xFFFFFFFF


class _PickleWriter:
    """Protocol 2 opcodes for a torch state dict, memoizing globals as torch's pickler does."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[str, int] = {}

    def put(self) -> None:
        index = len(self.memo) + 1000
        self.out += b"r" + struct.pack("<I", index)

    def global_(self, module: str, name: str) -> None:
        key = f"{module} {name}"
        if key in self.memo:
            self.out += b"j" + struct.pack("<I", self.memo[key])
            return
        self.memo[key] = len(self.memo)
        self.out += f"c{module}\n{name}\n".encode() + b"r" + struct.pack("<I", self.memo[key])

    def text(self, value: str) -> None:
        raw = value.encode()
        self.out += b"X" + struct.pack("<I", len(raw)) + raw

    def int_(self, value: int) -> None:
        self.out += b"J" + struct.pack("<i", value)

    def ints(self, values: list[int]) -> None:
        self.out += b"("
        for value in values:
            self.int_(value)
        self.out += b"t"


def torch_pickle(tensors: list[tuple[str, list[int]]]) -> bytes:
    """data.pkl of {name: bf16 tensor on storage str(i)} in an OrderedDict, as torch.save writes it."""
    w = _PickleWriter()
    w.global_("collections", "OrderedDict")
    w.out += b")R("
    for key, (name, shape) in enumerate(tensors):
        w.text(name)
        w.global_("torch._utils", "_rebuild_tensor_v2")
        w.out += b"(("
        w.text("storage")
        w.global_("torch", "BFloat16Storage")
        w.text(str(key))
        w.text("cpu")
        w.int_(math.prod(shape))
        w.out += b"tQ"
        w.int_(0)
        w.ints(shape)
        w.ints([math.prod(shape[i + 1 :]) for i in range(len(shape))])
        w.out += b"\x89"
        w.global_("collections", "OrderedDict")
        w.out += b")RtR"
    w.out += b"u."
    return bytes(w.out)


def write_sparse_pt(path: Path, tensors: list[tuple[str, list[int]]]) -> int:
    """A zip-format torch checkpoint whose data records are holes: each local header is
    written, then the file offset skips over the record. Returns data bytes."""
    root = "pytorch_model"
    entries: list[tuple[str, int, int, int]] = []  # name, crc, size, header offset
    total = 0
    with open(path, "wb") as f:

        def member(name: str, data: bytes | None, size: int) -> None:
            raw = name.encode()
            offset = f.tell()
            pad = -(offset + 30 + len(raw) + 4) % 64  # torch aligns record data to 64 bytes
            extra = struct.pack("<HH", 0x4B46, pad) + b"Z" * pad  # torch's "FB" padding field
            crc = zlib.crc32(data) if data is not None else crc32_of_zeros(size)
            f.write(
                struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45, 0, 0, 0, 0, crc, size, size, len(raw), len(extra))
                + raw
                + extra
            )
            if data is not None:
                f.write(data)
            else:
                f.seek(size, os.SEEK_CUR)  # a hole
            entries.append((name, crc, size, offset))

        member(f"{root}/data.pkl", torch_pickle(tensors), len(torch_pickle(tensors)))
        member(f"{root}/byteorder", b"little", 6)
        for key, (_, shape) in enumerate(tensors):
            nbytes = math.prod(shape) * BF16_BYTES
            member(f"{root}/data/{key}", None, nbytes)
            total += nbytes
        member(f"{root}/version", b"3\n", 2)
        cd_start = f.tell()
        for name, crc, size, offset in entries:
            raw = name.encode()
            extra = struct.pack("<HHQ", 0x0001, 8, offset) if offset >= 0xFFFFFFFF else b""
            stated = 0xFFFFFFFF if extra else offset
            f.write(
                struct.pack(
                    "<4sHHHHHHIIIHHHHHII",
                    b"PK\x01\x02",
                    45,
                    45,
                    0,
                    0,
                    0,
                    0,
                    crc,
                    size,
                    size,
                    len(raw),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    stated,
                )
                + raw
                + extra
            )
        cd_size = f.tell() - cd_start
        eocd64 = f.tell()
        f.write(
            struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, len(entries), len(entries), cd_size, cd_start)
        )
        f.write(struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd64, 1))
        f.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
    return total


def synthesize_pt(model: LlamaShape, root: Path) -> Path:
    directory = root / f"llama-2-{model.key}-pt-sparse"
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    path = directory / "pytorch_model.bin"
    total = write_sparse_pt(path, model.tensors())
    on_disk = path.stat().st_blocks * 512
    print(
        f"  {model.title:<12} as one zip-format pytorch_model.bin: {total / 1e9:.1f} GB bf16 apparent, {on_disk / 2**10:.0f} KiB on disk  ({path})"
    )
    return path


# ------------------------------------------------------------------------------------- timing

BASELINE_CODE = """\
import json, os, sys
from safetensors import safe_open
framework, model_dir = sys.argv[1], sys.argv[2]
with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
for shard in shards:
    with safe_open(os.path.join(model_dir, shard), framework=framework) as fh:
        for k in fh.keys():
            s = fh.get_slice(k)
            print(k, s.get_dtype(), s.get_shape())
"""


TORCH_LOAD_CODE = """\
import sys, torch
state = torch.load(sys.argv[1], weights_only=True, mmap=True, map_location="cpu")
for k, v in state.items():
    print(k, v.dtype, tuple(v.shape))
"""


def command(variant: str, model_dir: Path) -> list[str]:
    if variant in ("qtool", "qtool(pt)"):
        return [sys.executable, "-m", "qtool", "inspect", str(model_dir), "--json"]
    if variant == "torch.load(mmap)":
        return [sys.executable, "-c", TORCH_LOAD_CODE, str(model_dir)]
    framework = {"safe_open(pt)": "pt", "safe_open(numpy)": "numpy"}[variant]
    return [sys.executable, "-c", BASELINE_CODE, framework, str(model_dir)]


VARIANTS = ("qtool", "safe_open(pt)", "safe_open(numpy)")
PT_VARIANTS = ("qtool(pt)", "torch.load(mmap)")


CPU_TIMES: dict[tuple[str, ...], list[float]] = {}  # user + sys seconds of each timed command


def run_once(cmd: list[str]) -> float:
    """Wall seconds of one run; its CPU seconds (user + sys, from wait4) go to CPU_TIMES, which
    a loaded machine disturbs far less than the wall clock."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.read() if proc.stderr else b""
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t0
    if status != 0:
        raise RuntimeError(f"wait status {status}: {err.decode(errors='replace')}")
    CPU_TIMES.setdefault(tuple(cmd), []).append(usage.ru_utime + usage.ru_stime)
    return elapsed


def warm_up(variant: str, model_dir: Path, n_tensors: int) -> str | None:
    """Run once, discarded, checking the output. Returns an error message or None."""
    proc = subprocess.run(command(variant, model_dir), cwd=REPO, capture_output=True)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip() or "(no stderr)"
        return f"exit status {proc.returncode}; stderr:\n" + indent(tail(err, 25))
    out = proc.stdout.decode(errors="replace")
    if variant in ("qtool", "qtool(pt)"):
        try:
            listed = len(json.loads(out)["weights"])
        except (ValueError, KeyError, TypeError) as e:
            print(f"  warning: qtool inspect --json on {model_dir.name}: stdout is not its JSON ({e})")
        else:
            if listed != n_tensors:
                return f"listed {listed} weights, expected {n_tensors}"
    elif len(out.splitlines()) != n_tensors:
        return f"listed {len(out.splitlines())} tensors, expected {n_tensors}"
    return None


def tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def indent(text: str) -> str:
    return "\n".join("    | " + line for line in text.splitlines())


def imported_modules(model_dir: Path) -> tuple[set[str], str | None]:
    """Top-level module names that `-X importtime` reports for qtool inspect."""
    cmd = [sys.executable, "-X", "importtime", "-m", "qtool", "inspect", str(model_dir), "--json"]
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.decode(errors="replace")
    names = set()
    for line in err.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            names.add(name.split(".")[0])
    bad = None
    if proc.returncode != 0:
        bad = f"exit status {proc.returncode}; stderr:\n" + indent(
            tail("\n".join(line for line in err.splitlines() if not line.startswith("import time:")), 25)
        )
    return names, bad


# --------------------------------------------------------------------- large headers (issue 10)

HEADER_TARGET_S = 2.0  # a 100k-tensor header lists in under 2 s
HEADER_BASELINE_CODE = """\
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], framework="numpy") as fh:
    for k in fh.keys():
        s = fh.get_slice(k)
        print(k, s.get_dtype(), s.get_shape())
"""


WRITE_HEADER_CODE = """\
import json, struct, sys
header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(int(sys.argv[2]))}
blob = json.dumps(header, separators=(",", ":")).encode()
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
"""


def write_empty_header(path: Path, count: int) -> None:
    """A fuzzer's resource bomb: `count` zero-size F32 tensors and no data. 1.6M of them with
    names like `t1234567` make a 95 MB header, under the 100 MB limit. Written by a child: a
    child's peak RSS (wait4) starts at the parent's peak, which the 1.6M dict would inflate."""
    subprocess.run([sys.executable, "-c", WRITE_HEADER_CODE, str(path), str(count)], check=True)


def run_measured(cmd: list[str]) -> tuple[float, float, int]:
    """(wall s, CPU s, peak RSS bytes) of one whole process, output discarded."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if status != 0:
        raise RuntimeError(f"status {status}: {tail(err, 10)}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def run_large_headers(sizes: list[int], repeats: int, root: Path) -> list[bool]:
    """`qtool inspect x.safetensors --json` on headers of `sizes` zero-size tensors, against
    safe_open(numpy) listing the same names, dtypes and shapes; interleaved, median of
    `repeats`. Returns the verdicts (100k under HEADER_TARGET_S)."""
    if not sizes:
        return []
    print(f"\nlarge headers: {', '.join(f'{n:,}' for n in sizes)} zero-size tensors, {repeats} runs each, interleaved")
    files = {}
    for count in sizes:
        files[count] = root / f"header-{count}.safetensors"
        write_empty_header(files[count], count)
    commands = {
        "qtool": lambda f: [sys.executable, "-m", "qtool", "inspect", str(f), "--json"],
        "safe_open(numpy)": lambda f: [sys.executable, "-c", HEADER_BASELINE_CODE, str(f)],
    }
    runs: dict[tuple[int, str], list[tuple[float, float, int]]] = {(n, v): [] for n in sizes for v in commands}
    for _ in range(repeats):
        for count in sizes:
            for variant, build in commands.items():
                runs[count, variant].append(run_measured(build(files[count])))
    print(f"{'tensors':>10} {'header':>8} {'variant':<17} {'wall s':>8} {'cpu s':>8} {'peak RSS':>9}  wall runs (s)")
    verdicts = []
    for count in sizes:
        size_mb = files[count].stat().st_size / 1e6
        for variant in commands:
            got = runs[count, variant]
            wall = statistics.median(r[0] for r in got)
            cpu = statistics.median(r[1] for r in got)
            rss = max(r[2] for r in got)
            walls = " ".join(f"{r[0]:.2f}" for r in got)
            print(
                f"{count:>10,} {size_mb:>6.1f}MB {variant:<17} {wall:>8.2f} {cpu:>8.2f} {rss / 2**20:>7.0f}MB  {walls}"
            )
        if count == 100_000:
            wall = statistics.median(r[0] for r in runs[count, "qtool"])
            ok = wall < HEADER_TARGET_S
            verdicts.append(ok)
            print(
                f"  {'PASS' if ok else 'FAIL'}  100k tensors listed in {wall:.2f} s < {HEADER_TARGET_S} s (wall; cpu {statistics.median(r[1] for r in runs[count, 'qtool']):.2f} s)"
            )
    return verdicts


# --------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time `qtool inspect --json` on sparse LLaMA-2-7B/70B checkpoints against "
        "safetensors safe_open listings (pt and numpy), and check that inspect imports no torch.",
    )
    p.add_argument("--repeats", type=int, default=7, help="timed runs per variant (default 7)")
    p.add_argument("--workdir", type=Path, help="where to synthesize checkpoints (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the synthesized checkpoints")
    p.add_argument("--models", default="7b,70b", help="comma list of: " + ",".join(MODELS))
    p.add_argument("--strict", action="store_true", help="exit 1 if a target fails or qtool fails")
    p.add_argument(
        "--no-pt", dest="pt", action="store_false", help="skip the .pt case (the 7B model as one pytorch_model.bin)"
    )
    p.add_argument(
        "--headers",
        default="100000,1600000",
        help="comma list of zero-size-tensor header sizes to list ('' skips them)",
    )
    p.add_argument("--header-repeats", type=int, default=3, help="timed runs per header size (default 3)")
    args = p.parse_args(argv)
    args.models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    args.headers = [int(n) for n in args.headers.split(",") if n.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print_environment(("safetensors", "torch"))
    return in_work_dir(args.workdir, "bench-inspect-", args.keep, lambda root: run(args, root))


def run(args: argparse.Namespace, root: Path) -> int:
    free = shutil.disk_usage(root).free
    print(f"synthesizing in {root} ({free / 2**30:.1f} GiB free; sparse files need only their headers)")
    dirs = {key: synthesize(MODELS[key], root) for key in args.models}
    pt_model = "7b" if args.pt and "7b" in args.models else None
    pt_path = synthesize_pt(MODELS[pt_model], root) if pt_model else None
    # `pip install` compiles bytecode for users; a source checkout under PYTHONDONTWRITEBYTECODE
    # would otherwise recompile qtool on every run and time the compiler, not qtool.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "qtool")], check=True)
    counts = {key: len(MODELS[key].tensors()) for key in args.models}

    # Warm-up: one discarded run of each, which also checks that each variant works.
    failed: dict[tuple[str, str], str] = {}
    paths = {(key, variant): dirs[key] for key in args.models for variant in VARIANTS}
    if pt_model and pt_path:
        paths.update({(pt_model, variant): pt_path for variant in PT_VARIANTS})
    for (key, variant), target in paths.items():
        msg = warm_up(variant, target, counts[key])
        if msg:
            failed[key, variant] = msg
            print(f"\nERROR: {variant} on {MODELS[key].title} failed, so it is not timed: {msg}\n")

    jobs = [job for job in paths if job not in failed]
    times: dict[tuple[str, str], list[float]] = {job: [] for job in jobs}
    print(f"timing {len(jobs)} variants x {args.repeats} runs, round-robin ...")
    for r in range(args.repeats):
        shift = r % len(jobs) if jobs else 0
        for key, variant in jobs[shift:] + jobs[:shift]:  # rotate the order too
            try:
                times[key, variant].append(run_once(command(variant, paths[key, variant])))
            except RuntimeError as e:
                failed[key, variant] = str(e)
    for job in list(times):
        if job in failed:
            del times[job]
            print(f"ERROR: {job[1]} on {MODELS[job[0]].title} failed during timing: {failed[job]}")

    med = {job: statistics.median(ts) for job, ts in times.items()}

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> str:
        return f"{med[a] / med[b]:.2f}x" if a in med and b in med else "n/a"

    print()
    head = f"{'model':<12} {'variant':<17} {'median s':>9} {'/pt':>7} {'/numpy':>7}  runs (s)"
    print(head)
    print("-" * len(head))
    for key in args.models:
        for variant in VARIANTS + (PT_VARIANTS if key == pt_model else ()):
            job = (key, variant)
            if job not in med:
                print(f"{MODELS[key].title:<12} {variant:<17} {'FAILED':>9}")
                continue
            pt, npy = ratio(job, (key, "safe_open(pt)")), ratio(job, (key, "safe_open(numpy)"))
            runs = " ".join(f"{t:.3f}" for t in times[job])
            print(f"{MODELS[key].title:<12} {variant:<17} {med[job]:>9.3f} {pt:>7} {npy:>7}  {runs}")
    if ("7b", "qtool") in med and ("70b", "qtool") in med:
        print(f"qtool 70B/7B: {ratio(('70b', 'qtool'), ('7b', 'qtool'))}")
    # the .pt variants ran on another path than dirs[...]: their CPU times are not keyed here
    timed = {job: CPU_TIMES.get(tuple(command(job[1], dirs[job[0]]))) for job in med}
    cpu = {job: statistics.median(t) for job, t in timed.items() if t}
    print(
        "CPU seconds (user + sys), median: "
        + "; ".join(
            f"{MODELS[k].title} " + ", ".join(f"{v} {cpu[k, v]:.3f}" for v in VARIANTS if (k, v) in cpu)
            for k in args.models
        )
    )

    # Targets.
    print("\ntargets")
    results: list[bool] = []

    def verdict(ok: bool | None, text: str) -> None:
        if ok is not None:
            results.append(ok)
        print(f"  {'n/a ' if ok is None else 'PASS' if ok else 'FAIL'}  {text}")

    for key in args.models:
        q, b = (key, "qtool"), (key, BASELINE)
        if q in med and b in med:
            verdict(
                med[q] <= TARGET_VS_BASELINE * med[b],
                f"{MODELS[key].title}: qtool {med[q]:.3f}s <= {TARGET_VS_BASELINE}x {BASELINE} "
                f"{med[b]:.3f}s: {ratio(q, b)} (vs safe_open(pt): {ratio(q, (key, 'safe_open(pt)'))})",
            )
        else:
            verdict(False if q in failed else None, f"{MODELS[key].title}: qtool vs {BASELINE}: not measured")
        if q in cpu and b in cpu:
            print(
                f"  info  {MODELS[key].title}: CPU qtool {cpu[q]:.3f}s / {BASELINE} {cpu[b]:.3f}s = {cpu[q] / cpu[b]:.2f}x"
            )
    if ("7b", "qtool") in med and ("70b", "qtool") in med:
        r = med["70b", "qtool"] / med["7b", "qtool"]
        verdict(r <= TARGET_70B_OVER_7B, f"qtool 70B/7B = {r:.2f}x <= {TARGET_70B_OVER_7B}x")
    else:
        verdict(None, "qtool 70B/7B: needs both models and a working qtool")

    probe = args.models[0]
    names, msg = imported_modules(dirs[probe])
    if msg:
        verdict(False, f"no torch import on `qtool inspect {MODELS[probe].title} --json`: qtool failed, {msg}")
    else:
        verdict("torch" not in names, f"`qtool inspect --json` imports torch: {'yes' if 'torch' in names else 'no'}")
        print(f"  info  `qtool inspect --json` imports numpy: {'yes' if 'numpy' in names else 'no'}")

    if pt_model and pt_path:
        title = MODELS[pt_model].title
        q, st, tl = (pt_model, "qtool(pt)"), (pt_model, "qtool"), (pt_model, "torch.load(mmap)")
        if q in med and st in med:
            r = med[q] / med[st]
            verdict(
                r <= TARGET_PT_OVER_SAFETENSORS,
                f"{title} .pt: qtool(pt) {med[q]:.3f}s <= {TARGET_PT_OVER_SAFETENSORS}x qtool on safetensors {med[st]:.3f}s: {r:.2f}x",
            )
        else:
            verdict(False if q in failed else None, f"{title} .pt vs safetensors: not measured")
        if q in med and tl in med:
            r = med[tl] / med[q]
            verdict(
                r >= TARGET_TORCH_OVER_PT,
                f"{title} .pt: torch.load(mmap) {med[tl]:.3f}s >= {TARGET_TORCH_OVER_PT}x qtool(pt): {r:.1f}x",
            )
        else:
            verdict(False if q in failed else None, f"{title} .pt vs torch.load: not measured")
        names, msg = imported_modules(pt_path)
        if msg:
            verdict(False, f"no torch import on `qtool inspect pytorch_model.bin --json`: qtool failed, {msg}")
        else:
            verdict(
                "torch" not in names,
                f"`qtool inspect pytorch_model.bin --json` imports torch: {'yes' if 'torch' in names else 'no'}",
            )
    results += run_large_headers(args.headers, args.header_repeats, root)

    assert not {"torch", "numpy", "safetensors"} & set(sys.modules), "the parent must stay stdlib-only"
    failed_any = bool(failed and any(v == "qtool" for _, v in failed)) or not all(results)
    return 1 if args.strict and failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
