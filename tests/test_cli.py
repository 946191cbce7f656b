"""The ``ggml-hybrid`` command line through click's CliRunner: run, inspect, bench, demo, options, errors.

Oracles are independent of the CLI code: generation is recomputed with ``MoEModel.eval`` directly (the
prompt as one batch, then one token per eval, as the documented generation loop evaluates it), byte counts
come from ``gguf.GGUFReader`` and from the model spec, option lists from ``SessionOptions``' dataclass fields.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from helpers import rewrite_gguf

from ggml_hybrid.cli import main
from ggml_hybrid.cli.report import RUN_SCHEMA_KEYS
from ggml_hybrid.gguf.store import GGUFStore
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.runtime.sampling import Sampler
from ggml_hybrid.synthetic import ModelSpec, write_model
from ggml_hybrid.text.tokenizer import Tokenizer
from ggml_hybrid.units import format_bytes

SPEC = ModelSpec()  # qwen3moe, 2 layers, embd 64, 8 experts, top-2, F32, vocab 384
DISK_CACHE = ["-o", "disk_experts=1", "-o", "expert_cache_slots=2"]
PROMPT_IDS = [5, 17, 42, 101]


def _runner() -> CliRunner:
    # click < 8.2 mixes stderr into stdout unless told not to; 8.2+ keeps them apart and has no mix_stderr
    if "mix_stderr" in inspect.signature(CliRunner).parameters:
        return CliRunner(mix_stderr=False)
    return CliRunner()


def cli(*args):
    return _runner().invoke(main, [str(a) for a in args])


def ok(*args):
    r = cli(*args)
    assert r.exit_code == 0 and r.exception is None, (r.exit_code, r.exception, r.stdout[-2000:], r.stderr[-2000:])
    return r


def run_json(*args) -> dict:
    greedy = () if {"--temp", "--temperature"} & {str(a) for a in args} else ("--temp", "0")  # reproducible
    r = ok("run", *greedy, *args, "--json")
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, f"--json must print exactly one line, got {r.stdout!r}"
    assert r.stderr == "", "--json: no stats block, and no progress bar when stderr is not a terminal"
    d = json.loads(lines[0])
    assert isinstance(d, dict)
    return d


def user_error(*args, expect=()):
    """The command must fail as a user error: exit 2, one 'error: ' line on stderr, no traceback."""
    r = cli(*args)
    assert r.exit_code == 2, (r.exit_code, r.exception, r.stdout[-1000:], r.stderr[-1000:])
    assert isinstance(r.exception, SystemExit), f"uncaught {r.exception!r}"
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    for frag in expect:
        assert frag in lines[0], f"{frag!r} not in {lines[0]!r}"
    return lines[0]


def reference(path, prompt, n, sampler=None, stop_at_eos=True):
    """(tokens, logits rows, stop reason) by MoEModel.eval: the prompt in one call, then each token but the last."""
    sampler = sampler or (lambda row: int(np.argmax(row)))
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        eos = m.tokenizer.eos_id
        rows = [m.eval(prompt, "all")]
        toks, stop = [], "length"
        while len(toks) < n:
            t = sampler(rows[-1][-1])
            if stop_at_eos and t == eos:
                stop = "eos"
                break
            toks.append(t)
            if len(toks) < n:
                rows.append(m.eval([t], "last"))
        return toks, np.concatenate(rows), stop


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_models")
    paths = {"m": write_model(d / "m.gguf", SPEC),
             "q2": write_model(d / "q2.gguf", arch="qwen2moe", head_dim=16),
             "q8": write_model(d / "q8.gguf", weight_type="q8_0", seed=3),
             "llama": write_model(d / "llama.gguf", arch="llama", seed=4)}
    junk = d / "junk.gguf"
    junk.write_bytes(b"definitely not a GGUF file\n" * 64)
    paths["junk"] = str(junk)
    # an architecture this package does not run: the same tensors under general.architecture = gpt2
    paths["gpt2"] = rewrite_gguf(paths["m"], d / "gpt2.gguf", arch="gpt2")
    # a dense model: no expert metadata, no router and no expert tensors, a plain FFN instead
    rng = np.random.default_rng(0)
    E, F = SPEC.n_embd, 128
    dense_ffn = {}
    for i in range(SPEC.n_layer):
        dense_ffn.update({f"blk.{i}.ffn_gate.weight": rng.standard_normal((F, E)).astype(np.float32),
                          f"blk.{i}.ffn_up.weight": rng.standard_normal((F, E)).astype(np.float32),
                          f"blk.{i}.ffn_down.weight": rng.standard_normal((E, F)).astype(np.float32)})
    paths["dense"] = rewrite_gguf(
        paths["m"], d / "dense.gguf",
        drop_keys=("qwen3moe.expert_count", "qwen3moe.expert_used_count", "qwen3moe.expert_feed_forward_length"),
        drop_tensors=[t for i in range(SPEC.n_layer) for t in
                      (f"blk.{i}.ffn_gate_inp.weight", f"blk.{i}.ffn_gate_exps.weight",
                       f"blk.{i}.ffn_up_exps.weight", f"blk.{i}.ffn_down_exps.weight")],
        tensors=dense_ffn)
    # the MoE tensors are all there, but the metadata says there are no experts
    paths["zero_experts"] = rewrite_gguf(
        paths["m"], d / "zero_experts.gguf",
        set_keys={"qwen3moe.expert_count": (0, gguf.GGUFValueType.UINT32)})
    return paths


@pytest.fixture(scope="module")
def tokenizer(models):
    store = GGUFStore(models["m"])
    try:
        return Tokenizer.from_gguf(store)
    finally:
        store.close()


@pytest.fixture(scope="module")
def plain_run(models, tmp_path_factory):
    """One resident run with logits, and its independent reference."""
    out = tmp_path_factory.mktemp("plain") / "logits.npy"
    d = run_json(models["m"], "--tokens", ",".join(map(str, PROMPT_IDS)), "-n", 6, "--ignore-eos", "-t", 1,
                 "--logits-out", out)
    return d, np.load(out)


# ---------------------------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------------------------

STATS = [re.compile(p) for p in (
    r"prompt (\d+) tok, [\d.]+ tok/s", r"decode (\d+) tok, [\d.]+ tok/s", r"stop: (\w+)",
    r"hits (\d+), misses (\d+), cpu misses (\d+)", r"share applied ([\d.]+)",
    r"hybrid_offload_active: (true|false)", r"peak device memory ([\d.,]+) [KMG]?i?B")]


def parse_stats(stderr: str) -> list[str]:
    found = []
    for pat in STATS:
        m = pat.search(stderr)
        assert m, f"{pat.pattern!r} not in the stats block {stderr!r}"
        found.append(m.groups())
    return found


def test_run_prompt_prints_the_greedy_text_and_a_stats_block(models, tokenizer):
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt)
    toks, _, stop = reference(models["m"], ids, 8)
    r = ok("run", "--temp", "0", models["m"], "--prompt", prompt, "-n", 8, "-t", 1)
    assert r.stdout == tokenizer.decode(toks) + "\n"
    (p,), (g,), (s,), (hits, misses, cpu), (share,), (active,), (peak,) = parse_stats(r.stderr)
    assert (int(p), int(g), s) == (len(ids), len(toks), stop)
    assert (hits, misses, cpu, float(share), active) == ("0", "0", "0", 0.0, "false")  # resident: no cache
    assert float(peak) > 0


def test_run_tokens_matches_the_reference(models, tokenizer):
    toks, _, stop = reference(models["m"], PROMPT_IDS, 7)
    r = ok("run", "--temp", "0", models["m"], "--tokens", ",".join(map(str, PROMPT_IDS)), "-n", 7, "-t", 1)
    assert r.stdout == tokenizer.decode(toks) + "\n"
    (p,), (g,), (s,), *_ = parse_stats(r.stderr)
    assert (int(p), int(g), s) == (len(PROMPT_IDS), len(toks), stop)


@pytest.mark.parametrize("name,arch", [("q2", "qwen2moe"), ("llama", "llama")])
def test_run_other_architectures_match_the_reference(models, name, arch):
    d = run_json(models[name], "--tokens", ",".join(map(str, PROMPT_IDS)), "-n", 5, "-t", 1, *DISK_CACHE,
                 "--moe-cpu-share", "0.5")
    toks, _, stop = reference(models[name], PROMPT_IDS, 5)
    assert d["architecture"] == arch and d["tokens"] == toks and d["stop_reason"] == stop


def test_run_stats_block_reports_the_cpu_offload_counters(models):
    args = (models["m"], "--tokens", "3,4,5", "-n", 5, "--ignore-eos", "-t", 1, *DISK_CACHE, "--moe-cpu-share", 0.5)
    d = run_json(*args)
    r = ok("run", "--temp", "0", *args)
    assert r.stdout == d["text"] + "\n"
    stats = parse_stats(r.stderr)
    c = d["counters"]
    assert stats[3] == (str(c["hits"]), str(c["misses"]), str(c["cpu_misses"]))
    assert c["cpu_misses"] > 0 and d["hybrid_offload_active"] is True and stats[5] == ("true",)
    assert float(stats[4][0]) == pytest.approx(d["share_applied"], abs=0.005) and d["share_applied"] > 0
    assert float(stats[6][0]) == pytest.approx(d["peak_device_bytes"] / 2**20, abs=0.005)


def test_run_json_schema_and_values(models, tokenizer, plain_run):
    d, _ = plain_run
    assert list(d) == list(RUN_SCHEMA_KEYS)
    toks, _, stop = reference(models["m"], PROMPT_IDS, 6, stop_at_eos=False)
    assert d["tokens"] == toks and d["generated_tokens"] == len(toks) == 6 and d["stop_reason"] == stop == "length"
    assert d["prompt_tokens"] == len(PROMPT_IDS)
    assert d["text"] == tokenizer.decode(toks)
    assert d["model"] == models["m"] and d["architecture"] == "qwen3moe"
    for k in ("load_seconds", "prompt_seconds", "decode_seconds", "prompt_tps", "decode_tps"):
        assert isinstance(d[k], float) and d[k] > 0, k
    assert d["prompt_tps"] == pytest.approx(d["prompt_tokens"] / d["prompt_seconds"])
    assert d["decode_tps"] == pytest.approx((d["generated_tokens"] - 1) / d["decode_seconds"])
    assert isinstance(d["hybrid_offload_active"], bool) and d["hybrid_offload_active"] is False
    assert isinstance(d["share_applied"], float) and d["share_applied"] == 0.0
    c = d["counters"]
    for k in ("hits", "misses", "cpu_misses"):
        assert isinstance(c[k], int) and c[k] == 0, k  # resident experts: no cache, no CPU work
    assert d["options"] == SessionOptions(n_threads=1).to_dict()
    # device memory from the file: dense tensors as weights, routed experts resident, an f16 K and V cache
    reader = gguf.GGUFReader(models["m"])
    routed = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    dense = sum(int(t.n_bytes) for t in reader.tensors) - routed
    mem = d["device_memory"]
    assert all(isinstance(v, int) for v in mem.values())
    n_ctx = min(SPEC.n_ctx_train, 4096)
    embd = next(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    # every dense tensor is on the device, but for the token embedding, which llama.cpp's layout keeps on the CPU
    assert mem["weights"] in (dense, dense - embd) and mem["experts"] == routed
    assert mem["kv_cache"] == 2 * SPEC.n_layer * n_ctx * SPEC.n_head_kv * SPEC.head_dim * 2
    assert d["peak_device_bytes"] == sum(mem.values())


def test_run_json_generated_tokens_at_most_n(models):
    for n in (0, 1, 3):
        d = run_json(models["m"], "--tokens", "7,8", "-n", n, "-t", 1)
        assert d["generated_tokens"] == len(d["tokens"]) <= n
        if d["stop_reason"] == "length":
            assert len(d["tokens"]) == n


@pytest.mark.parametrize("all_logits", [False, True])
def test_run_json_counters_follow_the_routing(models, tmp_path, all_logits):
    """With the expert cache every (token, expert) pair that reaches a MoE layer is counted once.

    As in llama.cpp, the last layer only computes the rows whose logits are wanted: of a prompt without
    --logits-out just its last position.
    """
    n = 5
    extra = ["--logits-out", tmp_path / "l.npy"] if all_logits else []
    d = run_json(models["m"], "--tokens", ",".join(map(str, PROMPT_IDS)), "-n", n, "--ignore-eos", "-t", 1,
                 *DISK_CACHE, "--moe-cpu-share", "0.5", *extra)
    c = d["counters"]
    evaluated = len(PROMPT_IDS) + n - 1
    pruned = 0 if all_logits else len(PROMPT_IDS) - 1
    assert c["routed"] == SPEC.n_used * (SPEC.n_layer * evaluated - pruned)
    assert c["calls"] == SPEC.n_layer * n  # the prompt in one call, then n - 1 decode steps
    assert c["hits"] + c["misses"] + c["cpu_misses"] == c["distinct"] > 0
    assert c["misses"] > 0 and c["cpu_misses"] > 0 and d["hybrid_offload_active"] is True
    assert d["options"]["moe_cpu_share"] == 0.5 and d["options"]["disk_experts"] is True


def test_logits_out_shape_and_rows_equal_the_reference(models, plain_run):
    d, logits = plain_run
    assert logits.dtype == np.float32
    # the last generated token is never evaluated: prompt + generated - 1 rows
    assert logits.shape == (d["prompt_tokens"] + d["generated_tokens"] - 1, SPEC.vocab_size) == (9, 384)
    toks, ref, _ = reference(models["m"], PROMPT_IDS, 6, stop_at_eos=False)
    assert np.array_equal(logits, ref)
    # one eval over the whole sequence batches differently (float sums in another order): equal to rounding
    with MoEModel(models["m"], SessionOptions(n_threads=1)) as m:
        once = m.eval(PROMPT_IDS + toks[:-1], "all")
    np.testing.assert_allclose(logits, once, rtol=0, atol=1e-4 * float(np.abs(once).max()))


def test_logits_out_when_generation_stops_at_eos(models):
    """An EOS stop: the token that predicted EOS was evaluated, so there is one row per prompt + generated token."""
    eos_prompt = None
    for prompt in ([3, 4], [1, 2, 3], [10], [200, 100]):
        toks, ref, stop = reference(models["m"], prompt, 24)
        if stop == "eos":
            eos_prompt = prompt
            break
    assert eos_prompt is not None, "no probe prompt reaches EOS within 24 tokens"
    out = Path(models["m"]).with_name("eos_logits.npy")
    d = run_json(models["m"], "--tokens", ",".join(map(str, eos_prompt)), "-n", 24, "-t", 1, "--logits-out", out)
    assert d["stop_reason"] == "eos" and d["tokens"] == toks
    logits = np.load(out)
    assert logits.shape == (len(eos_prompt) + len(toks), SPEC.vocab_size)
    assert np.array_equal(logits, ref)


def test_logits_out_with_no_generated_tokens(models, tmp_path):
    out = tmp_path / "l.npy"
    d = run_json(models["m"], "--tokens", "9,8,7", "-n", 0, "-t", 1, "--logits-out", out)
    assert d["generated_tokens"] == 0 and d["tokens"] == []
    _, ref, _ = reference(models["m"], [9, 8, 7], 0)
    assert np.array_equal(np.load(out), ref) and ref.shape == (3, SPEC.vocab_size)


def test_logits_out_writes_the_named_file(models, tmp_path):
    """--logits-out X writes X itself (np.save would add '.npy' to a bare file name)."""
    out = tmp_path / "logits.f32"
    run_json(models["m"], "--tokens", "1,2", "-n", 2, "-t", 1, "--logits-out", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.f32"]
    assert np.load(out).shape == (3, SPEC.vocab_size)


@pytest.mark.parametrize("share", ["0.5", "auto"])
def test_cpu_offload_logits_are_bit_identical_through_the_cli(models, plain_run, tmp_path, share):
    d0, l0 = plain_run
    out = tmp_path / "hybrid.npy"
    d = run_json(models["m"], "--tokens", ",".join(map(str, PROMPT_IDS)), "-n", 6, "--ignore-eos", "-t", 1,
                 *DISK_CACHE, "--moe-cpu-share", share, "--logits-out", out)
    assert d["tokens"] == d0["tokens"] and d["text"] == d0["text"]
    assert np.array_equal(np.load(out), l0)
    c = d["counters"]
    assert c["misses"] + c["cpu_misses"] > 0  # the experts really came through the cache
    assert d["options"]["moe_cpu_share"] == (0.5 if share == "0.5" else "auto")
    if share == "0.5":
        assert c["cpu_misses"] > 0 and d["hybrid_offload_active"] is True


def test_auto_slots_say_what_they_chose_and_why(models):
    """--expert-cache-slots auto prints its choice (and the run used it); --json carries the numbers behind it."""
    r = ok("run", "--temp", "0", models["m"], "--tokens", "1,2", "-n", 2, "-t", 1, "--expert-cache-slots", "auto")
    d = run_json(models["m"], "--tokens", "1,2", "-n", 2, "-t", 1, "--expert-cache-slots", "auto")
    choice = d["slot_choice"]
    assert d["options"]["expert_cache_slots"] == choice["slots"] == SPEC.n_expert  # every expert fits this CPU
    (dev,) = choice["per_device"]
    assert choice["per_device"][dev] > SPEC.n_expert
    line = next(x for x in r.stderr.splitlines() if x.startswith("expert_cache_slots=auto -> "))
    assert line.startswith(f"expert_cache_slots=auto -> {SPEC.n_expert} (the model's {SPEC.n_expert} experts per "
                           f"layer; {dev}: "), line
    assert run_json(models["m"], "--tokens", "1,2", "-n", 2, "-t", 1)["slot_choice"] is None


def test_seeded_sampling_is_deterministic(models):
    args = (models["m"], "--tokens", "5,6", "-n", 10, "--ignore-eos", "-t", 1, "--temp", 0.8)
    a = run_json(*args, "--seed", 3)["tokens"]
    b = run_json(*args, "--seed", 3)["tokens"]
    c = run_json(*args, "--seed", 4)["tokens"]
    greedy = run_json(*args[:-2])["tokens"]
    assert a == b and len(a) == 10
    assert a != c and a != greedy
    ref, _, _ = reference(models["m"], [5, 6], 10, Sampler(temperature=0.8, seed=3), False)
    assert a == ref


def test_moe_cpu_share_shorthand_conflicting_with_session_option(models):
    base = (models["m"], "--tokens", "1,2", "-n", 2, "-t", 1, *DISK_CACHE)
    user_error("run", *base, "--moe-cpu-share", "0.5", "-o", "moe_cpu_share=0.25", expect=["moe_cpu_share"])
    user_error("run", *base, "--moe-cpu-share", "auto", "-o", "moe_cpu_share=0", expect=["moe_cpu_share"])
    user_error("run", *base, "--expert-cache-slots", 3, expect=["expert_cache_slots"])  # DISK_CACHE gives 2
    user_error("run", *base, "-o", "n_threads=2", expect=["n_threads"])  # -t 1 in base
    assert run_json(*base, "--expert-cache-slots", 2, "-o", "n_threads=1")["options"]["expert_cache_slots"] == 2
    for x, y in (("0.5", "0.5"), ("0.5", "0.50"), ("auto", "AUTO")):
        d = run_json(*base, "--moe-cpu-share", x, "-o", f"moe_cpu_share={y}")
        assert d["options"]["moe_cpu_share"] == (0.5 if x == "0.5" else "auto")


def test_run_rejects_a_prompt_that_is_not_utf8(models):
    # a command line argument with bytes that are not UTF-8 reaches Python as lone surrogates
    user_error("run", models["m"], "--prompt", "caf\udce9", "-n", 1, "-t", 1, expect=["--prompt"])


# ---------------------------------------------------------------------------------------------------------------
# --config
# ---------------------------------------------------------------------------------------------------------------

CONFIG = """\
[models.small]
path = "m.gguf"
role = "main"
[models.small.session_options]
disk_experts = true
expert_cache_slots = 2
"main.moe_cpu_share" = 0.5
"draft.n_threads" = 3

