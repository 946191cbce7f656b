"""``plan --format k8s``: a Kubernetes Deployment that runs ``ggml-hybrid serve`` as planned, or with
``--rpc-workers N`` a LeaderWorkerSet (kubernetes-sigs/lws) of a ``serve`` leader and N ``rpc-server`` workers.

The container runs ``ggml-hybrid serve MODEL --host 0.0.0.0 --port PORT`` with the plan's session
options as ``-o key=value`` items (``n_parallel`` among them), asks for the memory and CPU the plan
computes (:func:`~ggml_hybrid.plan.planner.k8s_resources`), and probes ``/health``: a startup probe
that allows for a long load (503 while loading), then readiness and liveness. The model path is the
one given to ``plan``: mount the file there. With ``api_key_secret`` the server takes its API keys from that
Secret (its ``api-keys`` entry, mounted read-only as a file: ``serve --api-key-file``); ``/health``, which
the probes read, needs none. The YAML is written here (no YAML library at runtime):
block style, strings JSON-quoted, which every YAML 1.2 reader reads back.

The LeaderWorkerSet (:func:`leader_worker_set`) groups a leader pod and N worker pods; LWS names the workers of the
leader pod ``NAME-G`` ``NAME-G-1`` ... ``NAME-G-N`` under the headless service ``NAME``, so the leader's ``--rpc``
is ``$(POD_NAME)-1.NAME:50052,...`` (its own pod name from the downward API: right for any group). Each worker runs
``ggml-hybrid rpc-server --host 0.0.0.0 --mem MiB`` with the memory the plan gives an RPC device of ``--worker-mem``
(plus :data:`WORKER_OVERHEAD`) and the plan's threads; its readiness is its port accepting. The leader waits for
every worker in an init container (``ggml-hybrid devices --rpc ...`` until it answers), then loads; its readiness
is ``/health`` as the Deployment's, its liveness the port (a lost worker makes ``/health`` say 503 while ``serve``
reconnects: that must not restart the leader), and the group's ``restartPolicy`` is ``None``: a worker restarted
alone is reconnected to (docs/rpc.md), the leader keeps its other work.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any

from ..checks import check_int
from ..errors import ArgumentError

if TYPE_CHECKING:
    from .planner import Plan

DEFAULT_IMAGE = "ggml-hybrid:latest"
DEFAULT_PORT = 8080
KEYS_DIR = "/etc/ggml-hybrid/api-keys"  # where the API key Secret is mounted
KEYS_ENTRY = "api-keys"  # the Secret's entry holding the keys, one a line
LOAD_SECONDS = 3600  # the startup probe's patience: a large model read from a network volume loads slowly
DRAIN_SECONDS = 30   # the server's --drain-timeout default: in-flight requests get this long after SIGTERM
RPC_PORT = 50052  # rpc-server's default port
WORKER_OVERHEAD = 1 << 30  # a worker's memory beyond what it serves: the process, GGML's own allocations
LWS_API = "leaderworkerset.x-k8s.io/v1"


def k8s_name(path: str) -> str:
    """A DNS-1123 name from the model file's name (``Qwen3-30B-A3B.Q4_K_M.gguf`` -> ``qwen3-30b-a3b-q4-k-m``)."""
    stem = os.path.basename(path)
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    name = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")[:63].strip("-")
    return name or "ggml-hybrid"


def _server_pod(p: Plan, resources: dict[str, Any], image: str, port: int, api_key_secret: str | None,
                extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """The pod spec of ``ggml-hybrid serve`` for plan ``p`` (the Deployment's, and a LeaderWorkerSet's leader)."""
    check_int(port, "k8s: port", 1, 65535)
    if api_key_secret is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", api_key_secret):
        raise ArgumentError(f"k8s: api_key_secret {api_key_secret!r} is not a Kubernetes object name (lower-case "
                            "letters, digits, '-' and '.', starting and ending with a letter or digit)")
    args = ["serve", p.model, "--host", "0.0.0.0", "--port", str(port), *extra_args]
    if api_key_secret is not None:
        args += ["--api-key-file", f"{KEYS_DIR}/{KEYS_ENTRY}"]
    for item in p.options:
        if not (extra_args and item.startswith("devices=")):  # with --rpc the workers' devices are the session's
            args += ["-o", item]
    probe = {"httpGet": {"path": "/health", "port": port}}
    container = {
        "name": "ggml-hybrid", "image": image, "command": ["ggml-hybrid"], "args": args,
        "ports": [{"name": "http", "containerPort": port}],
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": LOAD_SECONDS // 10},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "resources": resources,
    }
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": DRAIN_SECONDS + 10, "containers": [container]}
    if api_key_secret is not None:
        container["volumeMounts"] = [{"name": "api-keys", "mountPath": KEYS_DIR, "readOnly": True}]
        pod["volumes"] = [{"name": "api-keys", "secret": {"secretName": api_key_secret,
                                                          "items": [{"key": KEYS_ENTRY, "path": KEYS_ENTRY}]}}]
    return pod


def deployment(p: Plan, resources: dict[str, Any], image: str = DEFAULT_IMAGE, port: int = DEFAULT_PORT,
               name: str | None = None, api_key_secret: str | None = None) -> dict[str, Any]:
    """The Deployment for plan ``p`` (``resources``: the container's ``resources`` stanza; ``api_key_secret``: the
    name of a Secret whose ``api-keys`` entry holds the server's API keys)."""
    pod = _server_pod(p, resources, image, port, api_key_secret)
    name = name or k8s_name(p.model)
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": pod}},
    }


