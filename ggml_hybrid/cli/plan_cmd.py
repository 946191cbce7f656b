"""``ggml-hybrid plan``: what a model needs per device and in host memory, before loading it.

It takes the session flags of ``run``; it reads the file's metadata and writes nothing.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import click

from ..options import SessionOptions
from ..plan.k8s import DEFAULT_IMAGE, DEFAULT_PORT
from .flags import flags_for, model_argument, pick_model, session_flags, session_from_flags
from .main import main


def _with(opts: SessionOptions, combination: str) -> list[str]:
    """The given options with the combination's over them (the experts' placement entirely the combination's)."""
    from ..plan.planner import EXPERT_KEYS

    items = combination.split()
    keys = {x.split("=", 1)[0] for x in items} | set(EXPERT_KEYS)
    return [x for x in opts.to_items() if x.split("=", 1)[0] not in keys] + items


def _keep(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """--trace and --plot: kept in the context (read by :func:`plan`), not passed as arguments."""
    ctx.meta[f"plan.{param.name}"] = value


def _plot(path: str, p: Any, opts: SessionOptions, trace: str, plot_file: str) -> None:
    """The trace's curves for this model: its experts' bytes, the runtime's policies, the share asked for."""
    import os

    from ..moe.traces import TraceError, read_trace
    from ..moe.traces.plot import check_plot_path, write_plot
    from .replay import sweep

    check_plot_path(plot_file)
    if not p.moe:
        raise TraceError(f"--plot: {path!r} has no routed experts: there is nothing to replay")
    head = read_trace(trace, warn=False)
    if (head.n_expert, head.n_used) != (p.experts.count, p.experts.used):
        raise TraceError(f"--trace {trace!r}: {head.n_expert} experts, top-{head.n_used}; the model has "
                         f"{p.experts.count}, top-{p.experts.used}: a trace of another model")
    share = opts.moe_cpu_share
    shares = [0.0] if share in (0.0, "auto") else [0.0, float(share)]
    tr, results = sweep(trace, [], [], shares, p.experts.bytes_per_expert)
    write_plot(plot_file, tr, results, f"{os.path.basename(path)}: routing trace {os.path.basename(trace)}")
    click.echo(f"wrote {plot_file}", err=True)


def _workers(opts: SessionOptions, sizes: list[int] | None, workers: int | None, worker_mem: str | None
             ) -> tuple[SessionOptions, list[int] | None]:
    """``--rpc-workers N --worker-mem SIZE``: the session's devices are the N workers' (RPC0, ...), SIZE each."""
    from ..units import parse_size

    if (workers is None) != (worker_mem is None):
        raise click.UsageError("--rpc-workers and --worker-mem go together (the workers do not exist yet: give "
                               "each one's memory)")
    if workers is None or worker_mem is None:
        return opts, sizes
    if sizes is not None or opts.rpc is not None or opts.devices is not None:
        raise click.UsageError("--rpc-workers plans the workers' devices: not with --vram, --rpc or -dev")
    names = ",".join(f"RPC{i}" for i in range(workers))
    return opts.merged(devices=names), [parse_size(worker_mem)] * workers


def _links(opts: SessionOptions, p: Any) -> dict[str, dict[str, float]]:
    """Each RPC device's link as measured now (``links.measure_link``), and what the plan's experts cost over it: one
    expert's upload, and a decode token's ``used`` misses of one layer (the bound a cache with no hit pays); none
    without RPC servers or for a dense model."""
    from ..ggml import links, rpc

    experts = getattr(p, "experts", None)
    if opts.rpc is None or experts is None:
        return {}
    out = {}
    for d in rpc.server_devices(opts.rpc, opts.rpc_timeout):
        link = links.measure_link(d)
        one = link.seconds(experts.bytes_per_expert)
        out[d.name] = {"bytes_per_s": link.bytes_per_s, "rtt_s": link.rtt_s, "expert_load_s": one,
                       "used": experts.used, "token_loads_s": one * experts.used}
    return out


def _k8s(p: Any, k8s: dict[str, Any], sizes: list[int] | None) -> str:
    """The Deployment, or with --rpc-workers the LeaderWorkerSet and its Service (two YAML documents)."""
    from ..plan.k8s import leader_worker_set, service, to_yaml
    from ..plan.planner import format_k8s, k8s_resources

    kw = {"image": k8s["image"], "port": k8s["port"], "api_key_secret": k8s["api_key_secret"]}
    if k8s["rpc_workers"] is None:
        return format_k8s(p, **kw)
    assert sizes is not None
    lws = leader_worker_set(p, k8s_resources(p)["resources"], k8s["rpc_workers"], sizes[0], **kw)
    return to_yaml(lws) + "---\n" + to_yaml(service(lws["metadata"]["name"], k8s["port"]))


@main.command()
@model_argument
@session_flags
@click.option("--vram", help="Device memory, one size per device: 24G or 80G,80G (plans for CUDA0, CUDA1, ... or the "
              "devices of -dev).")
@click.option("--ram", help="Host memory for the warnings, e.g. 64G.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "k8s"]), default="text", show_default=True,
              help="k8s: a Deployment running `ggml-hybrid serve` with these options, resources and probes.")
@click.option("--json", "as_json", is_flag=True, help="The same as --format json.")
@click.option("--image", default=DEFAULT_IMAGE, show_default=True, help="Container image (--format k8s).")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(1, 65535),
              help="The server's port (--format k8s).")
