"""``run -cnv``: llama.cpp's conversation mode, a chat in the terminal.

Each turn renders the whole conversation with the model's chat template (the one the server uses,
:class:`~ggml_hybrid.text.chat.ChatTemplate`), evaluates only the tokens after the longest prefix
already in the KV cache, and streams the reply until an end-of-generation token, ``-n`` tokens or
a full context. End of input (Ctrl-D) ends the chat; Ctrl-C stops a reply and returns to the prompt
(at the prompt it ends the command, exit status 130, as Ctrl-C does everywhere).
"""

from __future__ import annotations

from typing import TextIO

import click

from ..errors import ContextFullError
from ..runtime.moe_model import MoEModel
from ..runtime.sampling import Sampler
from ..text.chat import ChatTemplate


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
    return line


def converse(m: MoEModel, sampler: Sampler, n_predict: int, system: str | None, first: str | None,
             ignore_eos: bool, stdin: TextIO) -> int:
    """Chat until end of input; returns the number of replies."""
    tok = m.tokenizer
    template = ChatTemplate.from_gguf(m.store, tok.tokens, tok.bos_id, tok.eos_id)
    messages = [{"role": "system", "content": system}] if system else []
    history: list[int] = []  # the tokens in the KV cache, in order
    m.reset()
    pending, replies = first, 0
    while True:
        if pending is None:
            click.echo("\n> ", nl=False)
            line = _read_line(stdin)  # Ctrl-C here ends the command as everywhere (exit status 130)
            if line is None:
                break
            if isinstance(line, _NotText):
                click.echo(f"(that line is not valid UTF-8 text: {line.why}; type it again)", err=True)
                continue
            pending = line.rstrip("\n")
        messages.append({"role": "user", "content": pending})
        pending = None
        text = template.render(messages, add_generation_prompt=True)
        add_bos = tok.add_bos and not (template.bos_token and text.startswith(template.bos_token))
        ids = tok.encode(text, add_bos=add_bos, special=True)
        if len(ids) >= m.n_ctx:
            raise ContextFullError(f"the conversation is {len(ids)} tokens; the context holds {m.n_ctx} "
                                   "(give a larger -c)")
        keep = min(_common_prefix(history, ids), len(ids) - 1)  # at least one token to evaluate
        if m.recurrent and keep < m.n_past:
            # a recurrent state cannot go back to the shared prefix: evaluate the conversation anew
            keep = 0
            m.reset()
        m.truncate(keep)
        del history[keep:]
        reply: list[int] = []
        stream = tok.stream()
        try:
            logits = m.eval(ids[keep:])
            history[:] = ids
            sampler.reset()
            for t in ids:
                sampler.accept(t)
            while n_predict < 0 or len(reply) < n_predict:
                t = sampler(logits[-1])
                if not ignore_eos and t in tok.eog_ids:
                    break
                sampler.accept(t)
                reply.append(t)
                click.echo(stream.push(t), nl=False)
                if m.position() >= m.n_ctx:
                    break
                logits = m.eval([t])
                history.append(t)
        except KeyboardInterrupt:
            click.echo(" [interrupted]", nl=False)
            del history[m.position():]  # what the cache holds: an interrupted eval leaves nothing behind
        click.echo(stream.flush(), nl=False)
        messages.append({"role": "assistant", "content": tok.decode(reply)})
        replies += 1
    click.echo()
    return replies


__all__ = ["converse"]
