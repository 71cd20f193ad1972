"""How qtool makes an HTTP request: over HTTP(S) only, and never for longer than a deadline.

urllib's default opener also opens `file://`, `ftp://` and `data:` URLs and follows redirects to
`ftp://`: a remote index or a redirect could then make qtool read local files (a FIFO blocks
for good) or tell a server which ones exist. `OPENER` carries the HTTP and HTTPS handlers only,
and its redirects go to http(s) only, never from https down to http.

A socket timeout bounds each read, not a response: a server that sends one byte every few
seconds never trips it. So every request runs under a `Watch`: when its deadline passes, the
watch shuts the request's socket down, which ends any read blocked on it at once, in whatever
thread; the caller then reports the deadline (`Deadlines.late`), not the broken read.

Two limits, from the environment so that the Python API and every command share them:

- `QTOOL_HTTP_TIMEOUT` (default 60 s): one read, its retries included;
- `QTOOL_HTTP_DEADLINE` (default 300 s): every remote read of one command together.
"""

from __future__ import annotations

import http.client
import math
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urljoin, urlsplit

from qtool.errors import CheckpointError, UsageError

__all__ = [
    "COMMAND_TIMEOUT_ENV",
    "DEFAULT_COMMAND_TIMEOUT",
    "DEFAULT_REQUEST_TIMEOUT",
    "OPENER",
    "READ_TIMEOUT",
    "REQUEST_TIMEOUT_ENV",
    "Deadlines",
    "RefusedURL",
    "Watch",
    "refuse_scheme",
]

REQUEST_TIMEOUT_ENV = "QTOOL_HTTP_TIMEOUT"
COMMAND_TIMEOUT_ENV = "QTOOL_HTTP_DEADLINE"
DEFAULT_REQUEST_TIMEOUT = 60.0
DEFAULT_COMMAND_TIMEOUT = 300.0
READ_TIMEOUT = 20.0  # seconds per connect and per socket read, within the deadline
SCHEMES = ("http", "https")


class RefusedURL(urllib.error.URLError):
    """A URL, or a redirect's target, that qtool will not open: not http(s), or https to http."""


def refuse_scheme(url: str, came_from: str | None = None) -> None:
    """Raise RefusedURL unless `url` is http(s) (and, after a redirect from https, https)."""
    scheme = urlsplit(url).scheme.lower()
    if scheme not in SCHEMES:
        raise RefusedURL(f"{scheme or 'a relative'}:// URLs are not read, only http:// and https://")
    if came_from is not None and urlsplit(came_from).scheme.lower() == "https" and scheme == "http":
        raise RefusedURL("a redirect from https:// to http:// is not followed")


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise UsageError(
            f"{name}={text!r} is not a number of seconds",
            hint=f"set {name} to a positive number, e.g. {name}={default:g}",
        )
    return value


class Deadlines:
    """The limits of one command's remote reads: a request's timeout, and when the whole command
    must be done. `cancel()` ends every request under way (the caller gave up waiting)."""

    def __init__(self, request_timeout: float, command_timeout: float) -> None:
        self.request_timeout = request_timeout
        self.command_timeout = command_timeout
        self.command_end = time.monotonic() + command_timeout
        self.cancelled = False
        self._live: set[Watch] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_environment(cls) -> Deadlines:
        return cls(
            _seconds(REQUEST_TIMEOUT_ENV, DEFAULT_REQUEST_TIMEOUT),
            _seconds(COMMAND_TIMEOUT_ENV, DEFAULT_COMMAND_TIMEOUT),
        )

    def watch(self) -> Watch:
        """A started watch for one request: its deadline is the sooner of the request's and the
        command's."""
        request_end = time.monotonic() + self.request_timeout
        if self.cancelled or self.command_end <= request_end:
            watch = Watch(self, min(self.command_end, request_end), COMMAND_TIMEOUT_ENV)
        else:
            watch = Watch(self, request_end, REQUEST_TIMEOUT_ENV)
        with self._lock:
            self._live.add(watch)
        watch.start()
        return watch

    def _done(self, watch: Watch) -> None:
        with self._lock:
            self._live.discard(watch)

    def cancel(self) -> None:
        """Cut every request under way and refuse new ones."""
        self.cancelled = True
        self.command_end = time.monotonic()
        with self._lock:
            live = list(self._live)
        for watch in live:
            watch.expire()

    def late(self, which: str, path: str) -> CheckpointError:
        """The error for a deadline that passed: which limit, and how to change it."""
        if which == REQUEST_TIMEOUT_ENV:
            return CheckpointError(
                f"no complete answer within {self.request_timeout:g} s ({REQUEST_TIMEOUT_ENV}, the limit for one request)",
                path=path,
                hint=f"the server is stalled or very slow; set {REQUEST_TIMEOUT_ENV}=SECONDS to wait longer",
            )
        return CheckpointError(
            f"remote reads took over {self.command_timeout:g} s ({COMMAND_TIMEOUT_ENV}, the limit for the whole command)",
            path=path,
            hint=f"the server is stalled or very slow; set {COMMAND_TIMEOUT_ENV}=SECONDS to wait longer",
        )


