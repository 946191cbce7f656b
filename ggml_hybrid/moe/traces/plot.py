"""Pictures of a routing trace (``ggml-hybrid replay TRACE --plot FILE``, ``plan MODEL --trace TRACE --plot FILE``).

Two panels: the heatmap of requests (a row per layer, a column per expert: the share of the layer's calls that
asked for the expert: the routing's skew), and the loads against the slots per layer, one curve per eviction
policy replayed (:func:`.replay.replay`: LRU, the runtime's default and Belady's offline optimum by default), drawn
solid without a CPU share and dashed with each CPU share asked for (the misses the CPU computes are not loaded).
Each point is a :class:`.replay.ReplayResult`'s ``misses``: the same number ``replay --json`` prints.

Drawn with matplotlib (the optional extra ``plot``): ``.png`` is its raster; ``.html`` is one self-contained page
holding matplotlib's SVG of the same figure and the table of every point drawn (no script, nothing fetched: it
opens offline and its numbers can be read back). Plotly's pages would carry several MB of JavaScript or fetch it
from a CDN, which a machine without internet cannot.
"""

from __future__ import annotations

import html
import io
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ...errors import TraceError
from .format import Trace
from .replay import ReplayResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FORMATS = (".png", ".html")


def requests_matrix(trace: Trace) -> npt.NDArray[np.int64]:
    """``[n_layer, n_expert]``: the calls of each layer that asked for each expert (each expert once per call)."""
    out = np.zeros((trace.n_layer, trace.n_expert), np.int64)
    for layer, ids in trace.calls:
        out[layer, np.unique(ids)] += 1
    return out


def default_slots(n_expert: int, n_used: int) -> list[int]:
    """A sweep of slot counts for a curve: from ``n_used`` (one token's experts) to every expert, about 12 points."""
    lo = max(1, min(n_used, n_expert))
    return sorted({int(round(x)) for x in np.geomspace(lo, n_expert, 12)})


def check_plot_path(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise TraceError(f"--plot {path!r}: the file must end in .png or .html (got {ext or 'no extension'!r})")
    return ext


def curve_points(results: Sequence[ReplayResult]) -> dict[tuple[str, float | str], list[tuple[int, int]]]:
    """``(policy, share) -> [(slots, loads)]`` in increasing slots: the points the curves draw."""
    out: dict[tuple[str, float | str], list[tuple[int, int]]] = {}
    for r in results:
        out.setdefault((r.policy, r.share), []).append((r.n_slots, r.misses))
    return {k: sorted(v) for k, v in out.items()}


def figure(trace: Trace, results: Sequence[ReplayResult], title: str) -> Figure:
    """The two panels for ``trace`` and its replays ``results``."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise TraceError("--plot needs matplotlib: pip install 'ggml-hybrid[plot]'") from None
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    heat, curve = fig.subplots(1, 2, width_ratios=[1.1, 1])
    req = requests_matrix(trace)
    calls = np.bincount([layer for layer, _ in trace.calls], minlength=trace.n_layer)
    share = req / np.maximum(calls, 1)[:, None]
    im = heat.imshow(share, aspect="auto", cmap="Blues", vmin=0, interpolation="nearest")
    heat.set(xlabel="expert", ylabel="layer", title="share of each layer's calls asking for the expert")
    fig.colorbar(im, ax=heat, shrink=0.85)
    colors: dict[str, str] = {}
    for (policy, s), pts in curve_points(results).items():
        xs, ys = zip(*pts)
        label = policy if s == 0.0 else f"{policy}, CPU share {s}"
        color = colors.setdefault(policy, f"C{len(colors)}")  # a policy's curves share its colour
        curve.plot(xs, ys, marker="o", markersize=3, linestyle="-" if s == 0.0 else "--", label=label, color=color,
                   gid=f"curve:{policy}:{s}")
    curve.set(xlabel="expert slots per layer", ylabel="experts loaded (whole trace)",
              title=f"loads against slots ({trace.n_calls} calls, {trace.tokens:.0f} tokens)")
    curve.grid(alpha=0.3)
    curve.legend(fontsize="small")
    fig.suptitle(title)
    return fig


def write_plot(path: str, trace: Trace, results: Sequence[ReplayResult], title: str) -> Figure:
    """Write the figure to ``path`` (``.png`` or ``.html``); returns it."""
    ext = check_plot_path(path)
    fig = figure(trace, results, title)
    if ext == ".png":
        fig.savefig(path, dpi=110)
        return fig
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    rows = "\n".join(f"<tr><td>{html.escape(r.policy)}</td><td>{html.escape(str(r.share))}</td><td>{r.n_slots}</td>"
                     f"<td>{r.misses}</td><td>{r.cpu}</td><td>{r.hits}</td><td>{r.hit_rate:.4f}</td></tr>"
                     for r in sorted(results, key=lambda r: (r.policy, str(r.share), r.n_slots)))
    body = svg.getvalue()
    body = body[body.index("<svg"):]  # the SVG element without its XML prolog: inline in the page
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title></head>
<body>
<h1>{html.escape(title)}</h1>
{body}
<table id="points">
<thead><tr><th>policy</th><th>share</th><th>slots</th><th>loads</th><th>cpu</th><th>hits</th><th>hit rate</th></tr>
</thead>
<tbody>
{rows}
</tbody></table>
</body></html>
""")
    return fig


__all__ = ["FORMATS", "check_plot_path", "curve_points", "default_slots", "figure", "requests_matrix",
           "write_plot"]
