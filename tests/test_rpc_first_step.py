"""The first decode step of a session over RPC asks the servers no allocation size.

GGML's RPC client asks a server the allocation size of each product of a new shape (``GET_ALLOC_SIZE``, a round
trip each) and caches the answer by shape. llama.cpp reserves the one-token graph when it creates its context, so
the first decode step of its client asks each worker once (the attention's product over the cells in use, whose
width differs from the reservation's): 1 + 1 for a model split over two workers (``tools/bench/rpc_counts.py``,
docs/benchmarks.md section 28). A session that reserved only the prompt's graph asked 9 + 5 at its first token; one
that reserves the graph of its first decode steps (one token over the first cells) asks none.

The oracle is a proxy in front of each server that parses GGML's RPC stream and counts each command
(``rpc_counts.CountingProxy``), and, for the memory, the compute buffers of a session that did not reserve the
one-token graph: reserving it must not grow them (the largest ubatch's graph is reserved first).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from rpc_counts import CountingProxy
from test_rpc import opts, rpc_server

from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.runtime.session import Session
from ggml_hybrid.synthetic import write_model

# bench_hosts.py's settings (llama.cpp's side there): a 512-cell context and batch, flash attention off
SETTINGS = ("n_ctx=512", "batch_size=512", "ubatch_size=512", "flash_attn=false", "tensor_split=1,1")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("first") / "m.gguf", n_layer=4, n_expert=8, n_used=2,
                       weight_type="q8_0", seed=44)


@pytest.fixture(scope="module")
def two_servers():
    with rpc_server() as a, rpc_server() as b:
        yield a, b


@contextmanager
def counted(*endpoints: str) -> Iterator[list[CountingProxy]]:
    """A counting proxy in front of each endpoint (new ports: GGML's cache of sizes, keyed by endpoint, is cold)."""
    proxies = []
    for e in endpoints:
        host, port = e.rsplit(":", 1)
        proxies.append(CountingProxy((host, int(port))))
    try:
        yield proxies
    finally:
        for p in proxies:
            p.listener.close()


def test_the_first_decode_step_asks_no_allocation_size(model, two_servers):
    """Every layer split 1:1 over two workers: the first decode step after a prompt asks no worker an allocation
    size (llama.cpp's client asks each one; before the fix: several a worker, one per product of a new shape)."""
    a, b = two_servers
    with counted(a.endpoint, b.endpoint) as proxies, \
            MoEModel(model, opts(f"rpc=127.0.0.1:{proxies[0].port},127.0.0.1:{proxies[1].port}", *SETTINGS)) as m:
        assert set(m.layout.layer_device) == {"RPC0", "RPC1"}
        logits = m.eval(list(range(10, 30)), "last")
        for p in proxies:
            p.take()
        m.eval([int(np.argmax(logits[-1]))], "last")
        step = [p.take() for p in proxies]
    assert all(s.get("GRAPH_COMPUTE", 0) == 1 for s in step)  # the proxies saw the step (the oracle ran)
    assert [s.get("GET_ALLOC_SIZE", 0) for s in step] == [0, 0], step


def test_reserving_the_one_token_graph_grows_no_compute_buffer(model, two_servers, monkeypatch):
    """The compute buffers of a session are those of the largest ubatch, with the first steps' graph reserved or
    not."""
    a, b = two_servers
    options = opts(f"rpc={a.endpoint},{b.endpoint}", *SETTINGS)

    def sizes() -> list[int]:
        with MoEModel(model, options) as m:
            return [m.sched.buffer_size(be) for be in m.sched.backends]

    with_step = sizes()
    monkeypatch.setattr(Session, "_reserve_step", lambda self: None)
    without = sizes()
    assert with_step == without and sum(with_step) > 0
