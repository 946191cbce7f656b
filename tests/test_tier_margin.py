"""The host tier's margin and plan's figures (the rough edges of issue 46).

- ``plan``'s bytes for a configuration are what ``run`` allocates for it, in every family, the host tier's
  configurations included (a CPU computing straight from the tier's frames holds no slot memory);
- ``host_tier_bytes=auto`` leaves what the session itself holds besides the tier (its KV cache, compute buffers and
  weights in host memory, a CPU playing the device included) plus a small fixed slack, not a flat 128 MiB;
- on a CPU-only machine ``plan --ram`` gives a ``try:`` line that runs as printed and fits the memory it was given.
"""

from __future__ import annotations

import json
import os
import shlex

import pytest
from click.testing import CliRunner
from helpers import FAMILY_SPECS

from ggml_hybrid.cli import main
from ggml_hybrid.errors import OptionError
from ggml_hybrid.moe.host_tier import AUTO_SLACK
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.plan.host_advice import program_bytes
from ggml_hybrid.plan.planner import plan
from ggml_hybrid.runtime.moe_model import MoEModel, auto_host_tier
from ggml_hybrid.synthetic import ARCHS, write_model
from ggml_hybrid.units import MiB, parse_size

# q8_0 experts are not repacked on x86 (a CPU computes them from the tier's frames), gpt-oss's MXFP4 ones are (slots)
SPECS = FAMILY_SPECS


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    d = tmp_path_factory.mktemp("tier-margin")
    return {a: write_model(d / f"{a}.gguf", arch=a, weight_type="q8_0", seed=46, **SPECS[a]) for a in ARCHS}


def _session_host_bytes(m: MoEModel) -> int:
    """What a loaded session holds in host memory besides the tier, read off its own buffers (the oracle): a CPU
    playing the device holds everything on it; the host its KV cache, states and compute buffer; the mapped file
    the dense weights it uses in place."""
    held = sum(sum(m.device_memory(d).values()) for d in m.devices if d.startswith("DEV"))
    held += m.kv.nbytes(m.host) + (m.rs.nbytes(m.host) if m.rs is not None else 0) + m.sched.buffer_size(m.host)
    tensors = m.layout_report()["tensors"]
    return held + sum(tensors.get("mapped", {}).values()) + sum(tensors.get("CPU", {}).values())


