"""``run -cnv``: llama.cpp's conversation mode, a chat in the terminal.

Each turn renders the whole conversation with the model's chat template (the one the server uses,
:class:`~ggml_hybrid.text.chat.ChatTemplate`), evaluates only the tokens after the longest prefix
already in the KV cache, and streams the reply until an end-of-generation token, ``-n`` tokens or
a full context. End of input (Ctrl-D) or ``/exit`` ends the chat; Ctrl-C stops a reply and returns to
the prompt (at the prompt it ends the command, exit status 130, as Ctrl-C does everywhere). The stats
of the whole chat go to stderr when it ends.

On a terminal the line is read through the standard ``readline`` module (line editing, the arrow keys,
the history of this chat); piped input is read line by line. A line ending in ``\\`` continues on the
next one (llama.cpp's multi-line input). ``/help`` lists the commands (``/clear``, ``/save FILE``,
``/load FILE``, ``/exit``). Control tokens (``<|im_end|>``, ...) print nothing unless ``special``
(``--special``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

import click

from ..errors import ChatTemplateError, ContextFullError, GgmlHybridError
from ..runtime.generate import GenerationStats
from ..runtime.moe_model import MoEModel
from ..runtime.sampling import Sampler
from ..text.chat import ChatTemplate
from ..text.vocab import TextStream, check_text

PROMPT = "\n> "
CONTINUATION = "... "
HELP = """commands (a line that starts with one; any other line is a message):
  /clear       start the conversation again (the system message stays)
  /save FILE   write the conversation to FILE as JSON: {"messages": [...]}, the request body of serve's
               /v1/chat/completions
  /load FILE   replace the conversation by FILE's (a file /save wrote)
  /exit        end the chat (as Ctrl-D)
  /help        this list
