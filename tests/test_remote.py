"""Remote checkpoints: `qtool inspect https://...` and `hf://ORG/REPO[@REV][/PATH]` against a
loopback HTTP server (http.server, here) that serves files with Range support, fakes the few Hub
endpoints huggingface_hub calls, misbehaves on demand, and logs every request with the bytes it
sent. No network beyond 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

from qtool.formats.remote import SLACK
from qtool.formats.remote_loader import FIRST_READ
from tests.conftest import CT_FIXTURES, REPO, SAMPLES

TOKEN = "hf_secretTOKEN1234567890"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 8192


class Server:
    """A threaded loopback server. `mode` chooses how it answers range requests: ok, norange
    (200, whole body), badrange (another Content-Range), cut (closes mid-body), huge (a
    Content-Length far over the range), long (no Content-Length, sends past the range),
    trickle (the body one byte every `pace` seconds), trickle-headers (the same with the
    headers), stall (headers, then nothing). `redirects` maps a path to a Location (302)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mode = "ok"
        self.pace = 0.5  # seconds between the bytes of a trickle
        self.redirects: dict[str, str] = {}
        self.trickling = 0  # answers that have started to trickle
        self.busy_sent = False
        self.latency = 0.0  # seconds added before each file response (benchmarks/bench_remote.py)
        self.log: list[dict] = []  # one entry per answered request, once its handler has returned
        self.answering = 0  # handlers under way
        self.lock = threading.Lock()
        self.repos: dict[str, dict] = {}  # repo id -> {"folder": Path, "private": bool}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                server.handle(self, head=True)

            def do_GET(self):
                server.handle(self, head=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- what was asked ---------------------------------------------------------------------------

    def requests(self, part: str = "") -> list[dict]:
        return [r for r in self.log if part in r["path"]]

    def settle(self, timeout: float = 120) -> None:
        """Until every handler under way has returned (its client gone): a request's entry is
        in the log only then. A wait on that state, not a sleep, so a loaded machine cannot
        leave an entry out of what a test checks."""
        deadline = time.monotonic() + timeout
        while self.answering:
            assert time.monotonic() < deadline, f"{self.answering} requests still being answered after {timeout} s"
            time.sleep(0.01)

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        entry = {
            "method": h.command,
            "path": h.path,
            "range": h.headers.get("Range"),
            "status": None,
            "sent": 0,
            "auth": h.headers.get("Authorization"),
        }
        with self.lock:
            self.answering += 1
        try:
            self._answer(h, head, entry)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self.log.append(entry)
            with self.lock:
                self.answering -= 1

    def _send(self, h, entry, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        entry["status"] = status
        h.send_response(status)
        for key, value in (headers or {}).items():
            h.send_header(key, value)
        if "Content-Length" not in (headers or {}):
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if body and h.command != "HEAD":
            h.wfile.write(body)
            entry["sent"] += len(body)

    def _answer(self, h, head: bool, entry: dict) -> None:
        path = h.path.split("?")[0]
        if path in self.redirects:
            return self._send(h, entry, 302, b"", {"Location": self.redirects[path]})
        api = re.match(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path)
        if api:
            return self._listing(h, entry, api.group(1), api.group(2) or "main")
        resolve = re.match(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if resolve:
            repo = self.repos.get(resolve.group(1))
            if repo is None or resolve.group(2) not in ("main", COMMIT) or not self._authorized(h, repo):
                return self._send(h, entry, 401 if repo and repo["private"] else 404, b"{}")
            if repo.get("cdn") is not None:  # large files live elsewhere, as on the Hub
                return self._send(
                    h, entry, 302, b"", {"Location": f"{repo['cdn'].url}/{resolve.group(3)}", "X-Repo-Commit": COMMIT}
                )
            return self._file(h, entry, repo["folder"] / resolve.group(3))
        return self._file(h, entry, self.root / unquote(path).lstrip("/"))  # as a real server decodes it

    def _authorized(self, h, repo: dict) -> bool:
        return not repo["private"] or h.headers.get("Authorization") == f"Bearer {TOKEN}"

    def _listing(self, h, entry, repo_id: str, revision: str) -> None:
        repo = self.repos.get(repo_id)
        if repo is None or not self._authorized(h, repo):
            return self._send(
                h,
                entry,
                401,
                b'{"error": "Repository not found"}',
                {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"},
            )
        if revision not in ("main", COMMIT):
            return self._send(
                h,
                entry,
                404,
                b'{"error": "Invalid rev id"}',
                {"X-Error-Code": "RevisionNotFound", "Content-Type": "application/json"},
            )
        files = sorted(str(p.relative_to(repo["folder"])) for p in repo["folder"].rglob("*") if p.is_file())
        body = json.dumps(
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": COMMIT,
                "private": repo["private"],
                "siblings": [{"rfilename": f} for f in files],
            }
        )
        self._send(h, entry, 200, body.encode(), {"Content-Type": "application/json"})

    def _file(self, h, entry, file: Path) -> None:
        if self.latency:
            time.sleep(self.latency)
        if not file.is_file():
            return self._send(h, entry, 404, b"not found", {"X-Error-Code": "EntryNotFound"})
        info = file.stat()
        size = info.st_size
        etag = f'"{size:x}-{info.st_mtime_ns:x}"'
        common = {"ETag": etag, "X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes"}
        wanted = h.headers.get("Range")
        if h.headers.get("If-None-Match") == etag:
            return self._send(h, entry, 304, b"", {**common, "Content-Length": "0"})
        if not wanted:
            return self._stream(h, entry, 200, file, 0, size, {**common, "Content-Length": str(size)}, pace=False)
        match = re.match(r"bytes=(\d+)-(\d+)$", wanted)
        start, last = int(match.group(1)), min(int(match.group(2)), size - 1)
        mode = self.mode
        if mode == "busy" or (mode == "busy-once" and not self.busy_sent):
            self.busy_sent = True
            return self._send(h, entry, 503, b"busy")
        if mode == "norange":
            return self._stream(h, entry, 200, file, 0, size, {**common, "Content-Length": str(size)})
        if mode == "trickle-headers":
            return self._trickle(h, entry, b"HTTP/1.1 206 Partial Content\r\nX-Slow: " + b"x" * 60_000)
        content_range = f"bytes {start}-{last}/{size}"
        if mode == "badrange":
            content_range = f"bytes {start + 1}-{last + 1}/{size}"
        headers = {**common, "Content-Range": content_range, "Content-Length": str(last + 1 - start)}
        if mode == "cut":
            return self._stream(h, entry, 206, file, start, start + 100, headers)
        if mode == "huge":
            return self._stream(h, entry, 206, file, start, size, {**headers, "Content-Length": str(10**12)})
        if mode == "long":
            del headers["Content-Length"]
            return self._stream(h, entry, 206, file, start, size, headers)
        if mode in ("trickle", "stall"):
            entry["status"] = 206
            h.send_response(206)
            for key, value in headers.items():
                h.send_header(key, value)
            h.end_headers()
            h.wfile.flush()
            return self._trickle(h, entry, file.read_bytes()[start : last + 1] if mode == "trickle" else b"")
        self._stream(h, entry, 206, file, start, last + 1, headers, pace=False)

    def _trickle(self, h, entry, data: bytes) -> None:
        """Send `data` one byte every `pace` seconds (raw: status line and headers too, when
        they are in it), then hold the connection open without a word, until the client goes."""
        h.close_connection = True
        self.trickling += 1
        for byte in data:
            h.wfile.write(bytes([byte]))
            h.wfile.flush()
            entry["sent"] += 1
            time.sleep(self.pace)
        while True:  # a stall: the client's deadline must end it
            time.sleep(self.pace)
            try:
                if h.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    return  # the client closed its end
            except BlockingIOError:
                pass

    def _stream(
        self, h, entry, status: int, file: Path, start: int, end: int, headers: dict, pace: bool = True
    ) -> None:
        """Send bytes [start, end) of `file` in chunks, as a real server does, until the client
        goes away (paced, for the misbehaving modes, so the log shows what it read)."""
        entry["status"] = status
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.end_headers()
        if h.command == "HEAD":
            return
        with open(file, "rb") as handle:
            handle.seek(start)
            at = start
            while at < end:
                piece = handle.read(min(CHUNK, end - at))
                h.wfile.write(piece)
                h.wfile.flush()
                entry["sent"] += len(piece)
                at += len(piece)
                if pace:
                    time.sleep(0.002)
        h.close_connection = True


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    shutil.copytree(SAMPLES / "tiny-llama", root / "tiny-llama")
    shutil.copytree(SAMPLES / "tiny-llama-sharded", root / "tiny-llama-sharded")
    shutil.copytree(CT_FIXTURES / "W4A16", root / "ct-w4a16", ignore=shutil.ignore_patterns("reference"))
    _write_gguf(root / "gguf" / "model.gguf")
    _write_big(root / "big" / "model.safetensors")
    _write_many(root / "many" / "model.safetensors")
    shutil.copytree(
        SAMPLES.parent / "tests" / "fixtures" / "bnb" / "nf4_nested",
        root / "bnb-nf4",
        ignore=shutil.ignore_patterns("reference"),
    )
    (root / "over").mkdir()
    (root / "over" / "model.safetensors").write_bytes((200_000_000).to_bytes(8, "little") + b"{}" + bytes(100_000))
    server = Server(root)
    server.repos["org/public"] = {"folder": root / "tiny-llama", "private": False}
    server.repos["org/private"] = {"folder": root / "ct-w4a16", "private": True}
    server.repos["org/sharded"] = {"folder": root / "tiny-llama-sharded", "private": False}
    yield server
    server.close()


@pytest.fixture(autouse=True)
def _answers_settled(request):
    """Before each test on the server: every answer of an earlier test is in the log, so none
    lands in this test's (a handler whose client has gone takes a moment to notice, more on a
    loaded machine)."""
    if "served" in request.fixturenames:
        request.getfixturevalue("served").settle()


def _write_many(path: Path) -> None:
    """A header over 64 KiB: its second part needs a second request."""
    from tests.conftest import write_safetensors

    write_safetensors(
        path, {f"model.layers.{i}.mlp.experts.{j}.weight": ("BF16", (4, 4)) for i in range(40) for j in range(40)}
    )


def _write_gguf(path: Path) -> None:
    import gguf
    import numpy as np

    path.parent.mkdir(parents=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"token-{i}" * 4 for i in range(8000)])  # a header over 64 KiB
    writer.add_tensor("blk.0.attn_q.weight", np.ones((512, 512), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((32, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_big(path: Path) -> None:
    """A 4 MB file with a small header: what a server that ignores Range would send whole."""
    from tests.conftest import write_safetensors

    write_safetensors(path, {"w": ("F32", (1024, 1024))})


def qtool(*args: str, cache: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("QTOOL_", "HF_"))}
    environment.update(
        PYTHONPATH=str(REPO), QTOOL_CACHE=str(cache), HF_HOME=str(cache / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1"
    )
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "qtool", *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=REPO,
        timeout=timeout,
    )


def local_json(path: Path) -> dict:
    result = qtool("inspect", str(path), "--json", cache=Path("/nonexistent"))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def same_but_location(remote: dict, local: dict) -> bool:
    def strip(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in ("path", "files")}

    return strip(remote) == strip(local)


def one_error(result: subprocess.CompletedProcess) -> str:
    """The error line of a failed run: exit 2, an `error:` line (and a hint), no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert lines and lines[0].startswith("error: ") and len(lines) <= 2, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def header_bytes(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


# -- https:// ----------------------------------------------------------------------------------------


def test_inspect_one_file_by_url(served, tmp_path):
    served.mode, served.log[:] = "ok", []
    url = f"{served.url}/tiny-llama/model.safetensors"
    result = qtool("inspect", url, "--json", cache=tmp_path)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert same_but_location(document, local_json(served.root / "tiny-llama"))
    assert document["path"] == url and document["files"] == [url]
    reads = served.requests("model.safetensors")
    assert len(reads) == 1 and reads[0]["range"] == f"bytes=0-{FIRST_READ - 1}"
    assert reads[0]["sent"] <= header_bytes(served.root / "tiny-llama" / "model.safetensors") + 64 * 1024
    assert "config" in document["metadata"] or True  # side files came along: config.json was asked for
    assert served.requests("config.json")


def test_inspect_a_sharded_index_by_url(served, tmp_path):
    served.mode, served.log[:] = "ok", []
    url = f"{served.url}/tiny-llama-sharded/model.safetensors.index.json"
    result = qtool("inspect", url, "--json", cache=tmp_path)
    assert result.returncode == 0, result.stderr
    assert same_but_location(json.loads(result.stdout), local_json(served.root / "tiny-llama-sharded"))
    assert len(served.requests("index.json")) == 1
    for shard in sorted((served.root / "tiny-llama-sharded").glob("*.safetensors")):
        reads = served.requests(shard.name)
        assert 1 <= len(reads) <= 2
        assert sum(r["sent"] for r in reads) <= header_bytes(shard) + 64 * 1024


def test_compressed_tensors_weight_shape_comes_by_range(served, tmp_path):
    served.mode, served.log[:] = "ok", []
    url = f"{served.url}/ct-w4a16/model.safetensors"
    result = qtool("inspect", url, "--json", cache=tmp_path)
    assert result.returncode == 0, result.stderr
    assert same_but_location(json.loads(result.stdout), local_json(served.root / "ct-w4a16"))
    reads = served.requests("model.safetensors")
    assert len(reads) > 1  # the header, then weight_shape tensors by range
    assert all(r["range"] for r in reads)


def test_bitsandbytes_quant_state_comes_by_range(served, tmp_path):
    served.mode, served.log[:] = "ok", []
    url = f"{served.url}/bnb-nf4/model.safetensors"
    result = qtool("inspect", url, "--json", cache=tmp_path)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert same_but_location(document, local_json(served.root / "bnb-nf4"))
    assert document["summary"]["quantized_weights"] > 0


def test_a_long_header_takes_a_second_request_for_the_rest(served, tmp_path):
    served.mode, served.log[:] = "ok", []
    file = served.root / "many" / "model.safetensors"
    result = qtool("inspect", f"{served.url}/many/model.safetensors", "--json", cache=tmp_path)
    assert result.returncode == 0, result.stderr
    assert same_but_location(json.loads(result.stdout), local_json(file))
    reads = served.requests("many/model.safetensors")
    assert header_bytes(file) > FIRST_READ
    assert [r["range"] for r in reads] == [f"bytes=0-{FIRST_READ - 1}", f"bytes={FIRST_READ}-{header_bytes(file) - 1}"]


def test_a_header_over_the_limit_is_refused_after_one_request(served, tmp_path):
    served.mode, served.log[:] = "ok", []
    line = one_error(qtool("inspect", f"{served.url}/over/model.safetensors", cache=tmp_path))
    assert "over the 100000000-byte limit" in line
    assert len(served.requests("over/model.safetensors")) == 1


def test_gguf_header_grows_by_ranges(served, tmp_path):
    served.mode, served.log[:] = "ok", []
    url = f"{served.url}/gguf/model.gguf"
    result = qtool("inspect", url, "--json", cache=tmp_path)
    assert result.returncode == 0, result.stderr
    assert same_but_location(json.loads(result.stdout), local_json(served.root / "gguf" / "model.gguf"))
    reads = served.requests("model.gguf")
    assert 2 <= len(reads) <= 4 and all(r["range"] for r in reads)
    assert sum(r["sent"] for r in reads) < (served.root / "gguf" / "model.gguf").stat().st_size


def test_check_reads_headers_remotely(served, tmp_path):
    served.mode = "ok"
    result = qtool(
        "check", f"{served.url}/ct-w4a16/model.safetensors", "--expect-scheme", "W4A16", "--json", cache=tmp_path
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "--stats"),
        ("dequantize", "-o", "OUT"),
        ("quantize", "-o", "OUT", "--scheme", "W8A16"),
        ("check", "--no-nan"),
        ("compare", "LOCAL"),
    ],
    ids=lambda a: " ".join(a),
)
def test_commands_that_read_data_say_download_first(served, tmp_path, args):
    served.mode = "ok"
    url = f"{served.url}/tiny-llama/model.safetensors"
    command, *rest = args
    rest = [
        str(tmp_path / "out") if a == "OUT" else str(served.root / "tiny-llama") if a == "LOCAL" else a for a in rest
    ]
    argv = [command, str(served.root / "tiny-llama"), url] if command == "compare" else [command, url, *rest]
    line = one_error(qtool(*argv, cache=tmp_path))
    assert "download it first" in line and "curl -LO" in line
    assert not (tmp_path / "out").exists()


# -- misbehaving servers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("norange", "does not support range requests"),
        ("badrange", "not the 0-"),
        ("cut", "connection closed"),
        ("huge", "announced"),
        ("long", "more than"),
    ],
)
def test_misbehaving_servers_are_refused_in_one_line(served, tmp_path, mode, says):
    served.mode, served.log[:] = mode, []
    try:
        url = f"{served.url}/big/model.safetensors"
        line = one_error(qtool("inspect", url, cache=tmp_path))
    finally:
        served.mode = "ok"
    assert says in line and url in line
    served.settle()  # the server noticed the client left
    assert served.requests("big/model.safetensors")
    for entry in served.requests("big/model.safetensors"):
        assert entry["sent"] <= FIRST_READ + SLACK + 4 * CHUNK, entry
    assert not list((tmp_path / "remote").glob("*")) if (tmp_path / "remote").exists() else True  # nothing cached


def test_5xx_is_retried_then_refused(served, tmp_path):
    url = f"{served.url}/tiny-llama/model.safetensors"
    served.mode, served.busy_sent, served.log[:] = "busy-once", False, []
    try:
        result = qtool("inspect", url, "--json", cache=tmp_path)
        assert result.returncode == 0, result.stderr
        assert [r["status"] for r in served.requests("model.safetensors")] == [503, 206]
        served.settle()  # the first run's answers all in the log before it is cleared
        served.mode, served.log[:] = "busy", []
        line = one_error(qtool("inspect", url, cache=tmp_path / "other"))
    finally:
        served.mode = "ok"
    assert "HTTP 503 (3 tries)" in line
    assert len(served.requests("model.safetensors")) == 3


def test_a_missing_file_is_one_line(served, tmp_path):
    served.mode = "ok"
    line = one_error(qtool("inspect", f"{served.url}/nothing/model.safetensors", cache=tmp_path))
    assert "not found" in line


# -- the cache ----------------------------------------------------------------------------------------


def test_a_second_inspect_of_a_url_revalidates_only(served, tmp_path):
    served.mode = "ok"
    url = f"{served.url}/ct-w4a16/model.safetensors"
    first = qtool("inspect", url, "--json", cache=tmp_path)
    served.log[:] = []
    second = qtool("inspect", url, "--json", cache=tmp_path)
    assert second.returncode == 0 and second.stdout == first.stdout
    reads = served.requests("model.safetensors")
    assert len(reads) == 1 and reads[0]["status"] == 304 and reads[0]["sent"] == 0  # one conditional request
    assert all(r["status"] in (304, 404) for r in served.log)  # side files: revalidated, or absent


# -- hf:// ----------------------------------------------------------------------------------------------


def hub_env(served, token: str | None = None) -> dict:
    env = {"HF_ENDPOINT": served.url, "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    if token:
        env["HF_TOKEN"] = token
    return env


def test_hf_location_at_main_then_pinned_commit(served, tmp_path):
    served.mode, served.log[:] = "ok", []
    local = local_json(served.root / "tiny-llama")
    result = qtool("inspect", "hf://org/public", "--json", cache=tmp_path, env=hub_env(served))
    assert result.returncode == 0, result.stderr
    assert same_but_location(json.loads(result.stdout), local)
    assert json.loads(result.stdout)["files"] == [f"{served.url}/org/public/resolve/{COMMIT}/model.safetensors"]
    assert served.requests("/api/models/org/public")
    served.log[:] = []
    again = qtool("inspect", "hf://org/public@main", "--json", cache=tmp_path, env=hub_env(served))
    assert again.returncode == 0 and same_but_location(json.loads(again.stdout), local)
    assert [r["path"] for r in served.log] == ["/api/models/org/public/revision/main"]  # the listing only
    served.log[:] = []
    pinned = qtool("inspect", f"hf://org/public@{COMMIT}", "--json", cache=tmp_path, env=hub_env(served))
    assert pinned.returncode == 0, pinned.stderr
    assert same_but_location(json.loads(pinned.stdout), local)
    assert served.log == []  # a commit's listing and headers come from the cache
    served.log[:] = []
    fresh = qtool(
        "inspect",
        f"hf://org/public@{COMMIT}/model.safetensors",
        "--json",
        cache=tmp_path / "fresh",
        env=hub_env(served),
    )
    assert fresh.returncode == 0 and same_but_location(json.loads(fresh.stdout), local)


def test_hf_sharded_repo(served, tmp_path):
    served.mode, served.log[:] = "ok", []
    result = qtool("inspect", "hf://org/sharded", "--json", cache=tmp_path, env=hub_env(served))
    assert result.returncode == 0, result.stderr
    assert same_but_location(json.loads(result.stdout), local_json(served.root / "tiny-llama-sharded"))
    assert len(served.requests("index.json")) == 1


def test_hf_private_repo_needs_the_token_and_never_shows_it(served, tmp_path):
    served.mode, served.log[:] = "ok", []
    line = one_error(qtool("inspect", "hf://org/private", cache=tmp_path, env=hub_env(served, token="hf_wrong")))
    assert "hf://org/private" in line
    result = qtool("inspect", "hf://org/private", cache=tmp_path, env=hub_env(served, token="hf_wrong"))
    assert "huggingface-cli login" in result.stderr and "hf_wrong" not in result.stderr
    served.log[:] = []
    ok = qtool("inspect", "hf://org/private", "--json", cache=tmp_path, env=hub_env(served, token=TOKEN))
    assert ok.returncode == 0, ok.stderr
    assert TOKEN not in ok.stdout + ok.stderr and not any(
        TOKEN.encode() in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
    )
    assert same_but_location(json.loads(ok.stdout), local_json(served.root / "ct-w4a16"))
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in served.log)
    line = one_error(
        qtool(
            "dequantize",
            "hf://org/private",
            "-o",
            str(tmp_path / "out"),
            cache=tmp_path,
            env=hub_env(served, token=TOKEN),
        )
    )
    assert "huggingface-cli download org/private" in line


def test_the_token_does_not_follow_a_redirect_to_another_host(served, tmp_path):
    cdn = Server(served.root / "ct-w4a16")
    served.repos["org/redirected"] = {"folder": served.root / "ct-w4a16", "private": True, "cdn": cdn}
    try:
        served.mode, served.log[:] = "ok", []
        result = qtool("inspect", "hf://org/redirected", "--json", cache=tmp_path, env=hub_env(served, token=TOKEN))
        assert result.returncode == 0, result.stderr
        assert same_but_location(json.loads(result.stdout), local_json(served.root / "ct-w4a16"))
        assert cdn.log and all(r["auth"] is None for r in cdn.log)
        assert all(r["auth"] == f"Bearer {TOKEN}" for r in served.log)
    finally:
        cdn.close()
        del served.repos["org/redirected"]


def test_hf_unknown_revision_and_bad_location(served, tmp_path):
    line = one_error(qtool("inspect", "hf://org/public@nope", cache=tmp_path, env=hub_env(served)))
    assert "revision 'nope' not found" in line
    one_error(qtool("inspect", "hf://justone", cache=tmp_path, env=hub_env(served)))
    assert "not a valid repository id" in one_error(qtool("inspect", "hf://@x/y", cache=tmp_path, env=hub_env(served)))


def test_hf_without_huggingface_hub_says_how_to_install(served, tmp_path):
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "huggingface_hub.py").write_text("raise ImportError('blocked for the test')\n")
    env = {**hub_env(served), "PYTHONPATH": f"{blocker}{os.pathsep}{REPO}"}
    result = subprocess.run(
        [sys.executable, "-m", "qtool", "inspect", "hf://org/public"],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "QTOOL_CACHE": str(tmp_path)},
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert 'pip install "qtool[hub]"' in result.stderr and "Traceback" not in result.stderr


def test_a_repository_is_resolved_in_transformers_order_like_a_local_folder():
    """model.safetensors before an index (as loader._open_directory does), then the index."""
    from qtool.formats.remote_loader import _choose

    both = [
        "model.safetensors",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert _choose("hf://o/r", both, "") == "model.safetensors"
    assert _choose("hf://o/r", both[1:], "") == "model.safetensors.index.json"
    assert _choose("hf://o/r", ["adapter_model.safetensors"], "") == "adapter_model.safetensors"


# -- stalled servers, deadlines and signals (issue 18, item 1) --------------------------------------


def _timed(*args: str, cache: Path, env: dict, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = qtool(*args, cache=cache, env=env, timeout=timeout)
    return result, time.monotonic() - started


@pytest.mark.parametrize("mode", ["trickle", "trickle-headers", "stall"])
def test_a_trickling_or_stalled_server_ends_at_the_request_deadline(served, tmp_path, mode):
    """One byte every 0.5 s never trips a socket's per-read timeout; the request's deadline
    (QTOOL_HTTP_TIMEOUT) cuts it, and the error says which limit and how to change it."""
    served.mode, served.log[:], served.trickling = mode, [], 0
    try:
        url = f"{served.url}/tiny-llama/model.safetensors"
        result, seconds = _timed("inspect", url, cache=tmp_path, env={"QTOOL_HTTP_TIMEOUT": "2"})
    finally:
        served.mode = "ok"
    line = one_error(result)
    assert line == f"error: {url}: no complete answer within 2 s (QTOOL_HTTP_TIMEOUT, the limit for one request)"
    assert "set QTOOL_HTTP_TIMEOUT=SECONDS to wait longer" in result.stderr
    assert seconds < 2 + 45, seconds  # the deadline, plus start-up on a loaded machine (without the deadline: hours)
    # A request past its deadline is not retried: one range request. Counted once the server has
    # answered (on a loaded machine its handler may still be starting when qtool gives up).
    served.settle()
    assert [entry["range"] is not None for entry in served.requests("tiny-llama/model.safetensors")] == [True], (
        served.log
    )


def test_a_request_past_its_deadline_is_not_retried_even_before_its_timer_fires(served, monkeypatch):
    """The deadline is a time, not only the timer thread's flag: on a loaded machine the socket's
    own read timeout (the time left) fired before the timer thread ran, the read looked like a
    dropped connection, and the stalled request was sent again (issue 43: two range requests in
    a stress run). Here the timer never fires at all."""
    from qtool.errors import CheckpointError
    from qtool.formats import http_opener
    from qtool.formats.remote import RemoteFile

    monkeypatch.setattr(http_opener.Watch, "start", lambda self: None)  # a timer thread that never gets to run
    served.mode, served.log[:] = "stall", []
    try:
        with pytest.raises(CheckpointError) as caught:
            RemoteFile(f"{served.url}/tiny-llama/model.safetensors", deadlines=http_opener.Deadlines(1.0, 60.0)).read(
                0, 100
            )
    finally:
        served.mode = "ok"
    assert "no complete answer within 1 s (QTOOL_HTTP_TIMEOUT" in str(caught.value)
    served.settle()
    assert len(served.requests("tiny-llama/model.safetensors")) == 1, served.log


def test_the_command_deadline_bounds_all_requests_together(served, tmp_path):
    served.mode, served.log[:] = "trickle", []
    try:
        url = f"{served.url}/tiny-llama-sharded/model.safetensors.index.json"
        result, seconds = _timed(
            "inspect", url, cache=tmp_path, env={"QTOOL_HTTP_TIMEOUT": "30", "QTOOL_HTTP_DEADLINE": "2"}
        )
    finally:
        served.mode = "ok"
    line = one_error(result)
    assert "remote reads took over 2 s (QTOOL_HTTP_DEADLINE, the limit for the whole command)" in line
    assert "set QTOOL_HTTP_DEADLINE=SECONDS" in result.stderr
    assert seconds < 2 + 45, seconds


@pytest.mark.parametrize("variable", ["QTOOL_HTTP_TIMEOUT", "QTOOL_HTTP_DEADLINE"])
@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf"])
def test_a_bad_timeout_setting_is_one_line(served, tmp_path, variable, value):
    line = one_error(
        qtool("inspect", f"{served.url}/tiny-llama/model.safetensors", cache=tmp_path, env={variable: value})
    )
    assert line == f"error: {variable}={value!r} is not a number of seconds"


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize(
    ("signum", "code", "says"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_ends_a_stalled_remote_read_at_once(served, tmp_path, signum, code, says):
    """The read runs in a worker thread: the signal must end the command at once, not when the
    worker's request ends (here: in 10 minutes, the deadlines set below; 91 hours without one).

    The signal is sent once the server is trickling its answer, the process frozen in that state
    (`signal_when`), and qtool starts with the signals at their defaults: a test run in the
    background of a script inherits SIGINT ignored, which qtool keeps, and that SIGINT was lost
    (issue 43: the run then waited out the test's timeout)."""
    from tests.signal_helpers import default_signal_dispositions, signal_when, wait_for_qtool_handlers

    served.mode, served.log[:], served.trickling = "trickle", [], 0
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("QTOOL_", "HF_"))}
    environment.update(
        PYTHONPATH=str(REPO), QTOOL_CACHE=str(tmp_path), QTOOL_HTTP_TIMEOUT="600", QTOOL_HTTP_DEADLINE="600"
    )
    url = f"{served.url}/tiny-llama/model.safetensors"
    process = subprocess.Popen(
        [sys.executable, "-m", "qtool", "inspect", url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=REPO,
        preexec_fn=default_signal_dispositions,
    )  # fmt: skip
    try:
        wait_for_qtool_handlers(process)
        assert signal_when(process, signum, lambda: served.trickling > 0, timeout=120), "the request never came"
        sent = time.monotonic()
        _, stderr = process.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        served.mode = "ok"
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert (process.returncode, stderr) == (code, f"error: {says}\n")
    assert took < 60, took  # at once: the request's own deadline is 600 s away


# -- HTTP(S) only (issue 18, item 3) ------------------------------------------------------------------


def test_the_opener_carries_http_and_https_handlers_only():
    import urllib.request

    from qtool.formats.http_opener import OPENER

    kinds = {type(h) for h in OPENER.handlers}
    for handler in (
        urllib.request.FileHandler,
        urllib.request.FTPHandler,
        urllib.request.DataHandler,
        urllib.request.CacheFTPHandler,
    ):
        assert not any(issubclass(k, handler) for k in kinds), handler
    assert set(OPENER.handle_open) - {"no"} == {
        "http",
        "https",
        "unknown",
    }  # "no": a no_proxy setting's entry, never a scheme


@pytest.mark.parametrize("scheme", ["file", "ftp", "data"])
def test_a_non_http_url_is_never_opened(tmp_path, scheme):
    """urllib's default opener reads file:// (a FIFO there blocks for good) and ftp://."""
    from qtool.errors import CheckpointError
    from qtool.formats.remote import RemoteFile

    local = tmp_path / "secret.json"
    local.write_text('{"a": 1}')
    url = {"file": f"file://{local}", "ftp": "ftp://127.0.0.1:9/secret.json", "data": "data:,secret"}[scheme]
    with pytest.raises(CheckpointError) as caught:
        RemoteFile(url).read_whole(1000)
    assert caught.value.message == f"not read: {scheme}:// URLs are not read, only http:// and https://"


@pytest.mark.parametrize("target", ["ftp", "file"])
def test_a_redirect_to_a_non_http_url_is_not_followed(served, tmp_path, target):
    local = served.root / "tiny-llama" / "model.safetensors"
    served.redirects["/elsewhere/model.safetensors"] = (
        f"ftp://127.0.0.1:{served.url.rsplit(':', 1)[1]}/tiny-llama/model.safetensors"
        if target == "ftp"
        else f"file://{local}"
    )
    try:
        line = one_error(qtool("inspect", f"{served.url}/elsewhere/model.safetensors", cache=tmp_path, timeout=30))
    finally:
        served.redirects.clear()
    assert "not read" in line and f"{target}:// URLs are not read" in line


# -- shard names resolve under the index (issue 18, item 2) --------------------------------------------


def _hostile_index(served, folder: str, name_for) -> str:
    """A copy of tiny-llama-sharded whose index names its first shard `name_for(shard)`; the
    index's URL."""
    source = served.root / "tiny-llama-sharded"
    target = served.root / folder
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    first = "model-00001-of-00002.safetensors"
    index["weight_map"] = {k: name_for(v) if v == first else v for k, v in index["weight_map"].items()}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return f"{served.url}/{folder}/model.safetensors.index.json"


@pytest.mark.parametrize(
    "kind",
    ["absolute", "absolute-upper", "scheme-relative", "file", "double-slash"],
)
def test_a_remote_index_cannot_send_qtool_to_another_url(served, tmp_path, kind):
    elsewhere = Server(served.root)  # another port: another origin, holding the same shards
    try:
        shard_dir = served.root / "tiny-llama-sharded"
        name_for = {
            "absolute": lambda shard: f"{elsewhere.url}/tiny-llama-sharded/{shard}",
            "absolute-upper": lambda shard: (
                f"HTTP://127.0.0.1:{elsewhere.url.rsplit(':', 1)[1]}/tiny-llama-sharded/{shard}"
            ),
            "scheme-relative": lambda shard: (
                f"//127.0.0.1:{elsewhere.url.rsplit(':', 1)[1]}/tiny-llama-sharded/{shard}"
            ),
            "file": lambda shard: f"file://{shard_dir / shard}",
            "double-slash": lambda shard: f"sub//{shard}",
        }[kind]
        url = _hostile_index(served, f"hostile-{kind}", name_for)
        served.mode = "ok"
        line = one_error(qtool("inspect", url, cache=tmp_path, timeout=60))
        assert elsewhere.log == []
    finally:
        elsewhere.close()
    if kind == "scheme-relative":  # also an absolute path: refused as outside the folder before it resolves
        assert "outside its folder" in line or "is a URL or holds '//'" in line
    else:
        assert "is a URL or holds '//', not a file name beside the index" in line
    assert line.startswith(f"error: {url}: index names shard ")


def test_shard_names_are_file_names_not_url_syntax(served, tmp_path):
    """`%` and `?` in a shard's name are part of the file name: quoted, and the URL stays in the
    index's folder."""
    folder = served.root / "odd-names"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(served.root / "tiny-llama-sharded", folder)
    odd = "model 1%2e?x#y.safetensors"
    (folder / "model-00001-of-00002.safetensors").rename(folder / odd)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        k: odd if v == "model-00001-of-00002.safetensors" else v for k, v in index["weight_map"].items()
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    served.mode, served.log[:] = "ok", []
    result = qtool("inspect", f"{served.url}/odd-names/model.safetensors.index.json", "--json", cache=tmp_path)
    assert result.returncode == 0, result.stderr
    assert same_but_location(json.loads(result.stdout), local_json(folder))
    assert any(r["path"] == "/odd-names/model%201%252e%3Fx%23y.safetensors" for r in served.log), [
        r["path"] for r in served.log
    ]


# -- offline, the documented refusal (issue 18, item 16) ------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("quantize", "REMOTE", "-o", "OUT", "--scheme", "W8A16"),
        ("dequantize", "REMOTE", "-o", "OUT"),
        ("check", "REMOTE", "--no-nan"),
        ("compare", "LOCAL", "REMOTE"),
        ("inspect", "REMOTE", "--stats"),
    ],
    ids=lambda a: a[0] + (" --stats" if "--stats" in a else ""),
)
@pytest.mark.parametrize("location", ["hf://org/repo", "hf://org/repo@v1.0/sub"])
def test_offline_commands_that_read_data_give_the_documented_refusal(tmp_path, args, location):
    """README: commands that read tensor data refuse a remote checkpoint with exit 2 and the
    command that downloads it. That needs no network: not "cannot reach the Hub"."""
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
    argv = [
        location
        if a == "REMOTE"
        else str(tmp_path / "out")
        if a == "OUT"
        else str(SAMPLES / "tiny-llama")
        if a == "LOCAL"
        else a
        for a in args
    ]
    line = one_error(qtool(*argv, cache=tmp_path, env=offline, timeout=60))
    download = "huggingface-cli download org/repo" + (" --revision v1.0" if "@" in location else "")
    assert line == f"error: {location}: tensor data of a remote checkpoint is not read; download it first: {download}"
    assert not (tmp_path / "out").exists()
