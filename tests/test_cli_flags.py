"""The CLI a llama.cpp user expects (issue 17): llama.cpp's flag names and meanings, one set of session flags
for run, plan and bench, no flag that silently does nothing, Ctrl-C, -n -1, the sampling flags.

Oracles: ``MoEModel.eval`` driven directly (greedy, or through the numpy sampler oracle of
test_sampling), ``SessionOptions`` built by hand, the planner's own API, and the model file's bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_cli import ok, run_json, user_error
from test_sampling import oracle

from ggml_hybrid.options import SessionOptions
from ggml_hybrid.plan.planner import plan
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import ModelSpec, write_model

SPEC = ModelSpec()  # qwen3moe, 2 layers, 8 experts, top-2, vocab 384
T1 = ["-t", "1"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("flags") / "m.gguf", SPEC)


def greedy_reference(path, prompt, n, penalties=None):
    """Tokens by MoEModel.eval: argmax of the logits (penalized by the oracle when given)."""
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        logits = m.eval(prompt, "last")[-1]
        history, out = list(prompt), []
        for i in range(n):
            if penalties:
                cand = oracle(logits, history, 0.0, 40, 0.95, 0.05, **penalties)
                t = next(iter(cand))
            else:
                t = int(np.argmax(logits))
            out.append(t)
            history.append(t)
            if i < n - 1:
                logits = m.eval([t], "last")[-1]
        return out


# -- the model: -m/--model or MODEL ------------------------------------------------------------------


def test_model_flag_or_positional(model):
    a = run_json(model, "--tokens", "1,2", "-n", 3, *T1)
    b = run_json("-m", model, "--tokens", "1,2", "-n", 3, *T1)
    c = run_json("--model", model, "--tokens", "1,2", "-n", 3, *T1)
    assert a["tokens"] == b["tokens"] == c["tokens"]
    user_error("run", "--temp", "0", model, "-m", model, "--tokens", "1", expect=["give the model once"])
    user_error("run", "--temp", "0", "--tokens", "1", expect=["missing the model"])
    assert json.loads(ok("inspect", "-m", model, "--json").stdout)["architecture"] == "qwen3moe"
    assert json.loads(ok("plan", "-m", model, "--json").stdout)["moe"] is True


# -- options that would do nothing are errors; flags that imply what they need --------------------------


def test_expert_cache_slots_implies_disk_experts(model):
    d = run_json(model, "--tokens", "1,2,3", "-n", 3, *T1, "--expert-cache-slots", 2)
    assert d["options"]["disk_experts"] is True and d["options"]["expert_cache_slots"] == 2
    assert d["counters"]["misses"] > 0
    d = run_json(model, "--tokens", "1,2,3", "-n", 3, *T1, "--expert-cache-slots", 2, "--moe-cpu-share", 0.5)
    assert d["options"]["disk_experts"] is True and d["counters"]["cpu_misses"] > 0
    d = run_json(model, "--tokens", "1,2,3", "-n", 3, *T1, "--disk-experts", "--expert-cache-slots", 2)
    assert d["options"]["disk_experts"] is True
    # a share implies the cache, which still needs its slots
    user_error("run", model, "--tokens", "1", *T1, "--moe-cpu-share", 0.5, expect=["expert_cache_slots=0"])
    user_error("run", model, "--tokens", "1", *T1, "--expert-cache-slots", 2, "-o", "disk_experts=0",
               expect=["disk_experts given twice"])


def test_host_tier_is_the_flag_and_host_cache_the_same_one(model):
    """One word for the host tier: --host-tier, and --host-cache (the name users know) sets the same option;
    the option's old key is refused with the new one named."""
    a = run_json(model, "--tokens", "1,2", "-n", 2, *T1, "--expert-cache-slots", 2, "--host-tier", "64M")
    b = run_json(model, "--tokens", "1,2", "-n", 2, *T1, "--expert-cache-slots", 2, "--host-cache", "64M")
    assert a["options"] == b["options"] and a["options"]["host_tier_bytes"] == 64 << 20
    assert a["tokens"] == b["tokens"] and a["host_tier"]["bytes_read"] > 0
    user_error("run", model, "--tokens", "1", *T1, "--expert-cache-slots", 2, "-o", "host_cache_bytes=64M",
               expect=["unknown option 'host_cache_bytes'", "did you mean 'host_tier_bytes'"])


