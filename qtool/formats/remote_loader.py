"""Open a checkpoint that is not on this machine: `hf://ORG/REPO[@REVISION][/PATH]`, or an
http(s) URL of a .safetensors file, a *.safetensors.index.json or a .gguf file.

Headers come by range requests (`qtool.formats.remote`) and go through the same validating
parsers as local files; side files and indexes are fetched whole, capped. No tensor data is
read: `RemoteCheckpoint` reads tiny metadata tensors by range and refuses everything else.

hf:// needs huggingface_hub (the `hub` extra), imported here only: it lists the repository at
the revision (one request; the listing of a commit hash is cached), builds each file's URL
(`hf_hub_url`, which follows HF_ENDPOINT) at the commit the listing names, and gives the token
(`get_token()`), sent as `Authorization: Bearer` and nowhere else.

The reads run in daemon threads while the calling thread waits, at most until the command's
deadline (`http_opener.Deadlines`): Ctrl-C or SIGTERM in the main thread ends the wait at once,
cancels the requests under way, and no exit waits for a thread stuck on a stalled server.
Shard names from a remote index resolve under the index's own URL, or are refused.
"""

from __future__ import annotations

import json
import posixpath
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable
from urllib.parse import quote, unquote, urljoin, urlsplit

from qtool.errors import CheckpointError, InternalError, UsageError
from qtool.formats.checkpoint import SIDE_FILES, SMALL_TENSOR_LIMIT, Checkpoint, StoredTensor
from qtool.formats.gguf import NeedMore, parse_gguf_prefix
from qtool.formats.http_opener import COMMAND_TIMEOUT_ENV, Deadlines
from qtool.formats.remote import LOGIN_HINT, RemoteCache, RemoteFile, display_url
from qtool.formats.safetensors import MAX_HEADER_SIZE, header_length, parse_header
from qtool.formats.shards import check_index, index_shards, merge_files
from qtool.formats.untrusted_json import parse_json

__all__ = ["open_remote", "refuse_remote_data", "RemoteCheckpoint", "FIRST_READ", "INDEX_CAP", "SIDE_FILE_CAP"]

FIRST_READ = 8 + 64 * 1024  # a safetensors file's first range: the length and most headers
GGUF_FIRST_READ = 64 * 1024  # a GGUF file's first range, doubled until the tensor table fits
GGUF_HEADER_CAP = MAX_HEADER_SIZE
INDEX_CAP = 50_000_000
SIDE_FILE_CAP = 10_000_000
WORKERS = 8
_COMMIT = re.compile(r"[0-9a-f]{40}$")
_HF_FORM = "hf://ORG/REPO[@REVISION][/PATH]"


@dataclass
class RemoteCheckpoint(Checkpoint):
    """A checkpoint read by HTTP range requests: headers and tiny metadata tensors only."""

    session: Any = field(default=None, repr=False, compare=False)
    download: str = ""  # the command that makes it local, for the error of commands that read data

    def __post_init__(self) -> None:
        pass  # no local files to fingerprint

    def require_local(self) -> None:
        raise _not_read(self.path, self.download)

    def read_small(self, tensor: StoredTensor) -> bytes:
        if tensor.nbytes > SMALL_TENSOR_LIMIT:
            raise CheckpointError(
                f"tensor {tensor.name!r} is {tensor.nbytes} bytes, too large to read as metadata", path=tensor.file
            )
        return self.session.read_range(tensor.file, tensor.begin, tensor.nbytes)

    def read_bytes(self, tensor: StoredTensor, start: int = 0, size: int | None = None):
        self.require_local()

    def load(self, tensor: StoredTensor):
        self.require_local()

    def verify_unchanged(self) -> None:
        self.require_local()


