"""The child process that compiles and renders chat templates (run as a script: only the standard library and Jinja2).

A chat template is Jinja2 source from the model file: untrusted code. Jinja2's sandbox keeps it away from
Python's internals, but not from time and memory: ``{{ 7 ** 7 ** 9 }}`` computes for hours inside one C call,
``{{ 'a' * 10 ** 9 }}`` allocates a gigabyte, nested loops never end, and no thread can be stopped from the
outside. So templates run here, in a process of their own, under an address-space limit
(:data:`MEMORY_LIMIT`); the parent (:mod:`.chat`) bounds each call's time and kills this process when it is
exceeded. Nothing of the parent's (its model, its threads, its memory) is shared.

Protocol, on stdin/stdout: each message is a 4-byte little-endian length and that many bytes of JSON. A request
is ``{"op": "compile" | "render", "source": str, ...}``; the answer ``{"ok": value}`` or ``{"error": kind,
"message": str}`` with kind one of ``syntax``, ``raised`` (the template's own ``raise_exception``), ``failed``,
``memory`` or ``output`` (more than ``max_chars`` characters).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from typing import IO, Any

MEMORY_LIMIT = 768 << 20  # bytes of address space the renderer may map (Python and Jinja2 need ~60 MiB)
MAX_CACHED = 8            # compiled templates kept (one per model served, in practice)


class _Raised(Exception):
    """A template's own ``raise_exception(message)``: its message is the user's error."""


class _TooLong(Exception):
    pass


def _raise(message: object) -> None:
    raise _Raised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Hugging Face's tojson: no HTML escaping (Jinja2's own escapes <, >, & and ')
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return time.strftime(str(fmt))


class Renderer:
    def __init__(self) -> None:
        import jinja2.sandbox

        self.jinja2 = jinja2
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        self.env = env
        self.cache: dict[str, Any] = {}

    def compile(self, source: str) -> Any:
        t = self.cache.get(source)
        if t is None:
            t = self.env.from_string(source)
            if len(self.cache) >= MAX_CACHED:
                self.cache.pop(next(iter(self.cache)))
            self.cache[source] = t
        return t

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            template = self.compile(req["source"])
        except MemoryError:
            return {"error": "memory", "message": "compiling it needed more memory than the renderer may use"}
        except self.jinja2.TemplateError as exc:
            return {"error": "syntax", "message": str(exc)}
        except Exception as exc:  # constant folding at compile time runs template code too
            return {"error": "failed", "message": f"{type(exc).__name__}: {exc}"}
        if req["op"] == "compile":
            return {"ok": True}
        max_chars = int(req["max_chars"])
        out: list[str] = []
        n = 0
        try:
            for piece in template.generate(messages=req["messages"], add_generation_prompt=req["add_generation_prompt"],
                                           bos_token=req["bos_token"], eos_token=req["eos_token"], **req["extra"]):
                n += len(piece)
                if n > max_chars:
                    raise _TooLong
                out.append(piece)
            text = "".join(out)
        except _TooLong:
            return {"error": "output", "message": f"its output passed {max_chars} characters"}
        except _Raised as exc:
            return {"error": "raised", "message": str(exc)}
        except MemoryError:
            out.clear()
            return {"error": "memory", "message": "rendering it needed more memory than the renderer may use"}
        except RecursionError:
            return {"error": "failed", "message": "RecursionError: it recursed too deeply"}
        except Exception as exc:  # the template is untrusted code: whatever it raises is its failure
            return {"error": "failed", "message": f"{type(exc).__name__}: {exc}"}
        return {"ok": text}


def read_message(f: IO[bytes]) -> Any:
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    data = f.read(n)
    if len(data) < n:
        return None
    return json.loads(data)


def write_message(f: IO[bytes], doc: Any) -> None:
    data = json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass")
    f.write(struct.pack("<I", len(data)) + data)
    f.flush()


def _limit_self() -> None:
    import resource
    import signal

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = MEMORY_LIMIT if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):  # a platform without it: the parent's time limit still holds
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends


def _watch_lifeline(fd: int) -> None:
    """End with the parent, even one killed hard while a template computes: the parent holds the write end of
    ``fd``'s pipe, and the kernel closes it when the parent ends, so the read below returns (end of file)."""
    import threading

    def wait() -> None:
        while os.read(fd, 1):
            pass
        os._exit(0)

    threading.Thread(target=wait, name="lifeline", daemon=True).start()


def main() -> None:
    _limit_self()
    if len(sys.argv) > 1:
        _watch_lifeline(int(sys.argv[1]))
    r = Renderer()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    write_message(out, {"ready": True})
    while True:
        req = read_message(inp)
        if req is None:
            return
        write_message(out, r.handle(req))


if __name__ == "__main__":
    main()
