"""``GET /metrics``: Prometheus text, read at scrape time from the engines' and models' figures.

Every metric is prefixed ``ggml_hybrid_`` and labelled with the model (``model``) where it has one.
Counters (``_total``): ``http_requests`` (endpoint, status), ``requests`` (finish_reason: stop, length,
cancelled, error), ``prompt_tokens``, ``prompt_tokens_reused`` and ``prompt_tokens_evaluated`` (kept from a
slot's cells by prompt reuse, computed), ``generated_tokens``, ``expert_cache_hits``, ``expert_cache_misses``,
``expert_cache_cpu_misses``, ``expert_cache_bytes_loaded``, and with speculative decoding
``speculative_drafted_tokens``, ``speculative_accepted_tokens``, ``speculative_verify_steps`` (llama-server's
``spec_decode_num_*``) and the gauge ``speculative_acceptance_rate``. Gauges: ``model_loaded``, ``slots``,
``busy_slots``, ``queue_depth``, ``tokens_per_second`` (generated tokens per second of decode steps
over the last 10 s), ``moe_cpu_share_applied``, ``hybrid_offload_active`` (0/1) and
``device_memory_bytes`` (device, purpose: weights, experts, kv_cache, recurrent, compute), and the process's
``grammar_compiles`` (state: running, waiting). docs/serve.md lists them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..runtime.grammar_pool import grammar_pool
from .models import ModelSet

P = "ggml_hybrid_"


class ServerCollector(Collector):
    def __init__(self, models: ModelSet) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        ms = self.models
        http = CounterMetricFamily(P + "http_requests", "HTTP requests answered, by endpoint and status",
                                   labels=["endpoint", "status"])
        for (endpoint, status), n in sorted(ms.http_requests.items()):
            http.add_metric([endpoint, str(status)], n)
        yield http

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(P + name, doc, labels=["model"])

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(P + name, doc, labels=["model"])

        requests = CounterMetricFamily(P + "requests", "Generations finished, by finish reason",
                                       labels=["model", "finish_reason"])
        prompt = counter("prompt_tokens", "Prompt tokens of finished prompts (reused and evaluated)")
        reused = counter("prompt_tokens_reused", "Prompt tokens kept from what a slot held (cache_prompt)")
        evaluated = counter("prompt_tokens_evaluated", "Prompt tokens computed by prompt steps")
        generated = counter("generated_tokens", "Tokens generated")
        hits = counter("expert_cache_hits", "Expert cache hits (routed experts found in a device slot)")
        misses = counter("expert_cache_misses", "Expert cache misses loaded into a device slot")
        cpu_misses = counter("expert_cache_cpu_misses", "Expert cache misses computed by the CPU (moe_cpu_share)")
        loaded = counter("expert_cache_bytes_loaded", "Bytes of experts copied into device slots")
        up = gauge("model_loaded", "1 once the model is loaded and serving")
        slots = gauge("slots", "Sequence slots (n_parallel)")
        busy = gauge("busy_slots", "Slots holding a request")
        queue = gauge("queue_depth", "Requests waiting for a slot")
        tps = gauge("tokens_per_second", "Generated tokens per second of decode steps, last 10 s")
        share = gauge("moe_cpu_share_applied", "Mean share of expert cache misses the CPU computed")
        offload = gauge("hybrid_offload_active", "1 when the CPU has computed part of the routed-expert work")
        memory = GaugeMetricFamily(P + "device_memory_bytes", "Bytes held on each device, by purpose",
                                   labels=["model", "device", "purpose"])
        for name, sm in ms.models.items():
            up.add_metric([name], 1.0 if sm.ready else 0.0)
            if sm.engine is None:
                continue
            st = sm.engine.stats
            for reason, n in sorted(st.requests.items()):
                requests.add_metric([name, reason], n)
            prompt.add_metric([name], st.prompt_tokens)
            reused.add_metric([name], st.prompt_tokens_reused)
            evaluated.add_metric([name], st.prompt_tokens_evaluated)
            generated.add_metric([name], st.generated_tokens)
            slots.add_metric([name], sm.engine.n_slots)
            busy.add_metric([name], st.busy_slots)
            queue.add_metric([name], st.queued)
            tps.add_metric([name], st.tokens_per_second)
            snap = sm.snapshot
            hits.add_metric([name], snap.hits)
            misses.add_metric([name], snap.misses)
            cpu_misses.add_metric([name], snap.cpu_misses)
            loaded.add_metric([name], snap.bytes_loaded)
            share.add_metric([name], snap.share_applied)
            offload.add_metric([name], 1.0 if snap.hybrid_offload_active else 0.0)
            for dev, purposes in snap.device_memory.items():
                for purpose, n in purposes.items():
                    memory.add_metric([name, dev, purpose], n)
        yield from (requests, prompt, reused, evaluated, generated, hits, misses, cpu_misses, loaded, up, slots,
                    busy, queue, tps, share, offload, memory)
        yield self._compiles()
        yield from self._speculative()

    @staticmethod
    def _compiles() -> Metric:
        """The process's grammar compile pool: compiles running and waiting for a compile thread."""
        compiles = GaugeMetricFamily(P + "grammar_compiles", "Grammar compiles in the compile pool, by state",
                                     labels=["state"])
        pool = grammar_pool()
        compiles.add_metric(["running"], pool.running)
        compiles.add_metric(["waiting"], pool.waiting)
        return compiles

    def _speculative(self) -> Iterator[Metric]:
        """Speculative decoding's counters, per model that speculates (llama-server's ``spec_decode_num_*``)."""
        drafted = CounterMetricFamily(P + "speculative_drafted_tokens", "Speculative decoding: draft tokens verified",
                                      labels=["model"])
        accepted = CounterMetricFamily(P + "speculative_accepted_tokens",
                                       "Speculative decoding: draft tokens the target kept", labels=["model"])
        verify = CounterMetricFamily(P + "speculative_verify_steps",
                                     "Speculative decoding: verify steps (a sequence's drafts)", labels=["model"])
        acceptance = GaugeMetricFamily(P + "speculative_acceptance_rate",
                                       "Speculative decoding: accepted / drafted tokens", labels=["model"])
        for name, sm in self.models.models.items():
            spec = sm.engine.stats.spec if sm.engine is not None else None
            if spec is not None:
                drafted.add_metric([name], spec.drafted)
                accepted.add_metric([name], spec.accepted)
                verify.add_metric([name], spec.verify_steps)
                acceptance.add_metric([name], spec.acceptance)
        yield from (drafted, accepted, verify, acceptance)


def registry(models: ModelSet) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ServerCollector(models))
    return reg


def render(reg: CollectorRegistry) -> tuple[bytes, str]:
    return generate_latest(reg), CONTENT_TYPE_LATEST


__all__ = ["ServerCollector", "registry", "render"]