class Watch:
    """One request's deadline. At the deadline (or on `expire`) the socket it was given is shut
    down; `expired` then says so. `close()` when the request is over."""

    def __init__(self, deadlines: Deadlines, deadline: float, which: str) -> None:
        self.deadlines = deadlines
        self.deadline = deadline
        self.which = which  # the environment variable that sets this limit
        self._expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self.expire)
        self._timer.daemon = True  # never waited for at exit

    def start(self) -> None:
        self._timer.start()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def expired(self) -> bool:
        """Cut (`expire`), or past the deadline: the clock says so even before the timer thread
        has run. On a loaded machine the socket's read timeout, the time left, fired first, and
        a read the deadline ended looked like a dropped connection, and was retried."""
        return self._expired or self.remaining() <= 0

    def attach(self, sock: socket.socket) -> None:
        """The socket a connection of this request reads from (a redirect makes another)."""
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _cut(sock)

    def expire(self) -> None:
        with self._lock:
            self._expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _cut(sock)

    def close(self) -> None:
        self._timer.cancel()
        self.deadlines._done(self)

    def sleep(self, seconds: float) -> None:
        """A retry's backoff, cut short by the deadline."""
        time.sleep(max(0.0, min(seconds, self.remaining())))


def _cut(sock: socket.socket) -> None:
    """Shut the socket down under any thread blocked reading it (the base class's method: an
    SSL socket's own would drop its SSL object under that thread)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # already closed, or never connected
        pass


def _watch_of(request: urllib.request.Request) -> Watch | None:
    return getattr(request, "qtool_watch", None)


class _WatchedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args, watch: Watch | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.watch = watch

    def connect(self) -> None:
        super().connect()
        if self.watch is not None:
            self.watch.attach(self.sock)


class _WatchedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args, watch: Watch | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.watch = watch

    def connect(self) -> None:
        super().connect()  # a proxy tunnel, then TLS: self.sock is the socket read from
        if self.watch is not None:
            self.watch.attach(self.sock)


def _connection(cls, watch: Watch | None):
    def make(host, **kwargs):
        return cls(host, watch=watch, **kwargs)

    return make


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_connection(_WatchedHTTPConnection, _watch_of(req)), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(_connection(_WatchedHTTPSConnection, _watch_of(req)), req, context=self._context)


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects to http(s) only (never https to http), under the same watch, and never
    carry the Authorization header to another host (the Hub redirects large files to a CDN with
    a signed URL). The redirect's own body is not read."""

    def http_error_302(self, req, fp, code, msg, headers):
        target = headers.get("location") or headers.get("uri")
        if target:  # before urllib's own check, which lets ftp:// through and refuses file:// as an HTTP error
            refuse_scheme(urljoin(req.full_url, target.strip()), came_from=req.full_url)
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        fp.close()  # urllib would read the whole body of the 3xx: unbounded
        refuse_scheme(newurl, came_from=req.full_url)
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            new.qtool_watch = _watch_of(req)
            if urlsplit(newurl).netloc != urlsplit(req.full_url).netloc:
                new.remove_header("Authorization")
        return new


class _Refuse(urllib.request.BaseHandler):
    """Every scheme without a handler above (file, ftp, data, ...): refused, never opened."""

    def unknown_open(self, req):
        refuse_scheme(req.full_url)


def _opener() -> urllib.request.OpenerDirector:
    opener = urllib.request.OpenerDirector()
    proxies = {k: v for k, v in urllib.request.getproxies().items() if k in SCHEMES or k == "no"}
    for handler in (
        urllib.request.ProxyHandler(proxies),  # http(s)_proxy only: an ftp_proxy would add ftp_open
        _HTTPHandler(),
        _HTTPSHandler(),
        _Redirects(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
        _Refuse(),
    ):
        opener.add_handler(handler)
    return opener


OPENER = _opener()
