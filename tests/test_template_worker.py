"""The chat template's renderer process lives as long as the process that started it, whichever of its threads
started it (a renderer started from a worker thread that then ends must keep rendering)."""

from __future__ import annotations

import os
import threading
import time

import pytest

pytest.importorskip("jinja2")

from ggml_hybrid.text.chat import ChatTemplate, RenderPool

MSGS = [{"role": "user", "content": "Hi"}]


def _wait_for(cond, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g} s"
        time.sleep(0.01)


def test_a_renderer_outlives_the_thread_that_started_it():
    """Linux ties PR_SET_PDEATHSIG to the thread that forked the child, not its process: a renderer started from
    anyio's or asyncio's worker thread was killed when that idle thread ended, and the next render was a 500."""
    pool = RenderPool(size=1, seconds=10.0)
    try:
        tid: list[int] = []

        def start() -> None:
            tid.append(threading.get_native_id())
            ChatTemplate(None, pool=pool).render(MSGS)  # starts the pool's one renderer from this thread

        th = threading.Thread(target=start)
        th.start()
        th.join()
        # the thread is gone from the kernel's view too (whatever its exit signalled has been sent)
        _wait_for(lambda: not os.path.exists(f"/proc/self/task/{tid[0]}"), "the starting thread's exit")
        (worker,) = pool._all
        pid = worker.proc.pid
        assert ChatTemplate(None, pool=pool).render(MSGS).startswith("<|im_start|>")
        assert pool._all == {worker} and worker.proc.pid == pid and worker.alive
    finally:
        pool.close()


def test_a_renderer_ends_with_its_parent_even_mid_render(tmp_path):
    """What the lifeline is for: a parent killed hard while its renderer computes leaves no renderer behind."""
    import signal
    import subprocess
    import sys

    pidfile = tmp_path / "renderer.pid"
    code = (
        "import sys, threading\n"
        "from ggml_hybrid.text.chat import ChatTemplate, RenderPool\n"
        "pool = RenderPool(size=1, seconds=3600)\n"
        "ChatTemplate(None, pool=pool).render([{'role': 'user', 'content': 'Hi'}])\n"
        "(w,) = pool._all\n"
        f"open({str(pidfile)!r}, 'w').write(str(w.proc.pid))\n"
        "ChatTemplate('{% for i in range(10**12) %}{% endfor %}', pool=pool).render([])\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        _wait_for(lambda: pidfile.exists() and pidfile.read_text() != "", "the renderer's pid")
        pid = int(pidfile.read_text())
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()

    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] == "Z"  # a zombie until its new parent reaps it
        except FileNotFoundError:
            return True

    _wait_for(gone, "the renderer's end after its parent was killed")
