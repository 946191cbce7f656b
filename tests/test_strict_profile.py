"""mypy's strict profile (pyproject.toml) names modules that exist, and covers every module the public API comes
from: what ``ggml_hybrid`` exports and every module docs/api.md names. A module moved or added without its entry
would otherwise leave the strict profile without a word."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

import ggml_hybrid as gh

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the 3.10 fallback
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _strict_patterns() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    strict = [o for o in config["tool"]["mypy"]["overrides"] if o.get("disallow_untyped_defs")]
    assert len(strict) == 1, "one strict section"
    return list(strict[0]["module"])


PATTERNS = _strict_patterns()


def _covered(module: str) -> bool:
    # mypy's rule: "a.b" names that module; "a.b.*" names a.b and every module below it
    return any(module == p or (p.endswith(".*") and (module + ".").startswith(p[:-1])) for p in PATTERNS)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ModuleNotFoundError, ValueError):  # ValueError: a module object of no spec (cffi's lib)
        return False


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_strict_entry_names_a_module(pattern):
    assert _is_module(pattern.removesuffix(".*")), f"{pattern}: no such module (moved?)"


def test_every_public_export_comes_from_a_strict_module():
    homes = {}
    for name in gh.__all__:
        obj = getattr(gh, name)
        module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
        if isinstance(module, str) and module.startswith("ggml_hybrid"):
            # gh.lib: cffi's "ggml_hybrid._native._ggml.lib", typed by the compiled module's stub
            homes[name] = module if _is_module(module) else module.rpartition(".")[0]
    assert {"MoEModel", "Tokenizer", "Tensor", "live_objects", "errors", "lib"} <= set(homes)
    assert {n: m for n, m in homes.items() if not _covered(m)} == {}


def test_every_module_api_md_names_is_strict():
    names = set(re.findall(r"ggml_hybrid(?:\.\w+)+", (ROOT / "docs" / "api.md").read_text()))
    assert names, "docs/api.md names no module"
    modules = set()
    for name in names:  # the longest prefix that is a module: "pkg.mod.function" -> "pkg.mod"
        parts = name.split(".")
        module = next(".".join(parts[:i]) for i in range(len(parts), 0, -1) if _is_module(".".join(parts[:i])))
        modules.add(module)
    assert {m for m in modules if not _covered(m)} == set()
