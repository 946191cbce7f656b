"""Issue 18, the CLI-facing items: outputs never destroy the model (1), config files are bounded (13), one
thread rule (14), full disks leave no truncated file and paths that are not files are named as such (15).

Each test uses a small generated model and checks the file bytes themselves (sha256 before and after).
"""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cli import run_json, user_error

from ggml_hybrid.errors import ArgumentError, ConfigError, OptionError
from ggml_hybrid.files import atomic_write, check_output
from ggml_hybrid.ggml.backend import cpu, max_threads
from ggml_hybrid.moe.traces import read_trace
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.plan.planner import plan
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.server.config import MAX_CONFIG_BYTES, load_config
from ggml_hybrid.synthetic import ModelSpec, write_model

T1 = ["-t", "1"]
DISK = ["--expert-cache-slots", "2"]


@pytest.fixture
def model(tmp_path):
    return write_model(tmp_path / "m.gguf", ModelSpec())


def digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def listing(folder) -> list[str]:
    return sorted(p.name for p in Path(folder).iterdir())


# -- 1: output paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["same", "symlink", "relative"])
def test_logits_out_never_overwrites_the_model(model, tmp_path, how):
    before = digest(model)
    target = {"same": model, "symlink": tmp_path / "link.gguf", "relative": os.path.relpath(model)}[how]
    if how == "symlink":
        os.symlink(model, target)
    user_error("run", model, "--tokens", "1,2", "-n", 2, *T1, "--logits-out", target, expect=["is the input file"])
    assert digest(model) == before


@pytest.mark.parametrize("command", ["run", "plan"])
def test_trace_path_never_overwrites_the_model(model, tmp_path, command):
    before = digest(model)
    link = tmp_path / "link.bin"
    os.symlink(model, link)
    for target in (model, link):
        args = ["--tokens", "1,2", "-n", 2] if command == "run" else []
        user_error(command, model, *args, *T1, *DISK, "-o", f"trace_path={target}", expect=["is the input file"])
    assert digest(model) == before


def test_plan_writes_nothing(model, tmp_path):
    trace = tmp_path / "old.trace"
    trace.write_bytes(b"an existing trace the plan must not touch")
    before = listing(tmp_path)
    p = plan(model, SessionOptions(disk_experts=True, expert_cache_slots=2, trace_path=str(trace)))
    assert p.moe
    assert trace.read_bytes() == b"an existing trace the plan must not touch" and listing(tmp_path) == before
    user_error("plan", model, *DISK, "-o", f"trace_path={tmp_path}", expect=["is a directory"])


def test_outputs_are_written_whole_and_renamed(model, tmp_path):
    trace, logits = tmp_path / "t.trace", tmp_path / "l.npy"
    trace.write_bytes(b"old")
    d = run_json(model, "--tokens", "1,2,3", "-n", 3, "--ignore-eos", *T1, *DISK, "-o", f"trace_path={trace}",
                 "--logits-out", logits)
    assert read_trace(trace).n_calls == 3 * 2 and np.load(logits).shape[0] == d["prompt_tokens"] + 2
    assert listing(tmp_path) == sorted(["m.gguf", "t.trace", "l.npy"])  # no temporary file left
    assert oct(os.stat(logits).st_mode & 0o777) != oct(0o600)  # the umask's mode, not mkstemp's


def test_a_failed_write_keeps_the_old_file(tmp_path):
    out = tmp_path / "x.npy"
    out.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_write(out) as f:
        f.write(b"partial")
        raise RuntimeError("disk full")
    assert out.read_bytes() == b"old" and listing(tmp_path) == ["x.npy"]
    with pytest.raises(ArgumentError, match="not a regular file"):
        check_output("/dev/null", [], "--logits-out")


def _limited_file_size(limit):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    return apply


def test_full_disk_leaves_no_truncated_npy(model, tmp_path):
    out = tmp_path / "logits.npy"
    np.save(out, np.arange(3.0))
    before = out.read_bytes()
    # the logits of 4 positions x 384 vocab in float32 are 6 KiB: a 2 KiB file limit fails the write half way
    r = subprocess.run([sys.executable, "-m", "ggml_hybrid_cli", "run", model, "--tokens", "1,2,3,4", "-n", "1", *T1,
                        "--logits-out", out], capture_output=True, text=True, preexec_fn=_limited_file_size(2048))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("error:"), r.stderr
    assert out.read_bytes() == before and listing(tmp_path) == ["logits.npy", "m.gguf"]


