"""The size budget: caps on function size, parameter count and module length that only shrink (tinygrad's habit).

Caps (the ones today's best rooms already meet; docs/architecture.md, "The size budget"):

- Python functions of the package: ruff's own rules, configured in ruff.toml: complexity (C901, 12), branches
  (PLR0912, 12), arguments (PLR0913, 8), statements (PLR0915, 50); ``ruff check`` in CI enforces them outside
  the files that hold today's exceptions, this test inside them, function by function;
- Python modules of the package: :data:`MODULE_LINES` lines;
- our C (``_native/src/*.c``), measured by lizard: :data:`C_FUNCTION_LINES` lines and :data:`C_PARAMS` parameters
  per function, :data:`C_FILE_LINES` lines per file.

Each exception of today is listed below with its size. The lists may only shrink: a listed item that grows fails,
a new item over a cap fails, and a listed item that now meets its cap (or is gone) fails until it leaves the list.
Oracles: ruff (the JSON of its findings), lizard (its function table), the line counts of the files.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import lizard
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ggml_hybrid"
C_SRC = PKG / "_native" / "src"
RULES = ("C901", "PLR0912", "PLR0913", "PLR0915")
MODULE_LINES = 600
C_FUNCTION_LINES = 64
C_PARAMS = 8
C_FILE_LINES = 700

# today's exceptions: "path:qualified name" -> {rule: size}; shrink them, never grow them
PY_FUNCTIONS: dict[str, dict[str, int]] = {
    "ggml_hybrid/cli/bench.py:_ab": {"PLR0913": 9},
    "ggml_hybrid/cli/bench.py:bench": {"PLR0913": 11},
    "ggml_hybrid/cli/flags.py:check_args": {"C901": 14, "PLR0912": 14},
    "ggml_hybrid/cli/gen.py:gen": {"PLR0913": 16},
    "ggml_hybrid/cli/run.py:run": {"C901": 25, "PLR0912": 27, "PLR0913": 26, "PLR0915": 82},
    "ggml_hybrid/cli/serve.py:_run_server": {"C901": 17},
    "ggml_hybrid/cli/serve.py:serve": {"PLR0913": 17},
    "ggml_hybrid/ggml/ops/attention.py:AttentionOps.rope": {"PLR0913": 12},
    "ggml_hybrid/ggml/ops/attention.py:AttentionOps.rope_multi": {"PLR0913": 12},
    "ggml_hybrid/gguf/header.py:_walk": {"C901": 14, "PLR0912": 13},
    "ggml_hybrid/gguf/store.py:load_into": {"PLR0913": 9},
    "ggml_hybrid/model/decoder.py:build_decoder": {"PLR0913": 9},
    "ggml_hybrid/model/kv_cache.py:KVCache.__init__": {"PLR0913": 13},
    "ggml_hybrid/model/layers.py:Builder.__init__": {"PLR0913": 10},
    "ggml_hybrid/model/step_feed.py:StepFeed.__init__": {"C901": 13},
    "ggml_hybrid/moe/expert_layers.py:ExpertLayers.__init__": {"PLR0913": 14},
    "ggml_hybrid/moe/expert_layers.py:check_moe_options": {"C901": 13},
    "ggml_hybrid/moe/slot_cache.py:SlotCache.plan": {"PLR0915": 54},
    "ggml_hybrid/moe/traces/format.py:read_trace": {"C901": 20, "PLR0912": 19, "PLR0915": 75},
    "ggml_hybrid/moe/traces/replay.py:replay": {"C901": 13, "PLR0912": 16, "PLR0915": 62},
    "ggml_hybrid/moe/traces/synthesis.py:synthetic_trace": {"PLR0913": 9, "PLR0915": 51},
    "ggml_hybrid/placement/layout.py:plan_layout": {"C901": 26, "PLR0912": 27, "PLR0915": 66},
    "ggml_hybrid/plan/planner.py:_verify": {"C901": 13, "PLR0912": 14},
    "ggml_hybrid/runtime/generate.py:generate": {"C901": 16, "PLR0912": 17, "PLR0915": 61},
    "ggml_hybrid/server/anthropic.py:read_request": {"C901": 16, "PLR0912": 15},
    "ggml_hybrid/server/config.py:load_config": {"C901": 15, "PLR0912": 14},
    "ggml_hybrid/server/guard.py:protocol_class": {"C901": 26},
    "ggml_hybrid/server/routes.py:Routes.stream": {"C901": 18, "PLR0912": 18, "PLR0915": 55},
    "ggml_hybrid/server/routes.py:Routes.wait": {"PLR0913": 9},
    "ggml_hybrid/synthetic/spec.py:ModelSpec.check": {"C901": 19, "PLR0912": 18},
    "ggml_hybrid/synthetic/writer.py:_first_three": {"C901": 14, "PLR0915": 62},
    "ggml_hybrid/synthetic/writer.py:_hybrid": {"PLR0915": 58},
    "ggml_hybrid/synthetic/writer.py:write_moe_stack": {"PLR0913": 9},
    "ggml_hybrid/text/spm.py:SPMTokenizer.__init__": {"PLR0913": 11},
    "ggml_hybrid/text/spm.py:SPMTokenizer._merge": {"C901": 14},
    "ggml_hybrid/text/tokenizer.py:Tokenizer.__init__": {"C901": 14, "PLR0912": 13, "PLR0913": 11},
}
PY_MODULES: dict[str, int] = {
    "ggml_hybrid/moe/executor.py": 649,
    "ggml_hybrid/plan/planner.py": 750,
}
C_FUNCTIONS: dict[str, dict[str, int]] = {
    "moe_policy.c:hy_cache_plan": {"lines": 119},
    "moe_policy.c:hy_split_misses": {"params": 10},
}
C_FILES: dict[str, int] = {}


def _qualnames(path: Path) -> dict[int, str]:
    """The qualified name of every function by the line of its ``def``."""
    out: dict[int, str] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not isinstance(child, ast.ClassDef):
                    out[child.lineno] = prefix + child.name
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text(encoding="utf-8")), "")
    return out


def ruff_sizes(paths: list[Path], config: list[str] = ()) -> dict[str, dict[str, int]]:
    """ruff's budget findings over ``paths`` with ruff.toml's caps and no file exempted: "path:function" ->
    {rule: size}."""
    cmd = [sys.executable, "-m", "ruff", "check", *map(str, paths), "--select", ",".join(RULES), "--output-format",
           "json", "--exit-zero", "--no-cache", "--config", "lint.per-file-ignores = {}", *config]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    found: dict[str, dict[str, int]] = {}
    names: dict[Path, dict[int, str]] = {}
    for f in json.loads(res.stdout):
        path = Path(f["filename"])
        row = f["location"]["row"]
        qual = names.setdefault(path, _qualnames(path)).get(row, f"line {row}")
        size = int(f["message"].rsplit("(", 1)[1].split(" > ")[0])
        key = f"{path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name}:{qual}"
        found.setdefault(key, {})[f["code"]] = size
    return found


def c_sizes(files: list[Path]) -> dict[str, dict[str, int]]:
    """lizard's length and parameter count of every function over a cap: "file:function" -> sizes."""
    found: dict[str, dict[str, int]] = {}
    for path in files:
        for fn in lizard.analyze_file(str(path)).function_list:
            over = {k: v for k, v, cap in (("lines", fn.length, C_FUNCTION_LINES),
                                           ("params", fn.parameter_count, C_PARAMS)) if v > cap}
            if over:
                found[f"{path.name}:{fn.name}"] = over
    return found


