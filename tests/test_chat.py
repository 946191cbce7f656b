"""Chat templates (rendered in Jinja2's sandbox), special-token parsing, and ``run -cnv``."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

pytest.importorskip("jinja2")

from helpers import greedy_chat_reply

from ggml_hybrid.cli import main
from ggml_hybrid.errors import ChatTemplateError
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.runtime.sampling import Sampler
from ggml_hybrid.synthetic import TEMPLATES, write_model
from ggml_hybrid.text.chat import DEFAULT_TEMPLATE, MAX_OUTPUT_CHARS, ChatTemplate

MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}, {"role": "assistant", "content": "A"},
        {"role": "user", "content": [{"type": "text", "text": "U"}, {"type": "text", "text": "2"}]}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    out = {arch: write_model(d / f"{arch}.gguf", arch=arch, seed=2) for arch in ("qwen3moe", "glm4moe", "gpt-oss")}
    # recurrent states (delta-net layers): a turn cannot go back to the shared prefix, it starts over
    out["qwen35moe"] = write_model(d / "qwen35moe.gguf", arch="qwen35moe", n_layer=4, n_rot=8, attn_interval=2,
                                   seed=2)
    return out


def test_default_template_is_chatml():
    t = ChatTemplate(None)
    assert not t.from_model and t.source == DEFAULT_TEMPLATE
    assert t.render(MSGS) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
                              "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n"
                              "<|im_start|>assistant\n")
    assert t.render(MSGS[:2], add_generation_prompt=False).endswith("U1<|im_end|>\n")


def test_the_files_template_is_used(models):
    with MoEModel(models["glm4moe"], SessionOptions(n_threads=1)) as m:
        tok = m.tokenizer
        t = ChatTemplate.from_gguf(m.store, tok.tokens, tok.bos_id, tok.eos_id)
    assert t.from_model and t.source == TEMPLATES["glm4moe"]
    assert t.render(MSGS) == "[gMASK]<sop><|system|>\nS<|user|>\nU1<|assistant|>\nA<|user|>\nU2<|assistant|>"


@pytest.mark.parametrize("source, fragment", [
    ("{{ messages[0].__class__.__mro__ }}", "unsafe"),                        # no way into Python's internals
    ("{{ ''.__class__.__subclasses__() }}", "unsafe"),
    ("{% set _ = messages.append(1) %}", "unsafe"),                           # the values passed in are immutable
    ("{% for i in range(10**9) %}{% endfor %}", "range"),                      # ranges are capped
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),  # the template's own refusal
    ("{{ messages[7]['content'] + 1 }}", "failed"),
])
def test_templates_run_in_a_sandbox(source, fragment):
    with pytest.raises(ChatTemplateError, match=fragment):
        ChatTemplate(source).render(MSGS)


def test_template_output_is_capped():
    with pytest.raises(ChatTemplateError, match="characters"):
        ChatTemplate("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}").render(MSGS)
    assert MAX_OUTPUT_CHARS < 100000 * 1000


def test_bad_templates_and_messages():
    with pytest.raises(ChatTemplateError, match="not valid Jinja2"):
        ChatTemplate("{% for %}")
    t = ChatTemplate(None)
    for bad, fragment in [([], "at least one"), ("hi", "at least one"), ([{"content": "x"}], "role"),
                          ([{"role": "user", "content": 1}], "content"),
                          ([{"role": "user", "content": [{"type": "image_url"}]}], "text part"), ([3], "object")]:
        with pytest.raises(ChatTemplateError, match=fragment):
            t.render(bad)


def test_hugging_face_names_are_there():
    src = ("{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% if loop.last %}{% break %}{% endif %}"
           "{% endfor %}{{ eos_token }}{{ strftime_now('%Y') | length }}")
    out = ChatTemplate(src, "<s>", "</s>").render([{"role": "user", "content": "é<b>"}])
    assert out == '<s>{"role": "user", "content": "é<b>"}</s>4'


def test_control_tokens_are_parsed_only_when_asked(models):
    with MoEModel(models["gpt-oss"], SessionOptions(n_threads=1)) as m:
        tok = m.tokenizer
        eog = sorted(tok.eog_ids)
        assert eog
        marker = tok.tokens[eog[0]]
        text = f"hi{marker}there"
        special = tok.encode(text, add_bos=False, special=True)
        plain = tok.encode(text, add_bos=False)
        assert eog[0] in special and eog[0] not in plain
        i = special.index(eog[0])
        assert special[:i] == tok.encode("hi", add_bos=False)
        assert special[i + 1:] == tok.encode("there", add_bos=False)
        assert tok.encode("no markers", special=True) == tok.encode("no markers")


def test_spm_control_tokens_are_parsed_only_when_asked(tmp_path):
    path = write_model(tmp_path / "spm.gguf", arch="llama", vocab="spm", vocab_size=512, seed=2)
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        tok = m.tokenizer
        eos = tok.eos_id
        assert eos is not None
        text = "a" + tok.tokens[eos] + "b"
        assert eos in tok.encode(text, add_bos=False, special=True)
        assert eos not in tok.encode(text, add_bos=False)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])
def test_run_conversation_mode(models, arch):
    """-cnv: each turn renders the conversation with the template; the replies are what greedy generation of
    the rendered conversation gives (a recurrent model's too: it re-evaluates each turn from the start)."""
    path = models[arch]
    r = CliRunner().invoke(main, ["run", "--temp", "0", path, "-cnv", "-sys", "be brief", "-n", "5", "-t", "1", "-c",
                                  "256"], input="Hello there\nAnd again\n")
    assert r.exit_code == 0, r.output
    turns = [t for t in r.stdout.split("\n> ") if t.strip()]
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=256)) as m:
        tok = m.tokenizer
        t = ChatTemplate.from_gguf(m.store, tok.tokens, tok.bos_id, tok.eos_id)
        msgs = [{"role": "system", "content": "be brief"}]
        want = []
        for user in ("Hello there", "And again"):
            msgs.append({"role": "user", "content": user})
            ids = tok.encode(t.render(msgs), add_bos=tok.add_bos, special=True)
            m.reset()
            logits = m.eval(ids)
            reply = []
            s = Sampler()
            for _ in range(5):
                tid = s(logits[-1])
                if tid in tok.eog_ids:
                    break
                reply.append(tid)
                logits = m.eval([tid])
            want.append(tok.decode(reply))
            msgs.append({"role": "assistant", "content": want[-1]})
    assert [x.rstrip("\n") for x in turns] == want


