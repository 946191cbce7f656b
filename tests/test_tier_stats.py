"""The stats and layout lines say what happened with the host tier on a CPU (issue 46): a CPU playing the device
computes straight from the tier's frames (tier_direct), so the cache slots are never used and the routed experts
are held by the tier, not used from the mapping."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ggml_hybrid.cli import main
from ggml_hybrid.gguf.store import GGUFStore
from ggml_hybrid.synthetic import write_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # the reproduction: gen m.gguf --type q8_0 --layers 4 --embd 128 --experts 16 --used 4
    return write_model(tmp_path_factory.mktemp("tier-stats") / "m.gguf", n_layer=4, n_embd=128, n_expert=16,
                       n_used=4, weight_type="q8_0")


def routed_bytes(path):
    store = GGUFStore(path)
    try:
        return sum(t.nbytes for t in store.tensors() if "_exps." in t.name)
    finally:
        store.close()


def layout_line(output):
    """The stats' layout line as {place: its classes' text}."""
    line = next(ln for ln in output.splitlines() if ln.startswith("layout: "))
    return dict(part.split(": ", 1) for part in line.removeprefix("layout: ").split("; "))


RUN = ["-p", "Hello there", "-n", "8", "--expert-cache-slots", "4", "-t", "1"]


def test_tier_direct_says_the_slots_were_unused_and_the_tier_holds_the_experts(model):
    r = CliRunner().invoke(main, ["run", model, *RUN, "--host-tier", "1M"])
    assert r.exit_code == 0, r.output
    assert "slots unused (the host tier feeds the compute directly)" in r.output
    assert "experts: hits" not in r.output  # hits of slots that never held an expert
    layout = layout_line(r.output)
    assert layout["host tier"].startswith("routed_experts ") and "routed_experts" not in layout.get("mapped", "")
    j = CliRunner().invoke(main, ["run", model, *RUN, "--host-tier", "1M", "--json"])
    out = json.loads(j.stdout)
    assert out["slots_unused"] is True
    assert out["layout"]["tensors"]["host tier"]["routed_experts"] == routed_bytes(model)
    assert "routed_experts" not in out["layout"]["tensors"].get("mapped", {})


def test_slots_that_run_keep_their_counts(model):
    """With a CPU share the slots are used (the worker takes misses from them): the hit/miss line stays."""
    r = CliRunner().invoke(main, ["run", model, *RUN, "--host-tier", "1M", "--moe-cpu-share", "0.5", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["slots_unused"] is False and out["counters"]["misses"] > 0
    assert out["layout"]["tensors"]["host tier"]["routed_experts"] == routed_bytes(model)
    r = CliRunner().invoke(main, ["run", model, *RUN])  # no tier: mapped, and the slots count
    assert "experts: hits" in r.output and "routed_experts" in layout_line(r.output)["mapped"]
