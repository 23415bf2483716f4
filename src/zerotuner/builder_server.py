"""`zerotuner builder`'s HTTP side: the page, its JSON endpoints, and the template folder.

Standard library only (ThreadingHTTPServer); the page's HTML, JS and CSS are package data
(zerotuner/web), so it works offline. Every answer is computed by `zerotuner.builder`.

    GET  /                      the page
    GET  /static/NAME           its script and style
    GET  /api/fields            the form: sections of fields, described from settings.py
    GET  /api/initial           the form filled from this process's ZT_* environment
    POST /api/evaluate          form -> config, notes, errors (with their fields), plan
    POST /api/export/FORMAT     form -> a file (env, compose, kubernetes, deepspeed, yaml)
    GET  /api/templates         saved template names
    GET  /api/templates/NAME    one template (a saved form)
    PUT  /api/templates/NAME    save the posted form under NAME
"""

from __future__ import annotations

import json
import logging
import os
import re
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from zerotuner import web
from zerotuner.builder import evaluate
from zerotuner.builder_exports import FORMATS, export
from zerotuner.builder_form import compose, form_fields
from zerotuner.errors import ConfigError, ZeroTunerError

log = logging.getLogger(__name__)

DEFAULT_TEMPLATES = Path("/config/templates")
MAX_BODY = 1 << 20  # a form is a few KB
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


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
        return sorted(p.stem for p in self.folder.glob("*.json") if TEMPLATE_NAME.fullmatch(p.stem))

    def save(self, name: str, form: dict[str, Any]) -> Path:
        path = self.path(name)
        compose(form)  # refuse what the page could not evaluate (wrong shapes, unknown fields)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(_form_only(form), indent=2, sort_keys=True) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            raise ConfigError(
                f"--templates={self.folder}: cannot save {name!r}: {exc.strerror or exc}; "
                "mount a writable folder there or pass --templates DIR"
            ) from None
        return path

    def load(self, name: str) -> dict[str, Any]:
        path = self.path(name)
        if not path.is_file():
            raise ConfigError(f"template {name!r}: no such template in {self.folder}")
        from zerotuner.files import parse_json

        return _form_only(parse_json(path.read_text(encoding="utf-8"), source=str(path)))


def _form_only(form: Any) -> dict[str, Any]:
    if not isinstance(form, dict):
        raise ConfigError("a template is a form: an object with settings, deepspeed, hardware")
    return {k: dict(form.get(k) or {}) for k in ("settings", "deepspeed", "hardware")}


def initial_form(environ: os._Environ[str] | dict[str, str] = os.environ) -> dict[str, Any]:
    """The form as this process's environment fills it (e.g. `docker run -e ZT_...`)."""
    names = {f["name"] for s in form_fields() for f in s["fields"]}
    settings = {k: v for k, v in environ.items() if k in names}
    return {"settings": settings, "deepspeed": {}, "hardware": {}}


class _Handler(BaseHTTPRequestHandler):
    server: BuilderServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("builder: " + format, *args)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
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
        self._json({"error": f"not found: {path}"}, HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/api/evaluate":
            return self._answer(lambda: evaluate(self._body()))
        if path.startswith("/api/export/"):
            return self._answer(lambda: self._export(path.removeprefix("/api/export/")))
        self._json({"error": f"not found: {path}"}, HTTPStatus.NOT_FOUND)

    def do_PUT(self) -> None:
        path = self.path.split("?", 1)[0]
        if path.startswith("/api/templates/"):
            name = _name(path)
            return self._answer(
                lambda: {"saved": name, "path": str(self.server.templates.save(name, self._body()))}
            )
        self._json({"error": f"not found: {path}"}, HTTPStatus.NOT_FOUND)

    def _export(self, fmt: str) -> dict[str, Any]:
        form = self._body()
        result = evaluate(form)
        if result["exit_code"] != 0:  # `train` would refuse it: no file to apply it with
            raise ConfigError("invalid", problems=[e["line"] for e in result["errors"]])
        name, media, text = export(fmt, compose(form), result["config"])
        return {"filename": name, "media_type": media, "text": text}

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise ConfigError(f"the form is larger than {MAX_BODY} bytes")
        try:
            data = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            raise ConfigError("the request is not JSON") from None
        if not isinstance(data, dict):
            raise ConfigError("the request is not a JSON object")
        return data

    def _answer(self, compute: Any) -> None:
        try:
            self._json(compute())
        except ZeroTunerError as error:
            errors = [{"line": line, "fields": []} for line in error.problems]
            self._json({"errors": errors, "exit_code": error.exit_code}, HTTPStatus.BAD_REQUEST)

    def _json(self, data: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(json.dumps(data).encode(), "application/json", status)

    def _asset(self, name: str) -> None:
        found = web.asset(name)
        if found is None:
            return self._json({"error": f"not found: {name}"}, HTTPStatus.NOT_FOUND)
        self._send(*found)

    def _send(self, body: bytes, media: str, status: HTTPStatus = HTTPStatus.OK) -> None:
        self.send_response(status)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)


def _name(path: str) -> str:
    return unquote(path.removeprefix("/api/templates/"))


class BuilderServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, *, templates: Path) -> None:
        super().__init__((host, port), _Handler)
        self.templates = Templates(templates)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{host}:{port}"


__all__ = ["FORMATS", "BuilderServer", "Templates", "initial_form"]
