"""Read byte ranges of files over HTTP(S), so a remote checkpoint's headers are read without
downloading it. Standard library only (urllib): no new dependency.

Every response is checked before its body is read, and no body is read past what was asked plus
`SLACK` bytes: a server that ignores `Range` (200), answers another range, or sends more than
asked is refused, never drained. Connection errors, 5xx and 429 are retried (3 tries, backoff).

Fetched bytes are cached under qtool's cache folder (`RemoteCache`), one file per URL and kind of
read, holding the ETag the server gave. A URL that names an immutable revision (a Hub
`/resolve/<40-hex commit>/` URL) is reused without a request; any other is revalidated with one
conditional request (`If-None-Match: <etag>`): a 304 reuses the cached bytes, anything else is
read and checked as a fresh response. Nothing is cached that failed validation: the callers
store only what their parsers accepted.

Requests go through `http_opener.OPENER` (HTTP and HTTPS only) and each read, retries included,
runs under a deadline (`QTOOL_HTTP_TIMEOUT`, and the command's `QTOOL_HTTP_DEADLINE`): a server
that trickles its headers or body is cut off there, with one line that names the limit.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from qtool.errors import CheckpointError
from qtool.formats.http_opener import (
    OPENER,
    READ_TIMEOUT,
    Deadlines,
    RefusedURL,
    Watch,
    refuse_scheme,
)
from qtool.formats.untrusted_json import parse_json

__all__ = ["RemoteFile", "RemoteCache", "display_url", "is_remote", "TIMEOUT", "TRIES", "SLACK"]

TIMEOUT = READ_TIMEOUT  # seconds per connect and per read; a whole read has its deadline
TRIES = 3
SLACK = 64 * 1024  # never read more than asked + this
_BACKOFF = 0.5  # seconds before the second try; doubled before the third
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")
_IMMUTABLE = re.compile(r"/resolve/[0-9a-f]{40}/")
_MAX_CACHE_LINE = 1 << 16  # a cache entry's metadata line: URL, kind, length, ETag
LOGIN_HINT = "log in with `huggingface-cli login` or set HF_TOKEN (a token with read access)"


def is_remote(location: object) -> bool:
    return isinstance(location, str) and location.startswith(("hf://", "http://", "https://"))


def display_url(url: str) -> str:
    """The URL as errors show it: no user info, query or fragment (where tokens hide)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


