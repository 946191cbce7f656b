"""The patch series as an upstream maintainer takes one (issue 41): one purpose per patch, each in ``git format-patch``
form with a message that says why, what and how it was tested, each applying on the ones before it, the scheduler fix
first and applying to the pin alone, and a script that exports the series.

Oracles: git (``tools/export_patches.sh`` applies the series with ``git am`` to a repository of the pin and exports it
with ``git format-patch``: the export must give the vendored files back byte for byte) and ``git apply --check`` at
the pin. The reproduction of the scheduler fix (it fails on the pin, passes with the fix) builds GGML twice: slow.
"""

from __future__ import annotations

import email
import email.policy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ggml_hybrid._native import buildinfo

ROOT = Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "vendor" / "patches").glob("*.patch"))
MAIL = re.compile(r"^From 0{40} Mon Sep 17 00:00:00 2001\n")
# the patch kept as a plain diff: its bytes are in the Vulkan backend's cache key (vendor/README.md)
PLAIN = {"0007-vulkan-old-headers.patch"}
FIX = "0001-sched-restore-replaced-sources.patch"

pytestmark = [
    pytest.mark.skipif(not buildinfo.VENDOR_DIR.is_dir(), reason="needs the source checkout's vendor/"),
    pytest.mark.skipif(shutil.which("git") is None, reason="needs git"),
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The series applied to a git repository of the pin by tools/export_patches.sh, and exported again."""
    repo = tmp_path_factory.mktemp("series") / "repo"
    res = subprocess.run(["bash", str(ROOT / "tools" / "export_patches.sh"), "--repo", str(repo)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env={"PYTHON": sys.executable,
                                                                           "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(repo)
    return repo


def _message(patch: Path) -> email.message.EmailMessage:
    msg = email.message_from_bytes(patch.read_bytes(), policy=email.policy.default)
    assert isinstance(msg, email.message.EmailMessage)
    return msg


def test_the_export_gives_the_series_back_byte_for_byte(exported):
    out = exported / "export"
    assert sorted(p.name for p in out.glob("*.patch")) == [p.name for p in PATCHES]
    for p in PATCHES:
        if p.name in PLAIN:
            continue
        assert (out / p.name).read_bytes() == p.read_bytes(), f"{p.name} is not what git format-patch writes"


def test_each_patch_but_one_is_in_mail_form_with_why_what_and_how_tested():
    assert {p.name for p in PATCHES if not MAIL.match(p.read_text())} == PLAIN
    for p in PATCHES:
        if p.name in PLAIN:
            continue
        msg = _message(p)
        subject = str(msg["Subject"]).removeprefix("[PATCH] ")
        # "area : what", and the file name is git's for that subject
        assert re.fullmatch(r"[a-z]+ : [a-z][\w ,'-]+", subject), subject
        assert p.name[5:-6] == re.sub(r"[^\w.]+", "-", subject).strip("-"), p.name
        body = str(msg.get_content()).split("\n---\n", 1)[0]
        paragraphs = [q for q in body.split("\n\n") if q.strip()]
        # why and what (at least two paragraphs), then how it was tested
        assert len(paragraphs) >= 3 and paragraphs[-1].startswith("Tested:"), p.name
        assert "diff --git" in p.read_text()


def test_the_scheduler_fix_applies_to_the_pin_alone(exported):
    res = subprocess.run(["git", "-C", str(exported), "worktree", "add", "-q", "--detach",
                          str(exported.parent / "pin"), "pin"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    res = subprocess.run(["git", "-C", str(exported.parent / "pin"), "apply", "--check",
                          str(ROOT / "vendor" / "patches" / FIX)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    # and it names no part of this project's series: upstream's code only
    text = (ROOT / "vendor" / "patches" / FIX).read_text()
    assert "ggml-hybrid" not in "".join(ln for ln in text.splitlines(keepends=True) if ln.startswith("+"))


def test_one_commit_per_patch_over_the_pin(exported):
    log = subprocess.run(["git", "-C", str(exported), "log", "--format=%s", "pin..HEAD"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert len(log) == len(PATCHES)
    assert log[-1] == "sched : restore replaced sources"  # the first commit after the pin


def test_the_families_op_list_is_not_in_ggml():
    """The RPC server's rules are GGML's; which ops a server computes is this project's (rpc_server.c), handed in
    by patch 0012: no patch adds a list of the families' ops, nor the old unchecked-ops switch."""
    added = "".join(ln for p in PATCHES for ln in p.read_text().splitlines(keepends=True) if ln.startswith("+"))
    assert "ggml_backend_rpc_server_set_ops" in added
    assert "set_unchecked_ops" not in added and "famil" not in added.lower()


@pytest.mark.slow
def test_the_scheduler_fix_reproduction_fails_on_the_pin_and_passes_with_the_fix():
    """tools/repro_sched_replaced_sources.py: the program aborts (or computes wrong numbers) on the pin, and computes
    all three graphs right with patch 0001 alone (each build of GGML is cached, minutes the first time)."""
    import repro_sched_replaced_sources as repro  # tools/ is on pytest's path

    pin = repro.run(False)
    assert pin.returncode != 0, pin.stdout
    assert "graph A: right" in pin.stdout and "graph B: right" in pin.stdout
    fixed = repro.run(True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "graph A again, after B: right" in fixed.stdout
