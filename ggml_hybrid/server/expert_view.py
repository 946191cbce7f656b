"""``GET /experts``: what a served model's expert cache is doing, for the chat page's live view (docs/serve.md).

``?model=NAME`` (optional with one model served, as every route), ``&heatmap=0|1`` (default 1). The answer is the
model's counters as they stand between two engine steps, cumulative since the load; the page keeps the answers of
its recent polls and shows their differences over its window (the server keeps no history, so a server no one looks
at does no work for this view). Its fields:

- ``t``: the server's monotonic clock (seconds) when read; ``steps``: the engine's prompt and decode steps so far.
- ``layers``: per MoE layer (``layer``: its index in the model; ``mode``: ``disk`` for a layer behind the expert
  cache, ``resident`` for one whose experts all sit on their device) the executor's counters: ``calls``,
  ``routed``, ``distinct``, ``hits``, ``misses`` (loads into a slot), ``cpu_misses``, ``bytes_loaded``,
  ``evictions``, ``load_ns``, ``compute_ns``, ``device_ns``, ``cpu_ns``, ``staging_wait_ns``, ``prefetched``.
- ``totals``: those counters summed over the layers: ``hits``, ``misses``, ``cpu_misses`` and ``bytes_loaded``
  equal ``/metrics``' ``expert_cache_*`` counters read at the same moment.
- ``tier``: the host tier's counters (``hits``, ``misses``, ``bytes_read``, ``wait_ns``, ``waits``,
  ``bytes_held``; one tier serves every disk layer), or null without one.
- ``time``: the engine's time in ``decode_ns`` and ``prompt_ns``, and of the experts' time ``load_ns``,
  ``compute_ns`` and ``wait_ns`` (loads waiting for a staging upload or for the host tier's read).
- ``heatmap`` (null with ``heatmap=0``): ``n_expert``, and per disk layer (``layers``, the same order)
  ``requests[i][e]``, the calls that asked for expert ``e`` (on the device or the CPU), and ``held[i]``, the
  experts its slots hold now.

The read runs on the engine thread between two steps (:meth:`.Engine.between_steps`): it never meets a step in
progress. Polls that arrive while a read is pending share it, so a hundred open pages cost one read per step.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import ClosedError
from ..moe.executor import ExpertCacheExecutor
from ..moe.native_executor import NativeExpertExecutor
from ..moe.residency import residency
from .models import ServedModel
from .protocol import APIError, bad
from .routes import Routes

READ_SECONDS = 60.0  # a read not done by then (a step longer than this) answers 503
LAYER_FIELDS = ("calls", "routed", "distinct", "hits", "misses", "cpu_misses", "bytes_loaded", "evictions", "load_ns",
                "compute_ns", "device_ns", "cpu_ns", "staging_wait_ns", "prefetched")
TOTAL_FIELDS = ("hits", "misses", "cpu_misses", "bytes_loaded", "load_ns", "compute_ns", "staging_wait_ns")
TIER_FIELDS = ("hits", "misses", "bytes_read", "wait_ns", "waits", "bytes_held")
QUERY = {"model", "heatmap"}


def read_view(sm: ServedModel, heatmap: bool) -> dict[str, Any]:
    """The view of ``sm`` now: to be called on its engine thread between two steps."""
    assert sm.model is not None and sm.engine is not None
    experts = sm.model.model.experts
    counters = experts.counters
    layers, totals = [], dict.fromkeys(TOTAL_FIELDS, 0)
    for i, c in zip(experts.moe_layers, counters):
        d = c.to_dict()
        layers.append({"layer": i, "mode": experts.modes[i], **{k: int(d[k]) for k in LAYER_FIELDS}})
        for k in TOTAL_FIELDS:
            totals[k] += int(d[k])
    tier = None if experts.tier is None else experts.tier.counters.to_dict()
    st = sm.engine.stats
    wait = totals["staging_wait_ns"] + (tier["wait_ns"] if tier else 0)
    return {"object": "experts", "model": sm.name, "t": time.monotonic(),
            "steps": st.decode_steps + st.prompt_steps, "layers": layers,
            "totals": {k: totals[k] for k in ("hits", "misses", "cpu_misses", "bytes_loaded")},
            "tier": None if tier is None else {k: tier[k] for k in TIER_FIELDS},
            "time": {"decode_ns": st.decode_ns, "prompt_ns": st.prompt_ns, "load_ns": totals["load_ns"],
                     "compute_ns": totals["compute_ns"], "wait_ns": wait},
            "heatmap": _heatmap(experts.executors, experts.moe_layers) if heatmap else None}


def _heatmap(executors: list[ExpertCacheExecutor | NativeExpertExecutor | None], moe_layers: list[int]
             ) -> dict[str, Any] | None:
    rows, requests, held, n_expert = [], [], [], 0
    for i, ex in zip(moe_layers, executors):
        r = None if ex is None else residency(ex)
        if r is None:
            continue
        rows.append(i)
        requests.append([int(x) for x in r.requests])
        held.append(list(r.held))
        n_expert = len(r.requests)
    return {"n_expert": n_expert, "layers": rows, "requests": requests, "held": held}


def _flag(value: str, name: str) -> bool:
    if value not in ("0", "1", "true", "false"):
        raise bad(f"'{name}' must be 0, 1, true or false, got {value!r}.", name)
    return value in ("1", "true")


class ExpertViewRoutes:
    """``GET /experts`` over the models of ``routes`` (its lookup and counting)."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes
        self._pending: dict[tuple[str, bool], asyncio.Future[dict[str, Any]]] = {}

    def table(self) -> list[Route]:
        return [Route("/experts", self.routes.counted("/experts", self.experts), methods=["GET"])]

    async def experts(self, request: HTTPRequest) -> Response:
        q = request.query_params
        unknown = sorted(set(q.keys()) - QUERY)
        if unknown:
            raise bad(f"Unknown query parameter {unknown[0]!r}: /experts takes 'model' and 'heatmap'.", unknown[0])
        if any(len(q.getlist(k)) > 1 for k in q.keys()):
            raise bad("Each query parameter of /experts may be given once.")
        heatmap = _flag(q.get("heatmap", "1"), "heatmap")
        sm = self.routes.lookup(q.get("model", ""))
        return JSONResponse(await self.read(sm, heatmap))

    async def read(self, sm: ServedModel, heatmap: bool) -> dict[str, Any]:
        """The view of ``sm``, read by its engine thread; a read already pending for it is shared."""
        key = (sm.name, heatmap)
        fut = self._pending.get(key)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = self._pending[key] = loop.create_future()
            engine = sm.engine
            assert engine is not None

            def on_engine() -> None:
                try:
                    view: dict[str, Any] | BaseException = read_view(sm, heatmap)
                except Exception as exc:  # answered as the route's 500 (one log line per cause)
                    view = exc
                loop.call_soon_threadsafe(_settle, fut, view)

            fut.add_done_callback(lambda _f: self._pending.pop(key, None))
            try:
                engine.between_steps(on_engine)
            except ClosedError:
                fut.cancel()
                raise APIError(503, f"The model '{sm.name}' is shutting down.", code="closed") from None
        try:
            return await asyncio.wait_for(asyncio.shield(fut), READ_SECONDS)
        except asyncio.TimeoutError:
            raise APIError(503, f"The model '{sm.name}' did not reach the end of a step within {READ_SECONDS:g} "
                           "seconds; retry.", code="busy") from None


def _settle(fut: asyncio.Future[dict[str, Any]], view: dict[str, Any] | BaseException) -> None:
    if fut.done():
        return
    if isinstance(view, BaseException):
        fut.set_exception(view)
    else:
        fut.set_result(view)


__all__ = ["ExpertViewRoutes", "read_view"]
