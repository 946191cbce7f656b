"""Where grammars are compiled: a few threads of a known, large stack, each with a checker process of its own.

A compile has two halves (:mod:`.grammar`): llguidance's checks and validation of the text, and the compile against
the model's vocabulary. The first runs in a child process (:mod:`.grammar_check`, run as a script): what overflows its
stack or outruns :data:`GRAMMAR_SECONDS` takes only that process down (it is killed on time and replaced), and the
request gets a :class:`~ggml_hybrid.errors.GrammarError` naming what was passed. The second runs here, on one of the
pool's threads, whose stack (:data:`COMPILE_STACK`) is four times the checker's: the text got through the same
recursion there. The pool's threads are the compiles' own limiter: at most :data:`COMPILE_THREADS` run at once,
the others wait their turn, and none of them holds a thread that tokenizing or template rendering needs.

A call's time (:data:`GRAMMAR_SECONDS`) runs from its submission: a caller is answered within it, waiting included;
a compile still running then on a pool thread (the half against the vocabulary, which cannot be stopped from outside)
finishes unseen, its work bounded by llguidance's own limits.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..errors import GrammarError
from ..machine import kill_child
from .grammar_check import CHECK_STACK

GRAMMAR_SECONDS = 10.0       # a compile (its wait for a thread included) that takes longer is refused
COMPILE_THREADS = 2          # compiles at once (each with its checker process)
COMPILE_STACK = 4 * CHECK_STACK  # the compile threads' stack: what passed the checker's recursion fits 4 times
START_SECONDS = 30.0         # a checker process that is not ready within this is a failure
_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grammar_check.py")

T = TypeVar("T")


class _Checker:
    """One checker process (``grammar_check.py``): a JSON line in, a JSON line out; killed when a call overruns."""

    def __init__(self) -> None:
        # its own session (a Ctrl-C at the terminal is the parent's); stderr dropped (a crash would print there)
        self.proc = subprocess.Popen([sys.executable, _SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        self._buf = b""
        self.timed_out = False  # the last call overran its time (and the process was killed for it)
        ready = self._line(time.monotonic() + START_SECONDS)
        if ready is None:
            self.kill()
            raise GrammarError("the grammar checker did not start")

    def call(self, req: dict[str, Any], deadline: float) -> dict[str, Any] | None:
        """The answer, or None: the process died (a crash) or ``deadline`` passed (then it is killed)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(req).encode("ascii") + b"\n")
            self.proc.stdin.flush()
        except OSError:
            self.kill()
            return None
        line = self._line(deadline)
        if line is None:
            return None
        doc: dict[str, Any] = json.loads(line)
        return doc

    def _line(self, deadline: float) -> bytes | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.timed_out = True
                self.kill()
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self.kill()
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def kill(self) -> None:
        """End the process and close its pipes: only from the thread that uses the checker."""
        kill_child(self.proc)

    def stop(self) -> None:
        """End the process from any thread (SIGKILL); its pipes stay open for the thread that uses them."""
        try:
            self.proc.kill()
        except OSError:  # it ended in between
            pass

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def died_of(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit status {code}"


@dataclass(eq=False)
class _Job(Generic[T]):
    request: dict[str, Any]
    compile: Callable[[str], T]
    deadline: float
    seconds: float
    future: Future[T] = field(default_factory=Future)


class GrammarPool:
    """``threads`` compile threads of ``stack`` bytes of stack, started on first use, each with a checker process
    whose validating thread has ``check_stack`` bytes; each call bounded by ``seconds`` (its default).
    :meth:`close` kills the checkers and ends the threads."""

    def __init__(self, threads: int = COMPILE_THREADS, seconds: float = GRAMMAR_SECONDS,
                 stack: int = COMPILE_STACK, check_stack: int = CHECK_STACK) -> None:
        self.n_threads, self.seconds, self.stack, self.check_stack = threads, seconds, stack, check_stack
        self._jobs: queue.Queue[_Job[Any] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._checkers: set[_Checker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.waiting = 0  # calls submitted that no thread has taken yet
        self.running = 0  # calls a thread is checking or compiling

    def submit(self, request: dict[str, Any], compile: Callable[[str], T], seconds: float | None = None
               ) -> Future[T]:
        """Check ``request`` (grammar_check's protocol) in a checker, then ``compile(spec)`` on a pool thread."""
        seconds = self.seconds if seconds is None else seconds
        job: _Job[T] = _Job({**request, "stack": self.check_stack}, compile, time.monotonic() + seconds, seconds)
        with self._lock:
            if self._closed:
                raise GrammarError("the grammar compiler is closed (the server is stopping)")
            self._start_threads()
            self.waiting += 1
            self._jobs.put(job)
        return job.future

    def run(self, request: dict[str, Any], compile: Callable[[str], T], seconds: float | None = None) -> T:
        """:meth:`submit`, waited for: the compiled result, or a :class:`GrammarError` within the time."""
        seconds = self.seconds if seconds is None else seconds
        fut = self.submit(request, compile, seconds)
        try:
            return fut.result(timeout=seconds)
        except FutureTimeout:
            fut.cancel()
            raise GrammarError(f"{request.get('what', 'the grammar')} did not compile within {seconds:g} s") from None

    def _start_threads(self) -> None:
        if self._threads:
            return
        with _STACK_LOCK:  # threading.stack_size is the process's: set, start, restore
            old = threading.stack_size(self.stack)
            try:
                for i in range(self.n_threads):
                    t = threading.Thread(target=self._serve, name=f"grammar-compile-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
            finally:
                threading.stack_size(old)

    def _serve(self) -> None:
        checker: _Checker | None = None
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                with self._lock:
                    self.waiting -= 1
                if not job.future.set_running_or_notify_cancel():
                    continue  # its caller stopped waiting
                with self._lock:
                    self.running += 1
                try:
                    checker = self._checked(job, checker)
                    if time.monotonic() >= job.deadline:  # it waited its time away (or a checker's start did)
                        raise GrammarError(f"{job.request.get('what', 'the grammar')} did not compile within "
                                           f"{job.seconds:g} s (it waited for a compile thread)")
                    spec = self._spec(job, checker)
                    job.future.set_result(job.compile(spec))
                except BaseException as exc:  # the caller's to see (a GrammarError, or a bug)
                    job.future.set_exception(exc)
                finally:
                    with self._lock:
                        self.running -= 1
        finally:
            if checker is not None:
                self._drop(checker)

    def _checked(self, job: _Job[Any], checker: _Checker | None) -> _Checker:
        """A live checker for ``job`` (a new one if the last died or was killed)."""
        if checker is not None and checker.alive:
            return checker
        if checker is not None:
            self._drop(checker)
        fresh = _Checker()
        with self._lock:
            self._checkers.add(fresh)
            closed = self._closed
        if closed:
            self._drop(fresh)
            raise GrammarError("the grammar compiler is closed (the server is stopping)")
        return fresh

    def _spec(self, job: _Job[Any], checker: _Checker) -> str:
        what = job.request.get("what", "the grammar")
        answer = checker.call(job.request, job.deadline)
        if answer is None:
            if checker.timed_out:
                raise GrammarError(f"{what} did not compile within {job.seconds:g} s (stopped)")
            raise GrammarError(f"{what} took llguidance's compiler down ({checker.died_of}: its recursion overflowed "
                               f"a stack of {self.check_stack >> 10} KiB, or it ran out of memory): refused")
        if "ok" not in answer:
            raise GrammarError(str(answer.get("message", what)))
        return str(answer["ok"])

    def _drop(self, checker: _Checker) -> None:
        checker.kill()
        with self._lock:
            self._checkers.discard(checker)

    def close(self) -> None:
        """Kill the checkers (a check in progress ends at once) and end the threads after their current job."""
        with self._lock:
            self._closed = True
            checkers = list(self._checkers)
            for _ in self._threads:
                self._jobs.put(None)
        for c in checkers:  # a signal only: the thread that owns a checker sees its output end and closes the
            c.stop()         # pipes (closing them here would pull a descriptor from under that thread's select)


_STACK_LOCK = threading.Lock()
_POOL = GrammarPool()
atexit.register(_POOL.close)


def grammar_pool() -> GrammarPool:
    """The process's pool (the Python API's; the server has its own, closed when it stops)."""
    return _POOL


__all__ = ["COMPILE_STACK", "COMPILE_THREADS", "GRAMMAR_SECONDS", "GrammarPool", "grammar_pool"]