def test_host_cache_feeds_the_expert_cache_and_reports_its_reads(model):
    ref = run_json(model, "--tokens", "1,2,3", "-n", 4, *T1)
    d = run_json(model, "--tokens", "1,2,3", "-n", 4, *T1, "--expert-cache-slots", 2, "--host-cache", "64M")
    assert d["tokens"] == ref["tokens"] and ref["host_tier"] is None
    assert d["options"]["disk_experts"] is True and d["options"]["host_tier_bytes"] == 64 << 20
    # CPU only, experts the CPU does not repack: every expert runs straight from the tier (no slot loads)
    t, c = d["host_tier"], d["counters"]
    assert t["misses"] > 0 and t["bytes_read"] > 0 and c["misses"] == 0 and t["hits"] + t["misses"] == c["distinct"]
    user_error("run", model, "--tokens", "1", *T1, "--expert-cache-slots", 2, "--host-cache", "lots",
               expect=["host_tier_bytes=lots"])
    # with a CPU share the worker's rows come from the tier too
    d = run_json(model, "--tokens", "1,2,3", "-n", 4, *T1, "--expert-cache-slots", 2, "--host-cache", "64M",
                 "--moe-cpu-share", "0.5")
    t, c = d["host_tier"], d["counters"]
    assert d["tokens"] == ref["tokens"] and c["cpu_misses"] > 0
    assert t["hits"] + t["misses"] == c["misses"] + c["cpu_misses"]


def test_a_cpu_only_run_with_the_host_tier_needs_no_expert_cache_slots(model):
    """CPU only, experts the CPU does not repack, no CPU share: every expert runs straight from the tier's frames and
    the slots would be address space only, so --host-tier alone runs (the slots derived, not demanded) with the
    resident tokens; where the slots are used (a CPU share: the device's misses load into them) it is refused,
    naming the option and why."""
    ref = run_json(model, "--tokens", "1,2,3", "-n", 4, *T1)
    d = run_json(model, "--tokens", "1,2,3", "-n", 4, *T1, "--host-tier", "auto")
    assert d["tokens"] == ref["tokens"] and d["options"]["disk_experts"] is True
    t, c = d["host_tier"], d["counters"]
    assert t["misses"] > 0 and c["misses"] == 0 and t["hits"] + t["misses"] == c["distinct"]
    user_error("run", model, "--tokens", "1", *T1, "--host-tier", "64M", "--moe-cpu-share", 0.5,
               expect=["expert_cache_slots=0", "without a CPU share"])


def test_a_flag_twice_with_a_newline_in_its_value_is_one_error_line(model):
    """Found by the CLI fuzzer: the message quoted the values raw, so '\n\n' split the error over lines."""
    user_error("run", model, "-p", "Hello world", "-p", "\n\n", *T1,
               expect=["-p 'Hello world' and -p '\\n\\n'", "given twice"])


