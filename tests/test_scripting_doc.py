"""docs/scripting.md's snippets run, in order, in one namespace (their own asserts check what they print)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "scripting.md"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_the_scripting_guide_runs():
    pytest.importorskip("sklearn")
    blocks = snippets()
    assert len(blocks) >= 6
    ns: dict[str, object] = {"__name__": "scripting_doc"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, block in enumerate(blocks):
            try:
                exec(compile(block, f"{DOC.name}[snippet {i + 1}]", "exec"), ns)
            except Exception as exc:  # pragma: no cover - the message names the snippet
                raise AssertionError(f"snippet {i + 1} of {DOC.name} failed: {exc!r}\n{block}") from exc
    text = out.getvalue()
    # what the guide says the first snippets print
    assert "[ 11.107338 223.09685 ]" in text
    assert "ops without a CPU kernel: none" in text
    assert "(2, 4, 8, 8)" in text
    assert "mul_mat: a and b must have the same innermost (k) dimension" in text
    assert "#  name    op        shape   type  backend  flags  sources" in text
    assert "no gradient for unary tanh" in text
