#!/usr/bin/env python3
"""What two RPC workers compute for ggml-hybrid's leader against the pinned llama.cpp's client (issue 44): the
graphs each worker receives, node by node; the CPU time each worker and each leader spends per decode step and per
prompt call; and where a step's wall time goes.

The setup is rpc_counts.py's: bench_hosts.py's generated qwen3moe split 1:1 over two of ggml-hybrid's rpc-servers
(1 thread each) on loopback, each reached through a proxy (``rpc_counts.CountingProxy``) that here also keeps each
GRAPH_COMPUTE's payload, the serialized graph exactly as the worker receives it (GGML's ``rpc_tensor`` records: op,
type, shape, strides, sources, buffers, flags), and the time of every message. Each side runs as a fresh leader
process per run, sides alternated over ``--rounds``: (1 repetition, 1 token), (1 repetition, 1 + ``--steps``
tokens) and (1 + 8 repetitions, 1 token), so that a decode step is the difference of the first two over
``--steps`` and a warm prompt call the difference of the first and third over 8. ``perf stat`` counts each
worker's CPU time, context switches and system calls while a run lasts (attached to the process: every thread)
and the leader's (the run under it): counts that other load on the machine changes little, unlike wall time.
From the messages' times, :func:`phases` splits each step into the leader's parts and each worker's graph-to-reply
time.

``--dump DIR`` writes each graph as text, one node a line, and a node-by-node diff of the two sides' graphs
(:func:`node_diff`); ``--show-step`` prints the messages of each side's last decode step and prompt call;
``--profile`` samples each worker with ``perf record`` and prints its CPU per step by function (GGML's kernels:
``ggml_vec_dot_*``, ``ggml_compute_forward_*``...), side by side.

Needs Linux ``perf`` (Debian's ``linux-perf``) allowed to attach to this user's processes (root, or
``kernel.perf_event_paranoid`` at most 2) and llama-cpp-python 0.3.36 built with GGML_RPC=on (``--llama-python``).

    python tools/bench/rpc_worker_cost.py --llama-python /opt/llref/bin/python [--steps 256] [--rounds 4]
        [--dump DIR] [--show-step] [--profile] [--json-out FILE]
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace

import click

HERE = Path(__file__).resolve().parent

GGML_MAX_SRC = 10
#: GGML's rpc_tensor (ggml-rpc.cpp, packed): id, type, buffer, ne[4] (u32), nb[4] (u32), op, op_params[16], flags,
#: src[GGML_MAX_SRC], view_src, view_offs, data, name[64], use_count: 296 bytes
RPC_TENSOR = struct.Struct(f"<QIQ4I4II16ii{GGML_MAX_SRC}QQQQ64si")
PROFILE_HZ = 2000
#: what perf stat counts for each worker and the leader: CPU time (ms), context switches, system calls
EVENTS = ("task-clock", "context-switches", "raw_syscalls:sys_enter")
WHO = ("worker 1", "worker 2", "the leader")
NAMED = {"task-clock": "CPU ms", "context-switches": "context switches", "raw_syscalls:sys_enter": "system calls"}
#: what :func:`measure` gives per decode step and per prompt call
QUANTITIES = ([f"{who}: {NAMED[e]}" for e in EVENTS for who in WHO] +
              [f"worker {i}: its graph to the reply, wall ms" for i in (1, 2)])
PROMPTS = 8  # prompt calls counted (runs of 1 + PROMPTS repetitions against 1)
SIDES = ("ours", "llama.cpp")
LABELS = ("decode", "prompt")
TENSOR_FLAGS = {1: "input", 2: "output", 4: "param", 8: "loss", 16: "compute"}


def _rpc_counts() -> ModuleType:
    """rpc_counts.py (next to this script) by its file, without touching sys.path."""
    if "rpc_counts" not in sys.modules:
        spec = importlib.util.spec_from_file_location("rpc_counts", HERE / "rpc_counts.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["rpc_counts"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["rpc_counts"]


@dataclass
class RPCTensor:
    id: int
    type: int
    buffer: int
    ne: tuple[int, ...]
    nb: tuple[int, ...]
    op: int
    op_params: tuple[int, ...]
    flags: int
    src: tuple[int, ...]
    view_src: int
    view_offs: int
    data: int
    name: str


@dataclass
class SerializedGraph:
    device: int
    nodes: list[int]  # tensor ids, in the order the worker computes them
    tensors: dict[int, RPCTensor]


def parse_graph(payload: bytes) -> SerializedGraph:
    """A GRAPH_COMPUTE payload: device (u32), n_nodes (u32), node ids (u64 each), n_tensors (u32), the tensors."""
    device, n_nodes = struct.unpack_from("<II", payload, 0)
    off = 8
    nodes = list(struct.unpack_from(f"<{n_nodes}Q", payload, off))
    off += 8 * n_nodes
    (n_tensors,) = struct.unpack_from("<I", payload, off)
    off += 4
    if len(payload) != off + n_tensors * RPC_TENSOR.size:
        raise ValueError(f"a graph of {n_nodes} nodes and {n_tensors} tensors is {off + n_tensors * RPC_TENSOR.size} "
                         f"bytes, not {len(payload)}")
    tensors = {}
    for i in range(n_tensors):
        f = RPC_TENSOR.unpack_from(payload, off + i * RPC_TENSOR.size)
        end = 29 + GGML_MAX_SRC
        t = RPCTensor(id=f[0], type=f[1], buffer=f[2], ne=tuple(f[3:7]), nb=tuple(f[7:11]), op=f[11],
                      op_params=tuple(f[12:28]), flags=f[28], src=tuple(f[29:end]), view_src=f[end],
                      view_offs=f[end + 1], data=f[end + 2],
                      name=f[end + 3].split(b"\0", 1)[0].decode(errors="replace"))
        tensors[t.id] = t
    return SerializedGraph(device, nodes, tensors)


class Names:
    """GGML's names of ops, types and unary/glu ops (from the installed native module)."""

    def __init__(self) -> None:
        from ggml_hybrid._native import ffi, lib

        self.ffi, self.lib = ffi, lib

    def op(self, t: RPCTensor) -> str:
        name = self.ffi.string(self.lib.ggml_op_name(t.op)).decode()
        if name == "UNARY":
            return "UNARY:" + self.ffi.string(self.lib.ggml_unary_op_name(t.op_params[0])).decode()
        if name == "GLU":
            return "GLU:" + self.ffi.string(self.lib.ggml_glu_op_name(t.op_params[0])).decode()
        return name

    def type(self, t: RPCTensor) -> str:
        return self.ffi.string(self.lib.ggml_type_name(t.type)).decode()


