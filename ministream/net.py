"""net: every HTTP read this package makes, within a deadline that a slow or hostile server cannot stretch.

urllib's `timeout` bounds each socket operation, not the request: a server that sends one byte every 2 s
holds a 5 s timeout open forever. Here a watchdog thread holds each request's sockets and shuts them down
when the request's time is up, whatever the reading thread is blocked in (connect aside: the socket timeout,
set to the same bound, ends that); the reader then ends with one line naming the URL and the bound (`Deadline`).

Two bounds, and which one a caller needs:
- `deadline`: the whole exchange, headers and body (an API answer, an index page, a readiness probe);
- `quiet`: no progress for that long, where progress is each read that returns data (a download of
  hundreds of MB, a stream of generated tokens, whose length no fixed bound fits); a download
  gives a generous `deadline` as well, so that a server dribbling a byte at a time still ends.

A status >= 400 raises urllib's HTTPError (as urlopen does) with its body already read within the bound.
Answers that are not HTTP, and bodies that are not JSON, end in one line naming the URL (`BadAnswer`,
`NotJSON`), never a traceback. The errors are MiniStreamErrors and also the OSError/ValueError that urllib
and json raise, so a caller's `except OSError` (not answering) keeps working.
"""

import functools
import http.client
import io
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

from . import MiniStreamError

ADVICE = "check the server and the network"


class Deadline(MiniStreamError, TimeoutError):
    """A request ran past its bound (its whole deadline, or its quiet bound without progress)."""


class BadAnswer(MiniStreamError, OSError):
    """Whatever answered is not an HTTP server (a malformed status line or headers)."""


class NotJSON(MiniStreamError, ValueError):
    """A body that should be JSON is not (or not the JSON expected)."""


def parse_json(data: bytes | str, source: str, advice: str = "check what answers there"):
    """`data` as JSON; NotJSON naming `source` (a URL or a file) and `advice` otherwise."""
    try:
        return json.loads(data)
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise NotJSON(f"{source} is not JSON ({e}): {advice}") from None


