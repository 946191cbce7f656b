"""expert_cache_slots=auto (runtime/cache_size.py): the slots the free device memory holds, and a clear refusal.

Oracles: a brute-force search over every slot count for the arithmetic; the planner's own dry runs at the
chosen count and one more for the sizing (the chosen count fits in the free memory less the margin, one more
does not); the resident model's logits for the outputs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_hybrid.cli import main
from ggml_hybrid.ggml.backend import cpu_instance
from ggml_hybrid.moe.expert_layers import check_moe_options
from ggml_hybrid.options import OptionError, SessionOptions
from ggml_hybrid.plan.planner import plan
from ggml_hybrid.runtime.cache_size import MARGIN_MIN, choose_slots, margin
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model

N_EXPERT, N_USED = 8, 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("slots")
    return write_model(d / "m.gguf", n_layer=4, n_expert=N_EXPERT, n_used=N_USED, weight_type="q8_0", seed=5)


def _brute_force(fixed, per_slot, free, n_expert):
    """The most slots <= n_expert that every device holds in its free memory less the margin, by trying each."""
    for s in range(n_expert, -1, -1):
        if all(fixed[d] + s * per_slot[d] <= free[d] - margin(free[d]) for d in fixed if per_slot[d] > 0):
            return s
    return 0


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 1 << 34), st.integers(0, 1 << 30), st.integers(0, 1 << 35)),
                min_size=1, max_size=4),
       st.integers(1, 256), st.integers(1, 16))
def test_the_choice_is_the_most_slots_every_device_holds(devices, n_expert, n_used):
    names = [f"DEV{i}" for i in range(len(devices))]
    fixed = {d: f for d, (f, _, _) in zip(names, devices)}
    per_slot = {d: k for d, (_, k, _) in zip(names, devices)}
    free = {d: m for d, (_, _, m) in zip(names, devices)}
    t1 = {d: fixed[d] + per_slot[d] for d in names}
    t2 = {d: fixed[d] + 2 * per_slot[d] for d in names}
    want = _brute_force(fixed, per_slot, free, n_expert)
    if want < max(1, n_used):
        with pytest.raises(OptionError, match=rf"only {want} expert slot\(s\) per layer fit, fewer than the "
                                              rf"{n_used} experts"):
            choose_slots(t1, t2, free, n_expert, n_used)
        return
    choice = choose_slots(t1, t2, free, n_expert, n_used)
    assert choice.slots == want
    assert set(choice.per_device) == {d for d in names if per_slot[d] > 0}


def test_the_margin():
    assert margin(0) == MARGIN_MIN and margin(100 << 30) == 5 << 30


def _device_bytes(model, opts, slots, vram):
    p = plan(model, opts.merged(expert_cache_slots=slots), vram=vram)
    return {d: v.total for d, v in p.devices.items()}


@pytest.mark.parametrize("items, want", [(["n_ctx=256"], 5), (["n_ctx=256", "virtual_devices=2"], 3),
                                         (["n_ctx=256", "n_parallel=2", "moe_cpu_share=auto"], 4)])
def test_plan_sizes_the_cache_from_the_given_memory(model, items, want):
    """vram sized for `want` slots (from dry runs at explicit slot counts): auto takes exactly that many, one
    more would not fit, and the plan shows the choice."""
    opts = SessionOptions.parse(items + ["disk_experts=true", "n_threads=1"])
    n_dev = 2 if "virtual_devices=2" in items else 1
    at = _device_bytes(model, opts, want, None)
    vram = [at[d] + MARGIN_MIN for d in sorted(at)]
    p = plan(model, opts.merged(expert_cache_slots="auto"), vram=vram)
    assert p.slot_choice is not None and p.slot_choice.slots == want
    assert f"expert_cache_slots={want}" in p.options
    assert all(v.total <= v.vram - MARGIN_MIN for v in p.devices.values())
    over = _device_bytes(model, opts, want + 1, vram)
    assert any(over[d] > vram[i] - MARGIN_MIN for i, d in enumerate(sorted(over)))
    assert len(p.devices) == n_dev


def test_auto_takes_every_expert_when_they_all_fit_and_is_capped(model):
    opts = SessionOptions.parse(["disk_experts=true", "expert_cache_slots=auto", "n_threads=1"])
    p = plan(model, opts, vram=[64 << 30])
    (fit,) = p.slot_choice.per_device.values()  # the plan's device: CUDA0 with --vram and no devices named
    assert p.slot_choice.slots == N_EXPERT and fit > N_EXPERT


def test_auto_refuses_when_fewer_than_the_experts_used_per_token_fit(model):
    opts = SessionOptions.parse(["disk_experts=true", "n_ctx=256", "n_threads=1"])
    at = _device_bytes(model, opts, 1, None)
    with pytest.raises(OptionError, match=r"expert_cache_slots=auto: only 1 expert slot\(s\) per layer fit, fewer "
                                          r"than the 2 experts .*CUDA0: 1 fit"):
        plan(model, opts.merged(expert_cache_slots="auto"), vram=[at["DEV0"] + MARGIN_MIN])
    with pytest.raises(OptionError, match="expert_cache_slots=auto: .*needs disk_experts=true"):
        plan(model, SessionOptions.parse(["expert_cache_slots=auto"]), vram=[1 << 30])


@pytest.mark.parametrize("items", [[], ["virtual_devices=2", "moe_cpu_share=0.5"], ["moe_cpu_share=auto"],
                                   ["moe_executor=python", "moe_cpu_share=0.5", "expert_eviction=lru"]])
def test_a_session_with_auto_slots_is_bit_identical_to_resident(model, items):
    """CPU instances playing devices take the host's available memory: this small model's experts all fit."""
    with MoEModel(model, SessionOptions(n_threads=1)) as m:
        tokens = m.tokenizer.encode("The cache sized itself.")
        ref = m.eval(tokens, "all")
    opts = SessionOptions.parse(items + ["disk_experts=true", "expert_cache_slots=auto", "n_threads=1"])
    with MoEModel(model, opts) as m:
        assert m.slot_choice is not None and m.options.expert_cache_slots == m.slot_choice.slots == N_EXPERT
        got = m.eval(tokens, "all")
    assert np.array_equal(got, ref)


def test_auto_is_refused_where_it_cannot_size_anything(model):
    """A model given its device, or a dry run, takes a number: one clear error, nothing loaded."""
    opts = SessionOptions.parse(["disk_experts=true", "expert_cache_slots=auto", "n_threads=1"])
    with cpu_instance(0, 1) as dev:
        with pytest.raises(OptionError, match="expert_cache_slots=auto: sizes the cache on the session's own devices"):
            MoEModel(model, opts, device=dev)
    with pytest.raises(OptionError, match="expert_cache_slots=auto: sizes the cache on the session's own devices"):
        MoEModel(model, opts, dry_run_devices=["DEV0"])
    with pytest.raises(OptionError, match="expert_cache_slots=auto: the slot count is chosen .* needs a number"):
        check_moe_options(opts, 4, N_EXPERT, N_USED)


def test_the_option_and_the_flag(model):
    assert SessionOptions.parse(["expert_cache_slots=AUTO"]).expert_cache_slots == "auto"
    with pytest.raises(OptionError, match="expert_cache_slots"):
        SessionOptions.parse(["expert_cache_slots=autox"])
    run = CliRunner().invoke
    t = run(main, ["plan", model, "--expert-cache-slots", "auto", "--vram", "16G"])
    assert t.exit_code == 0, t.output
    assert f"expert_cache_slots=auto -> {N_EXPERT} (the model's {N_EXPERT} experts per layer; CUDA0: " in t.output
    j = run(main, ["plan", model, "--expert-cache-slots", "auto", "--vram", "16G", "--format", "json"])
    assert json.loads(j.output)["slot_choice"]["slots"] == N_EXPERT
    bad = run(main, ["plan", model, "--expert-cache-slots", "0"])
    assert bad.exit_code == 2
