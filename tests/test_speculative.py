"""Speculative decoding: greedy with speculation is greedy without it, token for token and logit for logit, on every
family with a draft head and in every expert mode, with the head's drafts and with replayed drafts kept at every rate;
verify steps are sequential decode steps bit for bit; the rejection rule keeps the target's distribution; the head's
cache follows the sequence; bad requests are refused in one error."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import rewrite_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from ggml_hybrid.errors import ArgumentError, ModelFileError, OptionError
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.generate import complete
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.runtime.sampling import Sampler
from ggml_hybrid.runtime.speculative import ReplayDrafts, Speculator, accept_drafts, draft_choice
from ggml_hybrid.synthetic import write_model

# the families whose pinned llama.cpp runs a next-token-prediction head, as small generated models with one
SPECS = {
    "glm4moe": dict(arch="glm4moe", n_layer=2, n_rot=16, n_dense_lead=1, qk_norm=True),
    "deepseek2": dict(arch="deepseek2", n_layer=2, weight_type="q8_0", n_embd=64),
    "qwen3next": dict(arch="qwen3next", n_layer=2, n_rot=8, attn_interval=2),
    "qwen35moe": dict(arch="qwen35moe", n_layer=2, n_rot=8, attn_interval=2, weight_type="q8_0"),
}
MODES = {
    "resident": {},
    "cache": dict(disk_experts=True, expert_cache_slots=3),
    "share_0.5": dict(disk_experts=True, expert_cache_slots=3, moe_cpu_share=0.5),
    "share_auto": dict(disk_experts=True, expert_cache_slots=3, moe_cpu_share="auto"),
    "host_tier": dict(disk_experts=True, expert_cache_slots=3, host_tier_bytes=8 << 20),
    "python_executor": dict(disk_experts=True, expert_cache_slots=3, moe_cpu_share=0.5, moe_executor="python"),
    "prefetch_tier": dict(disk_experts=True, expert_cache_slots=3, host_tier_bytes=8 << 20, moe_prefetch=True),
}
N = 24  # tokens generated per run


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    return {name: write_model(d / f"{name}.gguf", seed=5, nextn=1, **spec) for name, spec in SPECS.items()}


def _opts(**kw) -> SessionOptions:
    return SessionOptions(n_threads=1, n_ctx=256, **kw)


def _plain(path: str, mode: dict) -> tuple[list[int], list[int], np.ndarray]:
    with MoEModel(path, _opts(**mode)) as m:
        prompt = m.tokenizer.encode("The cache runs the hits first, then the misses.")
        _, st_ = complete(m, prompt, N, Sampler(), keep_logits=True, stop_at_eos=False)
        return prompt, st_.tokens, st_.all_logits()


@pytest.fixture(scope="module")
def plain(models):
    """Each family's plain greedy run, resident (every mode is bit-identical to it: tests/test_recurrent_families.py
    and the converted fixtures)."""
    return {name: _plain(path, {}) for name, path in models.items()}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("family", sorted(SPECS))
def test_greedy_with_speculation_is_greedy_without(models, plain, family, mode):
    prompt, want, want_logits = plain[family]
    kw = MODES[mode]
    with MoEModel(models[family], _opts(spec_type="draft-mtp", draft_max=3, **kw)) as m:
        _, st_ = complete(m, prompt, N, Sampler(), keep_logits=True, stop_at_eos=False)
        assert st_.tokens == want
        assert np.array_equal(st_.all_logits(), want_logits)
        assert st_.spec is not None and st_.spec.verify_steps > 0 and st_.spec.draft_steps > 0
        assert not st_.benchmark_only
        if mode != "resident":
            head = m.experts.counters[m.model.head_layer]  # the head's experts go through the cache like any layer's
            assert head.calls > 0
    with MoEModel(models[family], _opts(spec_type="replay", draft_max=4, **kw)) as m:
        for accept in (0.0, 0.5, 1.0):
            sp = Speculator(m, ReplayDrafts(prompt + want, accept=accept, seed=3), backoff=False)
            _, st_ = complete(m, prompt, N, Sampler(), keep_logits=True, stop_at_eos=False, speculator=sp)
            assert st_.tokens == want, accept
            assert np.array_equal(st_.all_logits(), want_logits), accept
            assert st_.benchmark_only and st_.spec is not None
            if accept == 0.0:
                assert st_.spec.accepted == 0 and st_.spec.drafted > 0
            elif accept == 1.0:
                assert st_.spec.accepted == st_.spec.drafted > 0 and st_.spec.verify_steps < N // 2
            else:
                assert 0 < st_.spec.accepted < st_.spec.drafted


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
          deadline=None)
@given(family=st.sampled_from(sorted(SPECS)), mode=st.sampled_from(sorted(MODES)), k=st.integers(1, 6),
       pattern=st.lists(st.booleans(), min_size=1, max_size=9), backoff=st.booleans())
def test_any_draft_length_and_acceptance_pattern(models, plain, family, mode, k, pattern, backoff):
    prompt, want, want_logits = plain[family]
    with MoEModel(models[family], _opts(spec_type="replay", draft_max=k, **MODES[mode])) as m:
        sp = Speculator(m, ReplayDrafts(prompt + want, pattern=pattern), backoff=backoff)
        _, st_ = complete(m, prompt, N, Sampler(), keep_logits=True, stop_at_eos=False, speculator=sp)
    assert st_.tokens == want
    assert np.array_equal(st_.all_logits(), want_logits)
    assert st_.spec is not None and st_.spec.accepted <= st_.spec.drafted


@pytest.mark.parametrize("family", sorted(SPECS))
def test_verify_rows_are_decode_steps(models, family):
    """Several sequences' verify rows in one step: each row bit-identical to its own decode step (a recurrent
    model's states chained per token), and accept() keeps exactly the first tokens."""
    path = models[family]
    rng = np.random.default_rng(7)
    with MoEModel(path, _opts(n_parallel=2, spec_type="replay", draft_max=4)) as m:
        toks = [list(rng.integers(0, m.hp.n_vocab, 12)) for _ in range(2)]
        ref = []
        for s in range(2):
            m.eval(toks[s][:7], seq=s)
            ref.append(np.concatenate([m.eval([t], seq=s) for t in toks[s][7:12]]))
            m.reset(s)
        for s in range(2):
            m.eval(toks[s][:7], seq=s)
        rows = m.verify([(1, toks[1][7:10]), (0, toks[0][7:12])])
        assert np.array_equal(rows[0], ref[1][:3]) and np.array_equal(rows[1], ref[0])
        with pytest.raises(ArgumentError, match="waiting for accept"):
            m.eval([1], seq=0)
        m.accept(0, 2)
        m.accept(1, 0)
        assert m.position(0) == 9 and m.position(1) == 7
        # each goes on exactly as if only the kept tokens had been evaluated
        assert np.array_equal(m.eval([toks[0][9]], seq=0), ref[0][2:3])
        assert np.array_equal(m.eval([toks[1][7]], seq=1), ref[1][0:1])


