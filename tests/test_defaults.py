"""Defaults aligned with llama.cpp (issue 34): the same sampling defaults in ``run`` and ``serve``, ``-n -1``,
and a context above the trained one allowed with a warning."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ggml_hybrid.cli import main
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.plan.planner import plan
from ggml_hybrid.runtime.generate import complete
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.runtime.sampling import LLAMA_DEFAULTS, Sampler
from ggml_hybrid.server.protocol import DEFAULTS
from ggml_hybrid.synthetic import write_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("defaults") / "m.gguf", arch="qwen3moe", seed=4)


def test_run_and_serve_share_llama_cpp_sampling_defaults():
    # llama.cpp's common_params_sampling (common/common.h): the values written out here, not read from the code
    assert LLAMA_DEFAULTS == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
                              "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert DEFAULTS == LLAMA_DEFAULTS
    params = {p.name: p.default for p in main.commands["run"].params}
    assert params["temp"] == 0.8 and params["n_predict"] == -1  # and no seed: a random one
    for key in ("top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                "frequency_penalty"):
        assert params[key] == LLAMA_DEFAULTS[key], key


def test_run_samples_at_temperature_0_8_by_default(model):
    """Without --temp, a seeded run gives the tokens of the library's sampler at llama.cpp's defaults."""
    r = CliRunner().invoke(main, ["run", model, "-p", "Once upon", "-n", "12", "-s", "7", "-t", "1", "--json"])
    assert r.exit_code == 0, r.output
    import json

    got = json.loads(r.stdout)["tokens"]
    with MoEModel(model, SessionOptions(n_threads=1)) as m:
        ids = m.tokenizer.encode("Once upon")
        s = Sampler(**LLAMA_DEFAULTS, seed=7)  # type: ignore[arg-type]
        _, st = complete(m, ids, 12, s)
        greedy = complete(m, ids, 12, Sampler())[1].tokens
    assert got == st.tokens
    assert got != greedy  # it is not greedy decoding (a 384-token vocabulary: equal 12 draws would be a fluke)


def test_n_predict_defaults_to_until_the_end(model):
    r = CliRunner().invoke(main, ["run", model, "-p", "Hi", "-c", "24", "--ignore-eos", "--temp", "0", "-t", "1",
                                  "--json"])
    assert r.exit_code == 0, r.output
    import json

    d = json.loads(r.stdout)
    assert d["stop_reason"] == "context" and d["prompt_tokens"] + d["generated_tokens"] == 24 + 1


def test_a_context_above_the_trained_one_warns_and_runs(model):
    with MoEModel(model, SessionOptions(n_threads=1)) as m:
        trained = m.hp.n_ctx_train
    r = CliRunner().invoke(main, ["run", model, "-p", "Hi", "-n", "2", "-c", str(trained * 2), "-t", "1"])
    assert r.exit_code == 0, r.output
    assert f"warning: n_ctx={trained * 2} is above the {trained} tokens the model was trained for" in r.stderr
    p = plan(model, SessionOptions(n_ctx=trained * 2))
    assert p.kv.n_ctx == trained * 2 and any("above the" in w for w in p.warnings)
    r = CliRunner().invoke(main, ["run", model, "-p", "Hi", "-n", "2", "-t", "1"])
    assert "warning" not in r.stderr
