"""The docs as tests: every shell command and Python snippet of README.md and docs/*.md runs as printed.

markdown-it finds the fenced blocks and the HTML comment before each. A block that cannot run here is marked in
the Markdown, right before it, with ``<!-- no-ci: the reason -->`` (the reason is required); ``<!-- ci-file: NAME
-->`` before a block (a TOML list of models, say) writes it to NAME for the commands after it.

Shell blocks: a block with ``$ `` prompts is a console transcript (the lines after a command are its output);
otherwise every line is a command (``\\`` joins lines, ``#`` starts a comment). Commands run in a folder per doc
holding generated models of the names and sizes the docs use (``model.gguf`` as cli.md makes it; the README's
``Qwen3-30B-A3B-Q4_K_M.gguf`` as a small qwen3moe of the real model's 128 experts, 8 used). ``ggml-hybrid``
commands run in-process through click's CliRunner (a trailing ``| head -N``, ``| tail -N`` or ``> /dev/null``
applied to its stdout); ``serve`` and ``rpc-server`` run as processes on a free loopback port until they answer
(``/health``, a TCP connect), then get Ctrl-C; anything else runs in bash. Where a transcript shows output, what is
stable is compared: an ``error:`` line means the command fails (exit status not 0) and says ``error:``, no error
line means it succeeds; each ``label:`` that starts a shown line (``load``, ``layout:``, ``recommend:``,
``try:``, YAML keys; ``warning:`` lines depend on the load and are left out) starts a line of the real output;
a shown JSON object has the real one's keys, at
every level. Numbers and the generated (random-weight) text are not compared.

Python blocks of one doc run in order in one namespace, in that doc's folder. docs/scripting.md's are run by
tests/test_scripting_doc.py (with what they print checked), so they are left out here.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")]
RUN_ELSEWHERE = {"scripting.md": "tests/test_scripting_doc.py"}
PROGRAMS = {"$", "ggml-hybrid", "python", "python3", "pip", "curl", "apt-get", "printf", "export"}
SHELL_INFO = {"bash", "sh", "shell", "console"}
MARKER = re.compile(r"<!--\s*(no-ci|ci-file)\b(.*?)-->", re.S)
LABEL = re.compile(r"[A-Za-z][A-Za-z0-9_-]*:")
PIPE_TAIL = re.compile(r"\s*(?:\|\s*(head|tail)\s+-(\d+)|>\s*/dev/null)\s*$")
SERVER_COMMANDS = {"serve", "rpc-server"}
START_TIMEOUT_S = 180.0


@dataclass
class Command:
    line: str                      # as printed, without the prompt and the comment
    output: list[str] = field(default_factory=list)  # the lines the doc shows after it (transcripts only)

    @property
    def ctrl_c(self) -> bool:
        """The doc stops it with Ctrl-C (``^C`` in what it shows)."""
        return any("^C" in ln for ln in self.output)


@dataclass
class Block:
    doc: str
    line: int                      # 1-based line of the fence in the doc
    info: str
    text: str
    no_ci: str | None = None       # the reason, when marked
    marker_error: str | None = None
    ci_file: str | None = None

    @property
    def ident(self) -> str:
        return f"{self.doc}:{self.line}"


_MD = MarkdownIt("commonmark")


def _marker(block: Block, comment: str) -> None:
    for kind, rest in MARKER.findall(comment):
        rest = rest.strip()
        if kind == "ci-file":
            rest = rest.removeprefix(":").strip()
            block.ci_file = rest or None
            if not rest:
                block.marker_error = "ci-file marker without a file name"
        elif not rest.startswith(":") or not rest[1:].strip():
            block.marker_error = f"no-ci marker without a reason ({comment.strip()!r}): write <!-- no-ci: why -->"
        else:
            block.no_ci = rest[1:].strip()


def doc_blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, each with the marker of the HTML comment right before it."""
    tokens = _MD.parse(path.read_text(encoding="utf-8"))
    out = []
    for i, tok in enumerate(tokens):
        if tok.type != "fence":
            continue
        assert tok.map is not None
        block = Block(path.name, tok.map[0] + 1, tok.info.strip().split(" ")[0], tok.content)
        if i > 0 and tokens[i - 1].type == "html_block":
            _marker(block, tokens[i - 1].content)
        out.append(block)
    return out


def stray_markers(path: Path) -> list[str]:
    """Markers that stand before no fenced block (they would mark nothing)."""
    tokens = _MD.parse(path.read_text(encoding="utf-8"))
    bad = []
    for i, tok in enumerate(tokens):
        if tok.type == "html_block" and MARKER.search(tok.content):
            if i + 1 >= len(tokens) or tokens[i + 1].type != "fence":
                bad.append(f"{path.name}:{(tok.map or [0])[0] + 1}: {tok.content.strip()}")
    return bad


