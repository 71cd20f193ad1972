"""`python -m tests.fuzz.remote`: fuzz qtool's remote reads by mutating how a server behaves.

    python -m tests.fuzz.remote --minutes 5 --seed 0
    python -m tests.fuzz.remote --cases 40 --seed 3 --summary-json remote.json

Each case runs the real CLI (`python -m qtool inspect URL`, a fresh cache) against a loopback
server whose answers the case mutates, request by request: a body or headers trickled a byte at
a time, a stall before or inside the body, an early close, wrong statuses and ranges, redirects
(same origin, another origin, a loop, and to `ftp://`, `file://`, `data:`, `https://` on a plain
port), and a sharded index whose shard names are absolute URLs, `file://` paths (to a real shard,
or a FIFO that blocks whoever opens it), `//host/x`, `sub//x`, quoting tricks and long names.
Some cases also send SIGINT, SIGTERM or SIGHUP part-way.

A case must end as exit 0 or as one `error:` line with exit 2 (or the signal's exit code, with
one line), no traceback, within the command deadline (`QTOOL_HTTP_DEADLINE`) plus start-up, and:
the "forbidden" server, named only by shard names, never gets a request; a shard name or redirect
to a non-HTTP URL never succeeds (its target is a real shard: exit 0 would mean it was read).
Anything else is a finding, printed with its case (seed and number reproduce it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

from tests.signal_helpers import default_signal_dispositions, wait_for_qtool_handlers

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "sample_models"
REQUEST_TIMEOUT = 1.5  # QTOOL_HTTP_TIMEOUT in every case
COMMAND_TIMEOUT = 4.0  # QTOOL_HTTP_DEADLINE
STARTUP_SLACK = 12.0  # an interpreter start and qtool's imports on a busy machine
SIGNAL_SLACK = 3.0  # seconds from a signal to the exit

ACTIONS = (
    "ok",
    "trickle-body",
    "trickle-headers",
    "stall-headers",
    "stall-body",
    "close",
    "slow-ok",
    "status",
    "bad-range",
    "redirect",
)
STATUSES = (200, 204, 301, 304, 400, 401, 403, 404, 416, 429, 500, 503)
REDIRECTS = ("same-origin", "other-origin", "loop", "ftp", "file", "data", "https-plain", "gopher", "relative-scheme")
SHARD_NAMES = (
    "absolute-forbidden",
    "absolute-upper",
    "scheme-relative",
    "file-shard",
    "file-fifo",
    "double-slash",
    "data",
    "dot-dot",
    "percent-dot-dot",
    "query",
    "long",
    "control",
    "space-unicode",
    "backslash",
    "dot-slash",
)
# A case whose request is sent to a non-HTTP URL must not succeed (see the module docstring).
_NON_HTTP = {"ftp", "file", "data", "gopher", "https-plain"}


@dataclass
class Behaviour:
    """What the server does in one case: an action per request number (others: ok)."""

    target: str  # "single" | "index"
    actions: dict[int, dict] = field(default_factory=dict)
    shard_name: str | None = None  # a SHARD_NAMES entry for the index's first shard
    signal_at: float | None = None
    signum: int | None = None


def make_case(seed: int, number: int) -> Behaviour:
    rng = random.Random(f"remote:{seed}:{number}")
    behaviour = Behaviour(target=rng.choice(("single", "index", "index")))
    for request in rng.sample(range(6), rng.randint(1, 3)):
        action = rng.choice(ACTIONS)
        spec: dict = {"action": action, "pace": rng.choice((0.05, 0.3, 0.6, 1.2))}
        if action == "status":
            spec["status"] = rng.choice(STATUSES)
        if action == "redirect":
            spec["to"] = rng.choice(REDIRECTS)
        if action in ("stall-body", "trickle-body"):
            spec["after"] = rng.choice((0, 1, 7, 100))
        behaviour.actions[request] = spec
    if behaviour.target == "index" and rng.random() < 0.6:
        behaviour.shard_name = rng.choice(SHARD_NAMES)
    if rng.random() < 0.15:
        behaviour.signum = int(rng.choice((signal.SIGINT, signal.SIGTERM, signal.SIGHUP)))
        behaviour.signal_at = rng.uniform(0.3, 2.5)
    return behaviour


class HostileServer:
    """A loopback server of `root`, misbehaving as the current case's Behaviour says."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.behaviour = Behaviour("single")
        self.count = 0
        self.log: list[str] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                try:
                    server.answer(self)
                except OSError:  # the client went away
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def reset(self, behaviour: Behaviour) -> None:
        with self.lock:
            self.behaviour, self.count, self.log = behaviour, 0, []

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        with self.lock:
            number, self.count = self.count, self.count + 1
            self.log.append(h.path)
            spec = self.behaviour.actions.get(number, {"action": "ok"})
        path = unquote(h.path.split("?")[0])
        try:
            file = self.root / path.lstrip("/")
            data = file.read_bytes() if file.is_file() else None
        except OSError:  # a name too long, a FIFO, ...: not found
            data = None
        action, pace = spec["action"], spec.get("pace", 0.3)
        h.close_connection = True
        if action == "redirect":
            return self._redirect(h, spec["to"], path)
        if action == "status":
            return self._raw(h, f"HTTP/1.1 {spec['status']} X\r\nContent-Length: 0\r\n\r\n".encode())
        if action == "close":
            return
        if action == "stall-headers":
            return self._hold(h, pace)
        if action == "trickle-headers":
            return self._trickle(h, b"HTTP/1.1 206 Partial Content\r\nX-Slow: " + b"x" * 10_000, pace)
        if action == "slow-ok":
            time.sleep(min(pace, REQUEST_TIMEOUT / 2))
        if data is None:
            return self._raw(h, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        start, last = 0, len(data) - 1
        wanted = h.headers.get("Range", "")
        status = 200
        if wanted.startswith("bytes="):
            first, _, end = wanted[6:].partition("-")
            start, last, status = int(first), min(int(end), len(data) - 1), 206
        body = data[start : last + 1]
        shown_start = start + (1 if action == "bad-range" else 0)
        head = f'HTTP/1.1 {status} OK\r\nContent-Length: {len(body)}\r\nETag: "{len(data)}"\r\n'
        if status == 206:
            head += f"Content-Range: bytes {shown_start}-{shown_start + len(body) - 1}/{len(data)}\r\n"
        head_bytes = (head + "\r\n").encode()
        if action in ("trickle-body", "stall-body"):
            after = spec.get("after", 0)
            self._raw(h, head_bytes + body[:after])
            return self._trickle(h, body[after:], pace) if action == "trickle-body" else self._hold(h, pace)
        self._raw(h, head_bytes + body)

    def _redirect(self, h, to: str, path: str) -> None:
        local = SAMPLES / "tiny-llama-sharded" / "model-00001-of-00002.safetensors"
        location = {
            "same-origin": f"{self.url}/redirected{path}",
            "other-origin": f"{self.behaviour_other}{path}",
            "loop": f"{self.url}{path}",
            "ftp": f"ftp://127.0.0.1:{self.port}{path}",
            "file": f"file://{local}",
            "data": "data:application/octet-stream;base64,AAAA",
            "https-plain": f"https://127.0.0.1:{self.port}{path}",
            "gopher": f"gopher://127.0.0.1:{self.port}/",
            "relative-scheme": f"//127.0.0.1:{self.port}{path}",
        }[to]
        self._raw(h, f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode())

    behaviour_other = ""  # the allowed other origin (a second server), set by the campaign

    @staticmethod
    def _raw(h, data: bytes) -> None:
        h.wfile.write(data)
        h.wfile.flush()

    def _trickle(self, h, data: bytes, pace: float) -> None:
        for byte in data:
            self._raw(h, bytes([byte]))
            time.sleep(pace)

    @staticmethod
    def _hold(h, pace: float) -> None:
        """Say nothing until the client goes (at most a minute)."""
        for _ in range(int(60 / pace)):
            time.sleep(pace)
            try:
                if h.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    return
            except BlockingIOError:
                pass
            except OSError:
                return


def _shard_name(kind: str, shard: str, forbidden: HostileServer, fifo: Path) -> str:
    port = forbidden.port
    return {
        "absolute-forbidden": f"{forbidden.url}/tiny-llama-sharded/{shard}",
        "absolute-upper": f"HTTP://127.0.0.1:{port}/tiny-llama-sharded/{shard}",
        "scheme-relative": f"//127.0.0.1:{port}/tiny-llama-sharded/{shard}",
        "file-shard": f"file://{SAMPLES / 'tiny-llama-sharded' / shard}",
        "file-fifo": f"file://{fifo}",
        "double-slash": f"sub//{shard}",
        "data": "data:application/octet-stream;base64,AAAA",
        "dot-dot": f"../tiny-llama-sharded/{shard}",
        "percent-dot-dot": f"%2e%2e/tiny-llama-sharded/{shard}",
        "query": f"{shard}?x=//127.0.0.1:{port}/",
        "long": "a" * 20_000 + ".safetensors",
        "control": "shard\r\nX-Injected: 1.safetensors",
        "space-unicode": "shard é 1.safetensors",
        "backslash": f"\\\\127.0.0.1:{port}\\{shard}",
        "dot-slash": f"./{shard}",
    }[kind]


def _serve_case(root: Path, behaviour: Behaviour, server: HostileServer, forbidden: HostileServer, fifo: Path) -> str:
    """Lay out the case's files under root/case/ and return the URL to inspect."""
    case = root / "case"
    shutil.rmtree(case, ignore_errors=True)
    if behaviour.target == "single":
        shutil.copytree(SAMPLES / "tiny-llama", case)
        return f"{server.url}/case/model.safetensors"
    shutil.copytree(SAMPLES / "tiny-llama-sharded", case)
    if behaviour.shard_name:
        index_path = case / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        first = "model-00001-of-00002.safetensors"
        name = _shard_name(behaviour.shard_name, first, forbidden, fifo)
        index["weight_map"] = {k: name if v == first else v for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index))
    return f"{server.url}/case/model.safetensors.index.json"