# -- 13: config files ---------------------------------------------------------------------------------


def _config(tmp_path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_config_devices_and_fifos_are_not_read(tmp_path):
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config("/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(fifo)  # returns at once: no writer is waited for
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_config_size_is_bounded(tmp_path):
    big = _config(tmp_path, "#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match=f"larger than {MAX_CONFIG_BYTES} bytes"):
        load_config(big)


def test_deeply_nested_toml_is_a_config_error(tmp_path):
    deep = _config(tmp_path, "x = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="too deeply"):
        load_config(deep)


def test_quoted_and_dotted_spellings_of_one_key_are_refused(tmp_path, model):
    p = _config(tmp_path, f'[models.a]\npath = "{model}"\n[models.a.session_options]\n'
                          '"main.moe_cpu_share" = 0.5\nmain.moe_cpu_share = 0.25\n')
    with pytest.raises(ConfigError, match="'main.moe_cpu_share' is given twice"):
        load_config(p)
    user_error("run", "a", "--config", p, "--tokens", "1", *T1, expect=["given twice"])


# -- 14: threads ---------------------------------------------------------------------------------------


def test_one_thread_rule_everywhere(model):
    n = max_threads()
    assert n == 4 * (os.cpu_count() or 1)
    for flag in ("-t", "-tb"):
        user_error("run", model, "--tokens", "1", flag, n + 1, expect=[f"1..{n}", "4 x the cores"])
    user_error("demo", "-t", n + 1, expect=[f"1..{n}"])
    with pytest.raises(OptionError, match=f"1..{n}"):
        SessionOptions(n_threads_batch=n + 1)
    with cpu(1) as b, pytest.raises(ArgumentError, match=f"1..{n}"):
        b.n_threads = n + 1
    with MoEModel(model, SessionOptions(n_threads=n)) as m:
        assert m.host.n_threads == n


# -- 15: paths named for what they are ----------------------------------------------------------------


def test_config_and_logits_paths_named_for_what_they_are(model, tmp_path):
    user_error("run", "a", "--config", tmp_path, "--tokens", "1", *T1, expect=["is a directory"])
    user_error("run", "a", "--config", "/dev/null", "--tokens", "1", *T1, expect=["not a regular file"])
    user_error("run", model, "--tokens", "1", *T1, "--logits-out", tmp_path, expect=["directory"])


# -- issue 28 items 17 and 20 -------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["missing folder", "file as folder"])
def test_logits_out_into_a_folder_that_cannot_hold_it_is_refused_before_loading(model, tmp_path, monkeypatch, where):
    """It was refused only after the whole run (at the rename into place)."""
    from ggml_hybrid.runtime import moe_model

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(moe_model.MoEModel, "__init__", no_load)
    if where == "missing folder":
        target, expect = tmp_path / "nowhere" / "x.npy", "does not exist"
    else:
        (tmp_path / "plain").write_text("")
        target, expect = tmp_path / "plain" / "x.npy", "not a directory"
    user_error("run", model, "--tokens", "1,2", "-n", 2, *T1, "--logits-out", target, expect=[expect, "--logits-out"])


def test_a_huge_value_in_a_message_is_cut(tmp_path):
    """A 1 MiB general.architecture gave a 1 MiB error line; the line is cut, keeping its start (the file, the
    value's beginning) and its end (the rule)."""
    from helpers import rewrite_gguf

    src = write_model(tmp_path / "m.gguf", ModelSpec(arch="qwen3moe", seed=3))
    bad = rewrite_gguf(src, tmp_path / "huge.gguf", arch="x" * (1 << 20))
    for cmd in (["run", bad, "--tokens", "1", "-n", 1, *T1], ["plan", bad]):
        line = user_error(*cmd, expect=["huge.gguf", "general.architecture", "xxxx", "characters left out",
                                        "supported"])
        assert len(line) < 1200, len(line)