def test_run_conversation_flags_are_checked(models):
    run = CliRunner().invoke
    r = run(main, ["run", models["qwen3moe"], "-sys", "x", "-p", "hi"])
    assert r.exit_code == 2 and "-cnv" in r.output
    r = run(main, ["run", models["qwen3moe"], "-cnv", "--tokens", "1,2"])
    assert r.exit_code == 2 and "--tokens" in r.output
    r = run(main, ["run", models["qwen3moe"], "-cnv", "-no-cnv"])
    assert r.exit_code == 2 and "choose one" in r.output
    r = run(main, ["run", models["qwen3moe"], "-p", "hi", "-np", "2"])
    assert r.exit_code == 2 and "n_parallel=2" in r.output and "serve" in r.output


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(models, monkeypatch):
    """Ctrl-C during a reply ends that reply ("[interrupted]"); the next turn re-evaluates from what the cache
    holds, so its reply is the one a fresh model gives for the same conversation."""
    path = models["qwen3moe"]
    real_eval = MoEModel.eval
    calls = {"n": 0}

    def eval_once_interrupted(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # the first reply: prompt, one token, then Ctrl-C
            raise KeyboardInterrupt
        return real_eval(self, *a, **kw)

    monkeypatch.setattr(MoEModel, "eval", eval_once_interrupted)
    r = CliRunner().invoke(main, ["run", "--temp", "0", path, "-cnv", "-n", "4", "-t", "1", "-c", "256"],
                           input="Hi\nMore\n")
    monkeypatch.setattr(MoEModel, "eval", real_eval)
    assert r.exit_code == 0, r.output
    first, second = [t for t in r.stdout.split("\n> ") if t.strip()]
    assert first.endswith(" [interrupted]")
    partial = first.removesuffix(" [interrupted]")
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=256)) as m:
        tok = m.tokenizer
        t = ChatTemplate.from_gguf(m.store, tok.tokens, tok.bos_id, tok.eos_id)
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": partial},
                {"role": "user", "content": "More"}]
        want = greedy_chat_reply(m, t, msgs, 4)
    assert second.rstrip("\n") == want