class _Watch:
    """The watchdog of one request: shuts its sockets down once `deadline` s have passed since it began, or
    `quiet` s since the last progress (`renew`). None: no such bound."""

    def __init__(self, url: str, deadline: float | None, quiet: float | None, advice: str):
        self.url, self.deadline, self.quiet, self.advice = url, deadline, quiet, advice
        self.began = self.last = time.monotonic()
        self.expired = False
        self.socks: list[socket.socket] = []
        self._done = threading.Event()
        if deadline is not None or quiet is not None:
            threading.Thread(target=self._run, name=f"deadline of {url}", daemon=True).start()

    def _left(self) -> float:
        ends = [self.began + self.deadline] if self.deadline is not None else []
        ends += [self.last + self.quiet] if self.quiet is not None else []
        return min(ends) - time.monotonic()

    def _run(self) -> None:
        while not self._done.wait(max(self._left(), 0)):
            if self._left() <= 0:
                self.expired = True
                for sock in self.socks:
                    self._shut(sock)
                return

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        # the plain socket's shutdown, also under TLS: it wakes a reader blocked in recv (close would not)
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:  # already closed
            pass

    def hold(self, sock: socket.socket) -> None:
        self.socks.append(sock)
        if self.expired:
            self._shut(sock)

    def renew(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def error(self, got: int | None) -> Deadline:
        """The one line: which bound ran out, and how much came (None: not the whole headers)."""
        came = "its headers never came whole" if got is None else f"{got} bytes of its body came"
        if self.deadline is not None and time.monotonic() - self.began >= self.deadline:
            why = f"no whole answer within {self.deadline:g} s ({came}): the server is stalled or sends too slowly"
        else:
            why = f"nothing came for {self.quiet:g} s ({came}): the server is stalled"
        return Deadline(f"{self.url}: {why}; {self.advice}")


@functools.cache
def _tls() -> ssl.SSLContext:
    """The one TLS context of this process's requests, as urllib would make each (the system's CAs, verified):
    made once, since loading the CAs costs ~40 ms a connection, half the CPU of reading release files by range
    requests (`make matrix` on a fresh cache, measured)."""
    return ssl.create_default_context()


class _Watching(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """urllib's HTTP and HTTPS handlers, each connection's socket held by the watch once connected."""

    def __init__(self, watch: _Watch):
        urllib.request.HTTPHandler.__init__(self)
        urllib.request.HTTPSHandler.__init__(self, context=_tls())
        self.watch = watch

    def do_open(self, http_class, req, **kw):
        watch = self.watch

        def connection(*args, **kwargs):
            conn = http_class(*args, **kwargs)
            connect = conn.connect

            def watched() -> None:  # HTTPS: after the handshake, so the TLS socket is the one held
                connect()
                watch.hold(conn.sock)

            conn.connect = watched
            return conn

        return super().do_open(connection, req, **kw)


class Response:
    """An open answer, read within its watch's bounds: `status`, `headers`, `url`, `read`, `readline`,
    iteration by lines; a context manager that closes it (and stops its watch)."""

    def __init__(self, raw, watch: _Watch):
        self.raw, self.watch = raw, watch
        self.status: int = raw.status
        self.headers = raw.headers
        self.url: str = watch.url
        self.got = 0

    def _step(self, read: Callable[[], bytes]) -> bytes:
        try:
            data = read()
        except (OSError, ValueError, http.client.HTTPException) as e:
            if self.watch.expired or isinstance(e, TimeoutError):
                raise self.watch.error(self.got) from None
            if isinstance(e, http.client.HTTPException):
                raise BadAnswer(f"{self.url}: the answer broke off ({e!r}): check the server") from None
            raise
        if self.watch.expired:  # a shut-down socket reads as the end of the answer
            raise self.watch.error(self.got)
        if not data and getattr(self.raw, "length", None):  # read1 does not say so, as read does (IncompleteRead)
            raise BadAnswer(
                f"{self.url}: the answer broke off after {self.got} bytes, {self.raw.length} short of its length: "
                "check the server and the network"
            )
        if data:
            self.got += len(data)
            self.watch.renew()
        return data

    def read(self, n: int = -1) -> bytes:
        """Up to `n` bytes, as soon as some are there (b"": the end); n < 0: all the rest."""
        if n >= 0:
            return self._step(lambda: self.raw.read1(n)) if n else b""
        parts = []
        while part := self._step(lambda: self.raw.read1(1 << 16)):
            parts.append(part)
        return b"".join(parts)

    def readline(self) -> bytes:
        return self._step(self.raw.readline)

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line

    def close(self) -> None:
        self.watch.stop()
        self.raw.close()

    def __enter__(self) -> "Response":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_url(
    request: urllib.request.Request | str,
    deadline: float | None = None,
    quiet: float | None = None,
    advice: str = ADVICE,
) -> Response:
    """The open Response to `request` (a Request or a URL), within `deadline` s in all and `quiet` s without
    progress (None: no such bound; give at least one); HTTPError (its body read) for a status >= 400. `advice`:
    what the Deadline's line tells the user to do."""
    req = request if isinstance(request, urllib.request.Request) else urllib.request.Request(request)
    watch = _Watch(req.full_url, deadline, quiet, advice)
    per_operation = min(t for t in (deadline, quiet) if t is not None)  # what connect may take
    try:
        raw = urllib.request.build_opener(_Watching(watch)).open(req, timeout=per_operation)
    except urllib.error.HTTPError as e:
        body = Response(e.fp, watch).read() if e.fp is not None else b""
        watch.stop()
        raise urllib.error.HTTPError(e.url, e.code, e.msg, e.hdrs, io.BytesIO(body)) from None
    except (OSError, http.client.HTTPException) as e:
        watch.stop()
        if watch.expired or isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            raise watch.error(None) from None
        if isinstance(e, http.client.HTTPException):  # RemoteDisconnected is a ConnectionResetError: not here
            raise BadAnswer(f"{req.full_url}: not an HTTP answer ({e!r}): check the URL and the server") from None
        raise
    return Response(raw, watch)


def read_url(request: urllib.request.Request | str, deadline: float, advice: str = ADVICE) -> tuple[int, bytes, str]:
    """(status, body, content type) of a whole answer within `deadline` s; HTTPError for a status >= 400."""
    with open_url(request, deadline, advice=advice) as r:
        return r.status, r.read(), r.headers.get_content_type()
