"""Benchmark `qtool quantize --workers N` and `--executor ray` (issue 22), and model where more
machines pay.

The script writes a sharded LLaMA-2-7B-shaped bf16 checkpoint outside the repository (default
/tmp; hidden 4096, intermediate 11008, vocab 32000, `--layers` decoder layers in `--shards`
shards; default 12 layers in 4 shards, 5.4 GB), in a child process (`tests/scale_models.py`),
and starts a local two-node Ray cluster (`ray start --head --block` and a second `ray start
--address --block`, one CPU each, on 127.0.0.1, stopped by PID at the end). Then, round-robin,
`--repeats` times, each a whole child process with this interpreter:

  W1   python -m qtool quantize MODEL -o OUT --scheme W4A16 -q --json --workers 1 --threads 2
  W2   ... --workers 2 --threads 2   (each worker 1 thread: --threads divided)
  RAY  ... --executor ray against the local cluster (a task per shard job, 1 CPU each)

Before every run the output is removed, `sync` is called, and the input is read once with
`cat > /dev/null`, so each run starts from a warm page cache. It records whole-process wall
time, the driver's peak RSS, and each shard job's worker peak RSS and time (from `--json`).

Targets (issue 22), as medians of per-round ratios: W2 <= 1.1 x W1 and RAY <= 1.15 x W2.

The model of where it goes: one shard job's input rate per CPU measured here (input bytes /
job seconds, from W2's JSON), and the read bandwidth of one node (`--read-gbps`, default the
rate `cat` reads a shard here, cold where the page cache lets it be). N nodes of C cores on
storage of S GB/s finish a model of M bytes in about
    max(M / (N * min(C * rate, read)), M / S) + overhead
where `overhead` is RAY - W1's compute, the fixed cost of dispatching to a cluster. The table
shows, for model sizes from 15 GB to 1.3 TB, the time on 1 node and on N nodes, so the README
can say from what size and storage bandwidth more machines pay.
"""

from __future__ import annotations

import argparse
import json
import importlib.util
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure, print_environment

REPO = Path(__file__).resolve().parent.parent
RAY = Path(sys.executable).with_name("ray")


def make_model(folder: Path, layers: int, shards: int) -> None:
    if (folder / "model.safetensors.index.json").exists():
        return
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
        "from tests.scale_models import llama_shaped;"
        "llama_shaped(Path(sys.argv[2]), hidden=4096, intermediate=11008, layers=int(sys.argv[3]), vocab=32000, shards=int(sys.argv[4]))"
    )
    subprocess.run([sys.executable, "-c", code, str(REPO), str(folder), str(layers), str(shards)], check=True)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def start_node(args: list[str], env: dict) -> subprocess.Popen:
    agent, grpc, runtime_env, metrics = _free_ports(4)
    command = [
        str(RAY),
        "start",
        *args,
        "--block",
        "--num-cpus",
        "1",
        "--node-ip-address",
        "127.0.0.1",
        "--disable-usage-stats",
    ]
    command += [
        "--dashboard-agent-listen-port",
        str(agent),
        "--dashboard-agent-grpc-port",
        str(grpc),
        "--runtime-env-agent-port",
        str(runtime_env),
        "--metrics-export-port",
        str(metrics),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    # os.read, not readline: lines the file object buffered are invisible to select() (the test
    # fixture in tests/test_ray_executor.py waited out its whole timeout so)
    deadline, seen = time.monotonic() + 300, ""
    while time.monotonic() < deadline and process.poll() is None:
        if select.select([process.stdout], [], [], 1)[0]:
            seen += os.read(process.stdout.fileno(), 65536).decode(errors="replace")
            if "Ray runtime started" in seen:
                return process
    stop_node(process)
    raise SystemExit("ray start did not come up:\n" + "\n".join(seen.splitlines()[-15:]))


def stop_node(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def read_rate(path: Path) -> float:
    """GB/s at which this node reads `path` (O_DIRECT where the filesystem allows it)."""
    started = time.perf_counter()
    result = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], capture_output=True)
    if result.returncode != 0:
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
    return path.stat().st_size / (time.perf_counter() - started) / 1e9