class _Session:
    """The requests of one open: shared headers (the token), RemoteFiles by URL, the cache."""

    def __init__(self, deadlines: Deadlines, headers: dict[str, str] | None = None) -> None:
        self.deadlines = deadlines
        self.headers = dict(headers or {})
        self.cache = RemoteCache()
        self.files: dict[str, RemoteFile] = {}

    def file(self, url: str) -> RemoteFile:
        if url not in self.files:
            self.files[url] = RemoteFile(url, self.headers, self.deadlines)
        return self.files[url]

    def read_header(self, url: str, first: int, cap: int, parse: Callable[[bytes, int], Any], double: bool) -> Any:
        """parse(prefix, file size) over a prefix that grows while it raises NeedMore: to exactly
        what it needs, or (double) to at least twice as much. The accepted prefix is cached."""
        remote = self.file(url)
        cached = self.cache.get(url, "head")
        data: bytes | None = None
        if cached is not None and not isinstance(cached[0].get("size"), int):
            cached = None  # an entry from elsewhere: fetch afresh
        if cached is not None:
            meta, blob = cached
            if self.cache.immutable(url) or meta.get("etag"):
                fresh = None if self.cache.immutable(url) else remote.read(0, len(blob), etag=meta["etag"])
                if fresh is None:  # unchanged (304), or immutable
                    data, remote.size, remote.etag = blob, meta.get("size"), meta.get("etag")
                else:
                    data = fresh
        if data is None:
            data = remote.read(0, first)
        size = remote.size
        if not isinstance(size, int):  # every read that returned bytes sets it
            raise InternalError(f"{url}: a read returned bytes without the file's size")
        fetched = cached is None or data is not cached[1]
        while True:
            try:
                result = parse(data, size)
                break
            except NeedMore as more:
                if more.size > cap:
                    raise remote.fail(f"header needs {more.size} bytes, over the {cap}-byte limit") from None
                want = min(size, cap, max(more.size, 2 * len(data))) if double else more.size
                if want <= len(data):
                    raise remote.fail("file is cut short inside its header") from None
                data += remote.read(len(data), want - len(data))
                fetched = True
        if fetched:
            self.cache.put(url, "head", data, etag=remote.etag, size=size)
        return result

    def read_range(self, url: str, start: int, size: int) -> bytes:
        """A small range (a metadata tensor), cached under the file's ETag."""
        remote = self.file(url)
        kind = f"range:{start}:{size}"
        cached = self.cache.get(url, kind)
        if cached is not None and (self.cache.immutable(url) or (remote.etag and cached[0].get("etag") == remote.etag)):
            return cached[1]
        data = remote.read(start, size) or b""
        if len(data) != size:
            raise remote.fail(f"the file ends before byte {start + size}")
        self.cache.put(url, kind, data, etag=remote.etag)
        return data

    def read_json(self, url: str, cap: int, missing_ok: bool) -> Any:
        """A whole JSON file, parsed; None when missing_ok and it does not exist (404)."""
        cached = self.cache.get(url, "whole")
        immutable = self.cache.immutable(url)
        if cached is not None and immutable:
            return None if cached[0].get("absent") else parse_json(cached[1], display_url(url))
        remote = RemoteFile(url, self.headers, self.deadlines)
        etag = cached[0].get("etag") if cached is not None else None
        data = remote.read_whole(cap, etag=etag)
        if data is None and remote.status == 304 and cached is not None:
            return parse_json(cached[1], display_url(url))
        if data is None:
            if not missing_ok:
                raise remote.fail("not found (HTTP 404)", hint="check the URL")
            if immutable:
                self.cache.put(url, "whole", b"", absent=True)
            return None
        parsed = parse_json(data, display_url(url))
        self.cache.put(url, "whole", data, etag=remote.etag)
        return parsed


def _safetensors_header(session: _Session, url: str) -> tuple[str, list[StoredTensor], dict[str, str]]:
    shown = display_url(url)

    def parse(data: bytes, size: int):
        if size == 0:
            raise CheckpointError("file is empty (0 bytes)", path=shown)
        if size < 8:
            raise CheckpointError(f"file is {size} bytes, shorter than the 8-byte header length", path=shown)
        length = header_length(shown, data[:8], size)
        if len(data) < 8 + length:
            raise NeedMore(8 + length)
        tensors, metadata = parse_header(url, bytes(data[8 : 8 + length]), size)
        return tensors, metadata

    tensors, metadata = session.read_header(url, FIRST_READ, 8 + MAX_HEADER_SIZE, parse, double=False)
    return url, tensors, metadata


def _gguf_header(session: _Session, url: str):
    return session.read_header(
        url, GGUF_FIRST_READ, GGUF_HEADER_CAP, lambda data, size: parse_gguf_prefix(url, data, size), double=True
    )


@dataclass
class _Place:
    """Where a remote checkpoint's files are: `url(name)` for a file beside the chosen one
    (None when known absent), what the user named, and how to download it."""

    display: str
    url: Callable[[str], str | None]
    download: str
    headers: dict[str, str] = field(default_factory=dict)


