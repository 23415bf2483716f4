"""`ZT_PUSH_TO`'s two forms, read where the setting is validated and where the remote opens."""

from __future__ import annotations

import re

from zerotuner.errors import ConfigError
from zerotuner.settings.urls import hide_credentials, refuse_credentials

SETTING = "ZT_PUSH_TO"
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<prefix>.*))?$")
_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*)/?$")


def parse(url: str) -> tuple[str, str, str]:
    """(`s3`|`hf`, bucket or repo, key prefix) of a `ZT_PUSH_TO` URL; one line naming it if not
    (its credentials masked: they go in AWS_* and HF_TOKEN)."""
    refuse_credentials(url, SETTING)
    if match := _S3.match(url):
        prefix = (match["prefix"] or "").strip("/")
        return "s3", match["bucket"], f"{prefix}/" if prefix else ""
    if match := _HF.match(url):
        return "hf", match["repo"], ""
    raise ConfigError(
        f"{SETTING}={hide_credentials(url)!r} is not a remote: use s3://bucket/prefix (any "
        "S3-compatible store) or hf://user/repo (a Hugging Face model repo)"
    )