class RemoteFile:
    """One remote file, read by byte ranges. `size` and `etag` are known after the first read.
    `deadlines` are the command's (`http_opener.Deadlines`), shared by all its files."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, deadlines: Deadlines | None = None) -> None:
        self.url = url
        self.display = display_url(url)
        self.headers = dict(headers or {})
        self.deadlines = deadlines or Deadlines.from_environment()
        self.size: int | None = None
        self.etag: str | None = None
        self.status: int | None = None  # of the last whole-file read: 200, 304 or 404

    def fail(self, message: str, hint: str | None = None) -> CheckpointError:
        return CheckpointError(message, path=self.display, hint=hint)

    @contextmanager
    def _deadline(self) -> Iterator[Watch]:
        """One read, its retries included, under its deadline: whatever went wrong in a read
        that the deadline cut short (a reset, a short body), the deadline is what is reported."""
        watch = self.deadlines.watch()
        try:
            yield watch
        except Exception:
            if watch.expired:
                raise self.deadlines.late(watch.which, self.display) from None
            raise
        finally:
            watch.close()

    def _open(self, extra: dict[str, str], watch: Watch, method: str = "GET"):
        """The response, after retries; an HTTP error status raises, except 304 and 404, which
        come back as the response (its body unread)."""
        request = urllib.request.Request(self.url, method=method, headers={**self.headers, **extra})
        request.qtool_watch = watch  # type: ignore[attr-defined]  # the opener's connections report their sockets to it
        for attempt in range(TRIES):
            last = attempt == TRIES - 1
            if watch.expired:
                raise self.deadlines.late(watch.which, self.display)
            try:
                refuse_scheme(self.url)
                return OPENER.open(request, timeout=max(0.001, min(TIMEOUT, watch.remaining())))
            except urllib.error.HTTPError as exc:
                if exc.code in (304, 404):
                    return exc
                exc.close()
                if (exc.code == 429 or exc.code >= 500) and not last:
                    watch.sleep(_BACKOFF * 2**attempt)
                    continue
                raise self._status_error(exc.code) from None
            except RefusedURL as exc:
                raise self.fail(
                    f"not read: {exc.reason}", hint="qtool reads remote checkpoints over HTTP(S) only"
                ) from None
            except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
                if not last:
                    watch.sleep(_BACKOFF * 2**attempt)
                    continue
                reason = getattr(exc, "reason", None) or exc
                raise self.fail(
                    f"cannot connect ({reason}, {TRIES} tries)", hint="check the URL and your network"
                ) from None
            except ValueError as exc:  # http.client.InvalidURL: a control character or a bad port
                raise self.fail(f"is not a URL qtool can request ({exc})") from None
        raise AssertionError("unreachable")

    def _status_error(self, code: int) -> CheckpointError:
        if code in (401, 403):
            return self.fail(f"access denied (HTTP {code})", hint=LOGIN_HINT)
        if code == 404:
            return self.fail("not found (HTTP 404)", hint="check the repository, revision and file name")
        if code == 416:
            return self.fail("the server refused the byte range (HTTP 416): the file is shorter than its header says")
        return self.fail(
            f"the server answered HTTP {code} ({TRIES} tries)"
            if code == 429 or code >= 500
            else f"the server answered HTTP {code}"
        )

    def read(self, start: int, size: int, etag: str | None = None) -> bytes | None:
        """Bytes [start, start + size) of the file, fewer only where the file ends. With `etag`,
        a conditional request: None when the file still has that ETag (304)."""
        if size <= 0:
            return b""
        extra = {"Range": f"bytes={start}-{start + size - 1}", "Accept-Encoding": "identity"}
        if etag:
            extra["If-None-Match"] = etag
        with self._deadline() as watch:
            for attempt in range(TRIES):
                response = self._open(extra, watch)
                try:
                    return self._range_body(response, start, size)
                except _Truncated as exc:
                    if attempt == TRIES - 1 or watch.expired:
                        raise self.fail(
                            f"the connection closed after {exc.got} of {exc.want} bytes ({TRIES} tries)",
                            hint="try again later",
                        ) from None
                    watch.sleep(_BACKOFF * 2**attempt)
                finally:
                    response.close()
        raise AssertionError("unreachable")

    def _range_body(self, response, start: int, size: int) -> bytes | None:
        status = response.status if hasattr(response, "status") else response.code
        if status == 304:
            return None
        if status == 404:
            raise self._status_error(404)
        if status == 200:
            raise self.fail(
                "the server does not support range requests (it answered 200 with the whole file)",
                hint="download the checkpoint and inspect the local copy",
            )
        if status != 206:
            raise self.fail(f"the server answered HTTP {status} to a range request")
        found = _CONTENT_RANGE.match(response.headers.get("Content-Range", "").strip())
        if not found or found.group(3) == "*":
            raise self.fail(
                f"the server sent a missing or malformed Content-Range ({response.headers.get('Content-Range')!r})"
            )
        first, last, total = int(found.group(1)), int(found.group(2)), int(found.group(3))
        want = min(size, total - start)
        if first != start or last != start + want - 1 or want <= 0:
            raise self.fail(
                f"the server sent bytes {first}-{last} of {total}, not the {start}-{start + size - 1} asked for"
            )
        length = response.headers.get("Content-Length")
        if length is not None and (not length.strip().isdigit() or int(length) != want):
            raise self.fail(f"the server announced {length} bytes for a range of {want}")
        try:
            data = response.read(want + 1)  # one more: a body longer than the range is refused
        except http.client.IncompleteRead as exc:
            raise _Truncated(len(exc.partial), want) from None
        except (OSError, http.client.HTTPException):
            raise _Truncated(0, want) from None
        if len(data) > want:
            raise self.fail(f"the server sent more than the {want} bytes asked for")
        if len(data) < want:
            raise _Truncated(len(data), want)
        if self.size is not None and self.size != total:
            raise self.fail(f"the file changed size while it was read ({self.size} then {total} bytes)")
        etag = response.headers.get("ETag")
        if etag and self.etag and etag != self.etag:
            raise self.fail("the file changed while it was read (its ETag changed)", hint="run qtool again")
        self.size = total
        self.etag = etag or self.etag
        return data

    def read_whole(self, cap: int, etag: str | None = None) -> bytes | None:
        """The whole file, at most `cap` bytes; None when it does not exist (404), or, with
        `etag`, when it still has that ETag (304): callers tell the two apart by `self.status`."""
        extra = {"Accept-Encoding": "identity"}
        if etag:
            extra["If-None-Match"] = etag
        with self._deadline() as watch:
            for attempt in range(TRIES):
                response = self._open(extra, watch)
                try:
                    status = response.status if hasattr(response, "status") else response.code
                    self.status = status
                    if status in (304, 404):
                        return None
                    if status != 200:
                        raise self.fail(f"the server answered HTTP {status}")
                    length = response.headers.get("Content-Length")
                    if length is not None and length.strip().isdigit() and int(length) > cap:
                        raise self.fail(f"is {int(length)} bytes, over the {cap}-byte limit for this kind of file")
                    try:
                        data = response.read(cap + 1)
                    except (http.client.HTTPException, OSError) as exc:  # IncompleteRead, a reset
                        got = len(getattr(exc, "partial", b"") or b"")
                        if attempt == TRIES - 1 or watch.expired:
                            raise self.fail(f"the connection closed after {got} bytes ({TRIES} tries)") from None
                        watch.sleep(_BACKOFF * 2**attempt)
                        continue
                    if len(data) > cap:
                        raise self.fail(f"is over the {cap}-byte limit for this kind of file")
                    if length is not None and length.strip().isdigit() and len(data) != int(length):
                        raise self.fail(f"the connection closed after {len(data)} of {length} bytes")
                    self.etag = response.headers.get("ETag")
                    return data
                finally:
                    response.close()
        raise AssertionError("unreachable")


class _Truncated(Exception):
    def __init__(self, got: int, want: int) -> None:
        super().__init__(got, want)
        self.got, self.want = got, want


def cache_root() -> str:
    """`$QTOOL_CACHE`, else `$XDG_CACHE_HOME/qtool`, else `~/.cache/qtool`."""
    root = os.environ.get("QTOOL_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "qtool")
    return root


class RemoteCache:
    """Bytes fetched from URLs, one file per (URL, kind): a JSON line (url, kind, etag, size,
    absent) then the bytes. Written atomically (temp file, os.replace); a damaged or foreign
    entry reads as a miss. Failures to write are ignored: the cache only saves requests."""

    def __init__(self, root: str | None = None) -> None:
        self.root = os.path.join(root or cache_root(), "remote")

    @staticmethod
    def immutable(url: str) -> bool:
        """A URL whose bytes never change: a Hub file at a commit hash."""
        return bool(_IMMUTABLE.search(urlsplit(url).path))

    def _path(self, url: str, kind: str) -> str:
        return os.path.join(self.root, hashlib.sha256(f"{url}\0{kind}".encode()).hexdigest())

    def get(self, url: str, kind: str) -> tuple[dict[str, Any], bytes] | None:
        try:
            with open(self._path(url, kind), "rb") as handle:
                raw = handle.read()
            line, _, data = raw.partition(b"\n")
            meta = parse_json(line, self._path(url, kind), max_bytes=_MAX_CACHE_LINE)
        except (OSError, CheckpointError):  # a damaged cache entry is a miss
            return None
        if (
            not isinstance(meta, dict)
            or meta.get("url") != url
            or meta.get("kind") != kind
            or meta.get("length") != len(data)
        ):
            return None
        return meta, data

    def put(self, url: str, kind: str, data: bytes, **meta: Any) -> None:
        record = json.dumps({"url": url, "kind": kind, "length": len(data), **meta}).encode()
        try:
            os.makedirs(self.root, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(record + b"\n" + data)
                os.replace(temp, self._path(url, kind))
            except BaseException:
                try:
                    os.unlink(temp)
                except OSError:
                    pass
                raise
        except OSError:
            pass