def _not_read(path: str, download: str) -> CheckpointError:
    return CheckpointError(
        f"tensor data of a remote checkpoint is not read; download it first: {download}",
        path=path,
        hint="then run the command on the local copy; `qtool inspect` and header-only `qtool check` read remote checkpoints",
    )


def refuse_remote_data(location: str) -> None:
    """For the commands that read tensor data: refuse a remote location with the command that
    downloads it, from the location alone (no request, so offline too)."""
    if location.startswith("hf://"):
        repo_id, revision, _ = _parse_hub(location)
        raise _not_read(location, _hub_download(repo_id, revision))
    raise _not_read(location, f"curl -LO {display_url(location)}")


def open_remote(location: str) -> Checkpoint:
    """Read the headers of a remote checkpoint. No tensor data is read. The reads run in daemon
    threads; this one waits, at most until the command's deadline (`QTOOL_HTTP_DEADLINE`)."""
    deadlines = Deadlines.from_environment()
    shown = location if location.startswith("hf://") else display_url(location)
    return _run_all([lambda: _open_remote(location, deadlines)], deadlines, shown, workers=1)[0]


def _run_all(calls: list[Callable[[], Any]], deadlines: Deadlines, shown: str, workers: int = WORKERS) -> list[Any]:
    """`calls` run on up to `workers` daemon threads: their results in order, or the first
    failure in order. The caller waits interruptibly (a signal's exception ends the wait) and at
    most until the command's deadline; either way the requests under way are cut. Daemon
    threads, never joined: a thread stuck on a server holds up no exit."""
    results: list[Any] = [None] * len(calls)
    failures: list[BaseException | None] = [None] * len(calls)
    pending = iter(range(len(calls)))
    finished = [0]
    lock = threading.Lock()
    done = threading.Event()

    def work() -> None:
        while True:
            with lock:
                index = next(pending, None)
            if index is None:
                return
            try:
                results[index] = calls[index]()
            except BaseException as exc:
                failures[index] = exc
            with lock:
                finished[0] += 1
                if finished[0] == len(calls):
                    done.set()

    if not calls:
        return []
    for _ in range(min(workers, len(calls))):
        threading.Thread(target=work, name="qtool-remote", daemon=True).start()
    try:
        while not done.wait(timeout=min(1.0, max(0.0, deadlines.command_end - time.monotonic()))):
            if time.monotonic() >= deadlines.command_end:
                raise deadlines.late(COMMAND_TIMEOUT_ENV, shown)
    except BaseException:
        deadlines.cancel()
        raise
    for failure in failures:
        if failure is not None:
            raise failure
    return results


def _open_remote(location: str, deadlines: Deadlines) -> Checkpoint:
    if location.startswith("hf://"):
        place, chosen = _hub_place(location, deadlines)
    else:
        parts = urlsplit(location)
        if not parts.netloc:
            raise UsageError(f"{location!r} is not a URL", hint="write https://HOST/PATH/model.safetensors")
        base = location

        def url(name: str) -> str:
            return urljoin(base, quote(name, safe="/"))  # a file name, not a URL: `%` and `?` are literal

        shown = display_url(location)
        place, chosen = _Place(location, url, f"curl -LO {shown}"), unquote(posixpath.basename(parts.path))
    session = _Session(deadlines, place.headers)
    if chosen.endswith(".index.json"):
        return _open_index(session, place, chosen)
    if chosen.endswith(".safetensors"):
        return _open_safetensors(session, place, [place.url(chosen) or chosen])
    if chosen.endswith(".gguf"):
        url = place.url(chosen) or chosen
        tensors, metadata = _gguf_header(session, url)
        return RemoteCheckpoint(
            path=place.display,
            format="gguf",
            files=[url],
            tensors={t.name: t for t in tensors},
            metadata=metadata,
            session=session,
            download=place.download,
        )
    raise CheckpointError(
        f"unsupported remote file {chosen!r}",
        path=display_url(location) if not location.startswith("hf://") else location,
        hint="remote locations read .safetensors, *.safetensors.index.json and .gguf files; download other formats first",
    )


