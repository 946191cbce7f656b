"""Chat prompts from the model's own template: ``tokenizer.chat_template`` rendered in a Jinja2 sandbox.

A GGUF file carries its chat template as Jinja2 source (Hugging Face's convention). The template
comes from the file, so it is untrusted input: it is rendered by Jinja2's immutable sandbox (no
attribute access to Python internals, no mutation of the values passed in, ranges capped) with
the names Hugging Face templates expect (``messages``, ``add_generation_prompt``, ``bos_token``,
``eos_token``, ``raise_exception``, ``strftime_now``, the ``tojson`` filter with their options)
and the output capped in size. Since the sandbox bounds neither time nor memory, templates are compiled
and rendered in a child process (:mod:`.template_worker`) under a time limit, an address-space limit and
an output limit; a template that overruns is stopped (its process killed) with a
:class:`~ggml_hybrid.errors.ChatTemplateLimitError`. A model without a template gets :data:`DEFAULT_TEMPLATE`, ChatML,
which is also llama.cpp's fallback. The server's chat endpoint and ``run -cnv`` both use
:class:`ChatTemplate`; the rendered text is tokenized with control tokens parsed
(``encode(..., special=True)``), as llama.cpp's server does.

Jinja2 comes with the ``server`` extra (``pip install -e '.[server]'`` in the checkout; ggml-hybrid is not on PyPI).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ChatTemplateError, ChatTemplateLimitError, MissingDependencyError
from ..gguf.store import GGUFStore
from ..machine import kill_child

# ChatML: <|im_start|>role\ncontent<|im_end|>\n ... then <|im_start|>assistant\n
DEFAULT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                    "{% endif %}")
MAX_OUTPUT_CHARS = 1 << 24  # a rendered prompt beyond this is an error, not an allocation
RENDER_SECONDS = 5.0        # a template that takes longer to compile or render is stopped (its process killed)
ROLES_RULE = "a list of messages, each an object with a string 'role' and a string (or text parts) 'content'"
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "template_worker.py")


def _jinja() -> Any:
    try:
        import jinja2.sandbox
    except ImportError:
        raise MissingDependencyError("chat templates need Jinja2 (the server extra): pip install -e '.[server]' in "
                                     "the ggml-hybrid checkout, or pip install jinja2") from None
    return jinja2


class _Worker:
    """One renderer process (``template_worker.py``); killed when a call overruns its time."""

    def __init__(self) -> None:
        # its own session: a Ctrl-C at the terminal is the parent's to handle; stderr dropped (a memory-limit
        # abort would print there)
        # and a lifeline: the renderer ends when this pipe's write end closes, which happens when this process ends
        # however it ends (the kernel closes it). PR_SET_PDEATHSIG would follow the *thread* that started the
        # renderer, and threads of pools end while the process goes on.
        lifeline, self._lifeline = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, _WORKER, str(lifeline)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                                         close_fds=True, pass_fds=(lifeline,))
        except BaseException:
            os.close(self._lifeline)
            raise
        finally:
            os.close(lifeline)
        self.busy = False  # a request sent, its answer not yet read
        self._stopped = False  # stop() was called: no more calls; the caller of one in progress cleans up
        self._state = threading.Lock()  # busy/_stopped, and the pipes' ends while kill() closes them
        self._read(30.0, "start")

    def call(self, req: dict[str, Any], seconds: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        data = json.dumps(req, ensure_ascii=False).encode("utf-8", "surrogatepass")
        stopped = ChatTemplateLimitError("the chat template's renderer stopped (the server is stopping, or it ran "
                                         "out of memory)", "stopped")
        with self._state:
            if self._stopped:
                raise stopped
            self.busy = True  # from here on stop() only signals: this thread owns the pipes until the call ends
        try:
            try:
                self.proc.stdin.write(struct.pack("<I", len(data)) + data)
                self.proc.stdin.flush()
            except OSError:
                self.kill()
                raise stopped from None
            return self._read(seconds, req["op"])
        finally:
            with self._state:
                self.busy = False
            if self._stopped:
                self.kill()

    def _read(self, seconds: float, op: str) -> dict[str, Any]:
        deadline = time.monotonic() + seconds
        head = self._exactly(4, deadline, op, seconds)
        (n,) = struct.unpack("<I", head)
        doc: dict[str, Any] = json.loads(self._exactly(n, deadline, op, seconds).decode("utf-8", "surrogatepass"))
        return doc

    def _exactly(self, n: int, deadline: float, op: str, seconds: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self.kill()
                verb = "render" if op == "render" else "compile" if op == "compile" else "start its renderer"
                raise ChatTemplateLimitError(f"the chat template did not {verb} within {seconds:g} s "
                                             "(stopped)", "time")
            chunk = os.read(fd, min(n - len(buf), 1 << 20))
            if not chunk:
                self.kill()
                raise ChatTemplateLimitError("the chat template's renderer stopped (it ran out of memory, or the "
                                             "server is stopping)", "memory")
            buf += chunk
        return bytes(buf)

    def kill(self) -> None:
        """End the process and close every pipe to it, from the thread that owns the pipes (the caller of a call
        in progress, or anyone while the worker is idle); safe twice."""
        with self._state:
            kill_child(self.proc)
            fd, self._lifeline = self._lifeline, -1
        if fd >= 0:
            os.close(fd)

    def stop(self) -> None:
        """End the process from any thread. A call in progress sees its renderer stop (end of output) and its
        caller closes the pipes: closing them here would pull a descriptor from under that caller's ``select``."""
        with self._state:
            self._stopped = True
            if self.busy:
                try:
                    self.proc.kill()
                except OSError:  # it ended in between
                    pass
                return
        self.kill()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class RenderPool:
    """Renderer processes shared by every template of the process, started on first use, at most ``size`` at a
    time (more callers wait their turn); :meth:`close` kills them all, which ends every call in progress."""

    def __init__(self, size: int = 2, seconds: float = RENDER_SECONDS) -> None:
        self.size, self.seconds = size, seconds
        self._free: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._closed = False

    def call(self, req: dict[str, Any], seconds: float | None = None) -> dict[str, Any]:
        seconds = self.seconds if seconds is None else seconds
        with self._slots:
            with self._lock:
                if self._closed:
                    raise ChatTemplateLimitError("the chat template's renderer is closed (the server is stopping)",
                                                 "stopped")
                w = self._free.pop() if self._free else None
            if w is None or not w.alive:
                w = _Worker()
                with self._lock:
                    self._all.add(w)
                    if self._closed:
                        w.kill()
                        raise ChatTemplateLimitError("the chat template's renderer is closed (the server is "
                                                     "stopping)", "stopped")
            try:
                out = w.call(req, seconds)
            finally:
                with self._lock:
                    if w.alive and not self._closed:
                        self._free.append(w)
                    else:
                        self._all.discard(w)
            return out

    @property
    def in_progress(self) -> int:
        """Calls a renderer is working on now (each request sent, its answer not yet read)."""
        with self._lock:
            return sum(1 for w in self._all if w.busy)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._free = list(self._all), []
            self._all.clear()
        for w in workers:
            w.stop()