def test_rejection_rule_keeps_the_target_distribution():
    """The emitted token of a step is distributed as the target's sampler distribution, whatever the drafts' (a
    chi-square test over 20,000 steps on a 6-token vocabulary; seeded), for drafts drawn from a distribution q and for
    deterministic ones; and given the first draft kept, the second emitted token follows the second row."""
    rows = np.log(np.array([[0.05, 0.4, 0.1, 0.25, 0.15, 0.05],
                            [0.3, 0.05, 0.05, 0.2, 0.1, 0.3],
                            [0.1, 0.1, 0.5, 0.1, 0.1, 0.1]]))
    p0, p1 = np.exp(rows[0]), np.exp(rows[1])
    q = np.array([[0.3, 0.1, 0.3, 0.05, 0.05, 0.2], [0.1, 0.1, 0.4, 0.1, 0.2, 0.1]])
    sampler = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    draws = np.random.default_rng(12)
    for source in ("q", "deterministic"):
        first, second = np.zeros(6), np.zeros(6)
        for _ in range(20000):
            if source == "q":
                drafts = [int(draws.choice(6, p=q[0])), int(draws.choice(6, p=q[1]))]
                out = accept_drafts(sampler, rows, drafts, q=q)
            else:
                drafts = [1, 0]
                out = accept_drafts(sampler, rows, drafts)
            first[out[0]] += 1
            if out[0] == drafts[0]:
                second[out[1]] += 1
            sampler.reset()
        assert stats.chisquare(first, first.sum() * p0).pvalue > 1e-3, (source, first)
        assert stats.chisquare(second, second.sum() * p1).pvalue > 1e-3, (source, second)