def line_counts(files: list[Path], cap: int) -> dict[str, int]:
    out = {}
    for p in files:
        n = len(p.read_text(encoding="utf-8").splitlines())
        if n > cap:
            out[p.relative_to(ROOT).as_posix() if p.is_relative_to(ROOT) else p.name] = n
    return out


def over_budget(found: dict, allowed: dict, what: str) -> list[str]:
    """What breaks the budget: a new item over a cap, a listed one that grew, a listed one that meets its cap."""
    bad = []
    for key, sizes in sorted(found.items()):
        listed = allowed.get(key)
        for rule, size in (sizes.items() if isinstance(sizes, dict) else [("lines", sizes)]):
            was = listed.get(rule) if isinstance(listed, dict) else listed
            if was is None:
                bad.append(f"{key}: {rule} {size} is over the cap ({what}): make it smaller")
            elif size > was:
                bad.append(f"{key}: {rule} grew from {was} to {size}: the list only shrinks")
    for key, sizes in sorted(allowed.items()):
        now = found.get(key)
        for rule in (sizes if isinstance(sizes, dict) else ["lines"]):
            if now is None or (isinstance(now, dict) and rule not in now):
                bad.append(f"{key}: {rule} now meets the cap (or is gone): take it off the list in tests/test_budget.py"
                           + (" and ruff.toml's per-file-ignores" if rule in RULES else ""))
    return bad


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_python_functions_keep_the_budget():
    assert over_budget(ruff_sizes([PKG]), PY_FUNCTIONS, "ruff.toml") == []