@dataclass
class Outcome:
    number: int
    behaviour: dict
    code: int | None
    seconds: float
    stderr: str
    verdict: str  # "exit0" | "exit2-one-line" | "signal-exit" | a finding class


def _verdict(
    behaviour: Behaviour,
    code: int | None,
    seconds: float,
    stderr: str,
    forbidden_hits: int,
    answered: int,
    signal_sent_at: float | None,
) -> str:
    """The case's outcome class; `answered`: how many requests the server saw."""
    lines = [line for line in stderr.splitlines() if not line.startswith("warning: ")]
    if code is None:
        return "timeout"
    if "Traceback" in stderr:
        return "traceback"
    if forbidden_hits:
        return "reached-forbidden-host"
    if signal_sent_at is not None and code in (129, 130, 143):
        if seconds - signal_sent_at > SIGNAL_SLACK:
            return "slow-signal-exit"
        return "signal-exit" if len(lines) == 1 else "signal-exit-not-one-line"
    if seconds > COMMAND_TIMEOUT + STARTUP_SLACK:
        return "over-deadline"
    if code == 0:
        # success through a non-HTTP URL means it was read: a shard name, or a redirect the server sent
        sent_away = any(
            spec["action"] == "redirect" and spec["to"] in _NON_HTTP and number < answered
            for number, spec in behaviour.actions.items()
        )
        return "read-non-http" if sent_away or behaviour.shard_name in ("file-shard", "file-fifo", "data") else "exit0"
    if code == 2:
        return (
            "exit2-one-line" if lines and lines[0].startswith("error: ") and len(lines) <= 2 else "exit2-not-one-line"
        )
    return "internal-error" if code == 70 else f"exit{code}"