def _contiguous(t: RPCTensor, type_size: int, block: int) -> bool:
    expect = type_size
    if t.nb[0] != expect:
        return False
    expect = type_size * t.ne[0] // block
    for d in (1, 2, 3):
        if t.ne[d] > 1 and t.nb[d] != expect:
            return False
        expect *= t.ne[d]
    return True


def describe(g: SerializedGraph, names: Names, buffers: dict[int, str]) -> list[str]:
    """One line per node: op, type, shape, layout (contiguous or its strides), flags, and each source's op or role,
    type, shape and layout. Buffers are named in order of first sight (``buffers``, shared between graphs of one
    worker, so that the same buffer reads the same across graphs of one side), never by address."""
    from ggml_hybrid._native import lib

    def buf(t: RPCTensor) -> str:
        return buffers.setdefault(t.buffer, f"buf{len(buffers)}") if t.buffer else "-"

    def shape(t: RPCTensor) -> str:
        ne = list(t.ne)
        while len(ne) > 1 and ne[-1] == 1:
            ne.pop()
        ts, bs = lib.ggml_type_size(t.type), lib.ggml_blck_size(t.type)
        lay = "" if _contiguous(t, ts, bs) else " nb=" + "/".join(str(x) for x in t.nb)
        return f"{names.type(t)}[{','.join(str(x) for x in ne)}]{lay}"

    def role(t: RPCTensor) -> str:
        if t.id in node_ids:
            return f"#{node_ids[t.id]}"
        kind = names.op(t)
        if kind == "NONE":  # a leaf: a weight, a cache, or an input (the scheduler's copy, named after it)
            kind = f"{'input' if t.flags & 1 else 'leaf'} '{t.name}'"
        elif kind in ("VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"):
            inner = g.tensors.get(t.view_src)
            what = "?" if inner is None else f"#{node_ids[inner.id]}" if inner.id in node_ids else inner.name
            kind = f"{kind}({what})"
        return kind

    node_ids = {tid: i for i, tid in enumerate(g.nodes)}
    out = []
    for i, tid in enumerate(g.nodes):
        t = g.tensors[tid]
        flags = ",".join(v for k, v in TENSOR_FLAGS.items() if t.flags & k)
        params = ""
        if names.op(t) in ("MUL_MAT", "MUL_MAT_ID") and any(t.op_params):  # precision, hints
            used = max(j + 1 for j, x in enumerate(t.op_params) if x)
            params = " op_params=" + ",".join(str(x) for x in t.op_params[:used])
        srcs = []
        for s in t.src:
            if not s:
                continue
            st = g.tensors[s]
            srcs.append(f"{role(st)}:{shape(st)}@{buf(st)}")
        out.append(f"{i:4d} {names.op(t):22s} {shape(t)}@{buf(t)}{' ' + flags if flags else ''}{params} "
                   f"<- {'; '.join(srcs)}  '{t.name}'")
    return out