def test_greedy_rule_keeps_argmax_drafts_only():
    rows = np.array([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    s = Sampler()
    assert accept_drafts(s, rows, [1, 0]) == [1, 0, 2]     # both kept, then the last row's argmax
    assert accept_drafts(s, rows, [1, 2]) == [1, 0]        # the second draft is not the argmax: corrected
    assert accept_drafts(s, rows, [2, 0]) == [1]
    assert accept_drafts(s, rows, [1, 0], stop={0}) == [1, 0]  # an end-of-generation draft ends the step
    with pytest.raises(ArgumentError, match="one more"):
        accept_drafts(s, rows, [1, 0, 2])


def test_draft_choice_is_llama_cpps_top10_greedy():
    z = np.array([5.0, 1.0, 4.0] + [0.0] * 20)
    tok, p = draft_choice(z)
    top = np.sort(z)[::-1][:10]
    assert tok == 0 and p == pytest.approx(1 / np.exp(top - 5.0).sum())


@pytest.mark.parametrize("family", ["deepseek2", "qwen35moe", "qwen3next"])  # two MoE layers: one lookahead link
def test_lookahead_predicts_every_row_of_a_verify_step(models, plain, family):
    """With moe_prefetch a verify step's first MoE layer predicts the next one's experts for every row, the drafts'
    included: each verify call's prediction is scored against the distinct experts of all its rows, and the tokens
    stay plain's."""
    prompt, want, _ = plain[family]
    opts = _opts(spec_type="replay", draft_max=3, **MODES["prefetch_tier"])
    with MoEModel(models[family], opts) as m:
        m.eval(prompt)  # the prompt alone: more tokens than a lookahead takes
        moe = [i for i, c in enumerate(m.experts.counters) if c is not None and i != m.model.head_layer]
        prompt_distinct = m.experts.counters[moe[1]].distinct
    with MoEModel(models[family], opts) as m:
        sp = Speculator(m, ReplayDrafts(prompt + want, accept=1.0), backoff=False)
        _, st_ = complete(m, prompt, N, Sampler(), stop_at_eos=False, speculator=sp)
        assert st_.tokens == want
        nxt = m.experts.counters[moe[1]]
        assert st_.spec is not None and nxt.calls == 1 + st_.spec.verify_steps  # the prompt, then verify steps
        assert nxt.predicted_of == nxt.distinct - prompt_distinct > 0
        if family != "deepseek2":  # the generated deepseek2 routes every token to the same two experts
            # more than one token's experts a call: the drafts' rows were predicted too
            assert nxt.predicted_of > m.hp.n_used * st_.spec.verify_steps


def test_p_min_stops_the_draft_and_backoff_pauses_it(models, plain):
    prompt, want, _ = plain["qwen35moe"]
    with MoEModel(models["qwen35moe"], _opts(spec_type="draft-mtp", draft_max=3, draft_p_min=1.0)) as m:
        sp = Speculator(m, backoff=False)
        _, st_ = complete(m, prompt, N, Sampler(), stop_at_eos=False, speculator=sp)
        assert st_.tokens == want
        assert st_.spec is not None and st_.spec.drafted == 0 and st_.spec.draft_steps > 0
        sp = Speculator(m, backoff=True)
        _, st2 = complete(m, prompt, N, Sampler(), stop_at_eos=False, speculator=sp)
        assert st2.tokens == want
        # paused after two empty drafts: 2, then 4, 8 tokens without the head
        assert st2.spec is not None and st2.spec.draft_steps < st_.spec.draft_steps // 2


def test_head_cache_follows_the_sequence(models, plain):
    """A truncated, restored or moved sequence's head state follows it, and a reset one starts clean: generation
    from it is the plain one."""
    prompt, want, _ = plain["glm4moe"]
    with MoEModel(models["glm4moe"], _opts(n_parallel=2, spec_type="draft-mtp")) as m:
        m.eval(prompt[:5])
        cp = m.checkpoint()
        m.eval(prompt[5:])
        assert m.head is not None and m.head.n[0] == len(prompt)
        m.restore(cp)
        assert m.head.n[0] == 5
        m.truncate(3)
        assert m.head.n[0] == 3
        m.move(0, 1)
        assert m.head.n[1] == 3 and m.head.n[0] == 0
        m.reset()
        _, st_ = complete(m, prompt, N, Sampler(), stop_at_eos=False)
        assert st_.tokens == want


def test_models_without_a_head_are_refused(tmp_path):
    no_head = write_model(tmp_path / "glm.gguf", arch="glm4moe", n_layer=2, n_dense_lead=1)
    with pytest.raises(ModelFileError, match="no next-token-prediction .MTP. head"):
        MoEModel(no_head, _opts(spec_type="draft-mtp"))
    other = write_model(tmp_path / "q3.gguf", arch="qwen3moe", n_layer=2)
    with pytest.raises(ModelFileError, match="qwen3moe has no next-token-prediction"):
        MoEModel(other, _opts(spec_type="draft-mtp"))
    with MoEModel(no_head, _opts(spec_type="replay")) as m:  # replayed drafts need no head
        with pytest.raises(ArgumentError, match="needs a draft source"):
            Speculator(m)


def test_a_head_with_missing_or_truncated_tensors_is_refused(models, tmp_path):
    import gguf

    src = models["glm4moe"]
    missing = str(tmp_path / "missing.gguf")
    rewrite_gguf(src, missing, drop_tensors={"blk.2.nextn.eh_proj.weight"})
    with MoEModel(missing, _opts()) as m:  # the trunk runs without the head
        assert m.head is None
    with pytest.raises(ModelFileError, match=r"blk\.2\.nextn\.eh_proj\.weight.*draft-mtp runs"):
        MoEModel(missing, _opts(spec_type="draft-mtp"))
    # the head's tensors moved to the end of the file, and the file cut inside the last one: refused at open,
    # naming it (as llama.cpp's loader checks every tensor's bytes against the file)
    head = {t.name: np.array(t.data) for t in gguf.GGUFReader(src).tensors if t.name.startswith("blk.2.nextn.")}
    last = str(tmp_path / "last.gguf")
    rewrite_gguf(src, last, drop_tensors=set(head), tensors=head)
    cut = str(tmp_path / "cut.gguf")
    with open(last, "rb") as f:
        data = f.read()
    with open(cut, "wb") as f:
        f.write(data[:len(data) - 100])
    with pytest.raises(ModelFileError, match=r"tensor 'blk\.2\.nextn\.shared_head_norm\.weight'.*truncated"):
        MoEModel(cut, _opts(spec_type="draft-mtp"))


@pytest.mark.parametrize("items, match", [
    (["draft_max=0"], r"draft_max=0: must be an integer in 1\.\.64"),
    (["draft_max=10000"], r"draft_max=10000: must be an integer in 1\.\.64"),
    (["draft_min=4", "draft_max=2"], "draft_min=4: must not exceed draft_max=2"),
    (["draft_p_min=1.5"], r"draft_p_min=1.5: must be a number in \[0, 1\]"),
    (["spec_type=ngram"], "spec_type=ngram: must be one of 'none', 'draft-mtp', 'replay'"),
])
def test_bad_speculation_options_are_refused(items, match):
    with pytest.raises(OptionError, match=match):
        SessionOptions.parse(items)


def test_verify_refuses_what_it_cannot_do(models):
    with MoEModel(models["glm4moe"], _opts()) as m:
        with pytest.raises(ArgumentError, match="without speculative decoding"):
            m.verify([(0, [1, 2])])
    with MoEModel(models["glm4moe"], _opts(spec_type="replay", draft_max=2)) as m:
        with pytest.raises(ArgumentError, match=r"takes 1\.\.3"):
            m.verify([(0, [1, 2, 3, 4])])
        with pytest.raises(ArgumentError, match="no verify step waiting"):
            m.accept(0, 1)
        m.verify([(0, [1, 2])])
        with pytest.raises(Exception, match="n_keep"):
            m.accept(0, 3)
        m.accept(0, 2)
        assert m.position() == 2


def test_offload_rule_counts_the_head_block_loaded_or_not():
    """llama.cpp's -ngl counts every block of the file (llama-model.cpp: ``i_gpu_start = n_layer_all + 1 -
    n_gpu_layers``), the next-token-prediction block too: -ngl 2 on a 2-layer file with a head offloads the output
    and the head's block, not the last layer."""
    from ggml_hybrid.placement.layout import plan_layout

    names = ["token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.1.attn_q.weight", "blk.2.attn_q.weight"]
    opts = SessionOptions(n_gpu_layers=2)
    lay = plan_layout(names[:4], 2, opts, ["DEV0"], False, n_blocks=3)  # the head's block not loaded
    assert lay.layer_device == ("CPU", "CPU") and lay.output_device == "DEV0"
    with_head = plan_layout(names, 3, opts, ["DEV0"], False, n_blocks=3)
    assert with_head.layer_device == ("CPU", "CPU", "DEV0") and with_head.tensors["blk.2.attn_q.weight"] == "DEV0"
    assert plan_layout(names[:4], 2, opts, ["DEV0"], False).layer_device == ("CPU", "DEV0")  # a file without one


def _engine_run(m: MoEModel, prompts: list[str], temp: float = 0.0, max_tokens: int = 12, **kw):
    from ggml_hybrid.runtime.engine import Engine, Request

    e = Engine(m)
    try:
        reqs = [e.submit(Request(m.tokenizer.encode(p), Sampler(temperature=temp, seed=i), max_tokens, **kw))
                for i, p in enumerate(prompts)]
        for r in reqs:
            assert r.done.wait(120)
        return reqs, e.stats
    finally:
        e.close()


PROMPTS = ["The cache runs the hits first", "a", "Once upon a time in a land far away there lived a", "misses",
           "then the", "CPU share of"]


@pytest.mark.parametrize("backoff", [False, True])
@pytest.mark.parametrize("family", ["glm4moe", "qwen35moe"])
def test_every_concurrent_sequence_speculates_and_keeps_its_tokens(models, family, backoff):
    """The server's engine: six requests over three slots, each speculating with the head in shared verify steps
    (with the backoff: some paused or probing while others draft), give the tokens of plain decoding one at a time;
    the step's counters and each request's are kept."""
    path = models[family]
    with MoEModel(path, _opts(ubatch_size=8)) as m:
        want, _ = _engine_run(m, PROMPTS)
    with MoEModel(path, _opts(ubatch_size=8, n_parallel=3, spec_type="draft-mtp", draft_backoff=backoff)) as m:
        got, stats = _engine_run(m, PROMPTS)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert stats.spec is not None and stats.spec.verify_steps > 0 and stats.spec.drafted == \
        sum(r.n_drafted for r in got)
    assert stats.spec.accepted == sum(r.n_accepted for r in got)


class _EvenTokens:
    """A test double of a grammar's constraint: only even token ids, done after four tokens."""

    def __init__(self) -> None:
        self.n = 0

    def mask(self, logits):
        out = np.array(logits, copy=True)
        out[1::2] = -np.inf
        return out

    def accept(self, tok: int) -> None:
        assert tok % 2 == 0
        self.n += 1

    @property
    def done(self) -> bool:
        return self.n >= 4


def test_constrained_requests_draft_nothing_and_keep_their_mask(models):
    path = models["glm4moe"]
    with MoEModel(path, _opts(ubatch_size=8, n_parallel=2, spec_type="draft-mtp", draft_backoff=False)) as m:
        from ggml_hybrid.runtime.engine import Engine, Request

        e = Engine(m)
        try:
            free = e.submit(Request(m.tokenizer.encode(PROMPTS[0]), Sampler(), 10))
            masked = e.submit(Request(m.tokenizer.encode(PROMPTS[1]), Sampler(), 10, constraint=_EvenTokens()))
            assert free.done.wait(120) and masked.done.wait(120)
        finally:
            e.close()
    assert masked.n_drafted == 0 and len(masked.tokens) == 4 and all(t % 2 == 0 for t in masked.tokens)
    assert free.n_drafted > 0


def test_seeded_sampling_with_speculation_runs_to_its_limits(models):
    with MoEModel(models["qwen3next"], _opts(ubatch_size=8, n_parallel=2, spec_type="draft-mtp")) as m:
        got, stats = _engine_run(m, PROMPTS[:4], temp=0.9, max_tokens=9)
    assert all(r.finish_reason in ("length", "stop") and len(r.tokens) <= 9 for r in got)
    assert all(len(r.tokens) == 9 for r in got if r.finish_reason == "length")


def test_serve_reports_speculation_in_timings_and_metrics(models, tmp_path):
    """``serve --spec-type draft-mtp``: a completion's ``timings`` carry llama-server's ``draft_n`` and
    ``draft_n_accepted``, ``/metrics`` the counters, and the text is the plain server's."""
    from test_server import Server, post, scrape

    body = '{"model": "qwen35moe", "prompt": "The cache runs the hits first", "max_tokens": 16, "temperature": 0}'
    args = [models["qwen35moe"], "-t", "1", "-c", "128", "-np", "2"]
    with Server(args) as plain:
        status, want = post(plain.url + "/v1/completions", body)
        assert status == 200
        plain.stop()
    with Server(args + ["--spec-type", "draft-mtp", "--draft-max", "2", "-o", "draft_backoff=false"]) as srv:
        status, got = post(srv.url + "/v1/completions", body)
        assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"]
        t = got["timings"]
        assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
        m = scrape(srv.url)
        model = (("model", got["model"]),)
        assert m[("ggml_hybrid_speculative_drafted_tokens_total", model)] == t["draft_n"]
        assert m[("ggml_hybrid_speculative_accepted_tokens_total", model)] == t["draft_n_accepted"]
        assert m[("ggml_hybrid_speculative_verify_steps_total", model)] > 0
        rc, _ = srv.stop()
        assert rc == 0
    assert "draft_n" not in want["timings"]


def test_serve_refuses_replay_and_a_model_without_a_head(tmp_path):
    from click.testing import CliRunner

    from ggml_hybrid.cli import main

    path = write_model(tmp_path / "q3.gguf", arch="qwen3moe", n_layer=2)
    r = CliRunner().invoke(main, ["serve", path, "--spec-type", "draft-mtp"])
    assert r.exit_code != 0 and r.output.count("error:") == 1 and "no next-token-prediction" in r.output
    r = CliRunner().invoke(main, ["serve", path, "-o", "spec_type=replay"])
    assert r.exit_code != 0 and "replayed drafts are for benchmarks" in r.output


def _cli(*args: str):
    from click.testing import CliRunner

    from ggml_hybrid.cli import main

    r = CliRunner().invoke(main, list(args))
    return r, (json.loads(r.stdout) if r.exit_code == 0 and "--json" in args else None)


def test_run_speculates_and_replays_with_the_plain_tokens(models, tmp_path):
    path = models["qwen35moe"]
    common = ["run", path, "-p", "The cache runs", "-n", "20", "--temp", "0", "--ignore-eos", "-t", "1", "--json"]
    r, plain = _cli(*common)
    assert r.exit_code == 0, r.output
    assert plain["speculative"] is None
    r, mtp = _cli(*common, "--spec-type", "draft-mtp", "--draft-max", "2")
    assert r.exit_code == 0, r.output
    assert mtp["tokens"] == plain["tokens"]
    sp = mtp["speculative"]
    assert sp["type"] == "draft-mtp" and sp["draft_max"] == 2 and sp["verify_steps"] > 0 and not sp["benchmark_only"]
    report = tmp_path / "plain.json"
    report.write_text(json.dumps(plain))  # a plain run's --json report
    r, rep = _cli(*common, "--draft-replay", str(report), "--draft-accept", "1")
    assert r.exit_code == 0, r.output
    assert rep["tokens"] == plain["tokens"]
    assert rep["speculative"]["benchmark_only"] and rep["speculative"]["acceptance_rate"] == 1.0
    text, _ = _cli(*common[:-1], "--draft-replay", str(report))
    assert text.exit_code == 0 and "BENCHMARK ONLY: drafts replayed" in text.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--spec-type", "draft-mtp", "--draft-max", "0"], "0 is not in the range 1<=x<=64"),
    (["--spec-type", "draft-mtp", "--draft-max", "10000"], "10000 is not in the range 1<=x<=64"),
    (["--spec-type", "ngram-simple"], "--spec-type ngram-simple is not supported by ggml-hybrid"),
    (["--spec-type", "mtp"], "--spec-type 'mtp': not a speculative decoding type"),
    (["--draft-accept", "0.5"], "--draft-accept needs --draft-replay"),
])
def test_run_refuses_bad_speculation_flags_in_one_line(models, args, fragment):
    r, _ = _cli("run", models["glm4moe"], "-p", "hi", "-n", "2", *args)
    assert r.exit_code != 0 and fragment in r.output
    assert r.output.count("error:") == 1 and "Traceback" not in r.output