def warm(model: Path) -> None:
    subprocess.run(["sync"], check=False)
    for shard in sorted(model.glob("*.safetensors")):
        subprocess.run(["cat", str(shard)], stdout=subprocess.DEVNULL, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--model", default="/tmp/qtool-bench-scale/model", help="the input (built there if missing; kept for reruns)"
    )
    parser.add_argument(
        "--read-gbps", type=float, help="one node's read bandwidth for the model (default: measured here with dd)"
    )
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    print_environment(("qtool", "ray"))
    model = Path(args.model)
    make_model(model, args.layers, args.shards)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    print(f"model: {model} {size / 1e9:.2f} GB in {args.shards} shards, {args.layers} layers")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}  # as tests/test_ray_executor.py
    nodes = []
    out_root = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=model.parent))
    try:
        configs = {"W1": ["--workers", "1", "--threads", "2"], "W2": ["--workers", "2", "--threads", "2"]}
        if not args.no_ray:
            temp = tempfile.mkdtemp(prefix="qr", dir="/tmp")
            gcs, client, dashboard = _free_ports(3)
            nodes.append(
                start_node(
                    [
                        "--head",
                        "--port",
                        str(gcs),
                        "--include-dashboard",
                        "false",
                        "--dashboard-port",
                        str(dashboard),
                        "--temp-dir",
                        temp,
                        # the client server's port only where ray[client] is installed: plain ray refuses the flag
                        *(["--ray-client-server-port", str(client)] if importlib.util.find_spec("grpc") else []),
                    ],
                    env,
                )
            )
            nodes.append(start_node(["--address", f"127.0.0.1:{gcs}"], env))
            env["RAY_ADDRESS"] = f"127.0.0.1:{gcs}"
            configs["RAY"] = ["--executor", "ray"]
        times: dict[str, list[float]] = {name: [] for name in configs}
        rss: dict[str, list[int]] = {name: [] for name in configs}
        cpu: dict[str, list[float]] = {
            name: [] for name in configs
        }  # user + system, the driver and the children it reaped
        worker_rss: dict[str, list[int]] = {name: [] for name in configs}
        shard_rates: list[float] = []
        for round_ in range(args.repeats):
            for name, extra in configs.items():
                out = out_root / name
                subprocess.run(["rm", "-rf", str(out)], check=True)
                warm(model)
                cmd = [
                    sys.executable,
                    "-m",
                    "qtool",
                    "quantize",
                    str(model),
                    "-o",
                    str(out),
                    "--scheme",
                    "W4A16",
                    "-q",
                    "--json",
                    *extra,
                ]
                result = measure(cmd, log_stem=out_root / f"{name}-{round_}", cwd=REPO, env=env, timeout_s=3600)
                if not result.ok:
                    print(f"{name} failed: {result.stderr_tail()}")
                    return 1
                times[name].append(result.wall_s)
                rss[name].append(result.peak_rss_bytes)
                cpu[name].append(result.cpu_s)
                document = json.loads(result.stdout_path.read_text())
                for shard in document.get("execution", {}).get("shards", []):
                    worker_rss[name].append(shard["peak_rss_bytes"])
                    if name == "W2" and shard["seconds"] > 0:
                        shard_rates.append(shard["bytes_in"] / shard["seconds"])  # one CPU each
                print(
                    f"round {round_ + 1} {name}: {result.wall_s:.1f} s wall, {result.cpu_s:.1f} s CPU, peak RSS {result.peak_rss_bytes / 2**20:.0f} MiB"
                )
        print()
        print(
            "| run | median wall | median CPU (driver + local workers) | peak RSS of the process (wait4: with the workers it reaped) | worker peak RSS (max, from --json) |"
        )
        print("|---|---|---|---|---|")
        for name in configs:
            worst = f"{max(worker_rss[name]) / 2**20:.0f} MiB" if worker_rss[name] else "—"
            print(
                f"| {name} | {statistics.median(times[name]):.1f} s | {statistics.median(cpu[name]):.1f} s | {max(rss[name]) / 2**20:.0f} MiB | {worst} |"
            )
        print("per-round W2/W1: " + ", ".join(f"{b / a:.3f}" for a, b in zip(times["W1"], times["W2"])))
        w2_over_w1 = statistics.median(b / a for a, b in zip(times["W1"], times["W2"]))
        print(f"\nW2 / W1: median ratio {w2_over_w1:.3f} (target <= 1.10): {'PASS' if w2_over_w1 <= 1.10 else 'FAIL'}")
        overhead = 0.0
        if "RAY" in configs:
            print("per-round RAY/W2: " + ", ".join(f"{c / b:.3f}" for b, c in zip(times["W2"], times["RAY"])))
            ray_over_w2 = statistics.median(c / b for b, c in zip(times["W2"], times["RAY"]))
            print(
                f"RAY / W2: median ratio {ray_over_w2:.3f} (target <= 1.15): {'PASS' if ray_over_w2 <= 1.15 else 'FAIL'}"
            )
            overhead = max(0.0, statistics.median(times["RAY"]) - statistics.median(times["W2"]))
        rate = statistics.median(shard_rates) if shard_rates else size / statistics.median(times["W1"]) / 2
        read = args.read_gbps * 1e9 if args.read_gbps else read_rate(sorted(model.glob("*.safetensors"))[0]) * 1e9
        print(
            f"\nmodel: one CPU quantizes {rate / 1e9:.3f} GB/s of input; one node reads {read / 1e9:.2f} GB/s; cluster overhead {overhead:.1f} s"
        )
        print_model(rate, read, overhead)
    finally:
        for node in reversed(nodes):
            stop_node(node)
        subprocess.run(["rm", "-rf", str(out_root)], check=False)
    return 0


def print_model(
    rate: float, read: float, overhead: float, cores: int = 32, storage_gbps: tuple[float, ...] = (2.0, 10.0, 40.0)
) -> None:
    """Hours for a model of M bytes on N nodes of `cores` CPUs, each reading at `read`, all on
    shared storage of S GB/s: max(M / (N * min(cores * rate, read)), M / S) + overhead."""
    node = min(cores * rate, read)
    print(f"\none node of {cores} CPUs: {node / 1e9:.2f} GB/s ({'read' if read < cores * rate else 'compute'}-bound)")
    sizes = [15e9, 140e9, 810e9, 1.3e12]
    print("| model | storage | 1 node | 2 nodes | 4 nodes | 8 nodes | 16 nodes |")
    print("|---|---|---|---|---|---|---|")
    for size in sizes:
        for storage in storage_gbps:
            cells = []
            for count in (1, 2, 4, 8, 16):
                seconds = max(size / (count * node), size / (storage * 1e9)) + (overhead if count > 1 else 0)
                cells.append(f"{seconds / 60:.1f} min")
            print(f"| {size / 1e9:.0f} GB | {storage:g} GB/s | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
