"""How many bytes each route's request body may hold, derived from the rules its fields obey once parsed.

A body is parsed whole before any of its fields is checked, and parsing holds the interpreter (and with it the
event loop) for as long as it runs: so each route refuses (413, :func:`.body.read_json`) a body longer than the
largest one its fields could ever accept, before parsing it. Each bound is the sum of what the route's fields take,
in bytes of JSON, for the largest model served (a body names its model only once it is parsed):

- a prompt's text: ``max_prompt_chars`` characters (more cannot fit in a sequence's context, whatever their tokens:
  :attr:`.models.ServedModel.max_prompt_chars`), each at most :data:`CHAR_BYTES` bytes of JSON; a prompt's ids:
  ``n_ctx`` of them, each at most :data:`ID_BYTES`;
- a chat (chat completions, Anthropic's messages and count_tokens, the Responses API, llama-server's
  ``/apply-template``): one prompt's text (messages, instructions and tools are all rendered into the prompt);
- a completion (``/v1/completions``, llama-server's ``/completion``; ``/v1/embeddings``, which refuses every model
  served but is bounded as a completion): :data:`~.protocol.MAX_CHOICES` prompts, each text and ids;
- with either, a schema or grammar (:data:`~ggml_hybrid.runtime.grammar_check.MAX_GRAMMAR_CHARS` characters),
  stop strings (:data:`~.protocol.MAX_STOP_TOTAL` characters) and :data:`BODY_SLACK` for the rest (the model's
  name, the sampling fields, whitespace);
- ``/tokenize``: one prompt's text; ``/detokenize``: ``n_ctx`` ids.

No bound exceeds :data:`~.protocol.MAX_BODY_BYTES`, the server-wide one (also the bound before any model has loaded:
such a request is refused as the model loads anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..runtime.grammar_check import MAX_GRAMMAR_CHARS
from .models import ServedModel
from .protocol import MAX_BODY_BYTES, MAX_CHOICES, MAX_STOP_TOTAL

BODY_SLACK = 64 << 10  # the rest of a body: the model's name, the flags, whitespace
ID_BYTES = 24  # one token id in JSON: at most 20 digits, a comma and a few spaces
CHAR_BYTES = 12  # one character of a JSON string at most: a character beyond the BMP escaped as two \u escapes
# what any generation may add to its prompts: a schema or grammar, and stop strings
EXTRA_BYTES = CHAR_BYTES * (MAX_GRAMMAR_CHARS + MAX_STOP_TOTAL)


def text_bytes(sm: ServedModel) -> int:
    """The most bytes of JSON a prompt's text takes on ``sm``."""
    return sm.max_prompt_chars * CHAR_BYTES


def ids_bytes(sm: ServedModel) -> int:
    """The most bytes of JSON a prompt's token ids take on ``sm``."""
    return sm.model.n_ctx * ID_BYTES if sm.model is not None else 0


# per kind of route: the largest payload it takes on a model, in bytes, and what the 413 says it is
KINDS: dict[str, tuple[Callable[[ServedModel], int], str]] = {
    "chat": (lambda sm: text_bytes(sm) + EXTRA_BYTES,
             "a prompt a sequence's context can hold, a schema or grammar, and stop strings"),
    "completion": (lambda sm: MAX_CHOICES * (text_bytes(sm) + ids_bytes(sm)) + EXTRA_BYTES,
                   f"{MAX_CHOICES} prompts a sequence's context can hold, a schema or grammar, and stop strings"),
    "tokenize": (text_bytes, "a text a sequence's context can hold"),
    "detokenize": (ids_bytes, "the ids a sequence's context holds"),
}


def body_bound(models: Iterable[ServedModel], kind: str) -> int:
    """The most bytes a body of a ``kind`` route (:data:`KINDS`) may hold: the largest payload over the loaded
    ``models``, plus :data:`BODY_SLACK`, at most :data:`~.protocol.MAX_BODY_BYTES` (which is also the bound before
    any model has loaded)."""
    payload = KINDS[kind][0]
    sizes = [payload(sm) for sm in models if sm.model is not None]
    return min(MAX_BODY_BYTES, BODY_SLACK + max(sizes)) if sizes else MAX_BODY_BYTES


def body_why(route: str, kind: str) -> str:
    """What a 413 of ``route`` adds to its bound: the route and what its bound is made of."""
    return f" ({route}: {KINDS[kind][1]})"


__all__ = ["BODY_SLACK", "CHAR_BYTES", "EXTRA_BYTES", "ID_BYTES", "KINDS", "body_bound", "body_why", "ids_bytes",
           "text_bytes"]