def op_summary(g: SerializedGraph, names: Names) -> Counter[str]:
    return Counter(f"{names.op(g.tensors[t])} {names.type(g.tensors[t])}" for t in g.nodes)


# -- where a step's wall time goes, from the messages' times at the proxies ------------------------------------------

PHASES = ("leader, until worker 1's graph is sent", "  of which its first input sent to its graph",
          "worker 1: graph to reply", "leader, between the workers", "worker 2: graph to reply",
          "leader, after worker 2's first reply", "the step")


Event = tuple[float, str, str, int]  # a proxy's timeline: time, "request" or "reply", command, bytes


def _merged(w1: list[Event], w2: list[Event]) -> tuple[list[tuple[float, int, str, str, int]], list[int]]:
    """Both workers' messages in time order, (time, worker, kind, command, bytes), and where each step ends: worker
    2's reply to GET_TENSOR (the logits)."""
    events = sorted([(t, 1, kind, name, n) for t, kind, name, n in w1] +
                    [(t, 2, kind, name, n) for t, kind, name, n in w2])
    ends = [i for i, (_, w, kind, name, _) in enumerate(events) if w == 2 and kind == "reply" and name == "GET_TENSOR"]
    return events, ends


def phases(w1: list[Event], w2: list[Event], n: int) -> dict[str, float]:
    """Median ms of each phase (:data:`PHASES`) over the last ``n`` steps of a run. A step ends with worker 2's
    reply to GET_TENSOR (the logits) and holds each worker's graph (GRAPH_COMPUTE or GRAPH_RECOMPUTE) and the first
    reply after it (which the worker sends once it computed the graph); what lies between the workers' messages is
    the leader's (and the proxies' loopback hops, the same for both sides)."""
    events, ends = _merged(w1, w2)
    graph = ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE")
    per: dict[str, list[float]] = {k: [] for k in PHASES}
    for a, b in zip(ends[-n - 1:-1], ends[-n:]):
        step, t0 = events[a + 1:b + 1], events[a][0]
        g1 = _first(step, 1, "request", t0, graph)
        i1 = _first(step, 1, "request", t0, ("SET_TENSOR",))  # worker 1's first input (after a reset's clear)
        r1 = _first(step, 1, "reply", g1)
        g2 = _first(step, 2, "request", r1, graph)
        r2 = _first(step, 2, "reply", g2)
        for k, v in zip(PHASES, (g1 - t0, g1 - i1, r1 - g1, g2 - r1, r2 - g2, step[-1][0] - r2, step[-1][0] - t0)):
            per[k].append(v * 1e3)
    return {k: statistics.median(v) for k, v in per.items() if v}


