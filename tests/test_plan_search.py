"""``plan --vram``'s combination search (issue 34): context, physical batch, KV type and placement, and the
experts' placement changed together; one command line; and, when nothing fits, what the smallest needs.

The oracle for "fits" is a real load: the model loaded with the combination's options (the CPU playing the
device) holds no more device memory than the size given."""

from __future__ import annotations

import shlex

import pytest
from click.testing import CliRunner

from ggml_hybrid.cli import main
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.plan.plan_text import format_text
from ggml_hybrid.plan.planner import plan
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("search")
    return write_model(d / "m.gguf", n_layer=4, n_expert=8, n_used=2, weight_type="q8_0", seed=21)


def loaded_total(path, items):
    with MoEModel(path, SessionOptions.parse(items + ["n_threads=1"])) as m:
        return sum(m.device_memory().values())


def test_a_combination_fits_where_no_single_change_does(model):
    """Issue 34's case: no one recommendation fits, changes together do; loaded with them, the model holds no
    more device memory than given, and it is the largest on the search's ladder (a physical batch twice as
    large, the rest the same, does not fit)."""
    nkvo = SessionOptions(no_kv_offload=True)  # the KV cache in host memory already: compute dominates
    dev = plan(model, nkvo).devices["DEV0"]
    vram = None
    for frac in (0.2, 0.25, 0.3, 0.15):  # a size at which single changes all fail
        v = int(dev.total * frac)
        p = plan(model, nkvo, vram=[v])
        if not p.recommendations and p.combination is not None and p.combination.fits:
            vram = v
            break
    assert vram is not None, "no size found at which only a combination fits"
    c = p.combination
    items = c.options.split()
    assert len([x for x in items if not x.startswith("n_ctx=")]) >= 2  # more than one change
    assert c.device_total["CUDA0"] <= vram
    assert loaded_total(model, items + ["no_kv_offload=true"]) <= vram
    ub = next((int(x.split("=")[1]) for x in items if x.startswith("ubatch_size=")), None)
    if ub is not None and ub < 512:
        bigger = [f"ubatch_size={ub * 2}" if x.startswith("ubatch_size=") else x for x in items]
        q = plan(model, SessionOptions.parse(bigger, base=nkvo), vram=[vram])
        assert not q.devices["CUDA0"].fits
    text = format_text(p)
    assert f"best combination: {c.options}" in text


def test_the_command_line_it_prints_fits(model):
    """The `try:` line is a command a user can paste: its flags, planned again with the same --vram, fit."""
    full = plan(model, SessionOptions(no_kv_offload=True)).devices["DEV0"].total
    vram = f"{int(full * 0.25) // 1024}K"
    r = CliRunner().invoke(main, ["plan", model, "--vram", vram, "-t", "1", "-nkvo"])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("try: "))
    argv = shlex.split(line.split("try: ", 1)[1])
    assert argv[:3] == ["ggml-hybrid", "run", model] and "-t" in argv and "-nkvo" in argv
    assert argv[-4:] == ["-p", "Hello", "-n", "32"]  # run as printed: a prompt (plan takes no prompt)
    r2 = CliRunner().invoke(main, ["plan", *argv[2:-4], "--vram", vram])
    assert r2.exit_code == 0, r2.output
    assert "DOES NOT FIT" not in r2.stdout and "fits" in r2.stdout.lower()
    # with several sequences the line runs serve, which holds them
    r = CliRunner().invoke(main, ["plan", model, "--vram", vram, "-np", "2", "-nkvo"])
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("try: "))
    assert line.split()[1:3] == ["ggml-hybrid", "serve"] and "-np 2" in line


def test_when_nothing_fits_it_says_what_the_smallest_needs(model):
    p = plan(model, SessionOptions(), vram=[64 * 1024])
    c = p.combination
    assert c is not None and not c.fits
    items = c.options.split()
    for x in ("n_ctx=512", "ubatch_size=32", "no_kv_offload=true", "cpu_moe=true"):
        assert x in items
    need = c.device_total["CUDA0"]
    assert need > 64 * 1024
    # what it says the smallest configuration needs is what that configuration, planned, holds
    q = plan(model, SessionOptions.parse(items))
    assert q.devices["DEV0"].total == need
    text = format_text(p)
    assert "nothing fits: the smallest configuration" in text and "given 64.00 KiB" in text
    r = CliRunner().invoke(main, ["plan", model, "--vram", "64K"])
    assert r.exit_code == 0 and "try:" not in r.stdout and "nothing fits" in r.stdout


def test_a_plan_that_fits_searches_nothing(model):
    p = plan(model, SessionOptions(), vram=[2 ** 34])
    assert p.combination is None and p.to_dict()["combination"] is None