def test_run_refuses_draft_mtp_without_a_head_in_one_line(tmp_path):
    path = write_model(tmp_path / "q3.gguf", arch="qwen3moe", n_layer=2)
    r, _ = _cli("run", path, "-p", "hi", "-n", "2", "--spec-type", "draft-mtp")
    assert r.exit_code != 0 and r.output.count("error:") == 1 and "no next-token-prediction (MTP) head" in r.output


def test_bench_times_speculation_and_marks_replay_benchmark_only(models):
    r, rows = _cli("bench", models["glm4moe"], "-p", "0", "-n", "12", "-r", "1", "-t", "1", "--draft-accept",
                   "0,1", "--json")
    assert r.exit_code == 0, r.output
    assert [x["mode"] for x in rows] == ["greedy", "replay 0", "replay 1"]
    assert all(x["speculative"]["benchmark_only"] for x in rows[1:])
    assert rows[1]["speculative"]["accepted"] == 0 and rows[2]["speculative"]["acceptance_rate"] == 1.0
    r, rows = _cli("bench", models["glm4moe"], "-p", "0", "-n", "12", "-r", "1", "-t", "1", "--spec-type",
                   "draft-mtp", "--json")
    assert r.exit_code == 0, r.output
    assert [x["mode"] for x in rows] == ["greedy", "draft-mtp"]
    assert not rows[1]["speculative"]["benchmark_only"] and rows[1]["speculative"]["draft_steps"] > 0


