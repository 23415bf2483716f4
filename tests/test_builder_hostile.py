"""The config builder against hostile and careless requests (issue 27): a real `zerotuner
builder` process (the CLI, its stderr read back) over HTTP on 127.0.0.1, started with a token
in its environment and without HF_HUB_OFFLINE, as a user's shell would have it.

- a form never chooses where the token goes: evaluation is offline, only shown settings count;
- only the builder's own page drives it: JSON bodies, same Origin, a Host of its own;
- keys are setting names only, everywhere (evaluate, every export, templates saved and read);
- malformed, oversized, slow and vanishing clients get a 4xx JSON answer or are dropped, and
  nothing resembling a traceback reaches stderr;
- a file a form names cannot wedge it (a FIFO, a device, a huge file).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

TOKEN = "hf_builderHostileTestToken0123456789abcdef"
TRACEBACK = re.compile(r"Traceback|\b[A-Z][A-Za-z]*Error\b|\bException\b")
GPU24 = {"gpus": "1", "gpu_memory": "24GiB", "host_memory": "64GiB"}
VALID = {"settings": {"ZT_MODEL_FAMILY": "sdxl", "ZT_ZERO_STAGE": "2"}, "hardware": GPU24}
EXPORTS = ("env", "compose", "kubernetes", "yaml", "deepspeed")


@dataclass
class Answer:
    status: int
    body: bytes

    @property
    def data(self) -> Any:
        return json.loads(self.body)

    @property
    def lines(self) -> list[str]:
        return [e["line"] for e in self.data.get("errors", [])]

    def refused(self, status: int, *words: str) -> None:
        """A refusal in the page's error shape, one line naming each of `words`."""
        assert self.status == status, (self.status, self.body[:500])
        data = self.data
        assert data["exit_code"] == 2, data
        (line,) = self.lines
        assert "\n" not in line and "\r" not in line, line
        for word in words:
            assert word in line, (word, line)


class Builder:
    """A `zerotuner builder` subprocess: requests over HTTP and raw sockets, and its output."""

    def __init__(self, proc: subprocess.Popen, log: Path, url: str, templates: Path) -> None:
        self.proc, self.log, self.url, self.templates = proc, log, url, templates
        self.files = templates.parent / "files"  # --files: the only folder a form may name
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.address = f"{self.host}:{self.port}"
        self._seen = 0

    def output(self) -> str:
        """What the process printed since the last call."""
        text = self.log.read_text(errors="replace")
        new, self._seen = text[self._seen :], len(text)
        return new

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        *,
        timeout: float = 60,
    ) -> Answer:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json"} if data is not None else {}
        sent |= headers or {}
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            connection.request(method, path, body=data, headers=sent)
            response = connection.getresponse()
            return Answer(response.status, response.read())
        finally:
            connection.close()

    def post(self, path: str, form: Any, **headers: str) -> Answer:
        return self.request("POST", path, form, headers)

    def raw(self, data: bytes, *, timeout: float = 10.0) -> bytes:
        """Send bytes as they are, read until the server closes (or `timeout` passes)."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
            sock.sendall(data)
            chunks = []
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
            return b"".join(chunks)


def raw_answer(response: bytes) -> Answer:
    assert response.startswith(b"HTTP/1."), response[:200]
    head, _, body = response.partition(b"\r\n\r\n")
    return Answer(int(head.split(b" ", 2)[1]), body)


def server_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("ZT_", "HF_"))}
    env |= {
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "HF_HOME": str(tmp / "hf-home"),
        "ZT_CACHE_DIR": str(tmp / "cache"),
        "HF_TOKEN": TOKEN,  # the user's token, as their shell holds it
        "ZT_HF_TOKEN": TOKEN,
    }  # no HF_HUB_OFFLINE: the builder must not need it
    return env | extra


@contextlib.contextmanager
def builder_process(tmp: Path, **env: str) -> Iterator[Builder]:
    log = tmp / "builder.log"
    templates = tmp / "templates"
    (tmp / "files").mkdir()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerotuner", "builder", "--port", "0", "--templates",
             str(templates), "--files", str(tmp / "files")],
            stdout=out, stderr=subprocess.STDOUT, env=server_env(tmp, **env),
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (match := re.search(r"builder on (http://\S+?)/? ", log.read_text())):
            assert proc.poll() is None, f"the builder exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the builder did not start:\n{log.read_text()}"
            time.sleep(0.1)
        yield Builder(proc, log, match.group(1), templates)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def _process(tmp_path_factory) -> Iterator[Builder]:
    with builder_process(tmp_path_factory.mktemp("builder-hostile")) as server:
        assert server.post("/api/evaluate", VALID).status == 200  # imports done once
        yield server


@pytest.fixture
def server(_process: Builder) -> Iterator[Builder]:
    """The shared builder; after the test, nothing on its stderr looks like a traceback and
    it still answers."""
    _process.output()
    yield _process
    assert _process.post("/api/evaluate", VALID, timeout=30).status == 200
    time.sleep(0.2)
    output = _process.output()
    assert not TRACEBACK.search(output), output
    assert TOKEN not in output


class Listener:
    """A TCP port on 127.0.0.1 that records every connection (and its first bytes)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.seen: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    self.seen.append(conn.recv(65536))
                except OSError:
                    self.seen.append(b"")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


