"""MoE routing traces: the file format, synthetic traces, and replays through expert caches."""

from __future__ import annotations

from ...errors import TraceError, TraceTruncatedWarning
from .format import FLAG_PREDICTIONS, FORMAT_VERSION, HEADER_SIZE, MAGIC, Trace, TraceWriter, read_trace
from .prefetch import PrefetchReplay, replay_prefetch
from .replay import (
                     CPU_RULES,
                     POLICIES,
                     CallRecord,
                     LayerStats,
                     LinkCost,
                     ReplayResult,
                     modeled_time_per_token,
                     parse_share,
                     replay,
)
from .synthesis import synthetic_trace

__all__ = [
    "CPU_RULES", "FLAG_PREDICTIONS", "FORMAT_VERSION", "HEADER_SIZE", "MAGIC", "POLICIES", "CallRecord",
    "LayerStats", "LinkCost", "PrefetchReplay", "ReplayResult", "Trace", "TraceError", "TraceTruncatedWarning",
    "TraceWriter", "modeled_time_per_token", "parse_share", "read_trace", "replay", "replay_prefetch",
    "synthetic_trace",
]