ACCEPTED = ("exit0", "exit2-one-line", "signal-exit")


def run_case(
    number: int, behaviour: Behaviour, root: Path, server: HostileServer, forbidden: HostileServer, fifo: Path
) -> Outcome:
    url = _serve_case(root, behaviour, server, forbidden, fifo)
    server.reset(behaviour)
    forbidden.reset(Behaviour("single"))
    cache = root / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QTOOL_", "HF_"))}
    env.update(
        PYTHONPATH=str(REPO),
        QTOOL_CACHE=str(cache),
        QTOOL_HTTP_TIMEOUT=str(REQUEST_TIMEOUT),
        QTOOL_HTTP_DEADLINE=str(COMMAND_TIMEOUT),
    )
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "qtool", "inspect", url], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=root,
        preexec_fn=default_signal_dispositions,  # a campaign run in the background would pass on SIGINT ignored
    )  # fmt: skip
    signal_sent_at = None
    if behaviour.signum is not None:
        wait_for_qtool_handlers(process)
        try:
            process.wait(timeout=behaviour.signal_at)
        except subprocess.TimeoutExpired:
            process.send_signal(behaviour.signum)
            signal_sent_at = time.monotonic() - started
    try:
        _, stderr = process.communicate(timeout=COMMAND_TIMEOUT + STARTUP_SLACK + SIGNAL_SLACK)
        code = process.returncode
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
        code = None
    seconds = time.monotonic() - started
    verdict = _verdict(behaviour, code, seconds, stderr, len(forbidden.log), server.count, signal_sent_at)
    return Outcome(number, asdict(behaviour), code, round(seconds, 2), stderr[-2000:], verdict)