def worker_resources(p: Plan, workers: int, worker_mem: int) -> dict[str, Any]:
    """A worker container's ``resources``: ``worker_mem`` (what its rpc-server reports) plus
    :data:`WORKER_OVERHEAD`, and the plan's threads. Raises :class:`ArgumentError` when the plan does not fit one
    of the ``workers`` devices (RPC0, ...) in ``worker_mem``, naming it and what it needs."""
    check_int(workers, "k8s: rpc_workers", 1, 15)
    if worker_mem < 1 << 20 or worker_mem % (1 << 20):
        raise ArgumentError(f"k8s: worker memory {worker_mem} bytes is not a whole number of MiB (rpc-server --mem "
                            "takes MiB)")
    for i in range(workers):
        d = p.devices.get(f"RPC{i}")
        if d is not None and d.total > worker_mem:
            raise ArgumentError(f"k8s: RPC{i} needs {d.total} bytes of the {worker_mem} each worker has "
                                f"(--worker-mem): give more workers (--rpc-workers) or more memory to each")
    mem_mi = -(-(worker_mem + WORKER_OVERHEAD) // (1 << 20))
    return {"requests": {"memory": f"{mem_mi}Mi", "cpu": str(p.threads)}, "limits": {"memory": f"{mem_mi}Mi"}}


def leader_worker_set(p: Plan, leader_resources: dict[str, Any], workers: int, worker_mem: int,
                      image: str = DEFAULT_IMAGE, port: int = DEFAULT_PORT, name: str | None = None,
                      api_key_secret: str | None = None) -> dict[str, Any]:
    """The LeaderWorkerSet for plan ``p`` (planned for devices ``RPC0`` .. ``RPC{workers-1}`` of ``worker_mem`` bytes
    each): a ``serve`` leader with ``leader_resources`` and ``workers`` rpc-server workers (module docstring)."""
    name = name or k8s_name(p.model)
    resources = worker_resources(p, workers, worker_mem)
    rpc = ",".join(f"$(POD_NAME)-{i}.{name}:{RPC_PORT}" for i in range(1, workers + 1))
    pod = _server_pod(p, leader_resources, image, port, api_key_secret, ("--rpc", rpc))
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    leader = pod["containers"][0]
    leader["env"] = env
    leader["livenessProbe"] = {"tcpSocket": {"port": port}, "periodSeconds": 10, "failureThreshold": 3}
    pod["initContainers"] = [{
        "name": "wait-for-workers", "image": image, "env": env,
        "command": ["sh", "-c", f"until ggml-hybrid devices --rpc {rpc} >/dev/null; do sleep 2; done"],
    }]
    port_probe = {"tcpSocket": {"port": RPC_PORT}}
    worker = {
        "name": "rpc-server", "image": image, "command": ["ggml-hybrid"],
        "args": ["rpc-server", "--host", "0.0.0.0", "--port", str(RPC_PORT), "--threads", str(p.threads),
                 "--mem", str(worker_mem >> 20)],
        "ports": [{"name": "rpc", "containerPort": RPC_PORT}],
        "readinessProbe": {**port_probe, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**port_probe, "periodSeconds": 10, "failureThreshold": 3},
        "resources": resources,
    }
    labels = {"app": name}
    return {
        "apiVersion": LWS_API, "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "labels": labels},
        "spec": {"replicas": 1, "startupPolicy": "LeaderCreated", "leaderWorkerTemplate": {
            "size": workers + 1, "restartPolicy": "None",
            "leaderTemplate": {"metadata": {"labels": {**labels, "role": "leader"}}, "spec": pod},
            "workerTemplate": {"metadata": {"labels": {**labels, "role": "worker"}}, "spec": {"containers": [worker]}},
        }},
    }


def service(name: str, port: int = DEFAULT_PORT) -> dict[str, Any]:
    """A Service in front of the leader's HTTP port (a LeaderWorkerSet makes only its headless service)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-http"},
            "spec": {"selector": {"app": name, "role": "leader"},
                     "ports": [{"name": "http", "port": port, "targetPort": port}]}}


def to_yaml(obj: Any, indent: int = 0) -> str:
    """Block-style YAML of dicts, lists, strings, numbers and booleans."""
    return "\n".join(_lines(obj, indent)) + "\n"


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, str):
        return json.dumps(v)
    raise TypeError(f"to_yaml: cannot write {type(v).__name__}")


def _lines(obj: Any, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{k}:")
                out += _lines(v, indent + 2)
            else:
                out.append(f"{pad}{k}: {_empty(v) if isinstance(v, (dict, list)) else _scalar(v)}")
    elif isinstance(obj, list):
        for v in obj:
            if isinstance(v, (dict, list)) and v:
                sub = _lines(v, indent + 2)
                out.append(f"{pad}- {sub[0].lstrip()}")
                out += sub[1:]
            else:
                out.append(f"{pad}- {_empty(v) if isinstance(v, (dict, list)) else _scalar(v)}")
    else:
        out.append(pad + _scalar(obj))
    return out


def _empty(v: dict[str, Any] | list[Any]) -> str:
    return "{}" if isinstance(v, dict) else "[]"


__all__ = ["DEFAULT_IMAGE", "DEFAULT_PORT", "LWS_API", "RPC_PORT", "WORKER_OVERHEAD", "deployment", "k8s_name",
           "leader_worker_set", "service", "to_yaml", "worker_resources"]