def shell_commands(block: Block) -> list[Command]:
    """The commands of a shell block: ``$ `` lines and their output, or every line (``\\`` joins lines)."""
    lines = block.text.splitlines()
    if any(ln.startswith("$ ") for ln in lines):
        cmds: list[Command] = []
        for ln in lines:
            if ln.startswith("$ "):
                cmds.append(Command(_strip_comment(ln[2:])))
            elif cmds and ln.strip():
                cmds[-1].output.append(ln)
        return cmds
    joined = block.text.replace("\\\n", " ")
    cmds = []
    return [Command(_strip_comment(ln)) for ln in joined.splitlines() if _strip_comment(ln)]


def _strip_comment(line: str) -> str:
    """The line up to its ``#`` comment: the first ``#`` outside quotes that starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return line.strip()


def all_blocks() -> list[Block]:
    return [b for p in DOCS for b in doc_blocks(p)]


def is_shell(block: Block) -> bool:
    """A block of commands: a shell info string, or none and a first line that is a prompt or a program."""
    if block.info:
        return block.info in SHELL_INFO
    first = block.text.split(None, 1)[0] if block.text.strip() else ""
    return first in PROGRAMS


def runnable_shell_blocks() -> list[Block]:
    return [b for b in all_blocks() if is_shell(b) and b.no_ci is None and b.marker_error is None
            and b.ci_file is None and b.doc not in RUN_ELSEWHERE]


# --- the models the docs assume -------------------------------------------------------------------------------

_BASE_FILES = {
    # cli.md's model, made by cli.md's own gen line
    "model.gguf": ["gen", "model.gguf", "--type", "q8_0", "--layers", "4", "--embd", "128", "--ff", "128",
                   "--experts", "16", "--used", "4", "--seed", "1"],
    # the README's big file: the real model's expert count and top-k, small widths
    "Qwen3-30B-A3B-Q4_K_M.gguf": ["gen", "Qwen3-30B-A3B-Q4_K_M.gguf", "--type", "q8_0", "--layers", "2",
                                  "--embd", "64", "--ff", "32", "--experts", "128", "--used", "8", "--seed", "3"],
    "big.gguf": ["gen", "big.gguf", "--type", "q8_0", "--layers", "2", "--embd", "64", "--experts", "32",
                 "--used", "4", "--seed", "5"],
    "big-q8_0.gguf": ["gen", "big-q8_0.gguf", "--type", "q8_0", "--layers", "2", "--embd", "64", "--experts", "32",
                      "--used", "4", "--seed", "5"],
    "qwen2moe.gguf": ["gen", "qwen2moe.gguf", "--arch", "qwen2moe", "--type", "q8_0", "--head-dim", "16"],
    "gpt-oss.gguf": ["gen", "gpt-oss.gguf", "--arch", "gpt-oss", "--type", "q8_0", "--layers", "4",
                     "--set", "expert_type=mxfp4", "--set", "n_swa=128"],
}


# a doc whose model is another: docs/speculative.md's model.gguf carries a draft (MTP) head
_DOC_FILES = {
    "speculative.md": {"model.gguf": ["gen", "model.gguf", "--arch", "glm4moe", "--type", "q8_0", "--layers", "2",
                                      "--embd", "64", "--experts", "64", "--used", "4", "--set", "nextn=1"]},
}


def _generate(folder: Path, files: dict[str, list[str]]) -> None:
    here = os.getcwd()
    os.chdir(folder)
    try:
        for name, args in files.items():
            res = CliRunner().invoke(_cli(), args)
            assert res.exit_code == 0, f"generating {name}: {res.output}"
    finally:
        os.chdir(here)


def _cli():
    from ggml_hybrid.cli import main

    return main


@pytest.fixture(scope="session")
def base_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("doc-models")
    _generate(folder, _BASE_FILES)
    (folder / "keys.txt").write_text("doc-example-key-1\n")
    return folder


@pytest.fixture(scope="session")
def doc_folders(base_folder, tmp_path_factory):
    made: dict[str, Path] = {}

    def get(doc: str) -> Path:
        if doc not in made:
            folder = tmp_path_factory.mktemp("doc-" + doc.removesuffix(".md"))
            for p in base_folder.iterdir():
                shutil.copy(p, folder / p.name)
            _generate(folder, _DOC_FILES.get(doc, {}))
            for b in (x for p in DOCS if p.name == doc for x in doc_blocks(p)):
                if b.ci_file:
                    (folder / b.ci_file).write_text(b.text)
            made[doc] = folder
        return made[doc]

    return get


# --- running one command --------------------------------------------------------------------------------------

@dataclass
class Outcome:
    status: int
    text: str          # stdout and stderr as the doc's reader sees them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _in_process(words: list[str], tail: re.Match[str] | None, cwd: Path) -> Outcome:
    here = os.getcwd()
    os.chdir(cwd)
    try:
        res = CliRunner().invoke(_cli(), words[1:])
    finally:
        os.chdir(here)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"{shlex.join(words)} raised {res.exception!r}") from res.exception
    out = res.stdout.splitlines()
    if tail is not None and tail.group(1) == "head":
        out = out[: int(tail.group(2))]
    elif tail is not None and tail.group(1) == "tail":
        out = out[-int(tail.group(2)):]
    elif tail is not None:
        out = []
    return Outcome(res.exit_code, "\n".join(out + res.stderr.splitlines()))


def _server_words(words: list[str], port: int) -> list[str]:
    """The command on a free loopback port: ``--port`` and ``--host`` replaced (or added)."""
    out, i = [], 0
    while i < len(words):
        if words[i] in ("--port", "--host") and i + 1 < len(words):
            i += 2
            continue
        out.append(words[i])
        i += 1
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


def _ready(command: str, port: int, printed: bytes) -> bool:
    """serve: /health answers 200; rpc-server: its banner is whole (it ends with the transport) and the port accepts."""
    try:
        if command == "serve":
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return bool(r.status == 200)
        if b"transport" not in printed:
            return False
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    except OSError:
        return False


def _as_server(words: list[str], cwd: Path) -> Outcome:
    port = _free_port()
    argv = [str(Path(sys.executable).parent / "ggml-hybrid"), *_server_words(words[1:], port)]
    proc = subprocess.Popen(argv, cwd=cwd, env={**_env(), "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    printed = b""
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while proc.poll() is None and not _ready(words[1], port, printed):
                assert time.monotonic() < deadline, f"{shlex.join(words)}: not ready in {START_TIMEOUT_S:.0f} s"
                if sel.select(timeout=0.2):  # a bounded poll: what it printed, then the port
                    printed += os.read(proc.stdout.fileno(), 1 << 16)
        started = proc.poll() is None
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return Outcome(0 if started else (proc.returncode or 1), (printed + rest).decode("utf-8", "replace"))


def _interrupted(words: list[str], cwd: Path) -> Outcome:
    """A command the doc stops with Ctrl-C: SIGINT once it has printed (it is under way), as a terminal sends it."""
    argv = [str(Path(sys.executable).parent / "ggml-hybrid"), *words[1:]]
    proc = subprocess.Popen(argv, cwd=cwd, env={**_env(), "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=START_TIMEOUT_S), f"{shlex.join(words)}: printed nothing"
        first = os.read(proc.stdout.fileno(), 1 << 16)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return Outcome(proc.returncode, (first + out + err).decode("utf-8", "replace"))


def _in_bash(line: str, cwd: Path, env: dict[str, str]) -> Outcome:
    proc = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return Outcome(proc.returncode, proc.stdout + proc.stderr)


def run_command(line: str, cwd: Path, env: dict[str, str], ctrl_c: bool = False) -> Outcome:
    tail = PIPE_TAIL.search(line)
    head = line[: tail.start()] if tail else line
    plain = not re.search(r"[|&;<>$`]", head)
    words = shlex.split(head) if plain else []
    if words and words[0] == "ggml-hybrid" and len(words) > 1 and words[1] in SERVER_COMMANDS and not tail:
        return _as_server(words, cwd)  # a server's transcript ends with ^C too: it is stopped so once ready
    if words and words[0] == "ggml-hybrid" and ctrl_c:
        return _interrupted(words, cwd)
    if words and words[0] == "ggml-hybrid" and env == os.environ:
        return _in_process(words, tail, cwd)
    return _in_bash(line, cwd, {**_env(), **{k: v for k, v in env.items() if k not in os.environ}})


# --- what a transcript shows ----------------------------------------------------------------------------------

def check_output(cmd: Command, got: Outcome) -> list[str]:
    """What of the shown output the real one lacks ([] when it agrees on what is stable)."""
    problems = []
    shown_error = any(ln.startswith("error:") for ln in cmd.output)
    if shown_error and got.status == 0:
        problems.append("the doc shows an error, the command succeeded")
    if not shown_error and got.status != 0 and not cmd.ctrl_c:
        problems.append(f"exit status {got.status}")
    real_lines = [ln.strip() for ln in got.text.splitlines()]
    firsts = {ln.split(" ", 1)[0] for ln in real_lines if ln}
    for ln in cmd.output:
        first = ln.strip().split(" ", 1)[0]
        if LABEL.fullmatch(first) and first != "warning:" and first not in firsts:
            problems.append(f"no line starts with {first!r} (the doc shows {ln.strip()[:80]!r})")
        if ln.startswith("{"):
            problems.extend(_json_keys(ln, real_lines))
    return problems


def _key_differences(shown: object, real: object, where: str = "") -> list[str]:
    """The keys one JSON object has and the other lacks, at every level of nested objects."""
    if not isinstance(shown, dict) or not isinstance(real, dict):
        return []
    out = [f"{where}{k}: not in the output" for k in shown if k not in real]
    out += [f"{where}{k}: not in the doc" for k in real if k not in shown]
    for k in shown.keys() & real.keys():
        out += _key_differences(shown[k], real[k], f"{where}{k}.")
    return out


def _json_keys(shown: str, real_lines: list[str]) -> list[str]:
    """A shown JSON object is a whole output: the real one has the same keys (values vary)."""
    try:
        expected = json.loads(shown)
    except ValueError:
        return []
    for ln in real_lines:
        if ln.startswith("{"):
            try:
                got = json.loads(ln)
            except ValueError:
                continue
            diff = _key_differences(expected, got)
            return [f"the JSON differs in its keys: {', '.join(diff)}"] if diff else []
    return ["no JSON object in the output"]


def _env_after(line: str, env: dict[str, str]) -> dict[str, str] | None:
    """``export A=B C=D``: the block's environment after it (None: not an export)."""
    words = shlex.split(line)
    if not words or words[0] != "export":
        return None
    return {**env, **dict(w.split("=", 1) for w in words[1:] if "=" in w)}