def _open_safetensors(
    session: _Session, place: _Place, urls: list[str], weight_map=None, shard_urls=None, index_url=None
) -> Checkpoint:
    side_urls = {name: url for name, url in ((name, place.url(name)) for name in SIDE_FILES) if url}
    calls: list[Callable[[], Any]] = [lambda url=url: _safetensors_header(session, url) for url in urls]
    calls += [lambda url=url: session.read_json(url, SIDE_FILE_CAP, True) for url in side_urls.values()]
    results = _run_all(calls, session.deadlines, place.display)
    per_file = results[: len(urls)]
    side_files = dict(zip(side_urls, results[len(urls) :]))
    tensors, metadata = merge_files(per_file)
    checkpoint = RemoteCheckpoint(
        path=place.display,
        format="safetensors",
        files=list(urls),
        tensors=tensors,
        metadata=metadata,
        side_files={name: value for name, value in side_files.items() if value is not None},
        session=session,
        download=place.download,
    )
    if weight_map is not None:
        check_index(checkpoint, weight_map, shard_urls, index_url)
    return checkpoint


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def _shard_url(place: _Place, index_url: str, folder: str, shard: str, shown: str) -> str:
    """A shard's URL: its name resolved under the index's own URL (same scheme, host and port,
    inside the index's folder). A name that is a URL (`http://elsewhere/...`, `file:///...`) or
    holds `//` would send qtool elsewhere: refused."""
    if _SCHEME.match(shard) or "//" in shard:
        raise CheckpointError(
            f"index names shard {shard!r}, which is a URL or holds '//', not a file name beside the index",
            path=shown,
            hint="shard names in a remote index must be relative file names; qtool reads nothing the index points to elsewhere",
        )
    url = place.url(posixpath.join(folder, shard) if folder else shard)
    if url is None:
        raise CheckpointError(
            f"index names shard {shard!r}, which does not exist", path=shown, hint="the repository may be incomplete"
        )
    resolved, base = urlsplit(url), urlsplit(index_url)
    inside = posixpath.dirname(base.path).rstrip("/") + "/"
    if (resolved.scheme, resolved.netloc) != (base.scheme, base.netloc) or not resolved.path.startswith(inside):
        raise CheckpointError(
            f"index names shard {shard!r}, which resolves to {display_url(url)}, outside the index's folder", path=shown
        )
    return url


def _open_index(session: _Session, place: _Place, name: str) -> Checkpoint:
    index_url = place.url(name) or name
    shown = display_url(index_url)
    weight_map, shards = index_shards(session.read_json(index_url, INDEX_CAP, missing_ok=False), shown)
    if not shards or not all(s.endswith(".safetensors") for s in shards):
        raise CheckpointError(
            "remote indexes must name .safetensors shards", path=shown, hint="download PyTorch pickle checkpoints first"
        )
    folder = posixpath.dirname(name)
    shard_urls = {shard: _shard_url(place, index_url, folder, shard, shown) for shard in shards}
    return _open_safetensors(session, place, list(shard_urls.values()), weight_map, shard_urls, shown)


# -- hf:// -----------------------------------------------------------------------------------------


def _parse_hub(location: str) -> tuple[str, str | None, str]:
    """hf://ORG/REPO[@REVISION][/PATH] as (repo id, revision or None, path)."""
    parts = location[len("hf://") :].split("/")
    if len(parts) < 2 or not parts[0] or not parts[1] or parts[1].startswith("@"):
        raise UsageError(f"{location!r} is not a Hub location", hint=f"write {_HF_FORM}")
    repo, _, revision = parts[1].partition("@")
    return f"{parts[0]}/{repo}", unquote(revision) or None, "/".join(p for p in parts[2:] if p)


def _hub_download(repo_id: str, revision: str | None) -> str:
    return f"huggingface-cli download {repo_id}" + (f" --revision {revision}" if revision else "")


def _hub_place(location: str, deadlines: Deadlines) -> tuple[_Place, str]:
    """Resolve hf://ORG/REPO[@REVISION][/PATH] with huggingface_hub: the file to read first."""
    repo_id, revision, path = _parse_hub(location)
    try:
        import huggingface_hub
    except ImportError:
        raise CheckpointError(
            "reading hf:// locations needs huggingface_hub", path=location, hint='pip install "qtool[hub]"'
        ) from None

    token = huggingface_hub.get_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    commit, files = _hub_listing(huggingface_hub, location, repo_id, revision, token, deadlines.request_timeout)
    listed = set(files)
    chosen = _choose(location, files, path)
    base = posixpath.dirname(chosen)

    def url(name: str) -> str | None:
        full = posixpath.normpath(posixpath.join(base, name)) if base else name
        return huggingface_hub.hf_hub_url(repo_id, full, revision=commit) if full in listed else None

    return _Place(location, url, _hub_download(repo_id, revision), headers), posixpath.basename(chosen)


