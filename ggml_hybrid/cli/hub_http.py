"""What a hostile or broken Hugging Face Hub can do to ``-hf`` / ``pull`` (:mod:`.hub`), bounded.

huggingface_hub sends every request through one shared ``httpx`` client (``huggingface_hub.get_session()``).
:func:`guarded` adds two event hooks to it for the time of a download:

- **Paths.** huggingface_hub (2.4.0) names files in its cache after what the hub answers, unchecked: a download
  is written to ``blobs/<ETag>`` (``X-Linked-Etag`` first), a missing file's marker to
  ``.no_exist/<X-Repo-Commit>/<file>``; an ETag of ``../../x`` or ``/an/absolute/path`` wrote the download there
  (docs/reliability.md holds the report for upstream). Each answer is checked before huggingface_hub reads it: an
  ETag must be a plain file name, a commit 40 hexadecimal digits (git's SHA-1, as the hub's are); otherwise
  :class:`~ggml_hybrid.errors.HubError` names the header, its value and the rule, and nothing is written. ETags
  are checked on the hub's own answers and on every ``HEAD`` answer (where huggingface_hub reads a file's
  metadata); a CDN's answers to the download's ``GET`` carry the CDN's own ETags, which name nothing.
- **Time.** Every read waits at most ``HF_HUB_DOWNLOAD_TIMEOUT`` seconds (huggingface_hub's setting, 10 by
  default, which it applies to downloads but not to the repository's listing: a hub that stalled there held
  ``pull`` for good), and a body must bring at least :data:`MIN_BYTES` in each such window (curl's low-speed
  limit): a hub that drips a byte at a time, each before the read timeout, is a read timeout too.
  huggingface_hub resumes a download after one from where it got to, five times, then gives up with one error.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2

from ..errors import HubError

MIN_BYTES = 16 << 10  # a body must bring this much in each HF_HUB_DOWNLOAD_TIMEOUT seconds
ETAG_RULE = "a plain file name: 1 to 128 letters, digits, '.', '_' or '-', not starting with '.'"
COMMIT_RULE = "a commit id of 40 hexadecimal digits"
_ETAG = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_ETAG_HEADERS = ("X-Linked-Etag", "ETag")


def etag_name(value: str) -> str | None:
    """The file name an ETag header stands for (``W/"abc"`` -> ``abc``), or None if it is no plain file name."""
    v = value.strip()
    if v.startswith("W/"):
        v = v[2:]
    if len(v) >= 2 and v[0] == v[-1] == '"':
        v = v[1:-1]
    return v if _ETAG.fullmatch(v) else None


def check_answer(response: httpx2.Response, hub: httpx2.URL) -> None:
    """Refuse (HubError) an answer whose headers would name a path outside huggingface_hub's cache."""
    url = response.request.url
    where = f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}{url.path}"
    commit = response.headers.get("X-Repo-Commit")
    if commit is not None and not _COMMIT.fullmatch(commit):
        raise HubError(f"the hub answered X-Repo-Commit: {commit!r} for {where}: huggingface_hub names folders of its "
                       f"cache after the commit, so it must be {COMMIT_RULE}; nothing was written")
    if response.request.method != "HEAD" and (url.scheme, url.host, url.port) != (hub.scheme, hub.host, hub.port):
        return  # a CDN's answer to the download itself: its ETag is the CDN's and names nothing
    for header in _ETAG_HEADERS:
        value = response.headers.get(header)
        if value is not None and etag_name(value) is None:
            raise HubError(f"the hub answered {header}: {value!r} for {where}: huggingface_hub names the download's "
                           f"file in its cache after the ETag, so it must be {ETAG_RULE}; nothing was written")


class LowSpeedStream(httpx2.SyncByteStream):
    """A response body that must bring :data:`MIN_BYTES` in each ``window`` seconds (a read timeout otherwise)."""

    def __init__(self, inner: httpx2.SyncByteStream, window: float, what: str) -> None:
        self.inner, self.window, self.what = inner, window, what

    def __iter__(self) -> Iterator[bytes]:
        start, got = time.monotonic(), 0
        for chunk in self.inner:
            got += len(chunk)
            now = time.monotonic()
            if now - start >= self.window:  # a window has passed: did it bring enough?
                if got < MIN_BYTES:
                    raise httpx2.ReadTimeout(f"{self.what}: {got} bytes in {now - start:.1f} s; a hub must send at "
                                             f"least {MIN_BYTES} bytes every {self.window:g} s "
                                             "(HF_HUB_DOWNLOAD_TIMEOUT)")
                start, got = now, 0
            yield chunk

    def close(self) -> None:
        self.inner.close()


def _window() -> float:
    from huggingface_hub import constants

    return float(constants.HF_HUB_DOWNLOAD_TIMEOUT)


def _on_request(request: httpx2.Request) -> None:
    timeout: dict[str, Any] = request.extensions.setdefault("timeout", {})
    for phase in ("connect", "read", "write"):  # huggingface_hub asks for none when it lists a repository
        if timeout.get(phase) is None:
            timeout[phase] = _window()


def _on_response(response: httpx2.Response) -> None:
    from huggingface_hub import constants

    check_answer(response, httpx2.URL(constants.ENDPOINT))
    if isinstance(response.stream, httpx2.SyncByteStream):
        url = response.request.url
        response.stream = LowSpeedStream(response.stream, _window(), f"{url.host}{url.path}")


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """huggingface_hub's shared client with the checks above, until the block ends."""
    from huggingface_hub import get_session

    client = get_session()
    added: dict[str, list[Callable[..., Any]]] = {"request": [_on_request], "response": [_on_response]}
    hooks = client.event_hooks
    client.event_hooks = {k: [*hooks.get(k, []), *added[k]] for k in ("request", "response")}
    try:
        yield
    finally:
        hooks = client.event_hooks
        client.event_hooks = {k: [h for h in hooks.get(k, []) if h not in added[k]] for k in ("request", "response")}


__all__ = ["COMMIT_RULE", "ETAG_RULE", "MIN_BYTES", "LowSpeedStream", "check_answer", "etag_name", "guarded"]
