"""`zerotuner builder`'s HTTP side: the page, its JSON endpoints, and the template folder.

Standard library only (ThreadingHTTPServer); the page's HTML, JS and CSS are package data
(zerotuner/web), so it works offline. Every answer is computed by `zerotuner.builder.evaluate`.

    GET  /                      the page
    GET  /static/NAME           its script and style
    GET  /api/fields            the form: sections of fields, described from settings.py
    GET  /api/initial           the form filled from this process's ZT_* environment
    POST /api/evaluate          form -> config, notes, errors (with their fields), plan
    POST /api/export/FORMAT     form -> a file (env, compose, kubernetes, deepspeed, yaml)
    GET  /api/templates         saved template names
    GET  /api/templates/NAME    one template (a saved form)
    PUT  /api/templates/NAME    save the posted form under NAME

The page holds this process's token (it evaluates with the machine's cache), so only its own
page may drive it: every request must name a Host that is an address of this server or a
loopback name (a DNS name could be another site's, re-pointed at 127.0.0.1: DNS rebinding),
an Origin, when sent, must be that same http://HOST, and a POST or PUT must be
`application/json` (a web page cannot send that to another origin without asking first).
A form names only the settings the page shows (form.accepted), is evaluated
offline, and may name files only under the folder the operator chose (`--files`, default
/config: evaluate.outside). Bodies are at most MAX_BODY with a Content-Length; a client gets
IDLE_TIMEOUT per read and REQUEST_TIMEOUT in all; a refusal is a 4xx JSON answer, a hang-up is
dropped.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import stat
import sys
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from zerotuner import web
from zerotuner.builder.evaluate import evaluate
from zerotuner.builder.exports import FORMATS, export
from zerotuner.builder.form import accepted, compose, form_fields, shown
from zerotuner.errors import EXIT_CONFIG, EXIT_FAILURE, ConfigError, ZeroTunerError
from zerotuner.monitor.http_limits import ConnectionLimits, StrictRequests
from zerotuner.settings.urls import hide_credentials

log = logging.getLogger(__name__)

DEFAULT_TEMPLATES = Path("/config/templates")
DEFAULT_FILES = Path("/config")  # the folder docs/deploy.md mounts for the builder
MAX_BODY = 1 << 20  # a form is a few KB
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
IDLE_TIMEOUT = 10.0  # seconds any read or write may wait (a body announced and not sent)
REQUEST_TIMEOUT = 120.0  # seconds a connection may live (a first evaluation imports torch)
MAX_CONNECTIONS = 32  # one person's page needs a few
LOOPBACK_NAMES = ("localhost",)


class Refused(Exception):
    """A request the builder does not serve: one line, answered with `status`."""

    def __init__(self, status: HTTPStatus, line: str) -> None:
        super().__init__(line)
        self.status, self.line = status, line


class Templates:
    """Saved forms, one JSON file per name, in one folder; a name cannot leave it."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def path(self, name: str) -> Path:
        if not TEMPLATE_NAME.fullmatch(name) or ".." in name:
            raise ConfigError(
                f"template name {name!r}: use up to 64 letters, digits, '.', '_' or '-' "
                f"(no path: templates stay in {self.folder})"
            )
        path = self.folder / f"{name}.json"
        if path.resolve().parent != self.folder.resolve():  # a symlink pointing out
            raise ConfigError(f"template name {name!r}: it leads outside {self.folder}")
        return path

    def names(self) -> list[str]:
        if not self.folder.is_dir():
            return []
        return sorted(
            p.stem
            for p in self.folder.glob("*.json")
            if TEMPLATE_NAME.fullmatch(p.stem) and p.is_file()
        )

    def save(self, name: str, form: dict[str, Any]) -> Path:
        path = self.path(name)
        accepted(form)  # only what the page shows: a template is read back into the page
        compose(form)  # refuse what the page could not evaluate (wrong shapes, bad values)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(_form_only(form), indent=2, sort_keys=True) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            raise ConfigError(
                f"--templates={self.folder}: cannot save {name!r}: {exc.strerror or exc}; "
                "mount a writable folder there or pass --templates DIR"
            ) from None
        return path

    def load(self, name: str) -> dict[str, Any]:
        """A saved form, held to what a request may send: a file edited (or placed) in the
        folder by hand is no way around `accepted`; at most MAX_BODY, a regular file."""
        path = self.path(name)
        missing = ConfigError(f"template {name!r}: no such template in {self.folder}")
        if not path.is_file():
            raise missing
        try:  # non-blocking: a FIFO put in its place since is refused, not waited on
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as file:
                if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                    raise missing
                data = file.read(MAX_BODY + 1)
        except OSError as exc:
            raise ConfigError(f"template {name!r}: cannot read it: {exc.strerror or exc}") from None
        if len(data) > MAX_BODY:
            raise ConfigError(f"template {name!r}: larger than a form ({MAX_BODY} bytes)")
        from zerotuner.settings.files import parse_json

        try:
            form = accepted(parse_json(data.decode("utf-8"), source=f"template {name!r}"))
        except UnicodeDecodeError:
            raise ConfigError(f"template {name!r}: not UTF-8 text") from None
        except RecursionError:
            raise ConfigError(f"template {name!r}: nested too deeply to be a form") from None
        except ConfigError as error:
            lines = [line if line.startswith("template ") else f"template {name!r}: {line}"
                     for line in error.problems]  # fmt: skip
            raise ConfigError(lines[0], problems=lines) from None
        return _form_only(form)