def _hub_listing(
    hub, location: str, repo_id: str, revision: str | None, token: str | None, timeout: float
) -> tuple[str, list[str]]:
    """The commit and the files of a repository at a revision; a commit hash's listing comes
    from the cache when it was read before (it can't change)."""
    cache = RemoteCache()
    key = f"{hub.constants.ENDPOINT}/api/models/{repo_id}/revision/{revision}"
    if revision and _COMMIT.match(revision):
        cached = cache.get(key, "listing")
        if cached is not None:
            listing = parse_json(cached[1], location)
            if isinstance(listing, dict) and isinstance(listing.get("files"), list):
                return revision, [f for f in listing["files"] if isinstance(f, str)]
    from huggingface_hub import utils as errors  # where 0.20 and later all export the error types

    try:
        info = hub.HfApi().model_info(repo_id, revision=revision, token=token or False, timeout=timeout)
    except errors.HFValidationError:
        raise UsageError(f"{repo_id!r} is not a valid repository id", hint=f"write {_HF_FORM}") from None
    except errors.GatedRepoError:
        raise CheckpointError(
            "the repository is gated: accept its terms on the Hub, then log in", path=location, hint=LOGIN_HINT
        ) from None
    except errors.RevisionNotFoundError:
        raise CheckpointError(
            f"revision {revision!r} not found", path=location, hint="check the branch, tag or commit"
        ) from None
    except errors.RepositoryNotFoundError:
        raise CheckpointError(
            "repository not found, or private and not readable with your token", path=location, hint=LOGIN_HINT
        ) from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        hint = LOGIN_HINT if status in (401, 403) else "check the location and your network"
        raise CheckpointError(f"the Hub refused the listing (HTTP {status})", path=location, hint=hint) from None
    except Exception as exc:  # connection errors come in the HTTP library's own types
        raise CheckpointError(
            f"cannot reach the Hub ({type(exc).__name__})", path=location, hint="check HF_ENDPOINT and your network"
        ) from None
    commit = info.sha if isinstance(info.sha, str) and _COMMIT.match(info.sha) else revision or "main"
    files = [s.rfilename for s in (info.siblings or []) if isinstance(getattr(s, "rfilename", None), str)]
    if _COMMIT.match(commit):
        cache.put(
            f"{hub.constants.ENDPOINT}/api/models/{repo_id}/revision/{commit}",
            "listing",
            json.dumps({"files": files}).encode(),
        )
    return commit, files


def _choose(location: str, files: list[str], path: str) -> str:
    """The file to read, chosen as in a local folder: model.safetensors, else the index, else the
    one .safetensors file, else the one .gguf. (Several .safetensors files without an index,
    which a local folder reads together, are refused: name one.)"""
    if path in files:
        return path
    prefix = f"{path}/" if path else ""
    names = sorted(f[len(prefix) :] for f in files if f.startswith(prefix) and "/" not in f[len(prefix) :])
    if not names:
        raise CheckpointError(
            f"no file or folder {path!r} in the repository" if path else "the repository is empty", path=location
        )
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if len(indexes) > 1:
        indexes = [n for n in indexes if n == "model.safetensors.index.json"] or indexes
        if len(indexes) > 1:
            raise CheckpointError(
                f"holds {len(indexes)} safetensors indexes ({', '.join(indexes)})",
                path=location,
                hint="name the index you mean in the location",
            )
    safetensors = [n for n in names if n.endswith(".safetensors")]
    ggufs = [n for n in names if n.endswith(".gguf")]
    if "model.safetensors" in safetensors:  # transformers' order, as a local folder is read
        chosen = "model.safetensors"
    elif indexes:
        chosen = indexes[0]
    elif len(safetensors) == 1:
        chosen = safetensors[0]
    elif safetensors:
        raise CheckpointError(
            f"holds {len(safetensors)} .safetensors files and no index",
            path=location,
            hint="name the file you mean in the location",
        )
    elif len(ggufs) == 1:
        chosen = ggufs[0]
    elif ggufs:
        raise CheckpointError(
            f"holds {len(ggufs)} GGUF files ({', '.join(ggufs)})",
            path=location,
            hint="name the .gguf file you mean in the location",
        )
    else:
        raise CheckpointError(
            "holds no .safetensors, *.safetensors.index.json or .gguf file",
            path=location,
            hint="remote locations read safetensors and GGUF; download other formats first",
        )
    return prefix + chosen
