"""The builder page and the run page: HTML, JS and CSS shipped in the package (no CDN), and the
Kubernetes Job template the builder fills (a copy of config/kubernetes/job.yaml; a test keeps
the two equal)."""

from __future__ import annotations

import re
from importlib import resources

MEDIA = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}


def asset(name: str) -> tuple[bytes, str] | None:
    """(bytes, media type) of a page file, or None for any other name."""
    match = re.fullmatch(r"[a-z][a-z0-9_-]*(\.html|\.js|\.css)", name)
    if not match:
        return None
    file = resources.files(__name__).joinpath(name)
    if not file.is_file():
        return None
    return file.read_bytes(), MEDIA[match.group(1)]