_POOL = RenderPool()
atexit.register(_POOL.close)  # its processes end with this one, waited for (no process left to the interpreter's exit)


def render_pool() -> RenderPool:
    """The process's renderer pool (the server closes it when it stops)."""
    return _POOL


class ChatTemplate:
    """A chat template (the model's, or ChatML) ready to render messages into a prompt.

    Compiling and rendering run in a renderer process (:mod:`.template_worker`) under a time limit
    (:data:`RENDER_SECONDS`), a memory limit and an output limit, so that no template can hang, exhaust or
    stop the process that uses it."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "",
                 pool: RenderPool | None = None) -> None:
        _jinja()
        self.from_model = source is not None
        self.source = source if source is not None else DEFAULT_TEMPLATE
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pool = pool if pool is not None else _POOL
        if not isinstance(self.source, str):
            raise ChatTemplateError(f"the chat template must be text, got {type(self.source).__name__}")
        got = self._call({"op": "compile", "source": self.source})
        if "error" in got:
            if got["error"] == "syntax":
                raise ChatTemplateError(f"the chat template is not valid Jinja2: {got['message']}")
            raise self._failure(got)

    def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.pool.call(req)
        except ChatTemplateError:
            raise
        except (TypeError, ValueError) as exc:  # values JSON cannot carry (the caller's extra arguments)
            raise ChatTemplateError(f"the chat template's arguments cannot be passed to it: {exc}") from None

    @staticmethod
    def _failure(got: dict[str, Any]) -> ChatTemplateError:
        kind, msg = got["error"], got["message"]
        if kind == "raised":
            return ChatTemplateError(f"the chat template refused the messages: {msg}")
        if kind == "output":
            return ChatTemplateLimitError(f"the chat template's output is too long: {msg}", "output")
        if kind == "memory":
            return ChatTemplateLimitError(f"the chat template exceeded its memory limit: {msg}", "memory")
        return ChatTemplateError(f"the chat template failed on these messages: {msg}")

    @classmethod
    def from_gguf(cls, store: GGUFStore, tokens: Sequence[str], bos_id: int | None,
                  eos_id: int | None, pool: RenderPool | None = None, source: str | None = None) -> ChatTemplate:
        """The file's ``tokenizer.chat_template`` (ChatML when it has none), with its BOS/EOS texts; ``source``: a
        template given instead of the file's (``serve --chat-template``)."""
        given = source is not None
        if not given:
            source = store.meta("tokenizer.chat_template", "") or None  # absent (or empty): ChatML
        if source is not None and not isinstance(source, str):
            raise ChatTemplateError(f"{store.path}: tokenizer.chat_template is not a string")

        def text(i: int | None) -> str:
            return tokens[i] if i is not None and 0 <= i < len(tokens) else ""

        t = cls(source, text(bos_id), text(eos_id), pool=pool)
        t.from_model = t.from_model and not given
        return t

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               max_chars: int = MAX_OUTPUT_CHARS, **extra: Any) -> str:
        """The prompt text of ``messages`` (checked: role and content strings; text parts are joined), at most
        ``max_chars`` characters (:class:`ChatTemplateLimitError` beyond, as beyond the time or memory limits)."""
        msgs = developer_as_system([normalize_message(m, i) for i, m in enumerate(messages)]) \
            if isinstance(messages, (list, tuple)) else None
        if not msgs:
            raise ChatTemplateError(f"messages must be {ROLES_RULE}, with at least one message")
        got = self._call({"op": "render", "source": self.source, "messages": msgs,
                          "add_generation_prompt": bool(add_generation_prompt), "bos_token": self.bos_token,
                          "eos_token": self.eos_token, "extra": extra,
                          "max_chars": max(0, min(int(max_chars), MAX_OUTPUT_CHARS))})
        if "error" in got:
            raise self._failure(got)
        text: str = got["ok"]
        return text


