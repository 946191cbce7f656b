"""``run -cnv`` as a user types it (issue 34): line editing and history through readline on a pseudo-terminal,
multi-line input, /clear /save /load /exit, control tokens hidden unless --special, the stats at exit.

The replies are checked against greedy generation of the rendered conversation by the library (the oracle the
other conversation tests use), computed apart from the command."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time

import pytest
from click.testing import CliRunner

pytest.importorskip("jinja2")

from helpers import greedy_chat_reply

from ggml_hybrid import SessionOptions
from ggml_hybrid.cli import main
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.runtime.sampling import Sampler
from ggml_hybrid.synthetic import write_model
from ggml_hybrid.text.chat import ChatTemplate
from ggml_hybrid.text.vocab import TextStream

UP, LEFT = "\x1b[A", "\x1b[D"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cnv") / "m.gguf", arch="qwen3moe", seed=2)


def greedy_replies(path, users, n, system=None):
    """What each turn's reply must be: greedy generation of the rendered conversation from a fresh cache."""
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=256)) as m:
        tok = m.tokenizer
        t = ChatTemplate.from_gguf(m.store, tok.tokens, tok.bos_id, tok.eos_id)
        msgs = [{"role": "system", "content": system}] if system else []
        out = []
        for user in users:
            msgs.append({"role": "user", "content": user})
            out.append(greedy_chat_reply(m, t, msgs, n))
            msgs.append({"role": "assistant", "content": out[-1]})
    return out


class Terminal:
    """The command on a pseudo-terminal (stdin, stdout and stderr), as a user's shell starts it."""

    def __init__(self, args, sigint=signal.SIG_DFL):
        self.fd, slave = pty.openpty()
        env = dict(os.environ, TERM="xterm", COLUMNS="200", LINES="50")

        def child():
            # a session of its own whose controlling terminal is the pty: Ctrl-C typed there is its SIGINT;
            # SIGINT's disposition set here, not inherited from whatever started pytest (nohup, a background job)
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            signal.signal(signal.SIGINT, sigint)

        self.proc = subprocess.Popen([sys.executable, "-m", "ggml_hybrid.cli", *args], stdin=slave, stdout=slave,
                                     stderr=slave, env=env, close_fds=True, start_new_session=True,
                                     preexec_fn=child)
        os.close(slave)
        self.out = b""
        self.seen = 0  # the end of the last match: the next one is looked for after it

    def expect(self, pattern: bytes, timeout: float = 120.0) -> None:
        """Read until ``pattern`` appears after the last match."""
        start = self.seen
        end = time.monotonic() + timeout
        while pattern not in self.out[start:]:
            if not self._read(end - time.monotonic()):
                raise AssertionError(f"{pattern!r} not seen; the terminal shows {self.out[start:]!r}")
        self.seen = self.out.index(pattern, start) + len(pattern)

    def _read(self, left: float) -> bool:
        if left <= 0:
            return False
        r, _, _ = select.select([self.fd], [], [], left)
        if not r:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the command ended and closed the terminal
            return False
        self.out += data
        return bool(data)

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait_reading(self, timeout: float = 120.0) -> None:
        """Wait (bounded) until the command's main thread blocks waiting for input. Readline prints its prompt, then
        waits in select(), and checks for a signal only when select() is interrupted: a Ctrl-C typed in between is
        taken at the next key (CPython's readline; a person never types that fast, a test on a busy machine does)."""
        waits = {7, 23, 270, 271} if os.uname().machine == "x86_64" else {72, 73}  # poll, select, pselect6, ppoll
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with open(f"/proc/{self.proc.pid}/syscall") as f:
                first = f.read().split()[0]
            if first.isdigit() and int(first) in waits:
                return
            self._read(0.01)
        raise AssertionError(f"the command never waited for input; the terminal shows {self.out[self.seen:]!r}")

    def finish(self, timeout: float = 120.0) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            self._read(0.2)
        while self._read(0.2):
            pass
        os.close(self.fd)
        return self.proc.wait(5)