def test_backoff_pauses_grow_and_probes_draft_one_token(models, plain):
    """Drafts that are never kept: two full drafts, then pauses of 2, 4, 8 plain steps, each followed by a probe of
    one draft token; a probe that is kept restores full drafts."""
    prompt, want, _ = plain["glm4moe"]

    class Recording(ReplayDrafts):
        """Wrong drafts for the first ``wrong`` proposals, right ones after."""

        wrong = 0

        def right(self, pos: int) -> bool:
            return len(lengths) >= self.wrong

        def propose(self, model, requests, counters):
            out = super().propose(model, requests, counters)
            lengths.extend(len(d) for d in out)
            steps.append(model.position(0))
            return out

    for wrong, expect in ((N, [3, 3, 1, 1, 1]), (3, [3, 3, 1, 1, 3])):
        lengths: list[int] = []
        steps: list[int] = []
        with MoEModel(models["glm4moe"], _opts(spec_type="replay", draft_max=3)) as m:
            source = Recording(prompt + want)
            source.wrong = wrong
            _, st_ = complete(m, prompt, N, Sampler(), stop_at_eos=False, speculator=Speculator(m, source))
        assert st_.tokens == want
        assert lengths[:5] == expect
        if wrong == N:
            gaps = [b - a for a, b in zip(steps, steps[1:])]
            assert gaps == [1, 3, 5, 9]  # a verify step, then 2, 4, 8 plain steps before each probe


