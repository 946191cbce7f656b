"""The models a server holds: each loaded in the background, then served by its own engine.

``/health`` says 503 until every model is loaded (and again while draining), 200 when they all are.
A model that fails to load stops the server (the ``serve`` command prints the error and exits 2).
After each engine step the engine thread copies the model's counters here, so a metrics scrape
never touches a model another thread is computing with.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..runtime.engine import Engine
from ..runtime.moe_model import MoEModel
from ..text.chat import ChatTemplate, RenderPool
from .config import ModelEntry

MEMORY_EVERY = 5.0  # seconds between device-memory readings after load
FINAL_GRACE = 3.0  # seconds cancelled requests get to answer once a drain has run out of time
LOADER_JOIN = 60.0  # seconds close() waits for a cancelled load to let go (it stops at the next tensor)


@dataclass
class Snapshot:
    """A model's figures as of the engine's last step (or its load)."""

    hits: int = 0
    misses: int = 0
    cpu_misses: int = 0
    bytes_loaded: int = 0
    share_applied: float = 0.0
    hybrid_offload_active: bool = False
    device_memory: dict[str, dict[str, int]] = field(default_factory=dict)  # device -> purpose -> bytes


class LoadCancelled(Exception):
    """A load stopped because the server is stopping (not a failure of the model)."""


class ServedModel:
    """One model entry: its load state, and once loaded its model, engine and chat template."""

    def __init__(self, entry: ModelEntry) -> None:
        self.name, self.aliases, self.path, self.options = entry.name, entry.aliases, entry.path, entry.options
        self.chat_template, self.jinja = entry.chat_template, entry.jinja
        self.created = int(time.time())
        self.model: MoEModel | None = None
        self.engine: Engine | None = None
        self.template: ChatTemplate | None = None
        self.template_error: str | None = None
        self.error: str | None = None
        self.snapshot = Snapshot()
        self.max_prompt_chars = 0
        self._memory_at = 0.0

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def load(self, cancelled: Callable[[], bool] | None = None, pool: RenderPool | None = None) -> None:
        """Load the model; ``cancelled()`` is asked after every tensor, and when it says so the load stops
        (:class:`LoadCancelled`) and frees what it had loaded."""
        def progress(done: int, total: int) -> None:
            if cancelled is not None and cancelled():
                raise LoadCancelled(f"{self.name}: the load was cancelled (the server is stopping)")

        model = MoEModel(self.path, self.options, progress=progress)
        try:
            tok = model.tokenizer
            try:
                # serve --chat-template: that template instead of the file's
                self.template = ChatTemplate.from_gguf(model.store, tok.tokens, tok.bos_id, tok.eos_id, pool=pool,
                                                       source=self.chat_template)
            except Exception as exc:  # completions still work; chat answers with this error
                self.template_error = " ".join(str(exc).split())
            # the longest text a token stands for: a text of more than max_prompt_chars characters cannot fit in
            # the context, whatever its tokens (it is refused before it is tokenized or rendered)
            longest = max((len(t) for t in tok.tokens), default=1)
            self.max_prompt_chars = model.n_ctx * max(longest, 8) * 2
            self.model = model
            self._snap(None)
            self.engine = Engine(model, self.name, after_step=self._snap)
        except BaseException:
            model.close()
            raise

    def _snap(self, _engine: Engine | None) -> None:
        m = self.model
        assert m is not None
        total = m.counters.total
        now = time.monotonic()
        memory = self.snapshot.device_memory
        if _engine is None or now - self._memory_at >= MEMORY_EVERY:  # it walks every tensor: not every step
            memory, self._memory_at = {d: m.device_memory(d) for d in m.devices}, now
        self.snapshot = Snapshot(total.hits, total.misses, total.cpu_misses, total.bytes_loaded, total.share_applied,
                                 m.cpu_experts_active, memory)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.model is not None:
            self.model.close()
            self.model = None


class ModelSet:
    """Every served model by name and alias, loaded one after another by a background thread."""

    def __init__(self, entries: list[ModelEntry]) -> None:
        self.models = {e.name: ServedModel(e) for e in entries}
        self.names: dict[str, ServedModel] = {}
        for sm in self.models.values():
            for n in (sm.name, *sm.aliases):
                self.names[n] = sm
        self.draining = False
        self.drain_started = 0.0
        self.failed: str | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.http_requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count
        self.in_flight = 0  # generation handlers that have not answered yet
        self.render_pool = RenderPool()  # the chat templates' renderer processes (killed at close)

    @property
    def ready(self) -> bool:
        return all(sm.ready for sm in self.models.values())

    def start_loading(self, on_failure: Callable[[str], Any],
                      on_loaded: Callable[[str, float], Any] | None = None) -> None:
        def run() -> None:
            for sm in self.models.values():
                with self._lock:
                    if self._closed:
                        return
                t0 = time.perf_counter()
                try:
                    sm.load(lambda: self._closed, self.render_pool)
                except LoadCancelled:
                    return  # stopped while loading: nothing failed
                except Exception as exc:
                    sm.error = self.failed = f"{sm.name}: {' '.join(str(exc).split())}"
                    on_failure(self.failed)
                    return
                with self._lock:
                    if self._closed:  # shut down while this one loaded
                        sm.close()
                        return
                if on_loaded is not None:
                    on_loaded(sm.name, time.perf_counter() - t0)

        self._thread = threading.Thread(target=run, name="model-loader", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Stop taking new requests (SIGTERM): ``/health`` answers 503, engines refuse new work."""
        if not self.draining:
            self.drain_started = time.monotonic()
        self.draining = True
        for sm in self.models.values():
            if sm.engine is not None:
                sm.engine.stop_accepting()

    def expire_drain(self) -> None:
        """End the drain now (a second signal): every request still running is cancelled."""
        self.drain()
        self.drain_started = min(self.drain_started, time.monotonic() - 1e9)
        self.cancel_all()

    def cancel_all(self) -> None:
        for sm in self.models.values():
            if sm.engine is not None:
                sm.engine.cancel_all()

    def begin(self) -> None:
        """A generation handler starts (it answers before the server may stop)."""
        with self._lock:
            self.in_flight += 1

    def end(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def drained(self, seconds: float) -> bool:
        """Whether a drain is over: every generation answered, or ``seconds`` passed (what still runs is then
        cancelled, and gets :data:`FINAL_GRACE` seconds to send its error event or 503)."""
        if not self.draining:
            return False
        if self.in_flight <= 0:
            return True
        if self.drain_expired(seconds):
            self.cancel_all()
            return time.monotonic() - self.drain_started > max(seconds, 0.0) + FINAL_GRACE
        return False

    def drain_expired(self, seconds: float) -> bool:
        """Whether a drain began more than ``seconds`` ago (what is still running is then cancelled)."""
        return self.draining and time.monotonic() - self.drain_started > seconds

    def count(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.http_requests[key] = self.http_requests.get(key, 0) + 1

    def close(self, timeout: float | None = LOADER_JOIN) -> bool:
        """Cancel a load in progress and wait for the loader thread (it writes into GGML buffers that exit-time
        finalizers free: it must be gone before the interpreter ends), then close every model. False if the
        loader was still inside one tensor's load after ``timeout`` seconds (the caller must then end the
        process without finalizers)."""
        with self._lock:
            self._closed = True
        self.render_pool.close()  # a render in progress ends now
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():
                return False
        for sm in self.models.values():
            sm.close()
        return True


__all__ = ["LoadCancelled", "ModelSet", "ServedModel", "Snapshot"]