# --- 1. the token never goes where a form says ------------------------------------------------


def test_a_form_never_chooses_where_the_token_goes(tmp_path):
    chosen, machines = Listener(), Listener()
    try:
        # The machine's own endpoint is the user's choice, yet a form is still judged offline.
        with builder_process(tmp_path, HF_ENDPOINT=machines.url) as server:
            form = {"settings": {"HF_ENDPOINT": chosen.url, "ZT_MODEL": "someuser/somemodel"}}
            answer = server.post("/api/evaluate", form)
            time.sleep(0.5)
            assert chosen.seen == [], chosen.seen  # today: `authorization: Bearer <token>`
            answer.refused(400, "HF_ENDPOINT", "not a setting of this form")

            for key in ("LD_PRELOAD", "HF_TOKEN", "ZT_HF_TOKEN", "HF_HUB_OFFLINE",
                        "ZT_CONFIG_FILE", "ZT_CACHE_DIR", "ZT_SECRETS_DIR", "ZT_OUTPUT_DIR",
                        "hf_endpoint", "PYTHONPATH"):  # fmt: skip
                form = {"settings": {key: "0", "ZT_MODEL": "someuser/somemodel"}}
                server.post("/api/evaluate", form).refused(400, key)
                assert server.post("/api/export/env", form).status == 400

            # A hub id is judged offline: from the cache (empty), else by its name.
            answer = server.post("/api/evaluate", {"settings": {"ZT_MODEL": "someuser/somemodel"},
                                                   "hardware": GPU24})  # fmt: skip
            assert answer.status == 200 and answer.data["exit_code"] == 2, answer.body
            assert "set ZT_MODEL_FAMILY" in answer.lines[0], answer.lines
            answer = server.post("/api/evaluate", {"settings": {"ZT_MODEL": "someuser/sdxl-tuned"},
                                                   "hardware": GPU24})  # fmt: skip
            assert answer.status == 200 and answer.data["exit_code"] == 0, answer.body
            time.sleep(0.5)
            assert chosen.seen == [] and machines.seen == [], (chosen.seen, machines.seen)
            output = server.output()
            assert TOKEN not in output and not TRACEBACK.search(output), output
    finally:
        chosen.close()
        machines.close()