def test_a_conversation_refuses_speculation_in_one_line(models):
    r, _ = _cli("run", models["glm4moe"], "-cnv", "--spec-type", "draft-mtp")
    assert r.exit_code != 0 and r.output.count("error:") == 1 and "does not speculate" in r.output


def test_a_failing_sampler_fails_its_request_alone(models):
    """In a speculative step, one sequence's sampler raising fails that request; the others go on unchanged."""
    from ggml_hybrid.runtime.engine import Engine, Request

    class Broken(Sampler):
        def candidates(self, logits):
            raise RuntimeError("this sampler is broken")

    path = models["qwen35moe"]
    with MoEModel(path, _opts(ubatch_size=8)) as m:
        want, _ = _engine_run(m, PROMPTS[:2])
    with MoEModel(path, _opts(ubatch_size=8, n_parallel=3, spec_type="draft-mtp", draft_backoff=False)) as m:
        e = Engine(m)
        try:
            good = [e.submit(Request(m.tokenizer.encode(p), Sampler(), 12)) for p in PROMPTS[:2]]
            bad = e.submit(Request(m.tokenizer.encode(PROMPTS[2]), Broken(), 12))
            assert all(r.done.wait(120) for r in good + [bad])
        finally:
            e.close()
    assert bad.finish_reason == "error" and "broken" in (bad.error or "")
    assert [r.tokens for r in good] == [r.tokens for r in want]