def test_ruff_exempts_exactly_the_files_of_todays_exceptions():
    """CI's ``ruff check`` enforces the caps in every other file of the package; a file leaves the exemptions with
    its last exception."""
    config = tomllib.loads((ROOT / "ruff.toml").read_text(encoding="utf-8"))
    lint = config["lint"]
    assert set(RULES) <= set(lint["select"])
    assert (lint["mccabe"]["max-complexity"], lint["pylint"]["max-branches"], lint["pylint"]["max-args"],
            lint["pylint"]["max-statements"]) == (12, 12, 8, 50)
    exempt = {path: sorted(set(rules) & set(RULES)) for path, rules in lint["per-file-ignores"].items()
              if not path.startswith("!") and set(rules) & set(RULES)}
    want: dict[str, set[str]] = {}
    for key, sizes in PY_FUNCTIONS.items():
        want.setdefault(key.split(":")[0], set()).update(sizes)
    assert exempt == {path: sorted(rules) for path, rules in sorted(want.items())}
    assert lint["per-file-ignores"]["!ggml_hybrid/**"] == list(RULES)  # the budget is the package's


def test_python_modules_keep_the_budget():
    assert over_budget(line_counts(_modules(), MODULE_LINES), PY_MODULES, f"{MODULE_LINES} lines") == []


def test_c_functions_keep_the_budget():
    found = c_sizes(sorted(C_SRC.glob("*.c")))
    assert over_budget(found, C_FUNCTIONS, f"{C_FUNCTION_LINES} lines, {C_PARAMS} parameters") == []


def test_c_files_keep_the_budget():
    assert over_budget(line_counts(sorted(C_SRC.glob("*.c")), C_FILE_LINES), C_FILES, f"{C_FILE_LINES} lines") == []


# -- the budget's checks can fail ---------------------------------------------------------------------------------

def test_the_checks_see_a_function_over_each_cap(tmp_path):
    args = ", ".join(f"a{i}" for i in range(9))
    body = "".join(f"    if a{i % 9} > {i}:\n        x += {i}\n" for i in range(14))
    body += "".join(f"    y{i} = {i}\n" for i in range(45))
    src = tmp_path / "big.py"
    src.write_text(f"def big({args}):\n    x = 0\n{body}    return x\n")
    found = ruff_sizes([src])
    assert set(found["big.py:big"]) == set(RULES), found
    assert over_budget(found, {}, "caps") and not over_budget(found, found, "caps")
    c = tmp_path / "big.c"
    c.write_text("int big(int a, int b, int c, int d, int e, int f, int g, int h, int i) {\n"
                 + "    a++;\n" * 70 + "    return a;\n}\n")
    assert c_sizes([c]) == {"big.c:big": {"lines": 73, "params": 9}}


@pytest.mark.parametrize("allowed, message", [
    ({"f.py:g": {"C901": 20}}, "now meets the cap"),  # listed, no longer over
    ({"f.py:h": {"C901": 13}}, "grew from 13 to 15"),  # listed, grown
    ({}, "is over the cap"),  # not listed
])
def test_the_list_only_shrinks(allowed, message):
    found = {"f.py:h": {"C901": 15}}
    bad = over_budget(found, allowed, "caps")
    assert any(message in b for b in bad), bad