@pytest.mark.parametrize("args,expect", [
    (["-o", "expert_cache_slots=2"], ["expert_cache_slots=2", "disk_experts=true"]),
    (["-o", "expert_eviction=lfu"], ["expert_eviction=lfu", "disk_experts=true"]),
    (["-o", "trace_path=t.bin"], ["trace_path", "disk_experts=true"]),
    (["--disk-experts", "--expert-cache-slots", "2", "-cmoe"], ["no layer would use the expert cache"]),
    (["--top-k", "5", "--temp", "0"], ["--top-k", "greedy"]),
    (["--seed", "3", "--temp", "0"], ["--seed", "greedy"]),
    (["--min-p", "0.1", "--temp", "0"], ["--min-p", "greedy"]),
    (["--repeat-last-n", "8"], ["--repeat-last-n", "no effect"]),
    (["--repeat-penalty", "1.2", "--repeat-last-n", "0"], ["--repeat-last-n 0"]),
    (["--virtual-devices", "2", "-dev", "DEV7"], ["DEV7 is not a device", "DEV0, DEV1"]),
    (["-dev", "none"], ["-dev none", "not supported", "-ngl 0"]),
    (["-ngl", "auto"], ["-ngl auto", "not supported"]),
    (["-sm", "row"], ["-sm row", "not supported"]),
    (["--no-mmap"], ["--no-mmap", "not supported", "memory-mapped"]),
    (["--mlock"], ["--mlock", "not supported"]),
    (["-lm", "dio"], ["-lm dio", "not supported"]),
    (["-mg", "1"], ["-mg", "-dev"]),
    (["-cnv"], ["--tokens does not go with -cnv"]),
    (["-sys", "be brief"], ["-sys/--system-prompt needs -cnv"]),
    (["-np", "2"], ["n_parallel=2", "one sequence", "serve"]),
])
def test_idle_or_unsupported_flags_are_errors(model, args, expect):
    user_error("run", model, "--tokens", "1,2", "-n", 2, *T1, *args, expect=expect)


def test_supported_spellings_run(model):
    base = ["--tokens", "1,2", "-n", 2, *T1]
    for extra in (["-lm", "mmap"], ["-lm", "auto"], ["-no-cnv"], ["-ngl", "all"], ["-sm", "none"]):
        run_json(model, *base, *extra)


# -- misparses: -cnv is not -c nv, -tb 2 is not -t b; one flag twice ------------------------------------


@pytest.mark.parametrize("args,expect", [
    (["-ctxx", "5"], ["No such option: -ctxx"]),
    (["-c512"], ["No such option: -c512", "separate argument"]),
    (["-tb2"], ["No such option: -tb2"]),
    (["-c", "512", "--ctx", "1024"], ["-c 512 and --ctx 1024", "twice"]),
    (["-n", "3", "--predict", "4"], ["-n 3 and --predict 4"]),
    (["-fa"], ["-fa", "requires an argument"]),
])
def test_misparses_and_conflicts_are_refused(model, args, expect):
    user_error("run", model, "--tokens", "1,2", *T1, *args, expect=expect)


def test_repeated_equal_values_and_llama_aliases(model):
    d = run_json(model, "--tokens", "1,2", "-n", 2, *T1, "-c", 256, "--ctx-size", 256, "-tb", 1, "-fa", "on",
                 "-ctk", "q8_0", "-ctv", "q8_0", "-b", 64, "-ub", 32, "-ncmoe", 1)
    o = d["options"]
    assert (o["n_ctx"], o["n_threads_batch"], o["flash_attn"], o["cache_type_v"], o["batch_size"],
            o["ubatch_size"], o["n_cpu_moe"]) == (256, 1, True, "q8_0", 64, 32, 1)
    assert run_json(model, "--tokens", "1,2", "-n", 2, *T1, "-fa", "auto")["options"]["flash_attn"] == "auto"
    assert run_json(model, "--tokens", "1,2", "-n", 2, "-t", 0)["options"]["n_threads"] is None  # <= 0: the default


def test_flash_attn_auto_resolves_like_llama_cpp(model):
    with MoEModel(model, SessionOptions(n_threads=1, flash_attn="auto")) as m:
        assert m.flash_attn is True  # the CPU backend runs flash attention for this model
        auto = m.eval([1, 2, 3], "all")
    with MoEModel(model, SessionOptions(n_threads=1, flash_attn=True)) as m:
        assert np.array_equal(auto, m.eval([1, 2, 3], "all"))


def test_threads_batch_switches_the_cpu_backends(model):
    with MoEModel(model, SessionOptions(n_threads=1, n_threads_batch=2)) as m:
        batch = m.eval([1, 2, 3, 4], "all")
        assert m.host.n_threads == 2
        one = m.eval([5], "all")
        assert m.host.n_threads == 1
    with MoEModel(model, SessionOptions(n_threads=1)) as m:
        # the same computation on another thread count: GGML splits rows between threads, not sums
        assert np.array_equal(batch, m.eval([1, 2, 3, 4], "all")) and np.array_equal(one, m.eval([5], "all"))