class _WrongHead:
    """The model's head drafting (its fills and draft steps run as ever), each draft token then replaced by one the
    target never picks (``want``: the plain run's tokens by position): acceptance 0 with a real head's costs."""

    benchmark_only = False

    def __init__(self, want: list[int], n_vocab: int) -> None:
        from ggml_hybrid.runtime.speculative import HeadDrafts

        self.head, self.want, self.n_vocab = HeadDrafts(), want, n_vocab

    def propose(self, model, requests, counters):
        out = self.head.propose(model, requests, counters)
        return [[(self.want[model.position(r.seq) + 1 + i] + 1) % self.n_vocab for i in range(len(d))]
                for r, d in zip(requests, out)]


@pytest.mark.parametrize("family", ["glm4moe", "qwen35moe"])
def test_a_pause_skips_the_heads_fill_and_a_probe_verifies_nothing(models, plain, family):
    """At acceptance 0 the backoff's pauses cost the head nothing: only the two drafting steps before the first pause
    fill its cache (the prompt, then one position); the probes after each pause draft over the unfilled positions
    (hidden from their attention) and are judged by the plain step's own token, so no verify step follows them."""
    prompt, want, _ = plain[family]
    with MoEModel(models[family], _opts(spec_type="draft-mtp", draft_max=3)) as m:
        source = _WrongHead(prompt + want, m.hp.n_vocab)
        _, st_ = complete(m, prompt, N, Sampler(), stop_at_eos=False, speculator=Speculator(m, source))
        assert st_.tokens == want
        sp = st_.spec
        assert sp is not None and sp.accepted == 0
        assert sp.verify_steps == 2 and sp.filled == len(prompt) + 1
        assert sp.drafted == 2 * 3  # two drafts of 3 verified; the probes after pauses of 2, 4 and 8 tokens are not
        assert sp.draft_steps == 2 * 3 + 3
        assert m.head is not None and m.head.filled(0) == len(prompt) + 1
        assert m.head.waiting(0) == m.n_past - m.head.filled(0)  # the skipped positions wait for a fill