def test_no_form_can_undo_the_offline_rule(monkeypatch, tmp_path):
    """In-process, below the server's check: what a form can put in the environment it is
    evaluated in (ZT_* names, no secret) cannot turn the hub back on or reach a token."""
    from huggingface_hub import constants

    from zerotuner.builder.evaluate import evaluate, form_environ
    from zerotuner.settings.effective import effective_settings

    (tmp_path / "hf_token").write_text(TOKEN)
    for key in ("HF_TOKEN", "ZT_HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.setenv(key, TOKEN)
    monkeypatch.setenv("ZT_SECRETS_DIR", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for key in ("HF_HUB_OFFLINE", "HF_ENDPOINT", "ZT_HF_TOKEN", "zt_hf_token", "A=B", "LD_PRELOAD"):
        result = evaluate({"settings": {key: "0"}})
        assert result["exit_code"] == 2 and key in result["errors"][0]["line"], result
    environ = form_environ({"ZT_MAX_STEPS": "1", "ZT_SECRETS_DIR": str(tmp_path)})
    assert environ["HF_HUB_OFFLINE"] == "1" and TOKEN not in environ.values()
    effective = effective_settings(environ)
    assert effective.hub_offline and effective.settings.hf_token is None
    assert constants.HF_HUB_OFFLINE is False and os.environ["HF_TOKEN"] == TOKEN  # untouched


# --- 2. only the builder's own page drives it --------------------------------------------------


def test_another_page_cannot_drive_it(server):
    evil = {"Origin": "http://evil.example"}
    body = json.dumps(VALID).encode()
    for headers in (
        evil | {"Content-Type": "text/plain"},  # a form or fetch any page may send unasked
        evil | {"Content-Type": "application/json"},
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "multipart/form-data; boundary=x"},
        {"Content-Type": ""},
        {"Origin": "null"},  # a sandboxed frame or a file:// page
        {"Origin": f"http://{server.host}:{server.port + 1}"},  # another local port
        {"Origin": f"https://{server.address}"},
        {"Host": f"evil.example:{server.port}"},  # DNS rebinding: a name re-pointed here
        {"Host": f"{server.host}.nip.io:{server.port}"},
        {"Host": f"localhost.:{server.port}"},
        {"Host": "evil.example", "Origin": "http://evil.example"},
    ):
        for path in ("/api/evaluate", "/api/export/env"):
            server.request("POST", path, body, headers).refused(403)
        server.request("PUT", "/api/templates/evil", body, headers).refused(403)
    assert not (server.templates / "evil.json").exists()

    for headers in ({"Host": f"evil.example:{server.port}"}, {"Host": "attacker.test"}):
        for path in ("/", "/static/builder.js", "/api/initial", "/api/templates"):
            server.request("GET", path, None, headers).refused(403, "Host")
    assert raw_answer(server.raw(b"GET /api/initial HTTP/1.1\r\n\r\n")).status == 403  # no Host
    two_hosts = f"GET / HTTP/1.1\r\nHost: {server.address}\r\nHost: evil.example\r\n\r\n"
    assert raw_answer(server.raw(two_hosts.encode())).status == 403

    # The page itself, opened by address or as localhost: served.
    for host in (server.address, f"localhost:{server.port}", f"LOCALHOST:{server.port}"):
        same = {"Host": host, "Origin": f"http://{host}"}
        assert server.request("POST", "/api/evaluate", body, same).status == 200
        assert server.request("GET", "/", None, {"Host": host}).status == 200
    assert server.request("POST", "/api/evaluate", body, {"Host": "[::1]:1"}).status == 200
    for type_ in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        assert server.post("/api/evaluate", VALID, **{"Content-Type": type_}).status == 200


# --- 3. setting names only, everywhere ---------------------------------------------------------

BAD_KEYS = {
    "settings": ["HF_HUB_OFFLINE\nZT_OUTPUT_DIR", "LD_PRELOAD", "ZT_OUTPUT_DIR", "A=B",
                 "ZT_ZERO_STAGE=3", "", "ZT_HF_TOKEN", "ZT_MODEL\x00", "ZT_ZERO_STAGE\r"],
    "deepspeed": ["evil", "ds.zero_optimization"],
    "hardware": ["evil", "hw.gpus"],
}  # fmt: skip


@pytest.mark.parametrize("part", BAD_KEYS)
def test_only_the_forms_names_are_taken_by_any_endpoint(server, part):
    for key in BAD_KEYS[part]:
        form = {"settings": {"ZT_MODEL_FAMILY": "sdxl"}, "hardware": GPU24} | {part: {key: "/"}}
        shown = key if key.isidentifier() else ascii(key)[1:-1]
        answers = [server.post("/api/evaluate", form)]
        answers += [server.post(f"/api/export/{fmt}", form) for fmt in EXPORTS]
        answers.append(server.request("PUT", "/api/templates/keys", form))
        for answer in answers:
            answer.refused(400, shown.removeprefix("ds.").removeprefix("hw."))
            assert b"ZT_OUTPUT_DIR=/" not in answer.body
    assert not (server.templates / "keys.json").exists()
    # An empty value is no way around it (compose drops empty values; a template kept them).
    form = {"settings": {"LD_PRELOAD": ""}, "deepspeed": {"evil": ""}}
    server.request("PUT", "/api/templates/keys", form).refused(400, "LD_PRELOAD")
    server.post("/api/evaluate", {"extra": {}}).refused(400, "extra")


LINE_BREAKS = ["\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029"]


def test_a_value_cannot_add_a_line_to_an_export(server):
    for brk in LINE_BREAKS:
        form = {"settings": {"ZT_MODEL_FAMILY": "sdxl", "ZT_MODEL": f"x{brk}ZT_OUTPUT_DIR=/"},
                "hardware": GPU24}  # fmt: skip
        for fmt in ("env", "compose", "yaml", "kubernetes"):
            answer = server.post(f"/api/export/{fmt}", form)
            assert answer.status == 400, (repr(brk), fmt, answer.body)
            assert any("ZT_MODEL" in line for line in answer.lines), answer.lines
    for value in ("a\x00b", "\ud800"):  # NUL, a lone surrogate: no environment holds them
        form = {"settings": {"ZT_MODEL_FAMILY": "sdxl", "ZT_MODEL": value}}
        server.post("/api/evaluate", form).refused(400, "ZT_MODEL")
        server.post("/api/export/env", form).refused(400, "ZT_MODEL")
        server.request("PUT", "/api/templates/values", form).refused(400, "ZT_MODEL")
        server.post("/api/evaluate", {"hardware": {"gpus": value}}).refused(400, "hw.gpus")
        server.post("/api/evaluate", {"deepspeed": {"eps": value}}).refused(400, "ds.eps")
    # A prompt per line is what that field is for: it is exported as one line of JSON.
    form = {"settings": {"ZT_MODEL_FAMILY": "sdxl", "ZT_VALIDATION_PROMPTS": "a cat\na dog"},
            "hardware": GPU24}  # fmt: skip
    answer = server.post("/api/export/env", form)
    assert answer.status == 200, answer.body
    assert 'ZT_VALIDATION_PROMPTS=["a cat", "a dog"]\n' in answer.data["text"]


def test_templates_on_disk_are_held_to_the_same_names(server):
    folder = server.templates
    folder.mkdir(exist_ok=True)
    good = {"settings": {"ZT_ZERO_STAGE": "2"}, "deepspeed": {}, "hardware": {"gpus": "1"}}
    assert server.request("PUT", "/api/templates/good", good).status == 200
    assert server.request("GET", "/api/templates/good").data == good

    files = {
        "preload": (json.dumps({"settings": {"LD_PRELOAD": "/tmp/x.so"}}), "LD_PRELOAD"),
        "endpoint": (json.dumps({"settings": {"HF_ENDPOINT": "http://x"}}), "HF_ENDPOINT"),
        "injected": (json.dumps({"settings": {"A\nZT_OUTPUT_DIR": "/"}}), "ZT_OUTPUT_DIR"),
        "shape": (json.dumps({"settings": [1, 2]}), "settings"),
        "values": (json.dumps({"settings": {"ZT_MODEL": 5}}), "settings"),
        "nul": (json.dumps({"settings": {"ZT_MODEL": "a\x00b"}}), "NUL"),
        "list": ("[]", "template"),
        "deep": ("[" * 200_000 + "]" * 200_000, "template"),
        "broken": ("{", "template"),
    }
    for name, (text, _) in files.items():
        (folder / f"{name}.json").write_text(text)
    (folder / "binary.json").write_bytes(b'{"settings": {"ZT_MODEL": "\xff"}}')
    (folder / "big.json").write_text('{"settings": {"ZT_MODEL": "' + "x" * (2 << 20) + '"}}')
    os.mkfifo(folder / "fifo.json")
    try:
        for name, (_, word) in files.items():
            server.request("GET", f"/api/templates/{name}").refused(400, f"template '{name}'", word)
        for name in ("binary", "big", "fifo"):
            server.request("GET", f"/api/templates/{name}", timeout=5).refused(400, name)
        assert "good" in server.request("GET", "/api/templates").data["names"]
    finally:
        _unblock(folder / "fifo.json")
    # Names that are no template name, or lead out of the folder.
    for name in ("..%2f..%2fetc%2fpasswd", "%00", "a%0ab", "x" * 300, ".hidden", "%2e%2e"):
        assert server.request("GET", f"/api/templates/{name}").status == 400, name
        answer = server.request("PUT", f"/api/templates/{name}", good)
        assert answer.status == 400 and "template name" in answer.lines[0], answer.body


# --- 4. malformed, oversized, slow and vanishing clients ---------------------------------------


def _post_raw(server: Builder, headers: str, body: bytes = b"", *, timeout: float = 10) -> Answer:
    head = f"POST /api/evaluate HTTP/1.1\r\nHost: {server.address}\r\n{headers}\r\n"
    return raw_answer(server.raw(head.encode() + body, timeout=timeout))


def test_malformed_bodies_get_a_clean_answer(server):
    json_type = "Content-Type: application/json\r\n"
    for length in ("abc", "1.5", "+5", "0x10", "5 5", "99999999999999999999999", "", "-0"):
        answer = _post_raw(server, f"{json_type}Content-Length: {length}\r\n", b"{}")
        answer.refused(400, "Content-Length")
    # -1 reads until the client closes (today: a 300 MiB body was read): refused at once.
    answer = _post_raw(server, f"{json_type}Content-Length: -1\r\n", b'{"settings": {', timeout=5)
    answer.refused(400, "Content-Length")
    both = f"{json_type}Content-Length: 2\r\nContent-Length: 3\r\n"
    _post_raw(server, both, b"{} ").refused(400, "Content-Length")
    _post_raw(server, json_type, b"{}").refused(411, "Content-Length")
    chunked = f"{json_type}Transfer-Encoding: chunked\r\n"
    _post_raw(server, chunked, b"2\r\n{}\r\n0\r\n\r\n").refused(411, "chunked")
    # Over the limit: answered from the headers, before a byte of the body is read.
    big = f"{json_type}Content-Length: {300 << 20}\r\n"
    _post_raw(server, big, timeout=5).refused(413, str(1 << 20))

    for body, word in (
        (b"not json", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'"text"', "not a JSON object"),
        (b"[" * 500_000, "not JSON"),  # today: RecursionError, a traceback
        (b'{"settings": {"ZT_MODEL": "\xff"}}', "not JSON"),
        (json.dumps({"settings": {"A=B": "1"}}).encode(), "A=B"),  # today: no answer
        (json.dumps({"settings": {"ZT_MODEL": 5}}).encode(), "settings"),
        (json.dumps({"settings": "ZT_MODEL=x"}).encode(), "settings"),
        (json.dumps({"hardware": {"gpus": ["1"]}}).encode(), "hardware"),
    ):
        answer = server.post("/api/evaluate", body)
        answer.refused(400, word)
    # A valid form over the limit: refused before the rest of it is read.
    huge = json.dumps({"settings": {"ZT_MODEL": "x" * (2 << 20)}}).encode()
    headers = f"{json_type}Content-Length: {len(huge)}\r\n"
    _post_raw(server, headers, huge[: 1 << 16], timeout=5).refused(413)


def test_clients_that_hang_up_leave_no_traceback(server):
    body = json.dumps(VALID).encode()
    requests = [
        f"POST /api/evaluate HTTP/1.1\r\nHost: {server.address}\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body,
        f"GET /static/builder.js HTTP/1.1\r\nHost: {server.address}\r\n\r\n".encode(),
        f"POST /api/evaluate HTTP/1.1\r\nHost: {server.address}\r\nContent-Type: "
        "application/json\r\nContent-Length: 1000\r\n\r\n{".encode(),
        b"GET /api/fie",
        b"",
    ]
    for _ in range(10):
        for data in requests:
            sock = socket.create_connection((server.host, server.port))
            sock.sendall(data)
            # Close with a reset, as a closed tab or a killed curl does.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
    time.sleep(1)  # the evaluations finish and write to the reset sockets


def test_slow_and_idle_clients_are_cut_off(tmp_path, capfd):
    from zerotuner.builder.server import BuilderServer

    server = BuilderServer("127.0.0.1", 0, templates=tmp_path, idle_timeout=1, request_timeout=2)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        slow = socket.create_connection((host, port), timeout=10)
        slow.sendall(
            f"POST /api/evaluate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: "
            'application/json\r\nContent-Length: 1000\r\n\r\n{"settings"'.encode()
        )  # announces 1000 bytes, sends 11
        idle = socket.create_connection((host, port), timeout=10)  # sends nothing
        trickle = socket.create_connection((host, port), timeout=10)
        started, cut = time.monotonic(), False
        try:  # a byte every 0.3 s: no read waits a second, yet the request never ends
            for byte in b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 20:
                trickle.sendall(bytes([byte]))
                if time.monotonic() - started > 4:
                    break
                time.sleep(0.3)
            cut = trickle.recv(1) == b""
        except OSError:
            cut = True
        assert cut
        answer = slow.recv(65536)
        assert answer == b"" or b" 408 " in answer.split(b"\r\n")[0], answer
        assert idle.recv(1) == b""
        assert time.monotonic() - started < 10
        connection = http.client.HTTPConnection(host, port, timeout=10)
        connection.request("GET", "/api/templates")
        assert connection.getresponse().status == 200
        for sock in (slow, idle, trickle):
            sock.close()
    finally:
        server.shutdown()
        server.server_close()
    out, err = capfd.readouterr()
    assert not TRACEBACK.search(out + err), out + err


# --- 5. a file a form names cannot wedge it ----------------------------------------------------


def _unblock(fifo: Path) -> None:
    """Give a reader stuck on `fifo` (today's builder) its end of file."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_fifo_or_device_named_by_a_form_cannot_wedge_it(server):
    fifo = server.files / "deepspeed.json"
    os.mkfifo(fifo)
    model = server.files / "model"
    model.mkdir()
    os.mkfifo(model / "model_index.json")
    big = server.files / "big.json"
    with big.open("wb") as f:
        f.truncate(1 << 30)  # a sparse GiB: reading it would take the memory
    try:
        for value, word in ((str(fifo), "FIFO"), ("/dev/zero", "--files="), (str(big), "larger")):
            form = {"settings": {"ZT_DEEPSPEED_CONFIG": value}, "hardware": GPU24}
            answer = server.post("/api/evaluate", form, timeout=5)  # today: never answered
            assert answer.status in (200, 400), answer.body
            assert answer.data["exit_code"] == 2, answer.body
            (error,) = [e for e in answer.data["errors"] if "ZT_DEEPSPEED_CONFIG" in e["line"]]
            assert word in error["line"], error
            assert server.post("/api/export/yaml", form, timeout=5).status == 400
            # the answer right after it: the builder is not wedged
            assert server.post("/api/evaluate", VALID, timeout=10).status == 200
        for key in ("ZT_CONFIG_FILE", "ZT_ACCELERATE_CONFIG"):  # not the form's: refused
            form = {"settings": {key: str(fifo)}}
            server.post("/api/evaluate", form, timeout=5).refused(400, key)
        form = {"settings": {"ZT_MODEL": str(model)}, "hardware": GPU24}
        answer = server.post("/api/evaluate", form, timeout=5)
        assert answer.status == 200 and answer.data["exit_code"] == 2, answer.body
        assert server.post("/api/evaluate", VALID, timeout=10).status == 200
    finally:
        _unblock(fifo)
        _unblock(model / "model_index.json")


def test_a_form_reads_no_file_outside_the_operators_folder(server, tmp_path):
    """Issue 40: a form naming any JSON file got its whole contents back (`config`), and a
    datasets file's first line came back in an error. Only files under --files are read; a
    path elsewhere (or leading out through `..` or a link) is refused in one line, unread."""
    secret = tmp_path / "secret.json"
    secret.write_text('{"api_key": "sk-builder-secret-0123"}\n')
    shadow = tmp_path / "shadow"
    shadow.write_text("root:$y$j9T$builderShadowHash:19000:0:99999:7:::\n")
    checkpoint = tmp_path / "step-5"
    checkpoint.mkdir()
    (checkpoint / "zerotuner.json").write_text('{"family": "sk-builder-secret-0123"}')
    (server.files / "out.json").symlink_to(secret)
    cases = {
        "ZT_DEEPSPEED_CONFIG": [str(secret), str(server.files / ".." / "secret.json"),
                                str(server.files / "out.json")],
        "ZT_DATASETS_FILE": [str(shadow)],
        "ZT_MODEL": [str(tmp_path)],
        "ZT_RESUME": [str(checkpoint)],
    }  # fmt: skip
    for name, values in cases.items():
        for value in values:
            form = {"settings": {name: value}, "hardware": GPU24}
            answer = server.post("/api/evaluate", form, timeout=30)
            assert answer.status == 200 and answer.data["exit_code"] == 2, answer.body
            assert answer.data["config"] is None and answer.data["plan"] is None, answer.body
            (error,) = answer.data["errors"]
            assert error["fields"] == [name] and "--files=" in error["line"], error
            for export in EXPORTS:
                assert server.post(f"/api/export/{export}", form).status == 400
                assert b"sk-builder" not in server.post(f"/api/export/{export}", form).body
            assert b"sk-builder" not in answer.body and b"builderShadow" not in answer.body
    inside = server.files / "stage1.json"
    inside.write_text('{"zero_optimization": {"stage": 1}}')
    form = {"settings": {"ZT_DEEPSPEED_CONFIG": str(inside)}, "hardware": GPU24}
    answer = server.post("/api/evaluate", form, timeout=30)
    assert answer.data["exit_code"] == 0, answer.body
    assert answer.data["config"]["zero_optimization"]["stage"] == 1
    hub = {"settings": {"ZT_MODEL": "stabilityai/stable-diffusion-xl-base-1.0"}, "hardware": GPU24}
    assert server.post("/api/evaluate", hub, timeout=30).data["exit_code"] == 0


# --- neighbours: every other way in ------------------------------------------------------------


def test_odd_paths_methods_and_request_lines_get_a_json_answer(server):
    for path in ("/static/../builder_server.py", "/static/%2e%2e/web/builder.js", "/static/",
                 "//etc/passwd", "/api/evaluate?x=1", "/api/export/env", "/api/", "/%00",
                 "/" + "a" * 8000):  # fmt: skip
        answer = server.request("GET", path)
        assert answer.status == 404 and "not found" in answer.data["error"], (path, answer)
    for fmt in ("unknown", "..%2fevaluate", "ENV", "env%00"):
        server.post(f"/api/export/{fmt}", VALID).refused(400, "export format")
    server.post("/api/templates/x", VALID).refused(404)
    server.request("PUT", "/api/evaluate", VALID).refused(404)
    for method in ("DELETE", "PATCH", "OPTIONS", "TRACE"):
        server.request(method, "/api/templates/good").refused(405, method)
    assert server.request("HEAD", "/").status == 405

    address = server.address.encode()
    for line, status in (
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1", 414),
        (b"GARBAGE", 400),
        (b"GET / HTTP/2.0", 505),
        (b"GET / HTTP/1.1 extra", 400),
        (b"GET http://evil.example/ HTTP/1.1", 404),
    ):
        answer = raw_answer(server.raw(line + b"\r\nHost: " + address + b"\r\n\r\n"))
        assert answer.status == status and answer.data["exit_code"] == 2, (line[:40], answer)
    answer = raw_answer(server.raw(b"GET /\r\n"))  # HTTP/0.9: a status line, not silence
    assert answer.status == 505
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(200))
    answer = raw_answer(
        server.raw(b"GET / HTTP/1.1\r\nHost: " + address + b"\r\n" + many + b"\r\n")
    )
    assert answer.status == 431


def test_a_failure_inside_an_evaluation_is_one_line_not_a_traceback(server):
    """Whatever an evaluation raises that is no ZeroTunerError (here a model folder whose
    model_index.json is no JSON) is answered in the page's shape, and the log gets one line."""
    model = server.files / "broken-model"
    model.mkdir()
    (model / "model_index.json").write_text("{broken")
    form = {"settings": {"ZT_MODEL": str(model)}, "hardware": GPU24}
    answer = server.post("/api/evaluate", form, timeout=10)
    assert answer.status in (200, 500), answer.body
    assert answer.data["exit_code"] != 0 and answer.lines, answer.body
    assert server.post("/api/evaluate", VALID, timeout=10).status == 200
    output = server.output()
    assert "Traceback" not in output and len(output.strip().splitlines()) <= 1, output