def _first(step: list[tuple[float, int, str, str, int]], worker: int, kind: str, after: float,
           names: tuple[str, ...] = ()) -> float:
    return next(t for t, w, k, name, _ in step if w == worker and k == kind and t >= after and
                (not names or name in names))


def last_step(w1: list[Event], w2: list[Event]) -> list[tuple[float, int, str, str, int]]:
    """The messages of a run's last step, their times in ms from the end of the step before."""
    events, ends = _merged(w1, w2)
    a, b = ends[-2], ends[-1]
    return [((t - events[a][0]) * 1e3, w, kind, name, n) for t, w, kind, name, n in events[a + 1:b + 1]]


# -- the workers' CPU time ------------------------------------------------------------------------------------


class PerfStat:
    """``perf stat`` of :data:`EVENTS` attached to a process (every thread, those it starts included) until stopped;
    or ``perf record`` into ``record``."""

    def __init__(self, pid: int, record: Path | None = None) -> None:
        self.out = Path(tempfile.mkstemp(prefix="rpc-worker-cost-", suffix=".csv")[1])
        if record is not None:
            cmd = ["perf", "record", "-q", "-F", str(PROFILE_HZ), "-o", str(record), "-p", str(pid)]
        else:
            cmd = ["perf", "stat", "-x,", "-e", ",".join(EVENTS), "-o", str(self.out), "-p", str(pid)]
        self.record = record
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> dict[str, float]:
        """Each event's count while attached (task-clock in ms); nothing for a recording."""
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=60)
        text = self.out.read_text()
        self.out.unlink()
        if self.record is not None:
            return {}
        return _perf_counts(text + err.decode(errors="replace"))


def profile_samples(data: Path) -> dict[str, int]:
    """Samples by function of a ``perf record`` (``perf report -n``)."""
    r = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "-n", "--sort", "sym"],
                       capture_output=True, text=True, timeout=300)
    rows: dict[str, int] = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].endswith("%") and parts[2].startswith("["):
            rows[" ".join(parts[3:])] = int(parts[1])
    return rows


def _perf_counts(text: str) -> dict[str, float]:
    """:data:`EVENTS` from ``perf stat -x,``'s lines (value, unit, event, ...)."""
    got = {}
    for line in text.splitlines():
        parts = line.split(",")
        if len(parts) > 2 and parts[2] in EVENTS:
            got[parts[2]] = float(parts[0])
    if set(got) != set(EVENTS):
        raise SystemExit(f"perf stat gave {sorted(got)}, not {list(EVENTS)}: {text!r}")
    return got


def _run(ns: SimpleNamespace, side: str, rpc: str, reps: int, decode: int, pids: list[int],
         record: list[Path] | None = None) -> tuple[list[dict[str, float]], list[int], dict[str, float]]:
    """One leader run (rpc_counts.py's workload) under ``perf stat``: the workers' counts while it ran (each
    attached for its length), its tokens, and the leader's own counts (every thread)."""
    stats = [PerfStat(pid, record[i] if record else None) for i, pid in enumerate(pids)]
    out = Path(tempfile.mkstemp(prefix="rpc-worker-cost-leader-", suffix=".csv")[1])
    cmd = _rpc_counts().leader_command(ns, side, rpc, reps, decode)
    try:
        # perf attaches to the workers within a moment; the leader's first second is its import and model load,
        # which send nothing, so no step is missed
        r = subprocess.run(["perf", "stat", "-x,", "-e", ",".join(EVENTS), "-o", str(out), "--", *cmd],
                           capture_output=True, text=True, timeout=900, env=dict(os.environ))
    finally:
        ms = [s.stop() for s in stats]
    leader = _perf_counts(out.read_text())
    out.unlink()
    if r.returncode != 0:
        raise SystemExit(f"{side} failed: {r.stderr[-3000:]}")
    return ms, list(json.loads(r.stdout.splitlines()[-1])["tokens"]), leader


