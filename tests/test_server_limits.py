"""The metrics port under idle, slow, crowded and malformed clients: real server, real sockets.

Every client here is on 127.0.0.1, waits a bounded time and closes what it opens.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from zerotuner.monitor.server import MetricsServer

STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


@contextlib.contextmanager
def metrics_server(**limits):
    server = MetricsServer(
        "127.0.0.1", 0, source=CollectorRegistry(), history_interval=None, **limits
    )
    with server:
        yield server


@contextlib.contextmanager
def connections(port: int, count: int):
    opened = []
    try:
        for _ in range(count):
            opened.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        yield opened
    finally:
        for sock in opened:
            sock.close()


def read_all(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """(what came, whether the server closed) within `timeout` seconds."""
    data, deadline = b"", time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def ask(port: int, raw: bytes, timeout: float = 2.0) -> tuple[bytes, bool]:
    with connections(port, 1) as (sock,):
        sock.sendall(raw)
        return read_all(sock, timeout)


def status_of(reply: bytes) -> int | None:
    match = STATUS_LINE.match(reply)
    return int(match.group(1)) if match else None


@pytest.fixture
def server_output(capsys, caplog):
    """Everything the server threads print or log; asserted free of tracebacks."""
    caplog.set_level(logging.DEBUG)

    def read() -> str:
        records = "\n".join(
            f"{r.levelname} {r.getMessage()} exc_info={bool(r.exc_info)}" for r in caplog.records
        )
        return capsys.readouterr().err + records

    return read


def test_idle_connections_are_closed_and_the_port_recovers(server_output):
    with metrics_server(idle_timeout=1.0, max_connections=16) as server:
        with connections(server.port, 40) as idle:
            started = time.monotonic()
            for sock in idle:  # each sends nothing; the server must hang up on all 40
                _, closed = read_all(sock, max(0.1, started + 3.0 - time.monotonic()))
                assert closed, "an idle connection was still open 3 s after a 1 s idle timeout"
        started = time.monotonic()
        reply, _ = ask(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(reply) == 200 and time.monotonic() - started < 2
    assert "Traceback" not in server_output() and "exc_info=True" not in server_output()


def test_probes_get_through_a_crowd_and_the_rest_get_503(server_output):
    ticks: list[float] = []
    stop = threading.Event()

    def loop() -> None:  # stands in for the entrypoint's own work while the port is crowded
        while not stop.wait(0.01):
            ticks.append(time.monotonic())

    ticker = threading.Thread(target=loop, daemon=True)
    ticker.start()
    try:
        with (
            metrics_server(idle_timeout=10.0, max_connections=16) as server,
            connections(server.port, 40),
        ):
            time.sleep(1.5)  # 16 are held; the spare slots' peeks (1 s) have ended
            with connections(server.port, 1) as (extra,):
                extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                reply, closed = read_all(extra, 2.0)
            assert status_of(reply) == 200 and closed, reply[:80]
            reply, closed = ask(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(reply) == 503 and closed, reply[:80]
    finally:
        stop.set()
        ticker.join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert max(gaps) < 0.5, "the process stalled while the port was crowded"
    assert "Traceback" not in server_output()


@pytest.mark.parametrize("raw", [b"GET /metrics\r\n", b"GET /metrics\r\n\r\n"])
def test_http09_gets_a_status_line_at_once(raw, server_output):
    with metrics_server(idle_timeout=5.0) as server:
        started = time.monotonic()
        reply, closed = ask(server.port, raw, timeout=2.0)
        assert status_of(reply) == 505 and closed, reply[:80]
        assert time.monotonic() - started < 1.5
    assert "Traceback" not in server_output()


def test_slowloris_is_cut_off(server_output):
    with (
        metrics_server(idle_timeout=1.0, request_timeout=2.0) as server,
        connections(server.port, 1) as (sock,),
    ):
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        started, cut = time.monotonic(), False
        for n in range(30):  # one header every 0.2 s: never idle for 1 s
            try:
                sock.sendall(b"X-%d: y\r\n" % n)
            except OSError:
                cut = True
                break
            _, cut = read_all(sock, 0.2)
            if cut:
                break
        assert cut, "a client trickling headers was still connected after 6 s"
        assert time.monotonic() - started < 4.0
    assert "Traceback" not in server_output() and "exc_info=True" not in server_output()


# Sizes chosen so the server reads every byte sent: a close with unread input resets the
# connection, which could eat the reply on the client's side.
MALFORMED = {
    "overlong request line": (b"GET /" + b"a" * 65532, 414),
    "overlong header": (b"GET / HTTP/1.1\r\nX: " + b"a" * 65534, 431),
    "too many headers": (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n", 431),
    "unknown method": (b"BREW /metrics HTTP/1.1\r\n\r\n", 405),
    "write method on a probe": (b"DELETE /healthz HTTP/1.1\r\n\r\n", 405),
    "control byte in method": (b"G\x00T /healthz HTTP/1.1\r\n\r\n", 405),
    "non-ascii path": ("GET /r\u00e9sum\u00e9/\u4e2d HTTP/1.1\r\n\r\n".encode(), 404),
    "invalid utf-8 escapes": (b"GET /static/%ff%00 HTTP/1.1\r\n\r\n", 404),
    "non-ascii sample path": ("GET /run/samples/\u00e9.png HTTP/1.1\r\n\r\n".encode(), 404),
    "http/2.0": (b"GET / HTTP/2.0\r\n\r\n", 505),
    "not http": (b"GET / FTP/1.0\r\n\r\n", 400),
    "four words": (b"GET / HTTP/1.1 extra\r\n\r\n", 400),
}


def test_malformed_requests_get_a_clean_status(server_output):
    with metrics_server(idle_timeout=2.0) as server:
        got = {name: status_of(ask(server.port, raw)[0]) for name, (raw, _) in MALFORMED.items()}
    assert got == {name: code for name, (_, code) in MALFORMED.items()}
    assert "Traceback" not in server_output() and "exc_info=True" not in server_output()


def test_the_run_page_answers_a_clients_mistake_in_one_line(tmp_path, server_output):
    """Issue 40: a 5000-digit Range value or `step-` path, and every reader that stopped reading
    a clip, wrote a traceback into the training log; each request read the whole file. Now: a
    status and one line, ranges streamed from disk, nothing in the log above debug."""
    import tracemalloc

    folder = tmp_path / "samples" / "step-10"
    folder.mkdir(parents=True)
    clip = folder / "00-a-clip.mp4"
    with clip.open("wb") as f:
        f.truncate(1 << 30)  # sparse: a server that reads it whole takes a GiB
    (folder / "00-a-clip.png").write_bytes(b"\x89PNG")
    path = "/run/samples/step-10/00-a-clip.mp4"
    with metrics_server(output_dir=tmp_path, idle_timeout=0.5) as server:

        def get(target: str, *headers: str) -> tuple[int | None, bytes]:
            lines = [f"GET {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", *headers]
            reply, closed = ask(server.port, ("\r\n".join(lines) + "\r\n\r\n").encode(), 10)
            assert closed, reply[:200]
            return status_of(reply), reply.partition(b"\r\n\r\n")[2]

        tracemalloc.start()
        try:
            assert get(path, "Range: bytes=5-5") == (206, b"\0")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, peak  # streamed from disk, not read whole
        status, body = get(path, "Range: bytes=" + "9" * 5000 + "-")
        assert status == 416 and body == b"range not satisfiable: the file has 1073741824 bytes\n"
        png = "/run/samples/step-10/00-a-clip.png"
        assert get(png, "Range: bytes=1-" + "9" * 5000) == (206, b"PNG")
        assert get(png, "Range: bytes=0-" + "9" * 5000 + ",") == (200, b"\x89PNG")  # ignored
        status, body = get("/run/samples/step-" + "1" * 5000 + "/00-a-clip.png")
        assert status == 404 and body.count(b"\n") == 1, body
        assert get("/run/samples/step-10/00-gone.mp4")[0] == 404

        for _ in range(3):  # readers that stop reading, and ones that hang up mid-clip
            with connections(server.port, 1) as (sock,):
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                sock.recv(1024)
                time.sleep(1.5)  # past idle_timeout: the server's write times out
            with connections(server.port, 1) as (sock,):
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                sock.recv(1024)
        time.sleep(1)
        assert get(png)[0] == 200
    output = server_output()
    assert "Traceback" not in output and "exc_info=True" not in output, output[-3000:]
    assert not re.search(r"^(ERROR|WARNING)", output, re.MULTILINE), output[-3000:]
