"""The package's import graph: no module imports itself back, through any chain.

The layer rule between subpackages is import-linter's contract (``[tool.importlinter]`` in pyproject.toml, run by
``lint-imports`` in .ci/run). This test adds what the contract does not see: cycles between modules, inside a
layer too. grimp (the graph import-linter builds) counts function-level imports, so an import moved into a
function to dodge a cycle still closes one here; imports made only for type checking are left out.
"""

from __future__ import annotations

import re
from pathlib import Path

import grimp


def _cycles(graph: grimp.ImportGraph) -> list[tuple[str, str]]:
    found = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if graph.chain_exists(importer=imported, imported=module):
                found.add(tuple(sorted((module, imported))))
    return sorted(found)


def test_no_module_imports_itself_back():
    graph = grimp.build_graph("ggml_hybrid", exclude_type_checking_imports=True)
    assert _cycles(graph) == []


def test_the_cycle_check_sees_function_level_imports(tmp_path, monkeypatch):
    # a two-module package whose cycle is hidden in a function: the check must still report it
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclepkg", exclude_type_checking_imports=True, cache_dir=None)
    assert _cycles(graph) == [("cyclepkg.a", "cyclepkg.b")]


def test_no_test_or_tool_edits_sys_path():
    # tests find their helpers and the tools through pytest's `pythonpath` setting; a tool run as a script has
    # its own folder on the path already: an edit of sys.path hides where a module really comes from
    root = Path(__file__).resolve().parents[1]
    files = [p for top in ("tests", "tools", "ggml_hybrid") for p in (root / top).rglob("*.py")]
    edits = [f"{p.relative_to(root)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"sys\.path\.(insert|append|extend)\(|sys\.path\s*\+?=", line) and p.name != "test_layers.py"]
    assert edits == []