CONFIGS = {  # the tier's configurations on a CPU playing the device
    "direct": ["disk_experts=1", "expert_cache_slots=2", "host_tier_bytes=64M"],  # q8_0: from the frames, no slots
    "slots": ["disk_experts=1", "expert_cache_slots=3", "host_tier_bytes=64M", "moe_cpu_share=0.5"],
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_plan_figures_are_what_a_run_allocates(families, arch, config):
    """plan's dry run and a loaded session agree buffer for buffer: before, plan counted the slots of a CPU running
    straight from the tier's frames (which a run never commits) and the routed experts as mapped."""
    opts = SessionOptions.parse([*CONFIGS[config], "n_ctx=256", "n_threads=1"])
    p = plan(families[arch], opts)
    with MoEModel(families[arch], opts) as m:
        ran = m.device_memory("DEV0")
        ran_host = (m.kv.nbytes(m.host), m.sched.buffer_size(m.host), m.layout_report()["tensors"].get("mapped", {}))
        direct = m.experts.slots_unused  # the CPU computes from the frames (not gpt-oss's repacked MXFP4)
    d = p.devices["DEV0"]
    assert (d.weights, d.experts, d.kv_cache, d.recurrent, d.compute) == (
        ran["weights"], ran["experts"], ran["kv_cache"], ran["recurrent"], ran["compute"])
    assert (p.host.kv_cache, p.host.compute, p.host.mapped) == ran_host
    assert direct == (config == "direct" and arch != "gpt-oss")
    if direct:
        assert d.experts == 0 and "routed_experts" not in p.host.mapped


def test_auto_leaves_what_the_session_holds_and_a_slack(families):
    """auto = available - (the session's own host bytes) - AUTO_SLACK, the session's bytes those a load allocates."""
    path = families["qwen3moe"]
    opts = SessionOptions.parse(["disk_experts=1", "expert_cache_slots=2", "n_ctx=256", "n_threads=1"])
    with MoEModel(path, opts.merged(host_tier_bytes=64 * MiB)) as m:
        held = _session_host_bytes(m)
        least, every = m.experts.tier_least, m.experts.tier_need
    assert every >= 2 * least
    available = held + AUTO_SLACK + least + (every - least) // 2
    choice = auto_host_tier(path, opts.merged(host_tier_bytes="auto"), available=available)
    assert choice.held == held and choice.budget == available - held - AUTO_SLACK == least + (every - least) // 2
    # more than every expert: capped there
    assert auto_host_tier(path, opts.merged(host_tier_bytes="auto"), available=1 << 40).budget == every
    # the old rule kept 128 MiB, which this budget (far less) could never give: refused
    assert available < 128 * MiB + least
    with MoEModel(path, opts.merged(host_tier_bytes=choice.budget)) as m:
        assert m.experts.tier.budget == choice.budget


def test_auto_refuses_with_the_figures_when_the_least_tier_does_not_fit(families):
    path = families["gpt-oss"]
    opts = SessionOptions.parse(["disk_experts=1", "expert_cache_slots=2", "n_ctx=256", "n_threads=1",
                                 "host_tier_bytes=auto"])
    with pytest.raises(OptionError, match=r"host_tier_bytes=auto: .* available less this session's .* less "
                                          r"a slack of 64.00 MiB leaves .*one layer's experts"):
        auto_host_tier(path, opts, available=AUTO_SLACK)
    # the file fits in that memory: no tier is needed; larger than it: plan --ram sizes a configuration
    with pytest.raises(OptionError, match=r"\(the file \(.*\) fits in the memory: leave --host-tier out\)"):
        auto_host_tier(path, opts, available=AUTO_SLACK + os.path.getsize(path))
    with pytest.raises(OptionError, match=r"\(`ggml-hybrid plan FILE --ram SIZE`, SIZE the memory the run gets, "
                                          r"prints a configuration that fits\)"):
        auto_host_tier(path, opts, available=os.path.getsize(path) // 2)


def _try_line(args: list[str]) -> tuple[str, list[str] | None]:
    r = CliRunner().invoke(main, ["plan", *args])
    assert r.exit_code == 0, r.output
    line = next((ln for ln in r.stdout.splitlines() if ln.strip().startswith("try: ")), None)
    return r.stdout, None if line is None else shlex.split(line.split("try: ", 1)[1])


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_cpu_only_plan_ram_gives_a_try_line_that_runs_and_fits(tmp_path, arch):
    """A file larger than --ram on a CPU-only machine: a try: line (not a warning's "e.g."), which runs as printed
    and whose session, tier included, fits --ram (its bytes read off the loaded session)."""
    path = write_model(tmp_path / "m.gguf", arch=arch, n_layer=12, n_embd=256, n_ff_exp=512, n_expert=32, n_used=4,
                       weight_type="q8_0", seed=7)
    ram = 120 * MiB  # the file is 155 MiB
    text, argv = _try_line([path, "--ram", str(ram), "-t", "1"])
    assert argv is not None and "--host-tier" in argv, text
    assert " e.g. " not in text
    assert argv[:3] == ["ggml-hybrid", "run", path]
    r = CliRunner().invoke(main, [*argv[1:-2], "-n", "2", "--ignore-eos", "--json"])
    assert r.exit_code == 0, f"{shlex.join(argv)}\n{r.output}"
    tier = parse_size(argv[argv.index("--host-tier") + 1])
    assert json.loads(r.stdout)["host_tier"]["bytes_held"] <= tier
    with MoEModel(path, SessionOptions(**json.loads(r.stdout)["options"])) as m:  # the run's own options
        assert _session_host_bytes(m) + tier + AUTO_SLACK + program_bytes() <= ram


def test_repacked_copies_larger_than_memory_are_refused_before_loading(tmp_path, monkeypatch):
    """The default path repacks gpt-oss's MXFP4 experts into anonymous memory: with a file larger than the memory
    that is an OOM kill, so it is refused before anything loads, naming the file, the memory and the flags that
    avoid it; --no-repack (the file used in place) loads."""
    import ggml_hybrid.runtime.moe_model as moe_model

    path = write_model(tmp_path / "g.gguf", arch="gpt-oss", seed=3, **SPECS["gpt-oss"])
    size = os.path.getsize(path)
    monkeypatch.setattr(moe_model, "memory_available", lambda: size // 2)
    with pytest.raises(OptionError, match=r"g\.gguf.* larger than the .* available.* copies .* repacked.*--no-repack"
                                          r".*--host-tier"):
        MoEModel(path, SessionOptions.parse(["n_threads=1", "n_ctx=64"]))
    with MoEModel(path, SessionOptions.parse(["n_threads=1", "n_ctx=64", "repack=false"])) as m:
        assert not m.model.repacked and not m.experts.repacked
    monkeypatch.setattr(moe_model, "memory_available", lambda: size * 4)  # it fits: loads as before
    with MoEModel(path, SessionOptions.parse(["n_threads=1", "n_ctx=64"])) as m:
        assert m.experts.repacked


def test_plan_without_ram_counts_the_memory_cgroup(tmp_path, monkeypatch):
    """Without --ram, plan's memory is what auto's is: MemAvailable or the process's memory cgroup, whichever is
    less; inside a cgroup smaller than the file it advises the host tier (before: MemAvailable alone, no advice)."""
    import ggml_hybrid.moe.host_tier as host_tier

    path = write_model(tmp_path / "m.gguf", arch="qwen3moe", n_layer=12, n_embd=256, n_ff_exp=512, n_expert=32,
                       n_used=4, weight_type="q8_0", seed=7)
    monkeypatch.setattr(host_tier, "cgroup_memory_left", lambda: 120 * MiB)
    text, argv = _try_line([path, "-t", "1"])
    assert "does not fit in the 120.00 MiB available now" in text and argv is not None and "--host-tier" in argv


CGROUP_V1 = "/sys/fs/cgroup/memory"


@pytest.fixture
def memory_cgroup():
    """A cgroup v1 memory group of this test's own (root and a writable v1 hierarchy; skipped elsewhere): yields a
    function that runs a command in it under a limit and returns (exit status, stdout, stderr, peak bytes)."""
    import subprocess
    from pathlib import Path

    group = Path(CGROUP_V1) / f"hy_test_tier_margin_{os.getpid()}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"no writable cgroup v1 memory hierarchy here ({e.strerror})")

    def run(limit: int, argv: list[str]) -> tuple[int, str, str, int]:
        (group / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (group / "memory.max_usage_in_bytes").write_text("0\n")
        shell = f"echo $$ > {group}/cgroup.procs && exec " + shlex.join(argv)
        p = subprocess.run(["sh", "-c", shell], capture_output=True, text=True, timeout=600)
        return p.returncode, p.stdout, p.stderr, int((group / "memory.max_usage_in_bytes").read_text())

    yield run
    group.rmdir()  # the commands have exited: the group is empty


def test_auto_runs_a_prompt_filling_the_context_in_a_memory_cgroup(tmp_path, memory_cgroup):
    """The kernel's limit as the oracle: a 155 MiB file in a 150 MiB memory cgroup, --host-tier auto beside a
    session of a 2048-token context, a prompt filling it: it runs and stays within the limit (the old flat 128 MiB
    margin refused any tier here; a tier sized without the session's buffers is killed on such a prompt)."""
    import sys

    path = write_model(tmp_path / "m.gguf", arch="qwen3moe", n_layer=12, n_embd=256, n_ff_exp=512, n_expert=32,
                       n_used=4, weight_type="q8_0", seed=7)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 72))  # 1,946 tokens
    cli = [sys.executable, "-m", "ggml_hybrid.cli", "run", path, "-t", "1", "-c", "2048", "-ub", "128"]
    rc, out, err, peak = memory_cgroup(150 * MiB, [*cli, "--host-tier", "auto", "-f", str(prompt), "-n", "4",
                                                   "--ignore-eos", "--json"])
    assert rc == 0, err
    d = json.loads(out)
    choice = d["tier_choice"]
    assert d["prompt_tokens"] > 1500 and choice["budget"] == choice["available"] - choice["held"] - AUTO_SLACK > 0
    assert d["host_tier"]["bytes_held"] <= choice["budget"] and peak <= 150 * MiB
