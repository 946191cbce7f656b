"""Dependencies whose internals the package reaches into are bounded to the versions it was checked on.

``server/guard.py`` subclasses uvicorn's h11 protocol and uses its private members (``connections``, ``conn``,
``cycle``, ``handle_events``, ``on_response_complete``): a uvicorn release may change them without notice (0.x),
so the ``server`` extra bounds uvicorn above until a newer one has passed tests/test_server_hostile.py.
Oracles: pyproject.toml read by tomllib, the requirement read by ``packaging``, the installed version's metadata.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _requirement(name: str, extra: str) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = [Requirement(r) for r in project["optional-dependencies"][extra]]
    found = [r for r in reqs if r.name == name]
    assert len(found) == 1, f"the {extra} extra names {name} {len(found)} times"
    return found[0]


def test_uvicorn_is_bounded_while_the_guard_subclasses_its_internals():
    guard = (ROOT / "ggml_hybrid" / "server" / "guard.py").read_text(encoding="utf-8")
    req = _requirement("uvicorn", "server")
    if "uvicorn.protocols" not in guard:
        return  # the guard no longer reaches into uvicorn: the bound may go
    uppers = [s for s in req.specifier if s.operator in ("<", "<=", "==", "~=")]
    assert uppers, f"{req}: server/guard.py subclasses uvicorn's protocol internals; bound the version above"
    assert Version("0.29.0") in req.specifier and Version("0.55.0") in req.specifier  # the versions checked
    installed = Version(importlib.metadata.version("uvicorn"))
    assert installed in req.specifier, f"uvicorn {installed} is installed, outside {req}"