def test_device_selection(model):
    d = run_json(model, "--tokens", "1,2", "-n", 2, *T1, "--virtual-devices", 2, "-dev", "DEV1")
    assert set(d["layout"]["layers"]) == {"DEV1"} and set(d["layout"]["tensors"]) <= {"DEV1", "mapped"}
    d = run_json(model, "--tokens", "1,2", "-n", 2, *T1, "--virtual-devices", 2, "-dev", "DEV1,DEV0", "-ts", "1,2")
    assert d["layout"]["layers"] == ["DEV1", "DEV0"]


# -- prompt sources -----------------------------------------------------------------------------------


def test_prompt_from_file_and_escapes(model, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("Once upon\na time\n")
    a = run_json(model, "-f", f, "-n", 3, *T1)
    b = run_json(model, "-p", "Once upon\\na time", "-n", 3, *T1)  # \n processed, as llama.cpp does
    c = run_json(model, "-p", "Once upon\na time", "-n", 3, *T1)
    assert a["tokens"] == b["tokens"] == c["tokens"] and a["prompt_tokens"] == b["prompt_tokens"]
    lit = run_json(model, "-p", "Once upon\\na time", "--no-escape", "-n", 3, *T1)
    assert lit["prompt_tokens"] > a["prompt_tokens"]  # the backslash and the n stay
    user_error("run", "--temp", "0", model, "-f", tmp_path, "-n", 1, *T1, expect=["is a directory"])
    user_error("run", "--temp", "0", model, "-f", tmp_path / "none.txt", "-n", 1, *T1, expect=["does not exist"])
    user_error("run", "--temp", "0", model, "--tokens", "1", "--no-escape", *T1, expect=["no effect with --tokens"])


# -- generation length and sampling --------------------------------------------------------------------


def test_n_predict_minus_one_runs_to_a_full_context(model):
    d = run_json(model, "--tokens", "1,2", "-n", -1, "--ignore-eos", "-c", 8, *T1)
    assert d["stop_reason"] == "context" and d["generated_tokens"] == 7  # positions 2..7 evaluated, then full


def test_n_predict_minus_one_stops_at_end_of_generation(model):
    for prompt in ([3, 4], [1, 2, 3], [10], [200, 100]):
        d = run_json(model, "--tokens", ",".join(map(str, prompt)), "-n", -1, "-c", 64, *T1)
        if d["stop_reason"] == "eos":
            assert d["tokens"] == greedy_reference(model, prompt, len(d["tokens"]))
            return
    pytest.skip("no probe prompt reaches EOS within the context")


def test_repeat_penalties_match_the_oracle(model):
    pen = dict(rp=1.8, last_n=6, presence=0.5, frequency=0.25)
    d = run_json(model, "--tokens", "5,6,7", "-n", 8, "--ignore-eos", *T1, "--repeat-penalty", 1.8,
                 "--repeat-last-n", 6, "--presence-penalty", 0.5, "--frequency-penalty", 0.25)
    assert d["tokens"] == greedy_reference(model, [5, 6, 7], 8, pen)
    plain = run_json(model, "--tokens", "5,6,7", "-n", 8, "--ignore-eos", *T1)
    assert plain["tokens"] == greedy_reference(model, [5, 6, 7], 8) != d["tokens"]


def test_sampling_flags_and_aliases(model):
    base = (model, "--tokens", "5,6", "-n", 8, "--ignore-eos", *T1)
    a = run_json(*base, "--temp", 0.9, "-s", 11, "--min-p", 0.1, "--top-p", 0.9, "--top-k", 20)
    b = run_json(*base, "--temperature", 0.9, "--seed", 11, "--min-p", 0.1, "--top-p", 0.9, "--top-k", 20)
    assert a["tokens"] == b["tokens"]
    run_json(*base, "--temp", 0.9, "-s", -1)  # -1: a random seed, as llama.cpp


def test_one_token_has_no_decode_rate(model):
    r = ok("run", model, "--tokens", "1,2", "-n", 1, *T1)
    assert "decode 1 tok, no decode step" in r.stderr and "0.0 tok/s" not in r.stderr.split("|")[2]


# -- hybrid_offload_active: configured and active ------------------------------------------------------


@pytest.mark.parametrize("args,active", [
    ([], False), (["-cmoe"], True), (["-ncmoe", "1"], True), (["-ot", "exps=CPU"], True),
    (["--expert-cache-slots", "2"], False), (["--expert-cache-slots", "2", "--moe-cpu-share", "0.5"], True),
    (["--expert-cache-slots", "2", "--moe-cpu-share", "auto"], True),
])
def test_hybrid_offload_active(model, args, active):
    d = run_json(model, "--tokens", "1,2,3", "-n", 3, *T1, *args)
    assert d["hybrid_offload_active"] is active
    if "-cmoe" in args:
        assert d["share_applied"] == 0.0 and d["counters"]["cpu_misses"] == 0  # the share is reported apart


# -- plan and bench take the same flags ----------------------------------------------------------------


def test_plan_takes_the_session_flags_and_json(model):
    j = json.loads(ok("plan", model, "--json", "--expert-cache-slots", 2, "-c", 256, "-ub", 32).stdout)
    f = json.loads(ok("plan", model, "--format", "json", "--expert-cache-slots", 2, "-c", 256, "-ub", 32).stdout)
    assert j == f
    want = plan(model, SessionOptions(disk_experts=True, expert_cache_slots=2, n_ctx=256, ubatch_size=32)).to_dict()
    assert j == want
    user_error("plan", model, "-c", 256, "--ctx", 512, expect=["-c 256 and --ctx 512"])
    user_error("plan", model, "--json", "--format", "k8s", expect=["choose one"])
    user_error("plan", model, "-o", "expert_cache_slots=2", expect=["disk_experts=true"])


def test_bench_takes_the_session_flags(model):
    d = json.loads(ok("bench", model, *T1, "-c", 128, "--b", "expert_cache_slots=2 disk_experts=1", "--runs", 1,
                      "-n", 2, "-p", 8, "--json").stdout)
    assert sorted(d["sides"]["A"]["options"]) == ["n_ctx=128", "n_threads=1"]
    assert sorted(d["sides"]["B"]["options"]) == ["disk_experts=true", "expert_cache_slots=2", "n_ctx=128",
                                                   "n_threads=1"]


def test_run_help_describes_every_flag():
    text = ok("run", "--help").stdout
    for flag, words in (("-ctk", "KV cache type of K"), ("-ctv", "KV cache type of V"), ("-b", "Logical batch"),
                        ("-ub", "Physical batch"), ("-fa", "flash attention"), ("-sm", "How layers spread"),
                        ("-tb", "prompt"), ("-dev", "devices"), ("--min-p", "Min-p")):
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(flag)), None)
        assert line is not None, flag
        assert words.lower() in text.lower(), (flag, words)