a line ending in \\ continues on the next line; Ctrl-C stops a reply"""
MAX_LOAD_BYTES = 16 << 20
_ROLES = ("system", "user", "assistant")

Message = dict[str, str]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _NotText:
    def __init__(self, why: str) -> None:
        self.why = why


def _read_line(stdin: TextIO) -> str | _NotText | None:
    """The next line of input (None at its end); bytes that are not UTF-8 are refused, not a crash."""
    raw = getattr(stdin, "buffer", None)
    line: str
    if raw is not None:
        data: bytes = raw.readline()
        if not data:
            return None
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return _NotText(f"byte {data[exc.start]:#04x} at {exc.start}")
    else:
        try:
            line = stdin.readline()
        except UnicodeDecodeError as exc:
            return _NotText(str(exc.reason))
        if not line:
            return None
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (a text stream decoding with surrogateescape)
        return _NotText(f"a lone surrogate at {exc.start}")
    return line.rstrip("\n")


def _terminal_reader(stdin: TextIO) -> Callable[[str], str | _NotText | None] | None:
    """A reader with line editing and history (``input`` over GNU readline or libedit) when stdin and stdout are
    this process's terminal; None where they are not (a pipe, a file, a test's stream) or readline is missing."""
    if stdin is not sys.stdin or not (sys.stdin.isatty() and sys.stdout.isatty()):
        return None
    try:
        import readline
    except ImportError:  # a Python built without it: plain lines
        return None
    readline.set_auto_history(True)

    def read(prompt: str) -> str | _NotText | None:
        try:
            line = input(prompt)
        except EOFError:
            return None
        except UnicodeDecodeError as exc:
            return _NotText(str(exc.reason))
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as exc:
            return _NotText(f"a lone surrogate at {exc.start}")
        return line

    return read


def _piped_reader(stdin: TextIO) -> Callable[[str], str | _NotText | None]:
    def read(prompt: str) -> str | _NotText | None:
        click.echo(prompt, nl=False)
        return _read_line(stdin)

    return read


def load_conversation(path: str) -> list[Message]:
    """The messages of a file ``/save`` wrote; an error naming the file and what is wrong with it."""
    from ..files import not_a_file

    why = not_a_file(path)
    if why is not None:
        raise click.BadParameter(f"{path!r} {why}", param_hint="/load")
    if os.path.getsize(path) > MAX_LOAD_BYTES:
        raise click.BadParameter(f"{path!r} is {os.path.getsize(path)} bytes; a conversation file is at most "
                                 f"{MAX_LOAD_BYTES} bytes", param_hint="/load")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (UnicodeDecodeError, ValueError) as exc:
        raise click.BadParameter(f"{path!r} is not JSON text: {exc}", param_hint="/load") from None
    except RecursionError:  # arrays or objects within each other deeper than the parser's recursion limit
        raise click.BadParameter(f"{path!r} is JSON nested too deeply to read (a conversation file is an object "
                                 '{"messages": [...]} of flat messages)', param_hint="/load") from None
    msgs = doc.get("messages") if isinstance(doc, dict) else None
    if not isinstance(msgs, list):
        raise click.BadParameter(f'{path!r} must hold an object {{"messages": [...]}} (what /save writes)',
                                 param_hint="/load")
    out: list[Message] = []
    for i, m in enumerate(msgs):
        if not (isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str)):
            raise click.BadParameter(f"{path!r}: messages[{i}] must be {{\"role\": system|user|assistant, "
                                     f"\"content\": text}}, got {_quote(m)}", param_hint="/load")
        try:  # JSON can write a lone surrogate (\ud800), which no text holds: /save and the tokenizer refuse it
            check_text(m["content"], f"{path!r}: messages[{i}].content")
        except GgmlHybridError as exc:
            raise click.BadParameter(str(exc), param_hint="/load") from None
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _quote(value: object) -> str:
    """A short JSON rendering of a value read from a file (any nesting, any string)."""
    try:
        return json.dumps(value)[:80]
    except (RecursionError, ValueError):
        return type(value).__name__


def save_conversation(path: str, messages: list[Message], model_path: str) -> None:
    """Written whole or not at all (a temporary file renamed over ``path``); the model file is refused."""
    from ..files import atomic_write, check_output

    path = check_output(path, [model_path], "/save")
    with atomic_write(path) as f:
        f.write(json.dumps({"messages": messages}, ensure_ascii=False, indent=1).encode("utf-8") + b"\n")


class _Chat:
    """The state of one chat: its messages, the tokens in the KV cache, the totals for the stats."""

    def __init__(self, m: MoEModel, system: str | None) -> None:
        self.m = m
        self.system = system
        self.messages: list[Message] = [{"role": "system", "content": system}] if system else []
        self.history: list[int] = []  # the tokens in the KV cache, in order
        self.stats = GenerationStats()
        self.replies = 0

    def command(self, line: str) -> bool | None:
        """Run ``line`` if it is a command: True to go on, False to end the chat; None if it is a message."""
        word, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if word == "/exit":
            return False
        if word == "/help":
            click.echo(HELP)
        elif word == "/clear":
            self.messages = [{"role": "system", "content": self.system}] if self.system else []
            click.echo("(conversation cleared)")
        elif word in ("/save", "/load"):
            if not arg:
                click.echo(f"({word} needs a file: {word} FILE)", err=True)
                return True
            try:
                if word == "/save":
                    save_conversation(arg, self.messages, self.m.store.path)
                    click.echo(f"(saved {len(self.messages)} messages to {arg})")
                else:
                    self.messages = load_conversation(arg)
                    click.echo(f"(loaded {len(self.messages)} messages from {arg})")
            except (click.ClickException, GgmlHybridError, OSError) as exc:
                msg = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
                click.echo(f"error: {' '.join(msg.split())}", err=True)
        else:
            return None
        return True

    def _prompt(self, text: str, template: ChatTemplate) -> list[int]:
        """The conversation with ``text`` added, as token ids; the message is kept only if they can be evaluated (a
        template that refuses the messages or stops at a bound, or a context too small, raise and keep nothing)."""
        m, tok = self.m, self.m.tokenizer
        self.messages.append({"role": "user", "content": text})
        try:
            rendered = template.render(self.messages, add_generation_prompt=True)
            add_bos = tok.add_bos and not (template.bos_token and rendered.startswith(template.bos_token))
            ids = tok.encode(rendered, add_bos=add_bos, special=True)
            if len(ids) >= m.n_ctx:
                raise ContextFullError(f"the conversation is {len(ids)} tokens; the context holds {m.n_ctx} "
                                       "(start with a larger -c, or /clear); the message was not sent")
        except (ChatTemplateError, ContextFullError):
            self.messages.pop()
            raise
        return ids

    def turn(self, text: str, sampler: Sampler, n_predict: int, ignore_eos: bool, special: bool,
             template: ChatTemplate) -> None:
        m, tok = self.m, self.m.tokenizer
        ids = self._prompt(text, template)
        keep = min(_common_prefix(self.history, ids), len(ids) - 1)  # at least one token to evaluate
        if m.recurrent and keep < m.n_past:
            # a recurrent state cannot go back to the shared prefix: evaluate the conversation anew
            keep = 0
            m.reset()
        m.truncate(keep)
        del self.history[keep:]
        reply: list[int] = []
        stream = TextStream(tok, () if special else tok.control)
        st = self.stats
        t0 = time.perf_counter()
        phase = "prompt"
        try:
            logits = m.eval(ids[keep:])
            st.prompt_tokens += len(ids) - keep
            st.prompt_seconds += time.perf_counter() - t0
            phase, t0 = "decode", time.perf_counter()
            self.history[:] = ids
            sampler.reset()
            for t in ids:
                sampler.accept(t)
            while n_predict < 0 or len(reply) < n_predict:
                t = sampler(logits[-1])
                if not ignore_eos and t in tok.eog_ids:
                    break
                sampler.accept(t)
                reply.append(t)
                st.generated_tokens += 1
                click.echo(stream.push(t), nl=False)
                if m.position() >= m.n_ctx:
                    break
                logits = m.eval([t])
                st.decode_steps += 1
                self.history.append(t)
        except KeyboardInterrupt:
            click.echo(" [interrupted]", nl=False)
            del self.history[m.position():]  # what the cache holds: an interrupted eval leaves nothing behind
        finally:
            if phase == "prompt":
                st.prompt_seconds += time.perf_counter() - t0
            else:
                st.decode_seconds += time.perf_counter() - t0
        click.echo(stream.flush(), nl=False)
        self.messages.append({"role": "assistant", "content": tok.decode(reply)})
        self.replies += 1


def _read_message(read: Callable[[str], str | _NotText | None]) -> str | None:
    """One message: lines ending in a backslash continue on the next; None at the end of input."""
    parts: list[str] = []
    prompt = PROMPT
    while True:
        line = read(prompt)
        if line is None:
            return "\n".join(parts) if parts else None
        if isinstance(line, _NotText):
            click.echo(f"(that line is not valid UTF-8 text: {line.why}; type it again)", err=True)
            continue
        if line.endswith("\\"):
            parts.append(line[:-1])
            prompt = CONTINUATION
            continue
        parts.append(line)
        return "\n".join(parts)


def _print_stats(chat: _Chat, stop: str) -> None:
    from .report import format_stats, run_report

    st = chat.stats
    st.stop_reason = stop
    click.echo(f"chat: {chat.replies} replies, {len(chat.messages)} messages, {len(chat.history)} tokens in the "
               "context", err=True)
    click.echo(format_stats(run_report(chat.m, st, "")), err=True)


def converse(m: MoEModel, sampler: Sampler, n_predict: int, system: str | None, first: str | None,
             ignore_eos: bool, stdin: TextIO, special: bool = False) -> int:
    """Chat until end of input or ``/exit``; returns the number of replies."""
    from .main import ignore_interrupts

    tok = m.tokenizer
    template = ChatTemplate.from_gguf(m.store, tok.tokens, tok.bos_id, tok.eos_id)
    chat = _Chat(m, system)
    read = _terminal_reader(stdin) or _piped_reader(stdin)
    from .._native import lib

    # Ctrl-C at the prompt: readline waits in select(), which only a SIGINT of the main thread interrupts, and
    # the threads a backend library starts (a Vulkan driver's) may take it instead (native signals.h)
    lib.hy_forward_sigint_to_main_thread()
    m.reset()
    pending = first
    try:
        while True:
            if pending is None:
                pending = _read_message(read)  # Ctrl-C here ends the command (exit status 130), after the stats
                if pending is None:
                    break
                done = chat.command(pending) if pending.startswith("/") else None
                if done is not None:
                    pending = None
                    if done:
                        continue
                    break
            text, pending = pending, None
            try:
                chat.turn(text, sampler, n_predict, ignore_eos, special, template)
            except ContextFullError as exc:  # the message is not kept: a shorter one, or /clear, goes on
                click.echo(f"error: {exc}", err=True)
            except ChatTemplateError as exc:  # likewise (a conversation /load gave that the template refuses)
                click.echo(f"error: {' '.join(str(exc).split())}; the message was not sent", err=True)
    except KeyboardInterrupt:
        ignore_interrupts()  # a second Ctrl-C must not cut the stats of the first short
        click.echo()
        _print_stats(chat, "interrupted")
        raise
    click.echo()
    _print_stats(chat, "end of input")
    return chat.replies


__all__ = ["HELP", "converse", "load_conversation", "save_conversation"]
