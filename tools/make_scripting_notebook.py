"""Write docs/scripting.ipynb by running it: a small model's graph, its backward pass, as a table and as a drawing.

    python tools/make_scripting_notebook.py          # needs nbformat, nbclient, ipykernel (the test extra)

The drawing is GGML's dot text rendered by Graphviz's ``dot`` (``apt-get install graphviz``) when it is installed;
without it the notebook shows the dot text. tests/test_scripting_notebook.py checks that the committed notebook is
this script's, run.
"""

from __future__ import annotations

from pathlib import Path

import click

OUT = Path(__file__).resolve().parents[1] / "docs" / "scripting.ipynb"

CELLS = [
    ("markdown", """# Seeing a GGML graph

A two-layer network's forward pass and GGML's backward pass, built with ggml-hybrid: `Graph.describe` lists the
nodes (op, numpy-order shape, type, the backend the scheduler gave each, flags, sources), `Graph.dot` gives GGML's
own dot text (`ggml_graph_dump_dot`), drawn here by Graphviz. [scripting.md](scripting.md) teaches the API."""),
    ("code", """import shutil
import subprocess

import numpy as np
from IPython.display import SVG, display

import ggml_hybrid as gh

cpu = gh.cpu(n_threads=1)
params = gh.Context(n_tensors=8)
x = params.new_tensor("f32", (4, 8), "x")
w1, b1 = params.new_tensor("f32", (16, 8), "w1"), params.new_tensor("f32", (16,), "b1")
w2 = params.new_tensor("f32", (3, 16), "w2")
labels = params.new_tensor("f32", (4, 3), "labels")
params.allocate(cpu)
for t in (w1, b1, w2):
    t.set_param()

ctx = gh.Context(n_tensors=256, graph_size=256, grads=True)
hidden = ctx.relu(ctx.add(ctx.mul_mat(w1, x), b1))
hidden.name = "hidden"
logits = ctx.mul_mat(w2, hidden)
logits.name = "logits"
loss = ctx.cross_entropy_loss(logits, labels)
loss.name = "loss"
forward = ctx.new_graph().expand(loss)
sched = gh.Scheduler([cpu], graph_size=256)
sched.alloc(forward)
print(forward.describe(sched))"""),
    ("code", """def draw(graph, forward=None):
    text = graph.dot(forward=forward)
    if shutil.which("dot"):
        display(SVG(subprocess.run(["dot", "-Tsvg"], input=text.encode(), capture_output=True, check=True).stdout))
    else:
        print(text)

draw(forward)"""),
    ("markdown", """With `backward(loss)` GGML adds the gradient of the loss for each parameter: `grad for w1` and the
others are nodes of the same graph (outputs: the allocator keeps them), `loss gradient seed` the input that
`graph.seed()` sets to 1 before each compute. In the drawing, parameters are yellow and the nodes with a gradient
green; a node's gradient is drawn in its record."""),
    ("code", """training = gh.Context(n_tensors=256, graph_size=256, grads=True)
h2 = training.relu(training.add(training.mul_mat(w1, x), b1))
loss2 = training.cross_entropy_loss(training.mul_mat(w2, h2), labels)
graph = training.new_graph().expand(loss2).backward(loss2)
sched.alloc(graph)
print(graph.describe(sched))"""),
    ("code", """draw(graph)"""),
]


def build():  # -> nbformat.NotebookNode
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, src in CELLS:
        nb.cells.append(nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src))
    return nb


def run(nb):
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(OUT.parent)}}).execute()
    return nb


@click.command(help=__doc__)
def main() -> None:
    import nbformat

    nb = run(build())
    nbformat.write(nb, str(OUT))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
