"""The summary of a fuzz run (JSON) and the reproducers of its failures."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from collections import Counter
from typing import Any

from .proc import BAD, CLASSES


class Summary:
    def __init__(self, kind: str, seed: int, cases: int, out: str, argv: list[str]) -> None:
        self.kind, self.seed, self.n, self.out = kind, seed, cases, out
        self.argv = argv
        self.by_class: Counter[str] = Counter()
        self.by_command: dict[str, Counter[str]] = {}
        self.exits: dict[str, Counter[str]] = {}  # per command: how the fine ones ended (coverage)
        self.failures: list[dict[str, Any]] = []
        self.harness_errors: list[dict[str, Any]] = []
        self.started = datetime.datetime.now().isoformat(timespec="seconds")

    def add(self, rec: dict[str, Any]) -> None:
        if "harness_error" in rec:
            self.harness_errors.append(rec)
            return
        self.by_class[rec["class"]] += 1
        for cmd, r in rec.get("results", {}).items():
            self.by_command.setdefault(cmd, Counter())[r["class"]] += 1
            if r["class"] == "fine":
                self.exits.setdefault(cmd, Counter())[str(r.get("rc"))] += 1
        if rec["class"] in BAD:
            self.failures.append(rec)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "seed": self.seed, "cases": self.n, "started": self.started,
            "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in self.argv), "python": sys.version.split()[0],
            "machine": platform.machine(),
            "classes": {c: self.by_class.get(c, 0) for c in CLASSES},
            "by_command": {cmd: dict(sorted(c.items())) for cmd, c in sorted(self.by_command.items())},
            "fine_exit_status": {cmd: dict(sorted(c.items())) for cmd, c in sorted(self.exits.items())},
            "failures": [_short(f) for f in self.failures],
            "harness_errors": self.harness_errors[:20],
        }

    def write(self) -> str:
        path = os.path.join(self.out, f"summary-{self.kind}.json")
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        return path

    def line(self) -> str:
        counts = ", ".join(f"{c} {self.by_class.get(c, 0)}" for c in CLASSES if self.by_class.get(c, 0) or c == "fine")
        extra = f", harness errors {len(self.harness_errors)}" if self.harness_errors else ""
        return f"{self.kind}: {sum(self.by_class.values())} cases: {counts}{extra}"


def _short(rec: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in rec.items() if k != "results"}
    out["results"] = {cmd: {**r, "repro": "ggml-hybrid " + " ".join(shlex.quote(str(a)) for a in r.get("args", []))}
                      for cmd, r in rec.get("results", {}).items() if r["class"] in BAD}
    return out


__all__ = ["Summary"]