def campaign(seed: int, cases: int | None, minutes: float | None, log=print) -> dict:
    """Run cases until `cases` or `minutes`; the counts, the slowest case and the findings."""
    stop = time.monotonic() + minutes * 60 if minutes else None
    counts: Counter = Counter()
    by_action: Counter = Counter()
    findings: list[dict] = []
    slowest = 0.0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="qtool-remote-fuzz-") as scratch:
        root = Path(scratch)
        fifo = root / "fifo.safetensors"
        os.mkfifo(fifo)
        server, forbidden, other = HostileServer(root), HostileServer(root), HostileServer(root)
        server.behaviour_other = other.url
        (root / "redirected").symlink_to(root)  # same-origin redirects land on the same files
        try:
            number = 0
            while (cases is None or number < cases) and (stop is None or time.monotonic() < stop):
                behaviour = make_case(seed, number)
                other.reset(Behaviour("single"))
                outcome = run_case(number, behaviour, root, server, forbidden, fifo)
                counts[outcome.verdict] += 1
                for spec in behaviour.actions.values():
                    by_action[spec["action"] if spec["action"] != "redirect" else f"redirect:{spec['to']}"] += 1
                if behaviour.shard_name:
                    by_action[f"shard:{behaviour.shard_name}"] += 1
                if behaviour.signum:
                    by_action[f"signal:{signal.Signals(behaviour.signum).name}"] += 1
                slowest = max(slowest, outcome.seconds)
                if outcome.verdict not in ACCEPTED:
                    findings.append(
                        asdict(outcome) | {"reproduce": f"python -m tests.fuzz.remote --seed {seed} --only {number}"}
                    )
                    log(f"finding: case {number}: {outcome.verdict}: {outcome.stderr.strip()[:300]}")
                number += 1
        finally:
            for each in (server, forbidden, other):
                each.close()
    return {
        "seed": seed,
        "cases": sum(counts.values()),
        "seconds": round(time.monotonic() - started, 1),
        "counts": dict(counts),
        "mutations": dict(sorted(by_action.items())),
        "slowest_seconds": slowest,
        "findings": findings,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fuzz.remote", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, help="stop starting cases after this long")
    parser.add_argument("--cases", type=int, help="cases to run (default: until --minutes, else 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, help="run case number ONLY of the seed (a reproducer)")
    parser.add_argument("--summary-json", type=Path)
    args = parser.parse_args(argv)
    if args.only is not None:
        behaviour = make_case(args.seed, args.only)
        print(json.dumps(asdict(behaviour), indent=2))
        with tempfile.TemporaryDirectory(prefix="qtool-remote-fuzz-") as scratch:
            root = Path(scratch)
            os.mkfifo(root / "fifo.safetensors")
            server, forbidden, other = HostileServer(root), HostileServer(root), HostileServer(root)
            server.behaviour_other = other.url
            (root / "redirected").symlink_to(root)
            try:
                outcome = run_case(args.only, behaviour, root, server, forbidden, root / "fifo.safetensors")
            finally:
                for each in (server, forbidden, other):
                    each.close()
        print(json.dumps(asdict(outcome), indent=2))
        return 0 if outcome.verdict in ACCEPTED else 1
    summary = campaign(
        args.seed, args.cases if args.cases is not None else (None if args.minutes else 30), args.minutes
    )
    print(
        f"qtool remote fuzz: seed {summary['seed']}, {summary['cases']} cases in {summary['seconds']} s, slowest {summary['slowest_seconds']:.1f} s"
    )
    for verdict, count in sorted(summary["counts"].items()):
        print(f"  {verdict:<24} {count}")
    print("mutations: " + ", ".join(f"{k} {v}" for k, v in summary["mutations"].items()))
    print(f"{len(summary['findings'])} findings")
    for finding in summary["findings"]:
        print(f"- case {finding['number']}: {finding['verdict']}: {finding['reproduce']}")
    if args.summary_json:
        args.summary_json.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if summary["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
