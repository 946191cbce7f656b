"""Issue 40's shapes for the server fuzzer: huge ``/tokenize`` and ``/detokenize`` inputs, and a hostile hub.

- ``huge``: ``/tokenize`` of texts around the prompts' bound and far past it (up to 4 Mi characters), with and
  without pieces, and ``/detokenize`` of id arrays around ``n_ctx`` and far past it (up to 4 M ids). Any answer
  below 500 in OpenAI's error shape is fine (server_cases classes it); ``/health`` is watched throughout
  (``server_cases.HealthWatch``).
- ``hub``: ``ggml-hybrid pull fuzz/case-I`` in a process of its own against :class:`HostileHub`, a stand-in Hugging
  Face Hub on loopback whose answers for that repository are drawn from ``(seed, I)``: listings with null, missing,
  ``..`` or absolute names, not a list, not JSON, stalled or dripped; file answers with ETags, ``X-Linked-Etag``s
  and commits that are paths (``../..``, absolute, weak), empty, too long or not ASCII, a missing file's 404 whose
  commit is a path, a body dripped a byte at a time, stalled or cut short. Classes: ``fine`` (the download done as
  served, or one ``error:`` line and exit status 2 for anything hostile), ``escape`` (a file written outside the
  hub cache), ``hang`` (past the time limit), ``traceback``, ``wrong`` (an exit status the answer does not call for).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SHA = "0123456789abcdef0123456789abcdef01234567"
FILE = "m-Q4_K_M.gguf"
DATA = random.Random(40).randbytes(96 << 10)  # what a good answer serves (pull never parses it)
LISTINGS = {"ok": 60, "null-name": 5, "no-name": 5, "dotdot": 5, "absolute": 5, "not-list": 4, "nested": 4,
            "not-json": 4, "stall": 2, "drip": 2, "error-500": 4}
FILES = {"ok": 30, "etag-dotdot": 8, "etag-absolute": 6, "etag-weak-dotdot": 5, "linked-dotdot": 6, "etag-empty": 4,
         "etag-long": 4, "etag-unicode": 4, "commit-dotdot": 6, "commit-short": 4, "missing-commit-dotdot": 6,
         "no-etag": 3, "no-commit": 3, "drip": 3, "stall": 3, "short-body": 3}
DOWNLOAD_TIMEOUT = "1"  # HF_HUB_DOWNLOAD_TIMEOUT for the pulls: a drip or a stall ends in seconds


def draw(rng: random.Random) -> dict[str, str]:
    listing = rng.choices(list(LISTINGS), list(LISTINGS.values()))[0]
    file = rng.choices(list(FILES), list(FILES.values()))[0] if listing == "ok" else "ok"
    return {"listing": listing, "file": file}


class HostileHub:
    """A stand-in hub on 127.0.0.1 answering each repository ``fuzz/case-I`` as ``cases[repo]`` says."""

    def __init__(self) -> None:
        self.cases: dict[str, dict[str, str]] = {}
        self.stopping = threading.Event()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hub.handle(self, head=False)

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()

    def _send(self, h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes, head: bool,
              how: str = "whole") -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if head:
            return
        try:
            if how == "stall":
                h.close_connection = True
                self.stopping.wait(120)
            elif how == "drip":
                h.close_connection = True
                for i in range(len(body)):
                    if self.stopping.wait(0.1):
                        return
                    h.wfile.write(body[i:i + 1])
                    h.wfile.flush()
            elif how == "short":
                h.close_connection = True
                h.wfile.write(body[: len(body) // 3])
            else:
                h.wfile.write(body)
        except OSError:  # the client gave up
            pass

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = h.path.split("?", 1)[0]
        m = re.fullmatch(r"/api/models/(fuzz/case-\d+)(?:/revision/[^/]+)?", path)
        if m:
            case = self.cases.get(m[1])
            if case is None:
                return self._send(h, 404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "not found"}', head)
            return self._listing(h, m[1], case["listing"], head)
        m = re.fullmatch(r"/(fuzz/case-\d+)/resolve/[^/]+/(.+)", path)
        case = self.cases.get(m[1]) if m else None
        if m is None or case is None:
            return self._send(h, 404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "not found"}', head)
        return self._file(h, case, head)

    def _listing(self, h: BaseHTTPRequestHandler, repo: str, kind: str, head: bool) -> None:
        siblings: Any = [{"rfilename": "README.md"}, {"rfilename": FILE}]
        how = "whole"
        if kind == "null-name":
            siblings.append({"rfilename": None})
        elif kind == "no-name":
            siblings.append({"size": 3})
        elif kind == "dotdot":
            siblings.insert(0, {"rfilename": "../../../../escaped-Q4_K_M.gguf"})
        elif kind == "absolute":
            siblings.insert(0, {"rfilename": "/tmp/escaped-Q4_K_M.gguf"})
        elif kind == "not-list":
            siblings = FILE
        elif kind == "nested":
            siblings = [[FILE]]
        elif kind in ("stall", "drip"):
            how = kind
        elif kind == "error-500":
            return self._send(h, 500, {"Content-Type": "application/json"}, b'{"error": "down"}', head)
        body = json.dumps({"id": repo, "sha": SHA, "siblings": siblings}).encode()
        if kind == "not-json":
            body = body[: len(body) // 2]
        self._send(h, 200, {"Content-Type": "application/json"}, body, head, how)

    def _file(self, h: BaseHTTPRequestHandler, case: dict[str, str], head: bool) -> None:
        kind, out = case["file"], case["dir"]  # an absolute ETag points inside the case's own folder
        headers = {"Content-Type": "application/octet-stream", "ETag": f'"{hashlib.sha256(DATA).hexdigest()}"',
                   "X-Repo-Commit": SHA, "Accept-Ranges": "bytes"}
        how = "whole"
        bad = {"etag-dotdot": ("ETag", '"../../../../escaped"'),
               "etag-absolute": ("ETag", f'"{out}/abs-escaped"'),
               "etag-weak-dotdot": ("ETag", 'W/"../../../../escaped"'),
               "linked-dotdot": ("X-Linked-Etag", '"../../../../escaped"'),
               "etag-empty": ("ETag", '""'), "etag-long": ("ETag", '"' + "a" * 300 + '"'),
               "etag-unicode": ("ETag", '"\u00e9t\u00e9"'), "commit-dotdot": ("X-Repo-Commit", "../../../../escaped"),
               "commit-short": ("X-Repo-Commit", "abc")}
        if kind in bad:
            k, v = bad[kind]
            headers[k] = v
        elif kind == "no-etag":
            del headers["ETag"]
        elif kind == "no-commit":
            del headers["X-Repo-Commit"]
        elif kind == "missing-commit-dotdot":
            return self._send(h, 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": "../../../../escaped"},
                              b'{"error": "Entry not found"}', head)
        elif kind in ("drip", "stall"):
            how = kind
        elif kind == "short-body":
            how = "short"
        self._send(h, 200, headers, DATA, head, how)


_hub: HostileHub | None = None
_lock = threading.Lock()


def start() -> HostileHub:
    global _hub
    with _lock:
        if _hub is None:
            _hub = HostileHub()
        return _hub


def stop() -> None:
    global _hub
    with _lock:
        if _hub is not None:
            _hub.close()
            _hub = None


def _written_outside(case_dir: str, home: str) -> list[str]:
    cache = os.path.join(home, "hub")
    out = []
    for root, dirs, files in os.walk(case_dir):
        for name in dirs + files:
            p = os.path.join(root, name)
            if p in (home, cache) or p.startswith(cache + os.sep):
                continue
            out.append(os.path.relpath(p, case_dir))
    return out


def hub_case(seed: int, i: int, out: str, timeout: float) -> tuple[str, str]:
    """(class, what) of hub case ``i``: one ``pull`` against the hostile hub."""
    rng = random.Random(seed * 1_000_003 + i + 7)
    case = draw(rng)
    hub = start()
    repo = f"fuzz/case-{i}"
    what = f"hub listing={case['listing']} file={case['file']}"
    case_dir = os.path.abspath(os.path.join(out, "hub-cases", f"{i:06d}"))
    hub.cases[repo] = {**case, "dir": case_dir}
    home = os.path.join(case_dir, "home")
    os.makedirs(home, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not (k.startswith(("HF_", "HUGGINGFACE_")) or
                                                      k.lower().endswith("_proxy"))}
    env.update(HF_HOME=home, HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1",
               HF_HUB_DOWNLOAD_TIMEOUT=DOWNLOAD_TIMEOUT)
    try:
        r = subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "pull", repo], capture_output=True, text=True,
                           env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang", what
    try:
        outside = _written_outside(case_dir, home)
        if outside:
            return "escape", f"{what}: {outside[:3]}"
        if "Traceback" in r.stderr:
            return "traceback", f"{what}: {r.stderr[-300:]}"
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        if case == {"listing": "ok", "file": "ok"}:  # served as it should be: downloaded whole
            path = r.stdout.strip()
            if r.returncode != 0 or not os.path.isfile(path) or open(path, "rb").read() != DATA:
                return "wrong", f"{what}: exit {r.returncode} {r.stderr[-300:]}"
        elif r.returncode != 2 or len(errors) != 1:
            return "wrong", f"{what}: exit {r.returncode}, {len(errors)} error lines {r.stderr[-300:]}"
        return "fine", f"{what} {r.returncode}"
    finally:
        hub.cases.pop(repo, None)
        shutil.rmtree(case_dir, ignore_errors=True)


def huge_info(rng: random.Random, port: int, timeout: float) -> tuple[int, bytes, str]:
    """One huge /tokenize or /detokenize: (status, body, what)."""
    if rng.random() < 0.6:
        n = rng.choice([6_000, 7_000, 100_000, 1 << 20, 4 << 20])
        body: dict[str, Any] = {"model": "q3", "content": ("the cache é ☃ " * (n // 13 + 1))[:n],
                                "with_pieces": rng.random() < 0.3}
        path, what = "/tokenize", f"/tokenize {n} chars"
    else:
        n = rng.choice([255, 256, 257, 100_000, 4_000_000])
        body = {"model": "q3", "tokens": [rng.randrange(10, 100)] * n}  # 4 bytes an id: 4 M ids fit in the body limit
        path, what = "/detokenize", f"/detokenize {n} ids"
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read(), what
    finally:
        c.close()


__all__ = ["HostileHub", "draw", "hub_case", "huge_info", "start", "stop"]