# --- the tests --------------------------------------------------------------------------------------------------

def test_markers_give_a_reason_and_mark_a_block():
    bad = [f"{b.ident}: {b.marker_error}" for b in all_blocks() if b.marker_error]
    bad += [f"{m}: a marker before no fenced block" for p in DOCS for m in stray_markers(p)]
    assert not bad, "\n".join(bad)


def test_the_docs_have_commands_and_snippets_to_run():
    """The extraction finds what the docs hold (a parser change that found nothing would pass every test)."""
    cmds = [c for b in runnable_shell_blocks() for c in shell_commands(b)]
    assert len(cmds) >= 60, len(cmds)
    assert len([b for b in all_blocks() if b.info == "python" and b.no_ci is None]) >= 3


@pytest.mark.parametrize("block", runnable_shell_blocks(), ids=lambda b: b.ident)
def test_doc_shell_block_runs(block, doc_folders):
    cwd = doc_folders(block.doc)
    env: dict[str, str] = dict(os.environ)
    failures = []
    last = Outcome(0, "")
    for cmd in shell_commands(block):
        exported = _env_after(cmd.line, env)
        if exported is not None:
            env = exported
            continue
        if cmd.line == "echo $?":  # the last command's exit status, as shown
            if cmd.output[:1] != [str(last.status)]:
                failures.append(f"$ echo $?\n  {last.status}, the doc shows {cmd.output[:1]}")
            continue
        got = last = run_command(cmd.line, cwd, env, cmd.ctrl_c)
        problems = check_output(cmd, got) if cmd.output else ([] if got.status == 0 else [f"exit {got.status}"])
        if problems:
            failures.append(f"$ {cmd.line}\n  " + "; ".join(problems) + "\n  output:\n    "
                            + "\n    ".join(got.text.splitlines()[-15:]))
    assert not failures, f"{block.ident}: a documented command does not run as printed:\n" + "\n".join(failures)


def _python_docs() -> list[str]:
    return sorted({b.doc for b in all_blocks() if b.info == "python" and b.no_ci is None
                   and b.doc not in RUN_ELSEWHERE})


@pytest.mark.parametrize("doc", _python_docs())
def test_doc_python_snippets_run(doc, doc_folders, monkeypatch):
    monkeypatch.chdir(doc_folders(doc))
    ns: dict[str, object] = {"__name__": "doc_snippets"}
    for block in (b for p in DOCS if p.name == doc for b in doc_blocks(p)):
        if block.info != "python" or block.no_ci is not None:
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(block.text, block.ident, "exec"), ns)
        except Exception as exc:
            raise AssertionError(f"{block.ident}: the snippet fails: {exc!r}\n{block.text}") from exc


def test_scripting_snippets_run_elsewhere():
    for test in RUN_ELSEWHERE.values():
        assert (ROOT / test).is_file(), test