def test_chat_on_a_terminal_edits_lines_and_recalls_history(model, tmp_path):
    """Typed as a user types: 'Helo', the left arrow and 'l' make 'Hello'; the up arrow brings it back; a line
    ending in a backslash goes on; /save writes the conversation, whose replies are greedy generation's."""
    saved = tmp_path / "chat.json"
    term = Terminal(["run", "--temp", "0", model, "-cnv", "-n", "4", "-t", "1", "-c", "256"])
    term.expect(b"> ")
    term.send("Helo" + LEFT + "l\r")
    term.expect(b"> ")
    term.send(UP + "\r")                       # the history: 'Hello' again
    term.expect(b"> ")
    term.send("two\\\r")                       # continued ...
    term.expect(b"... ")
    term.send("lines\r")                       # ... on the next line: one message
    term.expect(b"> ")
    term.send(f"/save {saved}\r")
    term.expect(b"(saved 6 messages")
    term.expect(b"> ")
    term.send("\x04")                          # Ctrl-D
    assert term.finish() == 0, term.out
    text = term.out.decode("utf-8", "replace")
    assert "^[[A" not in text and "^[[D" not in text
    users = ["Hello", "Hello", "two\nlines"]
    msgs = json.loads(saved.read_text())["messages"]
    assert [m["content"] for m in msgs if m["role"] == "user"] == users
    assert [m["content"] for m in msgs if m["role"] == "assistant"] == greedy_replies(model, users, 4)
    assert "chat: 3 replies, 6 messages" in text and "stop: end of input" in text
    assert re.search(r"prompt \d+ tok, [\d.]+ tok/s \| decode \d+ tok", text)


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored"])
def test_ctrl_c_at_the_prompt_prints_the_stats_and_exits_130(model, inherited):
    """Also when the command inherits SIGINT ignored (a background job, nohup, a CI runner): it takes its own."""
    # greedy: a sampled reply could hold "> " itself, and the Ctrl-C would then come mid-reply
    term = Terminal(["run", "--temp", "0", model, "-cnv", "-n", "3", "-t", "1", "-c", "256"], sigint=inherited)
    term.expect(b"> ")
    term.send("Hi\r")
    term.expect(b"> ")
    term.wait_reading()
    term.send("\x03")                          # Ctrl-C
    assert term.finish() == 130, term.out
    text = term.out.decode("utf-8", "replace")
    assert "chat: 1 replies" in text and "stop: interrupted" in text and "Traceback" not in text


def test_clear_load_and_exit(model, tmp_path):
    """/load replaces the conversation: the next reply is the one a fresh model gives after the loaded messages;
    /clear forgets them (the system message stays); /exit ends the chat as end of input does."""
    conv = tmp_path / "c.json"
    conv.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello"},
                                             {"role": "assistant", "content": "Hi there"}]}))
    r = CliRunner().invoke(main, ["run", "--temp", "0", model, "-cnv", "-n", "4", "-t", "1", "-c", "256", "-sys",
                                  "be brief"], input=f"First\n/load {conv}\nAgain\n/clear\nOnce\n/exit\nnever sent\n")
    assert r.exit_code == 0, r.output
    replies = [t.rstrip("\n") for t in r.stdout.split("\n> ") if t.strip() and not t.startswith("(")]
    assert "(loaded 2 messages" in r.stdout and "(conversation cleared)" in r.stdout
    with MoEModel(model, SessionOptions(n_threads=1, n_ctx=256)) as m:
        tok = m.tokenizer
        t = ChatTemplate.from_gguf(m.store, tok.tokens, tok.bos_id, tok.eos_id)

        def reply(msgs):
            return greedy_chat_reply(m, t, msgs, 4)

        want = [reply([{"role": "system", "content": "be brief"}, {"role": "user", "content": "First"}]),
                reply([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"},
                       {"role": "user", "content": "Again"}]),
                reply([{"role": "system", "content": "be brief"}, {"role": "user", "content": "Once"}])]
    assert replies == want
    assert "chat: 3 replies" in r.stderr


@pytest.mark.parametrize("content, why", [
    ("not json", "not JSON text"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "messages[0] must be"),
    ('[1, 2]', 'must hold an object {"messages"'),
])
def test_a_bad_conversation_file_is_one_error_and_the_chat_goes_on(model, tmp_path, content, why):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    r = CliRunner().invoke(main, ["run", model, "-cnv", "-n", "2", "-t", "1", "-c", "256"],
                           input=f"/load {bad}\n/load {tmp_path}\n/save {model}\n/save\nHi\n")
    assert r.exit_code == 0, r.output
    assert why in r.stderr and "is a directory" in r.stderr and "is the input file" in r.stderr
    assert "/save needs a file" in r.stderr and "chat: 1 replies" in r.stderr
    with MoEModel(model, SessionOptions(n_threads=1)) as m:  # the model file is untouched
        assert m.hp.n_layer > 0


