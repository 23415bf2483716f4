"""`zerotuner builder`: the config builder page, served from this process (127.0.0.1 by default).

The page runs every change through the same code as `config` and `plan`
(zerotuner.builder.evaluate); it exports env files, a compose override, a Kubernetes Job, the
DeepSpeed JSON and the YAML config file, and keeps templates in a folder (`--templates`,
default /config/templates). A form may name files (a DeepSpeed JSON, a datasets file, a model
folder) only under `--files` (default /config): anyone who reaches the page could otherwise
read any file of this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from zerotuner.errors import EnvironmentUnfit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a container)"
    )
    parser.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    parser.add_argument(
        "--templates", type=Path, default=None, help="template folder (default /config/templates)"
    )
    parser.add_argument(
        "--files", type=Path, default=None,
        help="the only folder whose files a form may name (default /config)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from zerotuner.builder.server import DEFAULT_FILES, DEFAULT_TEMPLATES, BuilderServer

    try:
        server = BuilderServer(
            args.host, args.port, templates=args.templates or DEFAULT_TEMPLATES,
            files=args.files or DEFAULT_FILES,
        )  # fmt: skip
    except OSError as exc:
        raise EnvironmentUnfit(
            f"--port={args.port}: cannot listen on {args.host}:{args.port} ({exc.strerror}); "
            "choose a free port, or 0 for any"
        ) from None
    print(f"zerotuner: builder on {server.url}/ (Ctrl-C stops it)", file=sys.stderr, flush=True)
    with server, contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0
