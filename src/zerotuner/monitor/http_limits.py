"""Bounds for the project's small HTTP servers: idle time, request time, open connections.

The standard library's threading servers start one thread per connection without limit and
wait forever on a client that sends nothing, so a few hundred idle sockets (a scraper storm, a
port scanner, slowloris) pile up threads for good. `ConnectionLimits` bounds all three:

- `idle_timeout`: seconds any read or write may wait (the socket timeout);
- `request_timeout`: seconds a connection may live in all, so a client trickling one header
  byte at a time is cut off too (enforced by the accept loop's `service_actions`);
- `max_connections`: connections served at once. Beyond it the accept loop never blocks: a
  connection that asks for one of `priority_paths` (the Kubernetes probes) is still served from
  a few spare slots; any other gets a 503 and is closed.

`StrictRequests` makes a handler answer malformed requests with a status line: the standard
library waits for headers after an HTTP/0.9 line (`GET /path` with no version) and writes its
errors without a status line before the version is parsed.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

SPARE_SLOTS = 8  # over the bound, connections that may still reach a priority path
PEEK_SECONDS = 1.0  # how long a spare slot waits for the request line it peeks at
BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 27\r\n"
    b"Connection: close\r\nRetry-After: 1\r\n\r\ntoo many open connections\r\n"
)


class ConnectionLimits:
    """Mix in before a `socketserver.TCPServer` subclass (`HTTPServer`, wsgiref's `WSGIServer`).

    Its `process_request` replaces `ThreadingMixIn`'s: one daemon thread per connection, at
    most `max_connections` (+ `SPARE_SLOTS` for `priority_paths`) at once."""

    request_queue_size = 256  # socketserver's backlog of 5 drops bursts of scrapes

    def __init__(
        self,
        *args: Any,
        idle_timeout: float = 5.0,
        request_timeout: float = 30.0,
        max_connections: int = 64,
        priority_paths: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> None:
        self.idle_timeout = idle_timeout
        self.request_timeout = request_timeout
        self.priority_paths = priority_paths
        self._slots = threading.BoundedSemaphore(max_connections)
        self._spare = threading.BoundedSemaphore(SPARE_SLOTS if priority_paths else 0)
        self._deadlines: dict[socket.socket, float] = {}  # open connections, monotonic time
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Runs in the accept loop: must never wait on a client."""
        if self._slots.acquire(blocking=False):
            slot, priority_only = self._slots, False
        elif self._spare.acquire(blocking=False):
            slot, priority_only = self._spare, True
        else:
            _refuse(request)
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        request.settimeout(self.idle_timeout)
        with self._lock:
            self._deadlines[request] = time.monotonic() + self.request_timeout
        threading.Thread(
            target=self._serve,
            args=(request, client_address, slot, priority_only),
            name="http-connection",
            daemon=True,
        ).start()

    def _serve(self, request: Any, client_address: Any, slot: Any, priority_only: bool) -> None:
        try:
            if priority_only and not self._asks_priority(request):
                _refuse(request)
            else:
                self.finish_request(request, client_address)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - one connection's failure must not reach the others
            self.handle_error(request, client_address)
        finally:
            with self._lock:  # before closing, so the accept loop never shuts a reused socket
                self._deadlines.pop(request, None)
            self.shutdown_request(request)  # type: ignore[attr-defined]
            slot.release()

    def _asks_priority(self, request: socket.socket) -> bool:
        """Whether the request line (peeked, left for the handler) names a priority path."""
        request.settimeout(min(PEEK_SECONDS, self.idle_timeout))
        try:
            line = request.recv(1024, socket.MSG_PEEK).split(b"\r\n", 1)[0]
        except OSError:
            return False
        finally:
            request.settimeout(self.idle_timeout)
        words = line.split(b" ")
        if len(words) != 3 or words[0] not in (b"GET", b"HEAD"):
            return False
        return words[1].split(b"?", 1)[0].decode("latin-1") in self.priority_paths

    def service_actions(self) -> None:
        """The accept loop's tick (every `poll_interval`): cut connections past their time."""
        super().service_actions()  # type: ignore[misc]
        now = time.monotonic()
        with self._lock:
            for request, deadline in list(self._deadlines.items()):
                if deadline < now:
                    del self._deadlines[request]
                    # The handler's blocked read returns; the handler then closes the socket.
                    with contextlib.suppress(OSError):
                        request.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Timeouts and hang-ups are the client's doing: one debug line, no traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # TimeoutError, ConnectionResetError, BrokenPipeError...
            log.debug("connection from %s ended: %r", client_address, error)
        else:
            log.error("error serving %s", client_address, exc_info=True)


def _refuse(request: socket.socket) -> None:
    """Best effort 503 that cannot block: a full send buffer just drops it."""
    request.setblocking(False)
    with contextlib.suppress(OSError):  # input left unread would make the close a reset
        request.recv(65536)
    with contextlib.suppress(OSError):
        request.send(BUSY)


class StrictRequests(BaseHTTPRequestHandler):
    """Mix in before `BaseHTTPRequestHandler` (or wsgiref's `WSGIRequestHandler`)."""

    # Errors found before the version is parsed (HTTP/2.0 -> 505) still get a status line.
    default_request_version = "HTTP/1.0"
    raw_requestline: bytes  # set by `handle_one_request` before it parses (typeshed omits it)

    def parse_request(self) -> bool:
        if len(self.raw_requestline.split()) == 2:  # HTTP/0.9: no version, and no headers come
            self.command, self.request_version = None, self.default_request_version  # type: ignore[assignment]
            self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
            self.close_connection = True
            self.send_error(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "HTTP/0.9 is not supported")
            return False
        return super().parse_request()


class LimitedHTTPServer(ConnectionLimits, ThreadingHTTPServer):
    """`ThreadingHTTPServer` with the bounds above (pass them as keyword arguments)."""

    daemon_threads = True


__all__ = ["ConnectionLimits", "LimitedHTTPServer", "StrictRequests"]
