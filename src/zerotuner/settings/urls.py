"""URLs in settings (ZT_DATA_DIR, a datasets file's paths, ZT_PUSH_TO): credentials never go in
one. The one check and the one mask: every setting that takes a URL refuses one that carries
them, and every line that shows a URL (errors here, every log line through monitor.logs.mask,
the builder's answers) masks them."""

from __future__ import annotations

import re

from zerotuner.errors import ConfigError

# A URL's `user:password@` (or `token@`): a secret wherever the URL is shown. A password may
# hold `/` (AWS secret keys do), so after a `:` it runs to the last `@` before a space or quote.
_USERINFO = re.compile(r"(?<=://)[^\s/@:'\"]*(?::[^\s'\"]*)?@")


def hide_credentials(text: str) -> str:
    """`text` with the credentials of every URL in it masked (`s3://***@bucket/x`)."""
    return _USERINFO.sub("***@", text)


def refuse_credentials(text: str, setting: str) -> None:
    """One line naming `setting` (its value masked) when the URL carries credentials."""
    if _USERINFO.search(text):
        raise ConfigError(
            f"{setting}={hide_credentials(text)!r}: credentials do not go in the URL; give S3 "
            "keys as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the secret files "
            "aws_access_key_id and aws_secret_access_key) and a hub token as HF_TOKEN"
        )
