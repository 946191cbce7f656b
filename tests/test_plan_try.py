"""``plan``'s advice runs as printed (issue 46): every ``try:`` line, shlex-split, is run, and it fits what the plan
said (the run's device memory within the combination's totals, its host tier within the size printed); with a file
larger than --ram the line reads the experts through the host tier, never one smaller than what works; gpt-oss too
(the tier holds its experts' biases)."""

from __future__ import annotations

import json
import shlex

import pytest
from click.testing import CliRunner

from ggml_hybrid.cli import main
from ggml_hybrid.moe.host_tier import AUTO_SLACK
from ggml_hybrid.plan.host_advice import program_bytes
from ggml_hybrid.synthetic import write_model
from ggml_hybrid.units import parse_size

# one layer's routed experts is 13 MiB and the file 155 MiB: larger than 150M of RAM, which still holds a tier beside
# the session's own buffers and auto's slack
DEEP = dict(n_layer=12, n_embd=256, n_ff_exp=512, n_expert=32, n_used=4, weight_type="q8_0", seed=46)
SMALL = dict(n_layer=4, n_embd=128, n_expert=16, n_used=4, weight_type="q8_0", seed=47)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan-try")
    return {"deep": write_model(d / "deep.gguf", **DEEP), "small": write_model(d / "small.gguf", **SMALL),
            "gptoss": write_model(d / "gptoss.gguf", **{**DEEP, "arch": "gpt-oss"})}


def plan_try(args):
    """The plan's JSON and its `try:` line's argv (None: no line) for ``plan args``."""
    r = CliRunner().invoke(main, ["plan", *args])
    assert r.exit_code == 0, r.output
    line = next((ln for ln in r.stdout.splitlines() if ln.strip().startswith("try: ")), None)
    j = CliRunner().invoke(main, ["plan", *args, "--json"])
    assert j.exit_code == 0, j.output
    return r.stdout, json.loads(j.stdout), None if line is None else shlex.split(line.split("try: ", 1)[1])


CASES = [  # model, plan's flags
    ("small", ["--vram", "12M", "-t", "1"]),
    ("small", ["--vram", "1M", "--ram", "3M", "-t", "1"]),
    ("deep", ["--vram", "30M", "--ram", "150M", "-t", "1", "-c", "512", "-ub", "64"]),
    ("deep", ["--vram", "8M", "--ram", "150M", "-t", "1", "-c", "512", "-ub", "64"]),
    ("deep", ["--vram", "30M", "-t", "1", "-c", "512"]),
    ("gptoss", ["--vram", "30M", "--ram", "150M", "-t", "1", "-c", "512", "-ub", "64"]),
]


@pytest.mark.parametrize("name,flags", CASES)
def test_every_try_line_runs_as_printed_and_fits_the_plan(models, name, flags):
    path = models[name]
    text, p, argv = plan_try([path, *flags])
    assert argv is not None, text
    assert argv[:3] == ["ggml-hybrid", "run", path]
    short = [*argv[1:-1], "2"] if argv[-2] == "-n" else argv[1:]  # a short run: -n 2 for the printed -n
    # --ignore-eos: a random model's sampled first token is its end token in about 1 run in 20 (gpt-oss's, seeds 0-39)
    r = CliRunner().invoke(main, [*short, "--ignore-eos", "--json"])
    assert r.exit_code == 0, f"{shlex.join(argv)}\n{r.output}"
    out = json.loads(r.stdout)
    assert out["generated_tokens"] >= 1
    c = p["combination"]
    planned = sum(c["device_total"].values())
    assert sum(out["device_memory"].values()) <= planned <= sum(c["device_vram"].values())
    if "--host-tier" in argv:
        size = parse_size(argv[argv.index("--host-tier") + 1])
        assert size >= p["experts"]["host_tier_min"] and out["host_tier"]["bytes_held"] <= size


def test_a_file_larger_than_ram_is_advised_the_host_tier(models):
    """--ram below the file: the recommended line reads the experts through a host tier, sized in what --ram leaves."""
    text, p, argv = plan_try([models["deep"], "--vram", "30M", "--ram", "150M", "-t", "1", "-c", "512", "-ub", "64"])
    assert argv is not None and "--host-tier" in argv and "--expert-cache-slots" in argv, text
    size = parse_size(argv[argv.index("--host-tier") + 1])
    # beside what that configuration's session holds in host memory, less auto's slack (not a flat 128 MiB)
    _, q, _ = plan_try([*argv[2:-4], "--vram", "30M", "--ram", "150M"])
    # and the program's own memory before it loads (measured in a child interpreter)
    rest = 150 * 2 ** 20 - q["host"]["held"] - AUTO_SLACK - program_bytes()
    assert q["host"]["held"] > 0 and p["experts"]["host_tier_min"] <= size <= rest < size + 2 ** 20  # all of it
    assert "host_tier_bytes=" in p["combination"]["options"]


def test_no_host_tier_below_what_works(models):
    """RAM that holds less than one layer's experts beside the session and the slack: no --host-tier size (0M) is
    suggested, and the plan says why."""
    text, p, argv = plan_try([models["deep"], "--ram", "40M", "-t", "1", "-c", "512"])
    assert argv is None
    assert "--host-tier 0M" not in text and "neither does the least host tier" in text
    # and a given tier below one layer's experts is named as what run refuses
    text, _, _ = plan_try([models["deep"], "--expert-cache-slots", "4", "--host-tier", "1M", "-t", "1", "-c", "512"])
    assert "run refuses a host tier of 1.00 MiB" in text


def test_gpt_oss_larger_than_ram_is_advised_the_host_tier_and_run_takes_it(models):
    """gpt-oss's experts have biases, which the host tier holds too (issue 46: plan advised what run refused): with
    --ram below the file the recommended line reads them through a tier of at least one layer's experts, and a
    tier given to run is taken."""
    path = models["gptoss"]
    text, p, argv = plan_try([path, "--vram", "30M", "--ram", "150M", "-t", "1", "-c", "512", "-ub", "64"])
    assert argv is not None and "--host-tier" in argv and "--expert-cache-slots" in argv, text
    assert parse_size(argv[argv.index("--host-tier") + 1]) >= p["experts"]["host_tier_min"]
    assert "host_tier_bytes=" in p["combination"]["options"] and "biases" not in text
    text, _, _ = plan_try([path, "--expert-cache-slots", "4", "--host-tier", "30M", "-t", "1", "-c", "512"])
    assert "run refuses" not in text
    r = CliRunner().invoke(main, ["run", path, "--expert-cache-slots", "4", "--host-tier", "30M", "-p", "Hello",
                                  "-n", "2", "-t", "1", "-c", "512", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["host_tier"]["misses"] > 0


def test_the_device_of_vram_alone_is_named_as_planned(models):
    """--vram on a machine without such a GPU plans for a hypothetical CUDA0: the text says so; the JSON keys stay."""
    from ggml_hybrid.ggml.backend import gpu_device_names

    if gpu_device_names():
        pytest.skip("this machine has a GPU: --vram sizes it")
    text, p, _ = plan_try([models["small"], "--vram", "2G", "-t", "1"])
    assert "CUDA0 (planned: --vram)" in text and list(p["devices"]) == ["CUDA0"]
    text, _, _ = plan_try([models["small"], "-t", "1"])  # the session's own device: no such note
    assert "planned: --vram" not in text
