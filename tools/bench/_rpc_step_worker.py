"""One arm of bench_rpc_status.py: its own ``rpc-server`` (this interpreter's build), a small decode-like graph on
the RPC device (a GET_ROWS of one token's embedding, a matrix product, an ADD_ID), computed ``--n`` times after
``--warmup``; prints the median seconds per compute (the output read back included) as JSON."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time

import click
import numpy as np

import ggml_hybrid as gh
from ggml_hybrid.ggml import rpc


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("n", type=int)
@click.argument("warmup", type=int)
def main(n: int, warmup: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", "from ggml_hybrid.cli import main; main()", "rpc-server",
                               "--port", str(port), "--threads", "1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        dev = rpc.server_devices(f"127.0.0.1:{port}")[0]
        backend, cpu = rpc.open_device(dev), gh.cpu(1)
        rng = np.random.default_rng(0)
        arrays = {"emb": rng.standard_normal((512, 256)).astype(np.float32),
                  "w": rng.standard_normal((256, 256)).astype(np.float32),
                  "bias": rng.standard_normal((8, 256)).astype(np.float32)}
        with gh.Context(n_tensors=8) as w, gh.Context(n_tensors=16, graph_size=32) as c, \
                gh.Scheduler([backend, cpu], graph_size=32) as sched:
            t = {k: w.new_tensor(v.dtype, v.shape, k) for k, v in arrays.items()}
            w.allocate(backend, "weights")
            for k, v in arrays.items():
                t[k].set(v)
            tok = c.new_tensor("i32", (1,), "tok").set_input()
            ids = c.new_tensor("i32", (1, 1), "ids").set_input()
            x = c.get_rows(t["emb"], tok)
            y = c.add_id(c.reshape(c.mul_mat(t["w"], x), (1, 1, 256)), t["bias"], ids).set_output()
            g = c.new_graph(32).expand(y)
            for node in g.nodes:
                sched.set_tensor_backend(node, backend)
            sched.alloc(g)
            times = []
            for i in range(warmup + n):
                t0 = time.perf_counter()
                tok.set(np.array([i % 512], np.int32))
                ids.set(np.array([[i % 8]], np.int32))
                sched.compute(g)
                y.numpy()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
        cpu.close()
        backend.close()
        print(json.dumps({"median_s": statistics.median(times)}))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
