"""A webhook receiver on 127.0.0.1 for the notification tests: it records the JSON bodies
POSTed to it, answers 500 (`mode="error"`), or holds each request until stopped
(`mode="hang"`)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.bodies: list[dict[str, Any]] = []
        self.requests = 0
        self._released = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                receiver.requests += 1
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if receiver.mode == "hang":
                    receiver._released.wait(120)
                    return
                if receiver.mode == "ok":
                    receiver.bodies.append(json.loads(body))
                self.send_response(200 if receiver.mode == "ok" else 500)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def titles(self) -> list[str]:
        return [b["title"] for b in self.bodies]

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._released.set()
        self.server.shutdown()
        self.server.server_close()