@dataclass
class Measured:
    """Per side: for each round, :data:`QUANTITIES` per decode step (``step``) and per prompt call (``prompt``); the
    phases of each (``times``); the last run's timelines (``last``); the graphs each worker received in a decode
    run (``graphs``); the greedy tokens."""

    step: dict[str, list[dict[str, float]]]
    prompt: dict[str, list[dict[str, float]]]
    times: dict[tuple[str, str], list[dict[str, float]]]
    last: dict[tuple[str, str], list[list[Event]]]
    graphs: dict[str, dict[str, list[bytes]]]
    tokens: dict[str, list[int]]


def measure(ns: SimpleNamespace, proxies: list, pids: list[int]) -> Measured:
    """Each side ``ns.rounds`` times, alternated: the runs (1, 1), (1, 1 + steps) and (1 + PROMPTS, 1)
    (repetitions, tokens), each a fresh leader process."""
    rpc = ",".join(f"127.0.0.1:{p.port}" for p in proxies)
    m = Measured({s: [] for s in SIDES}, {s: [] for s in SIDES}, {(s, k): [] for s in SIDES for k in LABELS}, {},
                 {s: {} for s in SIDES}, {})
    for side in [s for r in range(ns.rounds) for s in (SIDES if r % 2 == 0 else SIDES[::-1])]:
        runs = {}
        for label, reps, decode in (("one", 1, 1), ("decode", 1, 1 + ns.steps), ("prompt", 1 + PROMPTS, 1)):
            for p in proxies:  # what came before this run (another run's last messages) is not this run's
                p.take()
                p.take_graphs()
                p.take_timeline()
            counts, toks, leader = _run(ns, side, rpc, reps, decode, pids)
            walls = [p.take().get("ms graph to next reply", 0.0) for p in proxies]
            timelines = [p.take_timeline() for p in proxies]
            runs[label] = _quantities(counts, leader, walls)
            if label != "one":
                m.times[(side, label)].append(phases(*timelines, ns.steps - 1 if label == "decode" else PROMPTS))
                m.last[(side, label)] = timelines
            if label == "decode":  # the graphs of a prompt call and a decode step, as each worker got them
                m.tokens[side] = toks
                m.graphs[side] = {f"worker{i + 1}": p.take_graphs() for i, p in enumerate(proxies)}
        m.step[side].append({k: (runs["decode"][k] - runs["one"][k]) / ns.steps for k in QUANTITIES})
        m.prompt[side].append({k: (runs["prompt"][k] - runs["one"][k]) / PROMPTS for k in QUANTITIES})
    return m


def _quantities(workers: list[dict[str, float]], leader: dict[str, float], walls: list[float]) -> dict[str, float]:
    out = {f"{who}: {NAMED[e]}": c[e] for e in EVENTS for who, c in zip(WHO, [*workers, leader])}
    out.update({f"worker {i + 1}: its graph to the reply, wall ms": w for i, w in enumerate(walls)})
    return out


def report(m: Measured, ns: SimpleNamespace) -> None:
    print(f"model {ns.model}; prompt {ns.prompt} tokens; {ns.steps} decode steps; {ns.rounds} rounds a side; "
          f"same tokens: {m.tokens['ours'] == m.tokens['llama.cpp']}; load average {os.getloadavg()[0]:.2f}")
    print("\nper decode step and per prompt call (perf stat of each worker process and of the leader, every "
          "thread; walls at the proxies); each round, ours | llama.cpp's (medians):")
    for what, per in (("a decode step", m.step), (f"a {ns.prompt}-token prompt call", m.prompt)):
        print(f"  {what}:")
        for k in QUANTITIES:
            cells = [" ".join(f"{r[k]:7.3f}" for r in per[side]) for side in SIDES]
            meds = [statistics.median(r[k] for r in per[side]) for side in SIDES]
            print(f"    {k:44s} {cells[0]} | {cells[1]}   ({meds[0]:.3f} | {meds[1]:.3f})")
    for label, what in (("decode", "a decode step"), ("prompt", f"a {ns.prompt}-token prompt call")):
        print(f"\nwhere {what}'s wall time goes (ms, median over the run's steps; each round: ours | llama.cpp's):")
        for k in PHASES:
            cells = [" ".join(f"{r[k]:6.3f}" for r in m.times[(side, label)]) for side in SIDES]
            meds = [statistics.median(r[k] for r in m.times[(side, label)]) for side in SIDES]
            print(f"  {k:44s} {cells[0]} | {cells[1]}   (medians {meds[0]:.3f} | {meds[1]:.3f})")
    if ns.show_step:
        for (side, label), tl in sorted(m.last.items()):
            print(f"\n{side}, the last {label} call's messages (ms from its start, worker, kind, command, bytes):")
            for t, w, kind, name, size in last_step(*tl):
                print(f"  {t:8.3f} w{w} {kind:7s} {name:20s} {size}")
    for w in ("worker1", "worker2"):
        for side in SIDES:
            gs = [parse_graph(b) for b in m.graphs[side].get(w, [])]
            print(f"{side}, {w}: {len(gs)} graphs computed (nodes: {[len(g.nodes) for g in gs]})")


