"""``ggml-hybrid bench`` as llama-bench (issue 34): pp/tg tests, -r -p -n, mean ± standard deviation, -o md|csv|json,
the noise warnings, and the warning for -t above the idle cores."""

from __future__ import annotations

import csv
import io
import json
import statistics

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from ggml_hybrid.cli import main
from ggml_hybrid.cli.abbench import spread_warnings
from ggml_hybrid.cli.llamabench import BenchResult, noise_warnings
from ggml_hybrid.synthetic import write_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("bench") / "m.gguf", arch="qwen3moe", seed=3)


def invoke(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def test_default_tests_are_pp512_and_tg128_as_a_markdown_table(model):
    r = invoke(model, "-t", 1, "-r", 2)
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["model", "size", "params", "backend", "threads", "test", "t/s"]
    assert set(lines[1].replace("|", "").replace(" ", "")) <= {"-", ":"}
    body = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [b[5] for b in body] == ["pp512", "tg128"]
    for b in body:
        mean, sd = b[6].split(" ± ")
        assert float(mean) > 0 and float(sd) >= 0
        assert b[4] == "1"


def test_json_figures_follow_from_the_samples(model):
    """The mean and standard deviation agree with numpy's of the tokens per second each repetition's time gives,
    and the model's size and parameters with the file's tensor table."""
    r = invoke(model, "-t", 1, "-r", 3, "-p", "16,32", "-n", "4", "-o", "json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(x["n_prompt"], x["n_gen"]) for x in rows] == [(16, 0), (32, 0), (0, 4)]
    reader = gguf.GGUFReader(model)  # the gguf package's reader: the oracle for the file's tensor table
    size = sum(int(t.n_bytes) for t in reader.tensors)
    params = sum(int(t.n_elements) for t in reader.tensors)
    for x in rows:
        n = x["n_prompt"] + x["n_gen"]
        ts = n * 1e9 / np.array(x["samples_ns"], dtype=np.float64)
        assert len(ts) == 3
        assert x["avg_ts"] == pytest.approx(ts.mean(), rel=1e-12)
        assert x["stddev_ts"] == pytest.approx(ts.std(ddof=1), rel=1e-12)
        assert x["avg_ns"] == int(np.mean(x["samples_ns"]))
        assert (x["model_size"], x["model_n_params"], x["n_threads"]) == (size, params, 1)


def test_csv_and_jsonl(model):
    r = invoke(model, "-t", 1, "-r", 2, "-p", 8, "-n", 0, "--output", "csv")
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert len(rows) == 1 and rows[0]["n_prompt"] == "8" and rows[0]["n_gen"] == "0"
    assert float(rows[0]["avg_ts"]) > 0
    r = invoke(model, "-t", 1, "-r", 2, "-p", "0", "-n", "2,3", "-o", "jsonl")
    assert r.exit_code == 0, r.output
    assert [json.loads(ln)["n_gen"] for ln in r.stdout.strip().splitlines()] == [2, 3]


@pytest.mark.parametrize("args, expect", [
    (["-p", "x"], "not a comma-separated list"),
    (["-p", "-3"], "0 or more"),
    (["-p", 0, "-n", 0], "no test to run"),
    (["-p", 100000], "does not fit the context"),
    (["-o", "md", "--json"], "choose one"),
    (["--a", "n_threads=1", "-p", "8,16"], "one prompt"),
    (["--a", "n_threads=1", "-p", 8, "-n", 4, "-o", "csv"], "md or json"),
])
def test_bad_arguments_are_one_error(model, args, expect):
    r = invoke(model, "-t", 1, "-r", 1, *args)
    assert r.exit_code == 2 and expect in r.output, r.output
    assert "Traceback" not in r.output


def test_noise_warnings():
    steady = BenchResult(512, 0, [1_000_000, 1_010_000, 990_000])
    shaky = BenchResult(0, 128, [1_000_000, 1_500_000, 700_000])
    assert noise_warnings([steady], 1, 2.0) == []
    w = noise_warnings([steady, shaky], 1, 2.0)
    assert len(w) == 1 and w[0].startswith("tg128 varies by ")
    spread = 100 * statistics.stdev(shaky.samples_ts) / statistics.fmean(shaky.samples_ts)
    assert f"{spread:.0f}%" in w[0]
    busy = noise_warnings([steady], 2, 0.4)
    assert len(busy) == 1 and "0.4 of" in busy[0] and "busy" in busy[0]


def test_an_ab_ratio_within_the_spread_is_said_to_be_noise():
    side = lambda d, sd: {"decode_tps": d, "decode_tps_stddev": sd, "prompt_tps": 100.0, "prompt_tps_stddev": 1.0}
    r = {"sides": {"A": side(100.0, 10.0), "B": side(85.0, 10.0)}, "ratio_decode_b_over_a": 0.85,
         "ratio_prompt_b_over_a": 1.0}
    w = spread_warnings(r)
    assert len(w) == 2 and w[0].startswith("decode: the ratio B/A 0.850 is within") and w[1].startswith("prompt")
    r = {"sides": {"A": side(100.0, 1.0), "B": side(85.0, 1.0)}, "ratio_decode_b_over_a": 0.85,
         "ratio_prompt_b_over_a": 1.3}
    assert spread_warnings(r) == []


def test_threads_above_the_idle_cores_warn(model, monkeypatch):
    import ggml_hybrid.machine as machine

    monkeypatch.setattr(machine, "usable_cores", lambda: 4)
    monkeypatch.setattr(machine, "idle_cores", lambda sample_s=0.2: 1.2)
    r = CliRunner().invoke(main, ["run", model, "-p", "hi", "-n", "2", "-t", "3"])
    assert r.exit_code == 0, r.output
    assert "warning: -t 3: only 1.2 of 4 cores are idle" in r.stderr and "at most 1" in r.stderr
    monkeypatch.setattr(machine, "idle_cores", lambda sample_s=0.2: 3.9)
    r = CliRunner().invoke(main, ["run", model, "-p", "hi", "-n", "2", "-t", "3"])
    assert r.exit_code == 0 and "warning" not in r.stderr
    r = CliRunner().invoke(main, ["run", model, "-p", "hi", "-n", "2"])  # the default: never warned
    assert "warning" not in r.stderr
