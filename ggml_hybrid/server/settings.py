"""What ``serve``'s server-wide flags set beyond the models: request defaults, browser access, optional endpoints.

- ``defaults``: what a request that leaves a field out gets (``--temp``, ``--top-k``, ..., ``--seed``, ``-n``;
  :class:`~.protocol.Defaults`).
- ``cors_origins``: the web pages (origins) whose scripts may call the API from a browser (``--cors-origins``):
  none (the default: browsers keep other sites' pages out), ``*`` (any, as llama-server's default), ``localhost``
  (pages served from this machine) or a list of origins such as ``https://app.example``. A browser's preflight
  (``OPTIONS``) is answered without an API key: it never carries one.
- ``slots_endpoint``: ``GET /slots`` answers (``--no-slots``: a 501, as llama-server's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import ConfigError
from .protocol import Defaults

LOCALHOST = "localhost"  # --cors-origins localhost: pages served from this machine, any port
# http(s) pages from a loopback name or address, any port (what --cors-origins localhost lets in)
LOCAL_ORIGIN_RE = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?"
_ORIGIN_RE = re.compile(r"https?://[^\s/?#]+")


@dataclass(frozen=True)
class ServerSettings:
    defaults: Defaults = field(default_factory=Defaults)
    cors_origins: tuple[str, ...] = ()
    slots_endpoint: bool = True


def parse_origins(text: str | None) -> tuple[str, ...]:
    """``--cors-origins``: comma-separated origins (``scheme://host[:port]``), ``*`` or ``localhost``."""
    if text is None:
        return ()
    items = tuple(x.strip() for x in text.split(","))
    for x in items:
        if x in ("*", LOCALHOST):
            continue
        if not _ORIGIN_RE.fullmatch(x):
            raise ConfigError(f"--cors-origins: {x!r} is not an origin (scheme://host[:port], such as "
                              "http://localhost:5173), '*' or 'localhost'")
    if len(items) > 1 and ("*" in items or LOCALHOST in items):
        raise ConfigError("--cors-origins: '*' and 'localhost' stand alone (not in a list of origins)")
    return items


__all__ = ["LOCALHOST", "LOCAL_ORIGIN_RE", "ServerSettings", "parse_origins"]
