"""``ggml-hybrid gen`` and ``demo --keep DIR``: a model of one's own without a download.

Oracle: ``ggml_hybrid.synthetic.write_model`` called directly with the same ModelSpec (the generator is
deterministic, so the files must be byte-identical), and ``inspect``'s figures against the spec.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_cli import ok, user_error

from ggml_hybrid.cli.demo import DEMO_SPEC
from ggml_hybrid.synthetic import ModelSpec, write_model

ROOT = Path(__file__).resolve().parents[1]


def test_gen_writes_what_the_generator_writes(tmp_path):
    out = tmp_path / "m.gguf"
    r = ok("gen", out, "--arch", "qwen2moe", "--type", "q8_0", "--layers", 3, "--experts", 16, "--used", 4,
           "--head-dim", 16, "--seed", 5, "--set", "n_ff_shexp=32")
    assert r.stdout.strip() == str(out)
    ref = write_model(tmp_path / "ref.gguf", ModelSpec(arch="qwen2moe", weight_type="q8_0", n_layer=3, n_expert=16,
                                                       n_used=4, head_dim=16, seed=5, n_ff_shexp=32))
    assert out.read_bytes() == Path(ref).read_bytes()
    d = json.loads(ok("inspect", out, "--json").stdout)
    assert (d["architecture"], d["n_layer"], d["experts"]["count"], d["experts"]["used"]) == ("qwen2moe", 3, 16, 4)
    assert d["experts"]["shared_ff"] == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "ref.gguf"]  # no temporary file left


def test_tools_gen_model_is_the_command(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    ok("gen", a, "--type", "q8_0", "--seed", 3, "--set", "n_expert=4", "--set", "n_used=1")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_model.py"), str(b), "--type", "q8_0", "--seed", "3",
                        "--set", "n_expert=4", "--set", "n_used=1"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == str(b), p.stderr
    assert a.read_bytes() == b.read_bytes()
    ref = write_model(tmp_path / "ref.gguf", ModelSpec(weight_type="q8_0", seed=3, n_expert=4, n_used=1))
    assert a.read_bytes() == Path(ref).read_bytes()  # --set has the last word over --experts' default


def test_gen_errors(tmp_path):
    user_error("gen", tmp_path / "m.gguf", "--set", "nope=1", expect=["--set", "nope=1", "n_expert"])
    user_error("gen", tmp_path / "m.gguf", "--set", "n_expert=x", expect=["'x' is not a int"])
    user_error("gen", tmp_path / "m.gguf", "--used", 9, expect=["n_used=9"])
    user_error("gen", tmp_path / "m.gguf", "--type", "q9_9", expect=["q9_9"])
    user_error("gen", tmp_path, expect=["directory"])
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary file


def test_demo_keep_keeps_its_model(tmp_path):
    keep = tmp_path / "new" / "dir"
    d = json.loads(ok("demo", "--json", "-t", 1, "-n", 2, "--keep", keep).stdout)
    assert d["all_identical"] is True and d["model"] == str(keep / "demo-qwen3moe.gguf")
    ref = write_model(tmp_path / "ref.gguf", DEMO_SPEC)
    assert Path(d["model"]).read_bytes() == Path(ref).read_bytes()
    out = ok("demo", "-t", 1, "-n", 2, "--keep", keep).stdout
    assert f"model kept: {keep / 'demo-qwen3moe.gguf'}" in out and "try: ggml-hybrid run" in out
    assert json.loads(ok("demo", "--json", "-t", 1, "-n", 2).stdout)["model"] is None
    user_error("demo", "--keep", ref, expect=["--keep", "is a file"])