@pytest.mark.parametrize("content, why", [
    # issue 40 E12: a RecursionError traceback ended the command
    ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),
    # E13: a lone surrogate (JSON's \ud800 escape) loaded; then /save was a UnicodeEncodeError traceback
    ('{"messages": [{"role": "user", "content": "a \\ud800 b"}]}', "messages[0]"),
    ('{"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "x\\udfff"}]}',
     "messages[1]"),
], ids=["deep", "surrogate", "surrogate-reply"])
@pytest.mark.parametrize("then", ["/save", "a message"])
def test_a_conversation_file_that_cannot_be_held_is_refused_and_the_chat_goes_on(model, tmp_path, content, why,
                                                                                   then):
    """/load refuses it in one line and keeps the conversation it had; /save then writes that one, and a message
    is answered (a message after the surrogate's load ended the chat)."""
    bad, out = tmp_path / "bad.json", tmp_path / "out.json"
    bad.write_text(content)
    after = f"/save {out}\n" if then == "/save" else "Hi\n"
    r = CliRunner().invoke(main, ["run", model, "-cnv", "-n", "2", "-t", "1", "-c", "256"],
                           input=f"First\n/load {bad}\n{after}Last\n")
    assert r.exit_code == 0 and r.exception is None, (r.exception, r.output[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and why in errors[0] and str(bad) in errors[0], r.stderr
    assert "Traceback" not in r.output
    replies = 3 if then == "a message" else 2
    assert f"chat: {replies} replies" in r.stderr, r.stderr
    if then == "/save":  # the conversation before the refused /load, whole
        msgs = json.loads(out.read_text(encoding="utf-8"))["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] and msgs[0]["content"] == "First"


def test_a_conversation_file_with_a_surrogate_pair_loads(model, tmp_path):
    """JSON writes a character outside the BMP as an escaped surrogate pair: that is text, and loads."""
    conv, out = tmp_path / "c.json", tmp_path / "out.json"
    conv.write_text('{"messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}]}')
    r = CliRunner().invoke(main, ["run", model, "-cnv", "-n", "2", "-t", "1", "-c", "256"],
                           input=f"/load {conv}\n/save {out}\n")
    assert r.exit_code == 0 and "(loaded 1 messages" in r.stdout, r.output
    assert json.loads(out.read_text(encoding="utf-8"))["messages"][0]["content"] == "smile \U0001f600"


def test_a_message_the_template_refuses_is_one_error_and_the_chat_goes_on(model, tmp_path):
    """A template's own raise_exception (as models' templates refuse roles out of order, say after a /load) ended
    the chat (exit status 2); now it is one line, the message is not kept, and the next one is answered as if it
    never came."""
    from gguf import GGUFValueType
    from helpers import rewrite_gguf

    picky = rewrite_gguf(model, tmp_path / "picky.gguf", set_keys={"tokenizer.chat_template": (
        "{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", GGUFValueType.STRING)})
    r = CliRunner().invoke(main, ["run", "--temp", "0", picky, "-cnv", "-n", "3", "-t", "1", "-c", "256"],
                           input="boom\nHi\n")
    assert r.exit_code == 0 and r.exception is None, (r.exception, r.output[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no boom here" in errors[0] and "not sent" in errors[0], r.stderr
    assert "chat: 1 replies, 2 messages" in r.stderr, r.stderr
    with MoEModel(picky, SessionOptions(n_threads=1, n_ctx=256)) as m:
        tok = m.tokenizer
        t = ChatTemplate.from_gguf(m.store, tok.tokens, tok.bos_id, tok.eos_id)
        want = greedy_chat_reply(m, t, [{"role": "user", "content": "Hi"}], 3)
    assert r.stdout.split("\n> ")[2].startswith(want), (r.stdout, want)


def test_control_tokens_are_hidden_unless_special(model, monkeypatch):
    """A reply that holds control tokens (<|im_start|>, not an end of generation) prints them only with
    --special; the text around them is the tokens' own."""
    with MoEModel(model, SessionOptions(n_threads=1)) as m:
        tok = m.tokenizer
        start = tok.tokens.index("<|im_start|>")
        assert start in tok.control and start not in tok.eog_ids
        plain = [i for i in range(len(tok.tokens)) if i not in tok.control and tok.token_bytes(i).isalpha()][:3]
        script = [plain[0], start, plain[1], plain[2], start]
        shown = tok.decode([plain[0]]) + tok.decode(plain[1:3])
        raw = tok.decode(script)
    calls = {"n": 0}

    def scripted(self, logits):
        t = script[calls["n"] % len(script)]
        calls["n"] += 1
        return t

    monkeypatch.setattr(Sampler, "__call__", scripted)
    for flags, want in (([], shown), (["--special"], raw)):
        calls["n"] = 0
        r = CliRunner().invoke(main, ["run", model, "-cnv", "-n", "5", "-t", "1", "-c", "256", *flags], input="Hi\n")
        assert r.exit_code == 0, r.output
        assert [t.rstrip("\n") for t in r.stdout.split("\n> ") if t.strip()] == [want]
    r = CliRunner().invoke(main, ["run", model, "-p", "hi", "--special"])
    assert r.exit_code == 2 and "-sp/--special needs -cnv" in r.output


def test_text_stream_hides_only_the_ids_it_is_given(model):
    with MoEModel(model, SessionOptions(n_threads=1)) as m:
        tok = m.tokenizer
        ids = list(range(0, len(tok.tokens), 7)) + sorted(tok.control)
        s = TextStream(tok, tok.control)
        got = "".join(s.push(i) for i in ids) + s.flush()
        assert got == tok.decode([i for i in ids if i not in tok.control])
        s = TextStream(tok)
        assert "".join(s.push(i) for i in ids) + s.flush() == tok.decode(ids)