def normalize_message(m: object, i: int) -> dict[str, Any]:
    """A message as templates expect it: ``role`` and ``content`` strings (OpenAI's text parts joined); a tool
    result's ``name`` and ``tool_call_id``, an assistant's ``tool_calls``."""
    if not isinstance(m, Mapping):
        raise ChatTemplateError(f"messages[{i}] must be an object, got {type(m).__name__}")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or not role:
        raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ChatTemplateError(f"messages[{i}].content[{j}] must be a text part "
                                        "{'type': 'text', 'text': '...'} (only text is supported)")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")
    out: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_call_id"):  # a tool result's function name and the call it answers
        if isinstance(m.get(key), str):
            out[key] = m[key]
    calls = m.get("tool_calls")  # an assistant's calls, as the caller shaped them (the server: arguments objects)
    if isinstance(calls, list) and calls:
        try:
            out["tool_calls"] = json.loads(json.dumps(calls))  # plain JSON values only: they cross to the renderer
        except (TypeError, ValueError):
            raise ChatTemplateError(f"messages[{i}].tool_calls holds values that are not JSON") from None
    return out


def developer_as_system(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's ``developer`` role as the templates know it, the system role: a run of system and developer messages
    that holds a developer message becomes one system message, their texts joined by a blank line (what OpenAI does
    for models without a developer role; the families' templates have none, and most drop a role they do not know).
    Runs without a developer message are left as sent."""
    out: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []

    def flush() -> None:
        if any(m["role"] == "developer" for m in run):
            out.append({"role": "system", "content": "\n\n".join(m["content"] for m in run)})
        else:
            out.extend(run)
        run.clear()

    for m in msgs:
        if m["role"] in ("system", "developer"):
            run.append(m)
            continue
        flush()
        out.append(m)
    flush()
    return out


__all__ = ["DEFAULT_TEMPLATE", "RENDER_SECONDS", "ChatTemplate", "RenderPool", "developer_as_system",
           "normalize_message", "render_pool"]
