"""Cases run in parallel, each in a forked worker that writes its result as JSON.

A worker is a fork of the (thread-free) harness process, so it starts clean for every case;
the commands of the case are forked again from it. A worker that dies or overruns is itself
a result (``harness_error``), never the end of the run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def fork_map(fn: Callable[[Any], dict[str, Any]], items: Iterable[Any], jobs: int, tmpdir: str,
             worker_timeout: float) -> Iterator[tuple[Any, dict[str, Any]]]:
    """``(item, fn(item))`` for every item, as they complete, with at most ``jobs`` workers at once."""
    pending = iter(items)
    running: dict[int, tuple[Any, str, float]] = {}
    n = 0
    while True:
        while len(running) < max(1, jobs):
            item = next(pending, _END)
            if item is _END:
                break
            path = os.path.join(tmpdir, f"result-{n}.json")
            n += 1
            running[_spawn(fn, item, path)] = (item, path, time.monotonic())
        if not running:
            return
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0 or pid not in running:
            for wpid, (_, _, t0) in list(running.items()):
                if time.monotonic() - t0 > worker_timeout:
                    _kill(wpid)
            time.sleep(0.01)
            continue
        item, path, _ = running.pop(pid)
        yield item, _result(path, os.waitstatus_to_exitcode(status))


_END = object()


def _spawn(fn: Callable[[Any], dict[str, Any]], item: Any, path: str) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        try:
            res = fn(item)
        except BaseException:
            res = {"harness_error": traceback.format_exc()[-3000:]}
        with open(path, "w") as f:
            json.dump(res, f)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _result(path: str, rc: int) -> dict[str, Any]:
    try:
        with open(path) as f:
            res: dict[str, Any] = json.load(f)
        os.unlink(path)
        return res
    except (OSError, ValueError):
        return {"harness_error": f"the case worker ended with status {rc} and no result"}


__all__ = ["fork_map"]
