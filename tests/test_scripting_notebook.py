"""docs/scripting.ipynb is tools/make_scripting_notebook.py's notebook, run: its cells are the script's, every code
cell has outputs, and running it again prints the same tables (the drawings hold pointer addresses: not compared)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "docs" / "scripting.ipynb"


def _maker():
    import make_scripting_notebook  # tools/ is on the test path

    return make_scripting_notebook


def _texts(nb) -> list[str]:
    return ["".join(o.get("text", "") for o in c.outputs if o.output_type == "stream")
            for c in nb.cells if c.cell_type == "code"]


def test_the_notebook_is_the_scripts_and_was_run():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(str(NB), as_version=4)
    nbformat.validate(nb)
    mod = _maker()
    assert [(c.cell_type, c.source) for c in nb.cells] == list(mod.CELLS)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs for c in code), "every code cell shows something: run the script"
    drawings = [o for c in code for o in c.outputs if o.output_type == "display_data"]
    assert drawings and all("image/svg+xml" in o.data for o in drawings), "the graphs are drawn (Graphviz)"
    assert "loss gradient seed" in _texts(nb)[2] and "grad for w1" in _texts(nb)[2]


def test_running_the_notebook_again_prints_the_same_tables():
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.skip("no python3 Jupyter kernel (pip install ipykernel)")
    committed = nbformat.read(str(NB), as_version=4)
    mod = _maker()
    fresh = mod.run(mod.build())
    assert _texts(fresh) == _texts(committed)