# -- issue 28 item 6: a template is bounded in time, memory and output, and the process stays in charge ------

@pytest.fixture
def pool():
    from ggml_hybrid.text.chat import RenderPool

    p = RenderPool(size=1, seconds=2.0)
    yield p
    p.close()


@pytest.mark.parametrize("source, kind", [
    ("{{ 7 ** (7 ** 9) }}", "time"),                                                    # one C call for long
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time"),  # nested ranges
    ("{{ 'a' * 10 ** 9 }}", "memory"),                                                  # a gigabyte
    ("{{ 'a' | center(10 ** 10) }}", "memory"),                                         # inside a filter
    ("{% for m in messages %}{% for i in range(100000) %}{{ m.content * 100 }}{% endfor %}{% endfor %}", "output"),
])
def test_a_template_is_stopped_at_its_bounds(pool, source, kind):
    import time

    from ggml_hybrid.errors import ChatTemplateLimitError

    t0 = time.monotonic()
    with pytest.raises(ChatTemplateLimitError) as e:
        ChatTemplate(source, pool=pool).render(MSGS, max_chars=100_000)
    assert e.value.kind == kind, e.value
    assert time.monotonic() - t0 < 2.0 + 5.0  # the time bound, and a renderer's start
    # the pool goes on: the next template renders
    assert ChatTemplate(None, pool=pool).render(MSGS[:1]).startswith("<|im_start|>system")


def test_closing_the_pool_ends_a_render_in_progress(pool):
    """What keeps a server stoppable: a render that would run for hours ends as soon as the pool is closed.

    The pool is closed once a renderer holds the request (it was closed 0.5 s after the call began; on a loaded
    machine the renderer had not started then, and its start outlasted the test's bound)."""
    import threading
    import time

    from ggml_hybrid.errors import ChatTemplateLimitError

    pool.seconds = 60.0
    got: list[BaseException] = []

    def go() -> None:
        try:  # compiling folds the constant: it is the compile that runs long
            ChatTemplate("{{ 7 ** (7 ** 9) }}", pool=pool).render(MSGS)
        except BaseException as exc:
            got.append(exc)

    th = threading.Thread(target=go)
    th.start()
    end = time.monotonic() + 60
    while pool.in_progress == 0:  # the event: a renderer works on the request
        assert th.is_alive() and time.monotonic() < end, got
        time.sleep(0.01)
    t0 = time.monotonic()
    pool.close()
    th.join(10)
    assert not th.is_alive() and time.monotonic() - t0 < 5
    assert isinstance(got[0], ChatTemplateLimitError)


def test_conversation_input_that_is_not_utf8_is_refused_and_the_chat_goes_on(models):
    """Issue 28 item 12: a line of invalid UTF-8 at the -cnv prompt was a traceback; now one message and the chat
    goes on with the next line."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "run", models["qwen3moe"], "-cnv", "-n", "3", "-t",
                        "1", "-c", "256"], input=b"bad \xff\xfe line\nHi\n", capture_output=True, timeout=120)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0, err
    assert "Traceback" not in err and "not valid UTF-8" in err
    assert r.stdout.count(b"> ") == 3  # the bad line, "Hi" (answered) and the end of input