@click.command(help=__doc__)
@click.option("--llama-python", required=True, help="a Python with llama-cpp-python 0.3.36 (GGML_RPC=on)")
@click.option("--model", default=None, help="the model (default: bench_hosts.py's generated qwen3moe)")
@click.option("--prompt", type=int, default=64, show_default=True)
@click.option("--steps", type=int, default=64, show_default=True, help="decode steps counted")
@click.option("--rounds", type=int, default=2, show_default=True, help="measurements per side, alternated")
@click.option("--profile", is_flag=True, help="also sample the workers by function (perf record)")
@click.option("--dump", default=None, help="write each side's graphs as text here, and their diffs")
@click.option("--show-step", is_flag=True, help="print the messages of each side's last decode step and prompt call")
@click.option("--json-out", default=None)
def main(**kw: object) -> None:
    ns = SimpleNamespace(**kw)
    rc = _rpc_counts()
    with tempfile.TemporaryDirectory(prefix="rpc-worker-cost-") as tmp:
        if ns.model is None:  # bench_hosts.py's model, in a folder of this run's: no other run rewrites it meanwhile
            from ggml_hybrid.synthetic import write_model

            ns.model = str(write_model(Path(tmp) / "bench_hosts-16.gguf", n_layer=8, n_embd=512, n_expert=16,
                                       n_used=2, weight_type="q8_0", seed=5))
        _main(ns, rc)


def _main(ns: SimpleNamespace, rc: ModuleType) -> None:
    ports = [rc._free_port(), rc._free_port()]
    servers = [rc._server(p) for p in ports]
    try:
        proxies = [rc.CountingProxy(("127.0.0.1", p), keep_graphs=True) for p in ports]
        pids = [s.pid for s in servers]
        m = measure(ns, proxies, pids)
        report(m, ns)
        if ns.dump:
            _dump(Path(ns.dump), m.graphs, Names())
        if ns.profile:
            _profile(ns, ",".join(f"127.0.0.1:{p.port}" for p in proxies), pids)
        if ns.json_out:
            Path(ns.json_out).write_text(json.dumps({"step": m.step, "prompt": m.prompt,
                                                     "phases": {f"{s} {k}": v for (s, k), v in m.times.items()}},
                                                    indent=1) + "\n")
    finally:
        _rpc_counts().stop_servers(servers)


def _normal(line: str) -> str:
    """A node's line as the two sides' diff compares it: no index, name, node references or leaf names (each side
    names its tensors its own way), no input flag (the scheduler flags its copies of the inputs only when it keeps
    several copies: llama.cpp's pipeline parallelism)."""
    line = line[5:].split("  '")[0]
    line = re.sub(r"#\d+", "#", line)
    line = re.sub(r"@buf\d+", "", line)  # buffers are numbered per side (ours keeps the experts in a buffer of theirs)
    return re.sub(r"(input|leaf) '[^']*'", "leaf", line)


