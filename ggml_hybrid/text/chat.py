"""Chat prompts from the model's own template: ``tokenizer.chat_template`` rendered in a Jinja2 sandbox.

A GGUF file carries its chat template as Jinja2 source (Hugging Face's convention). The template
comes from the file, so it is untrusted input: it is rendered by Jinja2's immutable sandbox (no
attribute access to Python internals, no mutation of the values passed in, ranges capped) with
the names Hugging Face templates expect (``messages``, ``add_generation_prompt``, ``bos_token``,
``eos_token``, ``raise_exception``, ``strftime_now``, the ``tojson`` filter with their options)
and the output capped in size. A model without a template gets :data:`DEFAULT_TEMPLATE`, ChatML,
which is also llama.cpp's fallback. The server's chat endpoint and ``run -cnv`` both use
:class:`ChatTemplate`; the rendered text is tokenized with control tokens parsed
(``encode(..., special=True)``), as llama.cpp's server does.

Jinja2 comes with the ``server`` extra (``pip install -e '.[server]'`` in the checkout; ggml-hybrid is not on PyPI).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ChatTemplateError, MissingDependencyError
from ..gguf.store import GGUFStore

# ChatML: <|im_start|>role\ncontent<|im_end|>\n ... then <|im_start|>assistant\n
DEFAULT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                    "{% endif %}")
MAX_OUTPUT_CHARS = 1 << 24  # a rendered prompt beyond this is an error, not an allocation
ROLES_RULE = "a list of messages, each an object with a string 'role' and a string (or text parts) 'content'"


def _jinja() -> Any:
    try:
        import jinja2.sandbox
    except ImportError:
        raise MissingDependencyError("chat templates need Jinja2 (the server extra): pip install -e '.[server]' in "
                                     "the ggml-hybrid checkout, or pip install jinja2") from None
    return jinja2


class _Raised(Exception):
    """A template's own ``raise_exception(message)``: its message is the user's error."""


def _raise(message: object) -> None:
    raise _Raised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Hugging Face's tojson: no HTML escaping (Jinja2's own escapes <, >, & and ')
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return time.strftime(str(fmt))


class ChatTemplate:
    """A chat template (the model's, or ChatML) ready to render messages into a prompt."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        jinja2 = _jinja()
        self.from_model = source is not None
        self.source = source if source is not None else DEFAULT_TEMPLATE
        self.bos_token, self.eos_token = bos_token, eos_token
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template is not valid Jinja2: {exc}") from None

    @classmethod
    def from_gguf(cls, store: GGUFStore, tokens: Sequence[str], bos_id: int | None,
                  eos_id: int | None) -> ChatTemplate:
        """The file's ``tokenizer.chat_template`` (ChatML when it has none), with its BOS/EOS texts."""
        source = store.meta("tokenizer.chat_template", "") or None  # absent (or empty): ChatML
        if source is not None and not isinstance(source, str):
            raise ChatTemplateError(f"{store.path}: tokenizer.chat_template is not a string")

        def text(i: int | None) -> str:
            return tokens[i] if i is not None and 0 <= i < len(tokens) else ""

        return cls(source, text(bos_id), text(eos_id))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text of ``messages`` (checked: role and content strings; text parts are joined)."""
        msgs = [normalize_message(m, i) for i, m in enumerate(messages)] if isinstance(messages, (list, tuple)) \
            else None
        if not msgs:
            raise ChatTemplateError(f"messages must be {ROLES_RULE}, with at least one message")
        out: list[str] = []
        n = 0
        try:
            for piece in self._template.generate(messages=msgs, add_generation_prompt=add_generation_prompt,
                                                  bos_token=self.bos_token, eos_token=self.eos_token, **extra):
                n += len(piece)
                if n > MAX_OUTPUT_CHARS:
                    raise ChatTemplateError(f"the chat template's output passed {MAX_OUTPUT_CHARS} characters")
                out.append(piece)
        except _Raised as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
        except ChatTemplateError:
            raise
        except Exception as exc:  # the template is untrusted code: whatever it raises is its failure
            raise ChatTemplateError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") \
                from None
        return "".join(out)


def normalize_message(m: object, i: int) -> dict[str, str]:
    """A message as templates expect it: ``role`` and ``content`` strings (OpenAI's text parts joined)."""
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
    out = {"role": role, "content": content}
    name = m.get("name")
    if isinstance(name, str):
        out["name"] = name
    return out


__all__ = ["DEFAULT_TEMPLATE", "ChatTemplate", "normalize_message"]
