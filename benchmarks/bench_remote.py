"""Benchmark `qtool inspect` of a remote sharded checkpoint against huggingface_hub's
`HfApi.get_safetensors_metadata`, both against the same loopback server.

The checkpoint is LLaMA-2-70B-shaped (bf16, 80 layers, 30 shards): real headers, sparse data
(each shard truncated to its full length), so it takes a few hundred KB of disk. The server is
tests/test_remote.py's (Range, ETag, the Hub's listing and resolve endpoints) with LATENCY
seconds added before every file response. HF_ENDPOINT points both clients at it.

  qtool      python -m qtool inspect hf://org/llama-70b --json   (a cold cache each run)
  hub        python -c 'HfApi().get_safetensors_metadata("org/llama-70b")'  (a cold HF_HOME)

Prints the median wall time of each over ROUNDS runs, round-robin, their requests, and the
ratio qtool / hub. Exit status 0 whatever the result.

Where the time goes (2 rounds, 20 ms latency, this machine): both pay ~0.4 s importing
huggingface_hub (httpx and friends); qtool adds its own start (~0.3 s, typer and the CLI) and
makes the same number of requests (listing, index, one range per shard, config.json), 8 at a
time. The ratio is therefore start-up bound, about 1.5-2.2x; the network part is ~0.15 s for both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.test_remote import Server  # noqa: E402 - after the repository is on the path

LATENCY = 0.020
HIDDEN, INTER, LAYERS, VOCAB, KV = 8192, 28672, 80, 32000, 1024
SHARDS = 30


def tensors() -> list[tuple[str, list[int]]]:
    out = [("model.embed_tokens.weight", [VOCAB, HIDDEN])]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", [HIDDEN, HIDDEN]),
            (p + "self_attn.k_proj.weight", [KV, HIDDEN]),
            (p + "self_attn.v_proj.weight", [KV, HIDDEN]),
            (p + "self_attn.o_proj.weight", [HIDDEN, HIDDEN]),
            (p + "mlp.gate_proj.weight", [INTER, HIDDEN]),
            (p + "mlp.up_proj.weight", [INTER, HIDDEN]),
            (p + "mlp.down_proj.weight", [HIDDEN, INTER]),
            (p + "input_layernorm.weight", [HIDDEN]),
            (p + "post_attention_layernorm.weight", [HIDDEN]),
        ]
    return out + [("model.norm.weight", [HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN])]


def write_checkpoint(folder: Path) -> None:
    folder.mkdir(parents=True)
    items = tensors()
    per = -(-len(items) // SHARDS)
    weight_map = {}
    for s in range(SHARDS):
        name = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        header, offset = {}, 0
        for tensor, shape in items[s * per : (s + 1) * per]:
            size = 2
            for d in shape:
                size *= d
            header[tensor] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
            weight_map[tensor] = name
            offset += size
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / name, "wb") as handle:
            handle.write(struct.pack("<Q", len(raw)) + raw)
            handle.truncate(8 + len(raw) + offset)  # a sparse hole: no data written
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": LAYERS})
    )


HUB = "from huggingface_hub import HfApi; m = HfApi().get_safetensors_metadata('org/llama-70b'); assert len(m.weight_map) > 700"


def run(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed:\n{result.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency", type=float, default=LATENCY)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        write_checkpoint(scratch / "llama-70b")
        server = Server(scratch)
        server.repos["org/llama-70b"] = {"folder": scratch / "llama-70b", "private": False}
        server.latency = args.latency
        base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "QTOOL_"))}
        base.update(
            PYTHONPATH=str(REPO), HF_ENDPOINT=server.url, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1"
        )
        times: dict[str, list[float]] = {"qtool": [], "hub": []}
        requests: dict[str, int] = {}
        for round_ in range(args.rounds):
            for name in times:
                cold = scratch / f"cache-{name}-{round_}"
                env = {**base, "QTOOL_CACHE": str(cold), "HF_HOME": str(cold / "hf")}
                argv = (
                    [sys.executable, "-m", "qtool", "inspect", "hf://org/llama-70b", "--json"]
                    if name == "qtool"
                    else [sys.executable, "-c", HUB]
                )
                server.log[:] = []
                times[name].append(run(argv, env))
                requests[name] = len(server.log)
        server.close()
        for name, values in times.items():
            print(
                f"{name:6s} median {statistics.median(values) * 1000:8.1f} ms over {len(values)} runs, {requests[name]} requests"
            )
        print(
            f"ratio qtool / hub: {statistics.median(times['qtool']) / statistics.median(times['hub']):.2f}  (latency {args.latency * 1000:.0f} ms per request)"
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