# -- truncated files and paths that are not files ------------------------------------------------------


def test_truncated_gguf_names_the_tensor_and_bytes(model, tmp_path):
    data = Path(model).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) * 2 // 3])
    msg = user_error("run", cut, "--tokens", "1", *T1)
    assert "tensor 'blk." in msg and "needs" in msg and "bytes" in msg and "holds" in msg and "truncated" in msg
    assert "reshape" not in msg


@pytest.mark.parametrize("which,expect", [("dir", "is a directory"), ("dev", "not a regular file"),
                                          ("missing", "does not exist")])
def test_paths_that_are_not_model_files(model, tmp_path, which, expect):
    path = {"dir": tmp_path, "dev": "/dev/null", "missing": tmp_path / "nope.gguf"}[which]
    for cmd in (["run", path, "--tokens", "1", *T1], ["inspect", path], ["plan", path]):
        msg = user_error(*cmd, expect=[expect])
        if which != "missing":
            assert "does not exist" not in msg


# -- Ctrl-C: the stats of what ran, exit 130, never a traceback ----------------------------------------


# the console script's launcher, started the way the script starts it, with a mark on stderr once it runs: a
# SIGINT before that lands in the interpreter's own start-up (site.py), which is Python's, not ours
_LAUNCH = "import sys, ggml_hybrid_cli; sys.stderr.write('@'); sys.stderr.flush(); ggml_hybrid_cli.main()"