def node_diff(theirs: list[str], ours: list[str]) -> list[str]:
    """The two node lists' differences, llama.cpp's ("-") against ours ("+"), with a node of context; difflib
    without its junk heuristic (a graph's lines repeat once per layer: with it, difflib aligns nothing)."""
    sm = difflib.SequenceMatcher(None, theirs, ours, autojunk=False)
    out = []
    for group in sm.get_grouped_opcodes(1):
        out.append(f"@@ llama.cpp {group[0][1]}, ours {group[0][3]} @@")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out += ["  " + x for x in theirs[i1:i2]]
            else:
                out += ["- " + x for x in theirs[i1:i2]] + ["+ " + x for x in ours[j1:j2]]
    return out


def _dump(out: Path, graphs: dict[str, dict[str, list[bytes]]], names: Names) -> None:
    """Each side's graphs as text (``<side>-<worker>-<n>.txt``), and for each worker the diff of the two sides'
    graph pairs (the same position in each side's sequence of graphs: the prompt's, then the decode step's)."""
    out.mkdir(parents=True, exist_ok=True)
    texts: dict[tuple[str, str], list[list[str]]] = {}
    for side, per in graphs.items():
        tag = side.replace(".", "")
        for w, payloads in per.items():
            buffers: dict[int, str] = {}
            texts[(side, w)] = []
            for k, b in enumerate(payloads):
                g = parse_graph(b)
                lines = describe(g, names, buffers)
                texts[(side, w)].append(lines)
                (out / f"{tag}-{w}-{k}.txt").write_text("\n".join(lines) + "\n")
                summary = op_summary(g, names)
                (out / f"{tag}-{w}-{k}.ops.txt").write_text(
                    "".join(f"{n:5d} {k2}\n" for k2, n in sorted(summary.items())))
    for w in ("worker1", "worker2"):
        a, b = texts.get(("ours", w), []), texts.get(("llama.cpp", w), [])
        for k in range(min(len(a), len(b))):
            strip = [[_normal(line) for line in x[k]] for x in (a, b)]
            (out / f"diff-{w}-{k}.txt").write_text("\n".join(node_diff(strip[1], strip[0])) + "\n")
    print(f"graphs and diffs written to {out}")


def _profile(ns: SimpleNamespace, rpc: str, pids: list[int]) -> None:
    """CPU ms per decode step and per prompt call by function on each worker: samples of ``perf record`` at
    2000 Hz (0.5 ms of CPU each) over a run with 1 + steps tokens and one with 1, the difference over steps (and
    over 8 prompt calls against 1)."""
    tmp = Path(tempfile.mkdtemp(prefix="rpc-worker-prof-"))
    per_sample = 1000 / PROFILE_HZ
    runs = {"one": (1, 1), "decode": (1, 1 + ns.steps), "prompt": (1 + PROMPTS, 1)}
    got: dict[tuple[str, str], list[dict[str, int]]] = {}
    for side in SIDES:
        for label, (reps, decode) in runs.items():
            rec = [tmp / f"{side.replace('.', '')}-{label}-w{i}.data" for i in (1, 2)]
            _run(ns, side, rpc, reps, decode, pids, rec)

            got[(side, label)] = [profile_samples(r) for r in rec]
    for label, div in (("decode", ns.steps), ("prompt", PROMPTS)):
        for i in (0, 1):
            table = {}
            for side in SIDES:
                a, b = got[(side, "one")][i], got[(side, label)][i]
                table[side] = {k: (b.get(k, 0) - a.get(k, 0)) * per_sample / div for k in set(a) | set(b)}
            what = "a decode step" if label == "decode" else f"a {ns.prompt}-token prompt call"
            print(f"\nworker {i + 1}, CPU ms of {what} by function (perf samples), ours / llama.cpp's:")
            keys = sorted(set(table["ours"]) | set(table["llama.cpp"]),
                          key=lambda k: -abs(table["ours"].get(k, 0)) - abs(table["llama.cpp"].get(k, 0)))
            for k in keys[:25]:
                print(f"  {table['ours'].get(k, 0):8.3f} {table['llama.cpp'].get(k, 0):8.3f}  {k}")
            print(f"  {sum(table['ours'].values()):8.3f} {sum(table['llama.cpp'].values()):8.3f}  (all)")
    print(f"perf data under {tmp}")


if __name__ == "__main__":
    main()
