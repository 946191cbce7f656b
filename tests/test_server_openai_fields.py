"""OpenAI's smaller fields and roles through ``ggml-hybrid serve``: ``developer`` messages reach every template as the
system role, ``GET /v1/models/{id}`` (OpenAI's shape, Anthropic's when asked with Anthropic's headers),
``system_fingerprint`` on chat and completions answers, ``usage: null`` on the chunks before the usage chunk."""

from __future__ import annotations

import json
import urllib.request

import gguf
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("jinja2")

from helpers import rewrite_gguf  # noqa: E402
from test_server import Server, get  # noqa: E402
from test_structured import FAMILY_TEMPLATES, TEMPLATES  # noqa: E402

from ggml_hybrid.synthetic import TEMPLATES as SYNTHETIC_TEMPLATES  # noqa: E402
from ggml_hybrid.synthetic import write_model  # noqa: E402
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


# -- through the server ---------------------------------------------------------------------------------

SERVED = ("hermes", "qwen3_xml", "glm", "deepseek")  # Qwen3, Qwen3.5, GLM-4.6, DeepSeek-V3.1


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("fields")
    base = write_model(d / "base.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    for fmt in SERVED:
        rewrite_gguf(base, d / f"{fmt}.gguf", set_keys={
            "tokenizer.chat_template": ((TEMPLATES / FAMILY_TEMPLATES[fmt]).read_text(), gguf.GGUFValueType.STRING)})
    cfg = d / "server.toml"
    alias = {"hermes": 'aliases = ["qwen"]'}
    cfg.write_text("".join(f'[models.{n}]\npath = "{n}.gguf"\n{alias.get(n, "")}\n'
                           f'[models.{n}.session_options]\nn_ctx = 2048\nn_threads = 1\n\n' for n in SERVED))
    return {"dir": d, "config": str(cfg)}


@pytest.fixture(scope="module")
def server(files):
    with Server(["--config", files["config"]]) as s:
        yield s
        rc, err = s.stop()
    assert rc == 0, err


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


@pytest.mark.parametrize("model", SERVED)
def test_a_developer_message_reaches_the_prompt(client, model):
    user = {"role": "user", "content": "Hello"}

    def prompt_tokens(msgs):
        return client.chat.completions.create(model=model, messages=msgs, max_tokens=1).usage.prompt_tokens

    alone = prompt_tokens([user])
    as_dev = prompt_tokens([{"role": "developer", "content": DEV}, user])
    assert as_dev > alone
    assert as_dev == prompt_tokens([{"role": "system", "content": DEV}, user])
    both = prompt_tokens([{"role": "system", "content": SYS}, {"role": "developer", "content": DEV}, user])
    assert both == prompt_tokens([{"role": "system", "content": f"{SYS}\n\n{DEV}"}, user]) > as_dev


def test_a_model_is_retrieved_by_name_or_alias(server, client):
    for name in ("hermes", "qwen", "glm"):
        m = client.models.retrieve(name)
        assert (m.id, m.object, m.owned_by) == (name, "model", "ggml-hybrid") and isinstance(m.created, int)
    listed = {m.id: m.created for m in client.models.list()}
    assert listed["qwen"] == client.models.retrieve("qwen").created
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    status, body = get(server.url + "/v1/models/a/b")  # a name with a slash is looked up whole
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def test_anthropic_clients_get_anthropics_model_shapes(server):
    a = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    m = a.models.retrieve("glm")
    assert (m.type, m.id, m.display_name) == ("model", "glm", "glm") and m.created_at.year >= 2024
    page = a.models.list()
    assert {x.id for x in page.data} == {*SERVED, "qwen"} and page.has_more is False
    assert page.first_id == page.data[0].id and page.last_id == page.data[-1].id
    with pytest.raises(anthropic.NotFoundError) as e:
        a.models.retrieve("nope")
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"


def _chunks(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                out.append(json.loads(line[5:]))
    return out


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"})])
def test_usage_is_null_on_every_chunk_but_the_last_when_asked(server, path, body):
    from openai.types.chat import ChatCompletionChunk

    req = {"model": "hermes", "max_tokens": 6, "stream": True, "ignore_eos": True, **body}
    chunks = _chunks(server.url + path, {**req, "stream_options": {"include_usage": True}})
    if "chat" in path:  # (the SDK reads a completions chunk as a Completion, whose finish_reason may not be null)
        for c in chunks:
            ChatCompletionChunk.model_validate(c)
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all("usage" not in c for c in _chunks(server.url + path, req))  # not asked: OpenAI leaves it out


def test_system_fingerprint_names_the_build_and_the_model(client):
    def fingerprints(model):
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)
        comp = client.completions.create(model=model, prompt="Hi", max_tokens=2)
        streamed = {c.system_fingerprint for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True)}
        streamed |= {c.system_fingerprint for c in client.completions.create(
            model=model, prompt="Hi", max_tokens=2, stream=True)}
        return {chat.system_fingerprint, comp.system_fingerprint, *streamed}

    hermes, glm = fingerprints("hermes"), fingerprints("glm")
    assert len(hermes) == 1 and len(glm) == 1  # one per model, on every answer and chunk
    (fh,), (fg,) = hermes, glm
    assert fh.startswith("fp_") and fg.startswith("fp_") and fh != fg  # another file, another fingerprint
    assert fingerprints("qwen") == hermes  # an alias is the same model


def test_the_fingerprint_follows_the_file_and_the_options(tmp_path):
    from ggml_hybrid.server.models import fingerprint

    a = write_model(tmp_path / "a.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    before = fingerprint(a, {"n_ctx": 128})
    assert fingerprint(a, {"n_ctx": 128}) == before
    assert fingerprint(a, {"n_ctx": 256}) != before
    write_model(a, arch="qwen3moe", weight_type="q8_0", seed=5)  # the same path, other weights
    assert fingerprint(a, {"n_ctx": 128}) != before