def _cli_process(*args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-c", _LAUNCH, *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    assert p.stderr.read(1) == b"@"
    return p


def test_ctrl_c_during_generation_prints_the_stats(model):
    p = _cli_process("run", model, "--tokens", "1,2", "-n", -1, "--ignore-eos", "-c", 4096, *T1)
    first = p.stdout.read(1)  # generation has started
    assert first
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    text = err.decode()
    assert p.returncode == 130, text
    assert "Traceback" not in text and "stop: interrupted" in text and "decode" in text and "tok/s" in text


# what a SIGINT between the mark and the call of main() prints: the harness's own line, not the program's
_HARNESS_ONLY = 'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\nKeyboardInterrupt\n'


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8])
def test_ctrl_c_at_any_moment_and_twice_prints_no_traceback(model, delay):
    for _ in range(5):  # on a loaded machine the child may be descheduled right after its mark: try again
        p = _cli_process("run", model, "--tokens", "1,2", "-n", -1, "--ignore-eos", "-c", 4096, *T1)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        time.sleep(0.01)
        if p.poll() is None:
            p.send_signal(signal.SIGINT)  # a second Ctrl-C while the first is handled
        out, err = p.communicate(timeout=60)
        text = err.decode()
        if not text.endswith(_HARNESS_ONLY):
            break
    assert "Traceback" not in text, text
    assert p.returncode == 130, (p.returncode, text)


# -- the tools: one CLI library, --help never runs anything -------------------------------------------

REPO = Path(__file__).resolve().parent.parent
# these run under the llama.cpp reference interpreter, which has llama-cpp-python and numpy only
REFERENCE_SIDE = {"llama_reference.py", "llama_mtp_reference.py", "_llama_worker.py", "_llama_steps_worker.py",
                  "_llama_verify_worker.py"}