@click.option("--api-key-secret", metavar="NAME", default=None,
              help="--format k8s: the server takes its API keys from this Secret's 'api-keys' entry (one key a line).")
@click.option("--trace", type=click.Path(dir_okay=False), expose_value=False, callback=_keep,
              help="A routing trace of this model (moe_trace_path): with --plot, its loads-against-slots curves.")
@click.option("--plot", type=click.Path(dir_okay=False), expose_value=False, callback=_keep,
              help="Draw --trace's heatmap and loads-against-slots curves for this model to FILE (.png or .html).")
@click.option("--rpc-workers", type=click.IntRange(1, 15), default=None, metavar="N",
              help="Plan for N rpc-server workers (devices RPC0..) of --worker-mem each; with --format k8s a "
                   "LeaderWorkerSet of a serve leader and N workers.")
@click.option("--worker-mem", metavar="SIZE", default=None, help="Each worker's memory (--rpc-workers), e.g. 64G.")
def plan(model: str | None, model_flag: str | None, hf_repo: str | None, hf_file: str | None, vram: str | None,
         ram: str | None, fmt: str, as_json: bool, **flags: Any) -> None:
    """What MODEL needs per device and in host memory under the given options, from metadata alone."""
    from ..plan.plan_text import format_text
    from ..plan.planner import plan as make_plan
    from ..units import parse_size

    k8s = {k: flags.pop(k) for k in ("image", "port", "api_key_secret", "rpc_workers", "worker_mem")}
    if as_json:
        if fmt not in ("text", "json"):
            raise click.UsageError(f"--json and --format {fmt}: choose one output format")
        fmt = "json"
    if k8s["api_key_secret"] is not None and fmt != "k8s":
        raise click.UsageError("--api-key-secret is for --format k8s (the Deployment's server reads its keys there)")
    trace, plot_file = (click.get_current_context().meta.get(f"plan.{k}") for k in ("trace", "plot"))
    if (trace is None) != (plot_file is None):
        raise click.UsageError("--trace and --plot go together: the curves of a trace for this model")
    path, _, opts = session_from_flags(pick_model(model, model_flag, hf_repo, hf_file, quiet=fmt != "text"), flags)
    sizes = [parse_size(x) for x in vram.split(",")] if vram else None
    opts, sizes = _workers(opts, sizes, k8s["rpc_workers"], k8s["worker_mem"])
    p = make_plan(path, opts, vram=sizes, ram=parse_size(ram) if ram else None)
    if trace is not None and plot_file is not None:
        _plot(path, p, opts, trace, plot_file)
    if fmt == "json":
        links = _links(opts, p)
        click.echo(json.dumps({**p.to_dict(), **({"links": links} if links else {})}))
    elif fmt == "k8s":
        click.echo(_k8s(p, k8s, sizes), nl=False)
    else:
        click.echo(format_text(p))
        for name, link in _links(opts, p).items():
            click.echo(f"  link {name}: {link['bytes_per_s'] * 8 / 1e9:.2f} Gbit/s, round trip "
                       f"{link['rtt_s'] * 1e3:.2f} ms: one expert's load {link['expert_load_s'] * 1e3:.2f} ms, a "
                       f"token's {link['used']:.0f} at most {link['token_loads_s'] * 1e3:.2f} ms per layer")
        c = getattr(p, "combination", None)
        if c is not None and c.fits:
            # run holds one sequence and needs a prompt to run as printed; serve holds several
            cmd = ["serve"] if opts.n_parallel > 1 else ["run", "-p", "Hello", "-n", "32"]
            click.echo("  try: " + shlex.join(["ggml-hybrid", cmd[0], path, *flags_for(_with(opts, c.options)),
                                               *cmd[1:]]))
