"""OpenAI's smaller fields and roles through ``ggml-hybrid serve``: ``developer`` messages reach every template as the
system role, ``GET /v1/models/{id}`` (OpenAI's shape, Anthropic's when asked with Anthropic's headers),
``system_fingerprint`` on chat and completions answers, ``usage: null`` on the chunks before the usage chunk."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("jinja2")

from test_structured import FAMILY_TEMPLATES, TEMPLATES  # noqa: E402

from ggml_hybrid.synthetic import TEMPLATES as SYNTHETIC_TEMPLATES  # noqa: E402
from ggml_hybrid.text.chat import ChatTemplate  # noqa: E402

# every template the project ships or tests: the families' published ones, the generated models' own, and ChatML
ALL_TEMPLATES = {**{f"fixture:{k}": (TEMPLATES / v).read_text() for k, v in FAMILY_TEMPLATES.items()},
                 **{f"synthetic:{k}": v for k, v in SYNTHETIC_TEMPLATES.items()}, "chatml": None}
DEV = "Answer in French. (developer-7f3a)"
SYS = "You are terse. (system-91c2)"


def _render_or_error(t: ChatTemplate, msgs: list[dict]) -> str:
    try:
        return t.render(msgs)
    except Exception as exc:  # a template that refuses a role refuses it under both names
        return f"refused: {type(exc).__name__}"


@pytest.mark.parametrize("name", sorted(ALL_TEMPLATES))
def test_a_developer_message_is_the_system_role(name):
    """The oracle is the template's own handling of the system role: a developer message renders as a system message
    with the same text would, and a system message followed by a developer message as one system message holding
    both (OpenAI's merge for models without a developer role)."""
    t = ChatTemplate(ALL_TEMPLATES[name], "<s>", "</s>")
    user = {"role": "user", "content": "Hello"}
    got = t.render([{"role": "developer", "content": DEV}, user])
    assert DEV in got
    assert got == t.render([{"role": "system", "content": DEV}, user])
    got = t.render([{"role": "system", "content": SYS},
                    {"role": "developer", "content": [{"type": "text", "text": DEV}]}, user])
    assert SYS in got and DEV in got
    assert got == t.render([{"role": "system", "content": f"{SYS}\n\n{DEV}"}, user])
    # later in a conversation: as a system message there (or refused by the template as that would be)
    turns = [user, {"role": "assistant", "content": "Bonjour"}]
    later = _render_or_error(t, [*turns, {"role": "developer", "content": DEV}, user])
    assert later == _render_or_error(t, [*turns, {"role": "system", "content": DEV}, user])
    # gpt-oss's template keeps only a first system (or developer) message, whatever its role is called
    assert later.startswith("refused") or DEV in later or name == "fixture:harmony"


def test_system_messages_without_a_developer_one_are_left_as_sent():
    t = ChatTemplate(None)
    got = t.render([{"role": "system", "content": SYS}, {"role": "system", "content": "second"},
                    {"role": "user", "content": "Hello"}])
    assert got.count("<|im_start|>system\n") == 2
