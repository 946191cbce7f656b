"""``ggml-hybrid replay TRACE --plot FILE``: the pictures of a real routing trace (``../shared/traces/``, read in
place: never copied into the project) draw the numbers ``replay --json`` prints, and the heatmap the routing the
trace's ``.npz`` twin holds (an independent record of the same router decisions).

With ``GGML_HYBRID_DOCS_IMAGES=DIR`` the PNG is also copied into DIR (docs/moe.md's picture).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from ggml_hybrid.cli.replay import sweep
from ggml_hybrid.moe.traces import read_trace
from ggml_hybrid.moe.traces.plot import figure, requests_matrix

pytest.importorskip("matplotlib")

# ../shared/traces beside the checkout (GGML_HYBRID_TRACES names another folder: a worktree's checkout sits deeper)
TRACES = Path(os.environ.get("GGML_HYBRID_TRACES", Path(__file__).resolve().parents[2] / "shared" / "traces"))
MIXTRAL = TRACES / "mixtral-8x7b_gsm8k_decode_p1.ghtrace"
QWEN = TRACES / "qwen1.5-moe-a2.7b_4bit_mlx_cooking_1.ghtrace"
real = pytest.mark.skipif(not MIXTRAL.exists(), reason=f"the real traces are not at {TRACES}")
ROOT = Path(__file__).resolve().parents[1]


def replay_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "replay", *args], capture_output=True, text=True,
                          timeout=600)


def points_of(doc: dict) -> dict[tuple[str, str], list[tuple[int, int]]]:
    out: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for r in doc["results"]:
        out.setdefault((r["policy"], str(float(r["share"]))), []).append((r["n_slots"], r["misses"]))
    return {k: sorted(v) for k, v in out.items()}


class _Table(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.tags: set[str] = set()
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag == "tr":
            self.rows.append([])
        elif tag == "td":
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


@real
def test_the_heatmap_counts_the_routing_of_the_npz_twin():
    """Per layer and expert, the calls asking for it: the prompt's call once for any of its tokens, then each
    decode token's; from the ``.npz`` (cells lost at capture, -1, left out)."""
    for trace in (MIXTRAL, QWEN):
        d = np.load(trace.with_suffix(".npz"))
        ex, phase = d["experts"], d["phase"]
        tr = read_trace(str(trace), warn=False)
        want = np.zeros((tr.n_layer, tr.n_expert), np.int64)
        for layer in range(tr.n_layer):
            prompt = ex[phase == 0, layer].ravel()
            want[layer, np.unique(prompt[prompt >= 0])] += 1
            for tok in ex[phase == 1, layer]:
                want[layer, np.unique(tok[tok >= 0])] += 1
        assert np.array_equal(requests_matrix(tr), want), trace.name


@real
@pytest.mark.parametrize("ext", [".png", ".html"])
def test_the_plot_draws_the_points_replay_json_prints(tmp_path, ext):
    out = tmp_path / f"mixtral{ext}"
    r = replay_cli(str(MIXTRAL), "--share", "0,0.5", "--plot", str(out), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    want = points_of(doc)
    # the default curves: LRU, the runtime's default policy and Belady's optimum, each without and with the share
    assert {p for p, _ in want} == {"lru", doc["runtime_policy"], "belady"} and len(want) == 6
    assert all(len(v) >= 5 for v in want.values())
    if ext == ".png":
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        from matplotlib.image import imread

        assert imread(out).shape[0] > 300
        if os.environ.get("GGML_HYBRID_DOCS_IMAGES"):
            shutil.copy(out, Path(os.environ["GGML_HYBRID_DOCS_IMAGES"]) / "replay-mixtral.png")
    else:
        page = _Table()
        page.feed(out.read_text(encoding="utf-8"))
        assert "svg" in page.tags and "script" not in page.tags
        drawn: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for policy, share, slots, loads, *_ in (row for row in page.rows if row):  # the header row has no td
            drawn.setdefault((policy, str(float(share))), []).append((int(slots), int(loads)))
        assert {k: sorted(v) for k, v in drawn.items()} == want
    # what the figure draws: its lines' points, and its heatmap's cells
    tr, results = sweep(str(MIXTRAL), [], [], [0.0, 0.5], None)
    fig = figure(tr, results, "t")
    heat, curve = fig.axes[:2]
    lines = {tuple(line.get_gid().split(":")[1:]): list(zip(line.get_xdata(), line.get_ydata()))
             for line in curve.get_lines()}
    assert {(p, str(float(s))): [(int(x), int(y)) for x, y in v] for (p, s), v in lines.items()} == want
    calls = np.bincount([layer for layer, _ in tr.calls], minlength=tr.n_layer)
    assert np.allclose(heat.get_images()[0].get_array(), requests_matrix(tr) / calls[:, None])


@real
def test_a_plot_file_of_another_kind_is_one_error_line(tmp_path):
    r = replay_cli(str(MIXTRAL), "--slots", "2", "--plot", str(tmp_path / "x.svg"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and ".png or .html" in r.stderr
    assert not (tmp_path / "x.svg").exists()
    r = replay_cli(str(MIXTRAL), "--slots", "9")
    assert r.returncode == 2 and "exceeds the trace's n_expert=8" in r.stderr


def drawn_points(path: Path) -> dict[tuple[str, str], list[tuple[int, int]]]:
    page = _Table()
    page.feed(path.read_text(encoding="utf-8"))
    out: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for policy, share, slots, loads, *_ in (row for row in page.rows if row):
        out.setdefault((policy, str(float(share))), []).append((int(slots), int(loads)))
    return {k: sorted(v) for k, v in out.items()}


def test_plan_draws_a_traces_curves_for_the_model(tmp_path):
    """``plan MODEL --trace T --plot F``: the curves of T for the model's experts and its CPU share, the same points
    as ``replay T --json`` with that share; a trace of another shape is one error line."""
    from ggml_hybrid.synthetic import write_model

    model = write_model(tmp_path / "glm.gguf", arch="glm4moe", weight_type="q8_0", seed=4)
    tool = str(ROOT / "tools" / "replay_trace.py")
    for name, experts in (("t8", 8), ("t16", 16)):
        r = subprocess.run([sys.executable, tool, "synth", str(tmp_path / name), "--layers", "2", "--experts",
                            str(experts), "--used", "2", "--calls", "120"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    out = tmp_path / "curve.html"
    r = subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "plan", model, "--moe-cpu-share", "0.5", "-o",
                        "expert_cache_slots=3", "--trace", str(tmp_path / "t8"), "--plot", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    want = replay_cli(str(tmp_path / "t8"), "--share", "0,0.5", "--json")
    assert want.returncode == 0, want.stderr
    assert drawn_points(out) == points_of(json.loads(want.stdout))
    r = subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "plan", model, "--trace", str(tmp_path / "t16"),
                        "--plot", str(tmp_path / "x.png")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "a trace of another model" in r.stderr