def test_tools_use_click_and_help_runs_nothing():
    scripts = [p for p in [*REPO.glob("tools/*.py"), *REPO.glob("tools/bench/*.py")]
               if p.name not in REFERENCE_SIDE and '__name__ == "__main__"' in p.read_text()]
    tools = sorted(scripts)
    assert len(tools) >= 10
    for tool in tools:
        assert "argparse" not in tool.read_text(), tool
        r = subprocess.run([sys.executable, str(tool), "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("Usage:"), (tool, r.stderr[-500:])
    assert "parity" not in subprocess.run([sys.executable, str(REPO / "tools/demo_moe.py"), "-h"], capture_output=True,
                                          text=True, timeout=120).stdout


def test_converter_side_tools_help_runs_nothing():
    """tools/converted/ runs under the converter's interpreter (torch, transformers) and the llama.cpp reference one:
    argparse there, as in llama_reference.py; --help imports neither."""
    for name in ("hf_side.py", "quantize.py"):
        r = subprocess.run([sys.executable, str(REPO / "tools" / "converted" / name), "--help"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("usage:"), (name, r.stderr[-500:])


def test_replay_trace_takes_comma_lists(tmp_path):
    trace = tmp_path / "t.trace"
    tool = str(REPO / "tools/replay_trace.py")
    subprocess.run([sys.executable, tool, "synth", str(trace), "--layers", "2", "--experts", "8", "--used", "2",
                    "--calls", "10"], check=True, capture_output=True, timeout=120)

    def rows(*args):
        r = subprocess.run([sys.executable, tool, str(trace), *args, "--json"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        return [(x["policy"], x["n_slots"], x["share"]) for x in json.loads(r.stdout)["results"]]

    commas = rows("--slots", "2,4,8", "--policy", "lru,lfu", "--share", "0,0.5")
    repeats = rows("--slots", "2", "--slots", "4", "--slots", "8", "--policy", "lru", "--policy", "lfu",
                   "--share", "0", "--share", "0.5")
    assert commas == repeats and len(commas) == 3 * 2 * 2
    bad = subprocess.run([sys.executable, tool, str(trace), "--slots", "2,x"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


# -- plan is what run allocates, disk experts with a CPU share included ------------------------------


def test_plan_equals_what_a_run_allocates_with_disk_experts_and_a_share(model):
    flags = [*T1, "--expert-cache-slots", 3, "--moe-cpu-share", 0.5, "-c", 256, "-ub", 64]
    planned = json.loads(ok("plan", model, "--json", *flags).stdout)["devices"]["DEV0"]
    want = {k: planned[k] for k in ("weights", "experts", "kv_cache", "recurrent", "compute")}
    # prompts of several lengths (one beyond a ubatch) and their decode steps allocate nothing past the load
    for prompt in ([1, 2, 3], list(range(1, 100)), list(range(5, 40))):
        d = run_json(model, "--tokens", ",".join(map(str, prompt)), "-n", 4, "--ignore-eos", *flags)
        assert d["counters"]["misses"] > 0 and d["counters"]["cpu_misses"] > 0
        assert d["device_memory"] == want
    with MoEModel(model, SessionOptions(n_threads=1, disk_experts=True, expert_cache_slots=3, moe_cpu_share="auto",
                                        n_ctx=256, ubatch_size=64)) as m:
        at_load = m.device_memory()
        for n in (1, 7, 64, 2, 33):
            m.eval(list(range(1, n + 1)))
        assert m.device_memory() == at_load


# -- issue 34: errors that say what to type ------------------------------------------------------------


@pytest.mark.parametrize("n_expert, n_used", [(16, 4), (8, 4), (6, 1)])
def test_disk_experts_without_slots_suggests_a_count(tmp_path, n_expert, n_used):
    path = write_model(tmp_path / "m.gguf", ModelSpec(n_expert=n_expert, n_used=n_used))
    want = min(n_expert, max(n_expert // 4, n_used, 1))  # a quarter of the experts, at least those used per token
    for flags in (["--disk-experts"], ["--moe-cpu-share", "0.5"], ["-o", "disk_experts=true"]):
        for cmd in (["run", path, "-p", "x", *T1], ["plan", path]):
            err = user_error(*cmd, *flags, expect=["expert_cache_slots=0", "--expert-cache-slots N"])
            assert f"e.g. {want} (a quarter of the model's {n_expert} experts, at least the {n_used} used" in err
    # the suggestion works as given
    assert run_json(path, "--tokens", "1,2", "-n", 2, "--moe-cpu-share", "0.5", "--expert-cache-slots", want,
                    *T1)["options"]["expert_cache_slots"] == want


def test_tensor_split_for_more_devices_than_the_session_has(model):
    for cmd in (["run", model, "--tokens", "1", "-n", 1, *T1], ["plan", model]):
        user_error(*cmd, "-ts", "3,1", expect=["tensor_split=3,1: needs 1 proportion(s), one per device, got 2",
                                               "nothing to split"])
    ok("plan", model, "-ts", "1")  # one proportion for one device
    p = json.loads(ok("plan", model, "-ts", "3,1", "--virtual-devices", 2, "--json").stdout)
    assert sorted(p["devices"]) == ["DEV0", "DEV1"]


def test_missing_server_extra_says_how_to_install_from_the_checkout(monkeypatch):
    from ggml_hybrid.errors import MissingDependencyError
    from ggml_hybrid.text import chat

    monkeypatch.setitem(sys.modules, "jinja2", None)  # import jinja2 fails as if it were not installed
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    with pytest.raises(MissingDependencyError, match=r"pip install -e '\.\[server\]'"):
        chat._jinja()
    root = Path(__file__).resolve().parents[1]
    for f in [*root.joinpath("docs").glob("*.md"), root / "README.md", *root.joinpath("ggml_hybrid").rglob("*.py")]:
        assert "ggml-hybrid[server]" not in f.read_text(), f"{f}: names a package that is not on PyPI"