[models.other]
path = "m.gguf"
role = "draft"
[models.other.session_options]
n_threads = 1
"main.moe_cpu_share" = 0.5
"""


@pytest.fixture(scope="module")
def config(models):
    # next to the model, with a relative path: it must resolve against the file, not the working directory
    p = Path(models["m"]).with_name("models.toml")
    p.write_text(CONFIG)
    return str(p)


@pytest.mark.parametrize("key", ["small", "main"])
def test_config_picks_by_name_or_role_and_applies_its_options(models, config, plain_run, key, tmp_path):
    d0, l0 = plain_run
    out = tmp_path / "l.npy"
    d = run_json(key, "--config", config, "--tokens", ",".join(map(str, PROMPT_IDS)), "-n", 6, "--ignore-eos",
                 "-t", 1, "--logits-out", out)
    assert d["model"] == models["m"]
    o = d["options"]
    # the role-scoped key applies to the model whose role is main; draft.n_threads does not
    assert (o["disk_experts"], o["expert_cache_slots"], o["moe_cpu_share"], o["n_threads"]) == (True, 2, 0.5, 1)
    c = d["counters"]
    assert c["misses"] > 0 and c["cpu_misses"] > 0 and d["hybrid_offload_active"] is True
    assert d["tokens"] == d0["tokens"] and np.array_equal(np.load(out), l0)


def test_config_role_scoped_key_applies_only_to_its_role(config):
    d = run_json("draft", "--config", config, "--tokens", "1,2", "-n", 2)
    o = d["options"]
    assert (o["moe_cpu_share"], o["disk_experts"], o["n_threads"]) == (0.0, False, 1)
    assert d["counters"]["misses"] == d["counters"]["cpu_misses"] == 0


def test_command_line_overrides_the_config(config):
    d = run_json("small", "--config", config, "--tokens", "1,2", "-n", 3, "-t", 1, "--expert-cache-slots", 4,
                 "-o", "moe_cpu_share=0")
    o = d["options"]
    assert (o["disk_experts"], o["expert_cache_slots"], o["moe_cpu_share"]) == (True, 4, 0.0)
    assert d["counters"]["cpu_misses"] == 0 and d["counters"]["misses"] > 0
    assert d["hybrid_offload_active"] is False
    d = run_json("small", "--config", config, "--tokens", "1,2", "-n", 3, "-t", 1, "--moe-cpu-share", "auto")
    assert d["options"]["moe_cpu_share"] == "auto"
    # role-scoped keys on the command line: the model's role (main) applies, another role's is ignored
    d = run_json("small", "--config", config, "--tokens", "1,2", "-n", 2, "-t", 1, "-o", "main.expert_cache_slots=3",
                 "-o", "draft.expert_cache_slots=1")
    assert d["options"]["expert_cache_slots"] == 3


def test_config_with_a_plain_model_path(models, config):
    # a path that is no name or role in the file runs the file with the default options
    d = run_json(models["m"], "--config", config, "--tokens", "1,2", "-n", 2, "-t", 1)
    assert d["options"] == SessionOptions(n_threads=1).to_dict()


@pytest.mark.parametrize("text,expect", [
    (None, ["does not exist"]),
    ("[[[ this is not toml", ["TOML"]),
    ('[models.a]\npath = "m.gguf"\ncolour = "red"\n', ["colour"]),
    ('[models.a]\npath = "m.gguf"\n[models.a.session_options]\nexpert_cache_slots = -1\n', ["expert_cache_slots"]),
    ('[models.a]\npath = "m.gguf"\n[models.a.session_options]\nn_threads = true\n', ["n_threads"]),
    ('[models.a]\npath = "m.gguf"\n[models.a.session_options]\nexpert_cache_slot = 2\n', ["expert_cache_slots"]),
    ('[models.a]\npath = "m.gguf"\nrole = "r"\n[models.b]\npath = "m.gguf"\nrole = "r"\n', ["several"]),
    ('[models.a]\npath = "missing.gguf"\n', ["does not exist"]),
    ('[models.a]\nrole = "r"\n', ["path"]),
    ("title = 'no models'\n", ["models"]),
    ('[models.x]\npath = "m.gguf"\n', ["neither a file nor a model name"]),
])
def test_bad_config_is_one_line(models, text, expect):
    p = Path(models["m"]).with_name("bad.toml")
    if text is None:
        p.unlink(missing_ok=True)
    else:
        p.write_text(text)
    key = "r" if "several" in expect else "a"
    user_error("run", key, "--config", p, "--tokens", "1", "-n", 1, "-t", 1, expect=expect)


# ---------------------------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------------------------

def _class_of(name: str) -> str:
    if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")):
        return "routed_experts"
    if "shexp" in name:  # ffn_{gate,up,down}_shexp and the shared expert's gate ffn_gate_inp_shexp
        return "shared_experts"
    return {"token_embd.weight": "embeddings", "output.weight": "output"}.get(name, "dense")


def _bytes_by_class(path) -> dict:
    out = dict.fromkeys(("dense", "routed_experts", "shared_experts", "embeddings", "output"), 0)
    for t in gguf.GGUFReader(path).tensors:
        out[_class_of(t.name)] += int(t.n_bytes)
    return out


@pytest.mark.parametrize("name,arch,shared_ff", [("m", "qwen3moe", 0), ("q2", "qwen2moe", 64),
                                                  ("q8", "qwen3moe", 0), ("llama", "llama", 0)])
def test_inspect_json(models, name, arch, shared_ff):
    d = json.loads(ok("inspect", models[name], "--json").stdout)
    assert d["architecture"] == arch and d["moe"] is True
    assert (d["n_layer"], d["n_embd"], d["n_vocab"]) == (SPEC.n_layer, SPEC.n_embd, SPEC.vocab_size)
    e = d["experts"]
    assert (e["count"], e["used"], e["ff"], e["shared_ff"]) == (SPEC.n_expert, SPEC.n_used, SPEC.n_ff_exp, shared_ff)
    reader = gguf.GGUFReader(models[name])
    assert d["tensors"] == len(reader.tensors)
    want = _bytes_by_class(models[name])
    assert d["bytes"] == want
    assert d["total_bytes"] == sum(d["bytes"].values()) == sum(int(t.n_bytes) for t in reader.tensors)
    # routed experts from the spec alone: gate, up and down of every expert of every layer
    per_expert = 3 * SPEC.n_ff_exp * SPEC.n_embd * (4 if name != "q8" else 34 / 32)
    assert d["bytes"]["routed_experts"] == SPEC.n_layer * SPEC.n_expert * per_expert
    assert e["bytes_per_expert"] == per_expert and e["bytes_per_layer"] == SPEC.n_expert * per_expert
    assert e["bytes_by_layer"] == {str(i): SPEC.n_expert * per_expert for i in range(SPEC.n_layer)}
    if name == "q2":
        # a shared expert (gate, up, down) plus its sigmoid gate vector, per layer
        assert d["bytes"]["shared_experts"] == SPEC.n_layer * 4 * (3 * 64 * SPEC.n_embd + SPEC.n_embd) > 0
    else:
        assert d["bytes"]["shared_experts"] == 0
    if name == "q8":
        assert d["types"]["routed_experts"] == {"Q8_0": 3 * SPEC.n_layer}
        assert d["types"]["dense"]["F32"] > 0  # norms and routers stay F32


def test_inspect_text(models):
    text = ok("inspect", models["q2"]).stdout
    assert "qwen2moe" in text and "MoE: 8 experts, 2 used per token" in text and "shared expert ff 64" in text
    assert f"{len(gguf.GGUFReader(models['q2']).tensors)} tensors" in text
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith("    ")}  # one per class
    assert set(lines) == {"dense", "routed_experts", "shared_experts", "embeddings", "output"}
    by = _bytes_by_class(models["q2"])
    for c, ln in lines.items():
        assert format_bytes(by[c]) in ln
    assert "shared_experts" not in ok("inspect", models["m"]).stdout


def test_inspect_dense_model_is_not_moe(models):
    d = json.loads(ok("inspect", models["dense"], "--json").stdout)
    assert d["moe"] is False and "experts" not in d and d["bytes"]["routed_experts"] == 0
    assert "not a MoE model" in ok("inspect", models["dense"]).stdout


@pytest.mark.parametrize("which,expect", [("junk", ["not a readable GGUF"]), ("missing", ["does not exist"])])
def test_inspect_bad_file(models, which, expect):
    path = models["junk"] if which == "junk" else str(Path(models["m"]).with_name("nope.gguf"))
    user_error("inspect", path, expect=expect)
    user_error("inspect", path, "--json", expect=expect)


# ---------------------------------------------------------------------------------------------------------------
# bench, demo, options
# ---------------------------------------------------------------------------------------------------------------

def test_bench_json(models, tokenizer):
    r = ok("bench", models["m"], "--a", "n_threads=1", "--b", "n_threads=1 disk_experts=1 expert_cache_slots=4",
           "--runs", 1, "-n", 2, "-p", 12, "--json")
    d = json.loads(r.stdout)
    assert (d["runs"], d["n_predict"]) == (1, 2)
    assert d["prompt_tokens"] == 12
    A, B = d["sides"]["A"], d["sides"]["B"]
    assert A["options"] == ["n_threads=1"]
    assert sorted(B["options"]) == ["disk_experts=true", "expert_cache_slots=4", "n_threads=1"]
    for s in (A, B):
        for k in ("prompt_tps", "decode_tps", "decode_tps_median", "decode_tps_first", "decode_tps_second"):
            assert isinstance(s[k], float) and s[k] > 0, k
        for k in ("prompt_tps_stddev", "decode_tps_stddev"):
            assert isinstance(s[k], float) and s[k] >= 0, k
    assert d["ratio_decode_b_over_a"] == pytest.approx(B["decode_tps"] / A["decode_tps"])
    assert d["ratio_prompt_b_over_a"] == pytest.approx(B["prompt_tps"] / A["prompt_tps"])


def test_bench_text_table(models):
    text = ok("bench", models["m"], "--a", "n_threads=1", "--b", "n_threads=1,expert_cache_slots=2,disk_experts=1",
              "--runs", 1, "-n", 2, "-p", 8).stdout
    assert "ratio B/A: decode" in text
    rows = [ln for ln in text.splitlines() if ln.startswith(("A ", "B "))]
    assert len(rows) == 2 and rows[0].rstrip().endswith("n_threads=1") and "disk_experts=true" in rows[1]


def test_bench_with_config(config):
    d = json.loads(ok("bench", "main", "--config", config, "--b", "moe_cpu_share=0 expert_cache_slots=8", "--runs", 1,
                      "-n", 2, "-p", 8, "--json").stdout)
    # the config's options (role main) are both sides' base; --b overrides two of them
    assert sorted(d["sides"]["A"]["options"]) == ["disk_experts=true", "expert_cache_slots=2", "moe_cpu_share=0.5"]
    assert sorted(d["sides"]["B"]["options"]) == ["disk_experts=true", "expert_cache_slots=8"]


def test_bench_errors(models):
    user_error("bench", models["m"], "--a", "n_threads=x", "--runs", 1, "-n", 2, expect=["n_threads"])
    user_error("bench", models["m"], "--b", "disk_experts=1", "--runs", 1, "-n", 2, expect=["expert_cache_slots"])
    user_error("bench", models["m"], "--runs", 0)


def test_demo_json():
    d = json.loads(ok("demo", "--json", "-t", 1, "-n", 4).stdout)
    assert d["all_identical"] is True and d["same_text"] is True and len(d["rows"]) == 4
    assert all(r["identical_logits"] is True for r in d["rows"])
    resident, cache, half, auto = d["rows"]
    assert resident["misses"] == resident["cpu_misses"] == 0 and not resident["hybrid_offload_active"]
    assert cache["misses"] > 0 and cache["cpu_misses"] == 0 and not cache["hybrid_offload_active"]
    assert half["cpu_misses"] > 0 and half["hybrid_offload_active"] is True and half["share_applied"] > 0


def test_demo_text():
    out = ok("demo", "-t", 1, "-n", 2).stdout
    assert "parity: every configuration's logits are bit-identical to the resident run" in out
    assert sum(ln.rstrip().endswith("identical") for ln in out.splitlines()) == 4


def test_options_lists_every_field():
    fields = dataclasses.fields(SessionOptions)
    lines = ok("options").stdout.splitlines()
    assert [ln.split(" (", 1)[0] for ln in lines] == [f.name for f in fields]
    rows = json.loads(ok("options", "--json").stdout)
    assert [r["name"] for r in rows] == [f.name for f in fields]
    assert [r["default"] for r in rows] == [f.default for f in fields]


def test_version_and_help():
    assert "ggml-hybrid" in ok("--version").stdout
    out = ok("--help").stdout
    for cmd in ("run", "inspect", "bench", "demo", "options"):
        assert cmd in out


# ---------------------------------------------------------------------------------------------------------------
# user errors: exit status 2, one line on stderr, no traceback
# ---------------------------------------------------------------------------------------------------------------

def test_error_missing_model_file(models):
    user_error("run", str(Path(models["m"]).with_name("missing.gguf")), "--prompt", "hi", expect=["does not exist"])


def test_error_not_a_gguf_file(models):
    user_error("run", models["junk"], "--prompt", "hi", expect=["not a readable GGUF"])


def test_error_unsupported_architecture(models):
    user_error("run", models["gpt2"], "--prompt", "hi", "-t", 1, expect=["'gpt2'", "not supported"])


@pytest.mark.parametrize("which", ["dense", "zero_experts"])
def test_error_dense_model(models, which):
    user_error("run", models[which], "--prompt", "hi", "-t", 1, expect=["MoE"])


@pytest.mark.parametrize("args,expect", [
    (["-o", "expert_cache_slot=2"], ["unknown option", "did you mean 'expert_cache_slots'"]),
    (["-o", "n_thread=2"], ["did you mean 'n_threads'"]),
    (["-o", "disk_experts"], ["missing '='"]),
    (["-o", "n_threads=abc"], ["n_threads=abc"]),
    (["-o", "expert_eviction=fifo"], ["expert_eviction"]),
    (["--moe-cpu-share", "2"], ["moe_cpu_share"]),
    (["--moe-cpu-share", "half"], ["moe_cpu_share"]),
    (["--moe-cpu-share", "0.5"], ["disk_experts"]),           # a CPU share needs the expert cache
    (["-o", "expert_cache_slots=9"], ["only 8 experts"]),
    (["-o", "disk_experts=1"], ["expert_cache_slots"]),        # disk experts need a slot
    (["-t", "99"], ["n_threads=99", "x the cores"]),
    (["-n", "-2"], ["-n"]),
    (["--temp", "-1"], ["--temp"]),
    (["--top-p", "0"], ["--top-p"]),
    (["--promt", "x"], ["--promt"]),
])
def test_error_bad_options(models, args, expect):
    user_error("run", models["m"], "--tokens", "1,2", *args, expect=expect)


@pytest.mark.parametrize("tokens,expect", [
    ("1,x", ["--tokens", "not a comma-separated list of integers"]),
    ("1.5", ["--tokens"]),
    (",,", ["no token ids"]),
    ("384", ["token id 384", "0..383"]),
    ("5,-1", ["token id -1"]),
    ("99999999999999999999999", ["outside the vocabulary"]),
])
def test_error_bad_tokens(models, tokens, expect):
    user_error("run", models["m"], "--tokens", tokens, "-t", 1, expect=expect)


@pytest.mark.parametrize("args", [[], ["--prompt", "hi", "--tokens", "1"], ["-p", "hi", "-f", "x.txt"]])
def test_error_prompt_and_tokens_both_or_neither(models, args):
    user_error("run", models["m"], *args, expect=["exactly one of -p/--prompt, -f/--file and --tokens"])


def test_error_empty_prompt(models):
    user_error("run", models["m"], "--prompt", "", "-t", 1, expect=["--prompt"])


def test_error_unknown_command_and_missing_argument():
    user_error("frobnicate", expect=["No such command"])
    user_error("inpsect", "x.gguf", expect=["Did you mean 'inspect'"])
    user_error("run", expect=["MODEL", "-m/--model"])


def test_error_prompt_longer_than_the_context(models):
    user_error("run", models["m"], "--tokens", "1,2,3,4,5", "-o", "n_ctx=4", "-t", 1, expect=["n_ctx=4"])


def test_error_logits_out_in_a_missing_folder(models, tmp_path):
    user_error("run", models["m"], "--tokens", "1", "-n", 1, "-t", 1, "--logits-out", tmp_path / "no" / "x.npy")


def test_context_stop(models):
    d = run_json(models["m"], "--tokens", "1,2", "-o", "n_ctx=4", "-n", 5, "--ignore-eos", "-t", 1)
    assert d["stop_reason"] == "context" and d["generated_tokens"] == 3  # positions 2, 3 evaluated, then full


def test_config_unquoted_role_key_is_a_role_scope(models, tmp_path):
    from ggml_hybrid.server.config import load_config

    p = tmp_path / "nested.toml"
    p.write_text(f'[models.a]\npath = "{models["m"]}"\nrole = "main"\n[models.a.session_options]\n'
                 'disk_experts = true\nexpert_cache_slots = 2\nmain.moe_cpu_share = 0.25\ndraft.n_threads = 3\n')
    entry = load_config(p)["a"]
    assert entry.options.moe_cpu_share == 0.25 and entry.options.n_threads is None