def _form_only(form: Any) -> dict[str, Any]:
    if not isinstance(form, dict):
        raise ConfigError("a template is a form: an object with settings, deepspeed, hardware")
    return {k: dict(form.get(k) or {}) for k in ("settings", "deepspeed", "hardware")}


def initial_form(environ: os._Environ[str] | dict[str, str] = os.environ) -> dict[str, Any]:
    """The form as this process's environment fills it (e.g. `docker run -e ZT_...`), a URL's
    credentials masked (the page is no place for them)."""
    names = {f["name"] for s in form_fields() for f in s["fields"]}
    settings = {k: hide_credentials(v) for k, v in environ.items() if k in names}
    return {"settings": settings, "deepspeed": {}, "hardware": {}}


class _Handler(StrictRequests, BaseHTTPRequestHandler):
    server: BuilderServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("builder: " + format, *args)

    def do_GET(self) -> None:
        self._serve(self._get)

    def do_POST(self) -> None:
        self._serve(self._post, writes=True)

    def do_PUT(self) -> None:
        self._serve(self._put, writes=True)

    def do_HEAD(self) -> None:
        self._method_not_allowed()

    do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = do_HEAD

    def _method_not_allowed(self) -> None:
        self.close_connection = True
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{shown(self.command)}: use GET, POST or PUT")

    def _serve(self, route: Callable[[str], None], *, writes: bool = False) -> None:
        try:
            self._check_caller(writes=writes)
            route(self.path.split("?", 1)[0])
        except Refused as refused:
            self.close_connection = True  # a body may be left unread
            self._error(refused.status, refused.line)

    def _get(self, path: str) -> None:
        if path in ("/", "/index.html"):
            return self._asset("builder.html")
        if path.startswith("/static/"):
            return self._asset(path.removeprefix("/static/"))
        if path == "/api/fields":
            return self._json(form_fields())
        if path == "/api/initial":
            return self._json(initial_form())
        if path == "/api/templates":
            return self._json({"names": self.server.templates.names()})
        if path.startswith("/api/templates/"):
            return self._answer(lambda: self.server.templates.load(_name(path)))
        self._not_found(path)

    def _post(self, path: str) -> None:
        if path == "/api/evaluate":
            form = self._form()
            return self._answer(lambda: evaluate(accepted(form), files_under=self.server.files))
        if path.startswith("/api/export/"):
            form = self._form()
            return self._answer(lambda: self._export(path.removeprefix("/api/export/"), form))
        self._not_found(path)

    def _put(self, path: str) -> None:
        if path.startswith("/api/templates/"):
            name, form = _name(path), self._form()
            return self._answer(
                lambda: {"saved": name, "path": str(self.server.templates.save(name, form))}
            )
        self._not_found(path)

    def _export(self, fmt: str, form: dict[str, Any]) -> dict[str, Any]:
        accepted(form)
        if fmt not in FORMATS:
            raise ConfigError(f"export format {shown(fmt)}: expected one of {', '.join(FORMATS)}")
        result = evaluate(form, files_under=self.server.files)
        if result["exit_code"] != 0:  # `train` would refuse it: no file to apply it with
            raise ConfigError("invalid", problems=[e["line"] for e in result["errors"]])
        name, media, text = export(fmt, compose(form), result["config"])
        return {"filename": name, "media_type": media, "text": text}

    # --- who may ask ----------------------------------------------------------------------------

    def _check_caller(self, *, writes: bool) -> None:
        """The builder's own page, opened at one of this server's addresses (see the module's
        docstring); refused with 403 otherwise."""
        hosts = self.headers.get_all("Host") or []
        if len(hosts) != 1:
            raise Refused(HTTPStatus.FORBIDDEN, "send one Host header: the address you opened")
        host = hosts[0].strip()
        if not self.server.host_allowed(host):
            raise Refused(
                HTTPStatus.FORBIDDEN,
                f"Host {shown(host)}: the builder answers only at its own addresses (an IP "
                f"address or localhost), not a DNS name another site may control",
            )
        origins = self.headers.get_all("Origin") or []
        if len(origins) > 1 or origins and origins[0].strip().lower() != f"http://{host}".lower():
            raise Refused(
                HTTPStatus.FORBIDDEN,
                f"Origin {shown(origins[0].strip())}: only the builder's own page "
                f"(http://{shown(host)}) may call it",
            )
        if writes:
            media = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                raise Refused(
                    HTTPStatus.FORBIDDEN,
                    f"Content-Type {shown(media) if media else '(none)'}: the builder takes "
                    "application/json, as its page sends",
                )

    # --- the body -------------------------------------------------------------------------------

    def _form(self) -> dict[str, Any]:
        """The request's JSON object: a Content-Length of at most MAX_BODY, sent within
        IDLE_TIMEOUT per read."""
        if self.headers.get("Transfer-Encoding"):
            raise Refused(
                HTTPStatus.LENGTH_REQUIRED, "send the form with a Content-Length (not chunked)"
            )
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            raise Refused(HTTPStatus.LENGTH_REQUIRED, "send the form with a Content-Length")
        text = lengths[0].strip()
        if len(lengths) > 1 or not re.fullmatch(r"[0-9]{1,18}", text):
            raise Refused(
                HTTPStatus.BAD_REQUEST,
                f"Content-Length {shown(', '.join(lengths))}: expected one whole number of bytes",
            )
        length = int(text)
        if length > MAX_BODY:
            raise Refused(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the form is {length} bytes; the builder takes at most {MAX_BODY}",
            )
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            raise Refused(
                HTTPStatus.REQUEST_TIMEOUT,
                f"the form did not arrive: no byte for {self.server.idle_timeout:g} s",
            ) from None
        if len(data) < length:
            raise Refused(
                HTTPStatus.BAD_REQUEST, f"the form ended after {len(data)} of {length} bytes"
            )
        try:
            form = json.loads(data or b"{}")
        except (ValueError, RecursionError):
            raise Refused(HTTPStatus.BAD_REQUEST, "the request is not JSON") from None
        if not isinstance(form, dict):
            raise Refused(
                HTTPStatus.BAD_REQUEST,
                "the request is not a JSON object (a form: settings, deepspeed, hardware)",
            )
        return form

    # --- answers --------------------------------------------------------------------------------

    def _answer(self, compute: Callable[[], Any]) -> None:
        try:
            data = compute()
        except ZeroTunerError as error:
            errors = [{"line": line, "fields": []} for line in error.problems]
            self._json({"errors": errors, "exit_code": error.exit_code}, HTTPStatus.BAD_REQUEST)
            return
        except Exception as error:  # noqa: BLE001 - a bug: one line each for the page and log
            log.error("builder: %s %s failed: %s: %s", self.command, shown(self.path, 200),
                      type(error).__name__, error)  # fmt: skip
            log.debug("builder: the failure's traceback", exc_info=True)
            self._error(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                f"the builder failed on this form ({type(error).__name__}); its log says more",
                exit_code=EXIT_FAILURE,
            )
            return
        self._json(data)

    def _not_found(self, path: str) -> None:
        self._error(HTTPStatus.NOT_FOUND, f"not found: {shown(path, 200)}")

    def _error(self, status: HTTPStatus, line: str, *, exit_code: int = EXIT_CONFIG) -> None:
        """The page's shape for errors (`errors`, `exit_code`) and a plain `error` line."""
        answer = {"error": line, "errors": [{"line": line, "fields": []}], "exit_code": exit_code}
        self._json(answer, status)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals (a request line too long, a bad version, too
        many headers) in the same JSON as ours, not HTML."""
        self.close_connection = True
        status = HTTPStatus(code)
        self._error(status, message or status.phrase)

    def _json(self, data: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(json.dumps(data).encode(), "application/json", status)

    def _asset(self, name: str) -> None:
        found = web.asset(name)
        if found is None:
            return self._not_found(name)
        self._send(*found)

    def _send(self, body: bytes, media: str, status: HTTPStatus = HTTPStatus.OK) -> None:
        self.send_response(status)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _name(path: str) -> str:
    return unquote(path.removeprefix("/api/templates/"))


class BuilderServer(ConnectionLimits, ThreadingHTTPServer):
    """The builder's server: bounded like the metrics server (http_limits), and answering only
    to the addresses it is reached at (see `host_allowed`)."""

    daemon_threads = True

    def __init__(
        self,
        host: str,
        port: int,
        *,
        templates: Path,
        files: Path = DEFAULT_FILES,
        idle_timeout: float = IDLE_TIMEOUT,
        request_timeout: float = REQUEST_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        super().__init__(
            (host, port),
            _Handler,
            idle_timeout=idle_timeout,
            request_timeout=request_timeout,
            max_connections=max_connections,
        )
        self.templates = Templates(templates)
        self.files = Path(files)  # the only folder whose files a form may name
        self.bound_name = host.lower()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        assert isinstance(host, str)  # bound: getsockname's, text
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{host}:{port}"

    def host_allowed(self, header: str) -> bool:
        """A Host header naming this server: a loopback name, the name it was started with,
        or an IP address (any, when bound to all of them; else a loopback one or its own). The
        port is not compared: a container's published port may differ from the one bound."""
        match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]]+)(?::[0-9]{1,5})?", header)
        if not match:
            return False
        name = match.group(1).strip("[]").lower()
        if name in LOOPBACK_NAMES or name == self.bound_name:
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False  # a DNS name: any site's page could be re-pointed at this address
        bound = str(self.server_address[0])
        if bound in ("", "0.0.0.0", "::"):
            return True
        return address.is_loopback or address == ipaddress.ip_address(bound)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A hang-up or timeout is the client's doing: one debug line. Anything else is a bug
        in a handler: one error line (its traceback at debug level); the server goes on."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.debug("builder: connection from %s ended: %r", client_address, error)
            return
        log.error("builder: a request from %s failed: %s: %s", client_address[0],
                  type(error).__name__, error)  # fmt: skip
        log.debug("builder: the failure's traceback", exc_info=True)


__all__ = ["FORMATS", "BuilderServer", "Templates", "initial_form"]
