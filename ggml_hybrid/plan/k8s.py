"""``plan --format k8s``: a Kubernetes Deployment that runs ``ggml-hybrid serve`` as planned.

The container runs ``ggml-hybrid serve MODEL --host 0.0.0.0 --port PORT`` with the plan's session
options as ``-o key=value`` items (``n_parallel`` among them), asks for the memory and CPU the plan
computes (:func:`~ggml_hybrid.plan.planner.k8s_resources`), and probes ``/health``: a startup probe
that allows for a long load (503 while loading), then readiness and liveness. The model path is the
one given to ``plan``: mount the file there. With ``api_key_secret`` the server takes its API keys from that
Secret (its ``api-keys`` entry, mounted read-only as a file: ``serve --api-key-file``); ``/health``, which
the probes read, needs none. The YAML is written here (no YAML library at runtime):
block style, strings JSON-quoted, which every YAML 1.2 reader reads back.
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


def k8s_name(path: str) -> str:
    """A DNS-1123 name from the model file's name (``Qwen3-30B-A3B.Q4_K_M.gguf`` -> ``qwen3-30b-a3b-q4-k-m``)."""
    stem = os.path.basename(path)
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    name = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")[:63].strip("-")
    return name or "ggml-hybrid"


def deployment(p: Plan, resources: dict[str, Any], image: str = DEFAULT_IMAGE, port: int = DEFAULT_PORT,
               name: str | None = None, api_key_secret: str | None = None) -> dict[str, Any]:
    """The Deployment for plan ``p`` (``resources``: the container's ``resources`` stanza; ``api_key_secret``: the
    name of a Secret whose ``api-keys`` entry holds the server's API keys)."""
    check_int(port, "k8s: port", 1, 65535)
    if api_key_secret is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", api_key_secret):
        raise ArgumentError(f"k8s: api_key_secret {api_key_secret!r} is not a Kubernetes object name (lower-case "
                            "letters, digits, '-' and '.', starting and ending with a letter or digit)")
    name = name or k8s_name(p.model)
    args = ["serve", p.model, "--host", "0.0.0.0", "--port", str(port)]
    if api_key_secret is not None:
        args += ["--api-key-file", f"{KEYS_DIR}/{KEYS_ENTRY}"]
    for item in p.options:
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
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": pod}},
    }


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


__all__ = ["DEFAULT_IMAGE", "DEFAULT_PORT", "deployment", "k8s_name", "to_yaml"]
