"""The docs name what is there: every ``ggml_hybrid.*`` path resolves, every source file and the names after it
exist, every patch they cite is in the series, and the map of the package is whole.

Oracles: the import system (a dotted path imports, then each attribute is there), the file system (a cited file
exists; a cited C function or Python name occurs in that file), ``vendor/patches/`` (the series as shipped) and
markdown-it with its anchors plugin (the headings' GitHub-style ids, the links as a renderer reads them).
The lab notebook (docs/benchmarks.md) records what was run then and is left out, but for its links.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from mdit_py_plugins.anchors import anchors_plugin

import ggml_hybrid

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ggml_hybrid"
DOCS = sorted([ROOT / "README.md", ROOT / "vendor" / "README.md",
               *(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")])
PATCHES = {p.name[:4]: p for p in (ROOT / "vendor" / "patches").glob("[0-9][0-9][0-9][0-9]-*.patch")}

DOTTED = re.compile(r"\bggml_hybrid(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# `path/to/file.py`, `file.c: name`, `file.py: Class.method, other`, `tests/test_x.py::test_y` inside backticks
CITED = re.compile(r"`((?:[\w.-]+/)*[\w-]+\.(?:py|c|h|toml))(?:::([\w]+)[^`]*|:\s*([^`]+))?`")
# GGML's and llama.cpp's own files (the pin's headers, llama.cpp's converter), not this repository's
UPSTREAM = re.compile(r"(?:^|/)(?:ggml[\w-]*\.h|gguf\.h|common\.h|convert_hf_to_gguf\.py)$|^src/ggml-")
PATCH_NO = re.compile(r"(?<![\d.\-\w])00\d\d(?![\d.\w])")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def _doc_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _resolve_dotted(name: str) -> object:
    """Import the longest module prefix of ``name``, then look the rest up as attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def _ours(p: Path) -> bool:
    return not {".venv", "build", ".git", "fixtures"} & set(p.relative_to(ROOT).parts)


def _cited_file(path: str) -> Path | None:
    """A cited path: under the package or the repository, or written from a subfolder the docs name elsewhere
    (``src/moe_exec.c``, ``ggfuzz/rpc_cases.py``, a bare ``gen_model.py``): the one file whose path ends so."""
    for base in (PKG, ROOT, PKG / "_native"):
        if (base / path).is_file():
            return base / path
    found = [p for p in ROOT.rglob(Path(path).name) if _ours(p) and ("/" + p.as_posix()).endswith("/" + path)]
    return found[0] if len(found) == 1 else None


def _names_in(path: Path) -> set[str]:
    """The names defined in a Python file (dotted for class members), or the identifiers of a C file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    names: set[str] = set()

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + child.name)
                if isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.Assign, ast.AnnAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.add(prefix + n.id)
                        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                            names.add(prefix + n.attr)
            elif isinstance(child, (ast.ImportFrom, ast.Import)):
                names.update(prefix + (a.asname or a.name).split(".")[0] for a in child.names)
            if not isinstance(child, ast.ClassDef):
                walk(child, prefix)

    walk(ast.parse(text), "")
    return names


def _citations() -> list[tuple[str, str, str | None]]:
    """(doc, path, the name cited in it or None) of every file citation of the docs but upstream files."""
    return [(p.name, m.group(1), m.group(2) or m.group(3)) for p in DOCS for m in CITED.finditer(_doc_text(p))
            if "<" not in m.group(1) and not UPSTREAM.search(m.group(1))]


@pytest.mark.parametrize("doc", DOCS + [PKG / "__init__.py"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_dotted_path_resolves(doc):
    text = _doc_text(doc) if doc.suffix == ".md" else (ggml_hybrid.__doc__ or "")
    bad = []
    for name in sorted(set(DOTTED.findall(text))):
        try:
            _resolve_dotted(name)
        except (ImportError, AttributeError) as exc:
            bad.append(f"{name} ({type(exc).__name__}: {exc})")
    assert not bad, f"{doc.name} names what is not there: " + "; ".join(bad)


def test_every_cited_file_and_name_exists():
    bad = []
    for doc, path, names in _citations():
        where = _cited_file(path)
        if where is None:
            bad.append(f"{doc}: `{path}` is no file")
            continue
        if names is None or where.suffix not in (".py", ".c", ".h"):
            continue
        defined = _names_in(where)
        for cited in re.split(r",\s*|\s+", names.strip()):
            ident = IDENT.match(cited.strip("()"))
            if ident is None or ident.group(0) in ("", "the"):
                continue
            name = ident.group(0)
            if name not in defined:
                bad.append(f"{doc}: `{path}: {name}` is not defined there")
            break  # the first name after the colon is the citation; what follows is prose
    assert not bad, "\n".join(bad)


def test_every_patch_the_docs_cite_is_in_the_series():
    bad = [f"{p.name}: patch {n}" for p in DOCS + [ROOT / "vendor" / "CMakeLists.txt"]
           for n in sorted(set(PATCH_NO.findall(_doc_text(p)))) if n not in PATCHES]
    assert not bad, "cited patches not in vendor/patches/: " + ", ".join(bad)


def test_architecture_and_the_vendor_readme_list_every_patch():
    for doc in (ROOT / "docs" / "architecture.md", ROOT / "vendor" / "README.md"):
        named = set(PATCH_NO.findall(_doc_text(doc)))
        missing = sorted(set(PATCHES) - named)
        assert not missing, f"{doc.relative_to(ROOT)} does not name patches {missing}"


def test_the_package_docstring_maps_every_subpackage_and_shared_module():
    doc = ggml_hybrid.__doc__ or ""
    named = {n.split(".")[1] for n in DOTTED.findall(doc)} | set(re.findall(r"``(\w+)``", doc))
    present = {m.name for m in pkgutil.iter_modules([str(PKG)])}
    missing = sorted(present - named)
    assert not missing, f"ggml_hybrid/__init__.py's docstring does not name {missing}"


def test_architecture_names_every_subpackage_and_module():
    """The map in docs/architecture.md lists every module of every layer (``name`` or ``name.py``)."""
    text = _doc_text(ROOT / "docs" / "architecture.md")
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    missing = []
    for info in pkgutil.walk_packages([str(PKG)], "ggml_hybrid."):
        leaf = info.name.rsplit(".", 1)[1]
        if leaf.startswith("__") or leaf in words:
            continue
        missing.append(info.name)
    assert not missing, f"docs/architecture.md does not name {missing}"


_MD = MarkdownIt("commonmark").use(anchors_plugin, max_level=6)


def _anchors(path: Path) -> set[str]:
    return {t.attrs["id"] for t in _MD.parse(_doc_text(path)) if t.type == "heading_open" and "id" in t.attrs}


def _links(path: Path) -> list[str]:
    out = []
    for t in _MD.parse(_doc_text(path)):
        for child in t.children or ():
            if child.type == "link_open":
                out.append(str(child.attrs["href"]))
    return out


@pytest.mark.parametrize("doc", DOCS + [ROOT / "docs" / "benchmarks.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(doc):
    bad = []
    for href in _links(doc):
        if "://" in href or href.startswith("mailto:"):
            continue
        target, _, anchor = href.partition("#")
        where = (doc.parent / target).resolve() if target else doc
        if not where.exists():
            bad.append(f"{href}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            bad.append(f"{href}: no heading #{anchor} in {where.relative_to(ROOT)}")
    assert not bad, f"{doc.relative_to(ROOT)}: " + "; ".join(bad)