def _head_after(path: str, prompt: list[int], garbage: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The head at the end of ``prompt``, its first 5 positions filled and the rest evaluated by the target while
    drafting paused: (its draft logits after those positions are filled, a probe's logits before: drafted at the
    position over the unfilled cells, hidden). ``garbage``: tokens drafted into the first unfilled cells before the
    probe (a draft step's scratch, which the fill overwrites)."""
    with MoEModel(path, _opts(spec_type="draft-mtp", draft_max=3)) as m:
        head = m.head
        assert head is not None
        m.eval(prompt[:5])
        assert m.draft_fill([0]) == 5
        m.eval(prompt[5:-1])
        holes = head.waiting(0)
        assert holes > len(garbage)
        if garbage:
            m.draft_step([(0, garbage, np.ones((len(garbage), m.hp.n_embd), np.float32), 0)])
        probe, _ = m.draft_step([(0, [prompt[-1]], head.last_h[0], holes)], [holes])
        assert m.draft_fill([0]) == holes
        lg, _ = m.draft_step([(0, [prompt[-1]], head.last_h[0], 0)])
        return lg[0], probe[0]


@pytest.mark.parametrize("family", sorted(SPECS))
def test_a_head_refilled_after_a_probe_is_a_head_never_skipped(models, plain, family):
    """The head's logits once the skipped positions are filled are bit-identical to those of a head whose draft
    steps never wrote over them; and a probe's hidden cells are hidden: whatever they hold, its logits are the same,
    and they differ from the filled head's (the unfilled positions are not seen)."""
    prompt = plain[family][0]
    assert len(prompt) > 9
    never, probe = _head_after(models[family], prompt, [])
    refilled, probe_over_garbage = _head_after(models[family], prompt, [3, 4, 5])
    assert np.array_equal(refilled, never)
    assert np.array_equal(probe_over_garbage, probe)
    assert not np.array_equal(probe, never)


def test_what_waits_for_the_heads_fill_stays_bounded(models, plain):
    """A sequence whose probes keep failing never fills for real: once an ubatch of positions waits (a hidden row
    each), its next probe fills them first, so what waits stays below an ubatch after every probe."""
    prompt, want, _ = plain["qwen35moe"]
    ub = 4
    waiting: list[int] = []
    with MoEModel(models["qwen35moe"], _opts(spec_type="draft-mtp", draft_max=3, ubatch_size=ub)) as m:
        source = _WrongHead(prompt + want, m.hp.n_vocab)
        inner = source.propose

        def propose(model, requests, counters):
            out = inner(model, requests, counters)
            waiting.extend(model.head.waiting(r.seq) for r in requests)
            return out

        source.propose = propose  # type: ignore[method-assign]
        _, st_ = complete(m, prompt, N, Sampler(), stop_at_eos=False, speculator=Speculator(m, source))
    assert st_.tokens == want
    assert st_.spec is not None and st_.spec.verify_steps == 2 and st_.spec.filled > len(prompt) + 1
    assert len(waiting) == 5 and max(waiting) < ub  # two drafts, then probes after 2, 4 and 8 plain steps
