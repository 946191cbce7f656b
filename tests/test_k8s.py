"""Every Kubernetes manifest ``plan --format k8s`` writes, checked by what Kubernetes itself checks.

Oracles: the OpenAPI schemas of Kubernetes' API (the ``kubernetes-validate`` package, strict: unknown fields are
errors) for the Deployment, the Service and the pod templates of a LeaderWorkerSet; the LeaderWorkerSet CRD of
kubernetes-sigs/lws (``tests/fixtures/lws/``, its ``v1`` OpenAPI schema, with jsonschema, made strict as
``kubectl apply --validate=strict`` is: unknown fields are errors) for the LeaderWorkerSet; PyYAML for the YAML.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from ggml_hybrid.cli import main
from ggml_hybrid.synthetic import write_model

CRD = Path(__file__).parent / "fixtures" / "lws" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
K8S_VERSION = "1.33.0"  # the Kubernetes API the manifests are checked against


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A model whose RPC0 needs 4.13 MiB over 2 workers and 3.15 MiB over 3 (-c 256 -ub 32): 3 workers of 4 MiB."""
    d = tmp_path_factory.mktemp("k8s")
    return write_model(d / "moe.gguf", n_layer=6, n_embd=256, n_expert=16, n_used=2, weight_type="q8_0", seed=3)


def _plan(model, *args: str) -> list[dict]:
    r = CliRunner().invoke(main, ["plan", str(model), "-c", "256", "-ub", "32", "--format", "k8s", *args])
    assert r.exit_code == 0, r.output
    return [d for d in yaml.safe_load_all(r.stdout) if d is not None]


def _strict(schema: object) -> object:
    """The schema with every object of listed properties closed (additionalProperties false), unless it keeps
    unknown fields (x-kubernetes-preserve-unknown-fields) or says what other keys hold."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def lws_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = copy.deepcopy(v1["schema"]["openAPIV3Schema"])
    schema["properties"].pop("status", None)  # the controller's part
    return _strict(schema)


def validate_lws(doc: dict) -> None:
    jsonschema.Draft7Validator(lws_schema()).validate(doc)
    for role in ("leaderTemplate", "workerTemplate"):  # the pods, against Kubernetes' own PodTemplate schema
        template = doc["spec"]["leaderWorkerTemplate"][role]
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                                      "template": template}, K8S_VERSION, strict=True)


def test_the_deployment_is_valid_kubernetes(model):
    for extra in ([], ["--api-key-secret", "llm-keys"], ["--parallel", "4", "--image", "reg/gh:1", "--port", "9000"]):
        (deploy,) = _plan(model, *extra)
        assert deploy["kind"] == "Deployment"
        kubernetes_validate.validate(deploy, K8S_VERSION, strict=True)


def test_a_model_that_needs_three_workers_is_a_leader_worker_set_of_three(model):
    r = CliRunner().invoke(main, ["plan", str(model), "-c", "256", "-ub", "32", "--format", "k8s", "--rpc-workers",
                                  "2", "--worker-mem", "4M"])
    assert r.exit_code != 0 and "RPC0 needs" in r.output and "--rpc-workers" in r.output, r.output
    lws, svc = _plan(model, "--rpc-workers", "3", "--worker-mem", "4M")
    validate_lws(lws)
    kubernetes_validate.validate(svc, K8S_VERSION, strict=True)
    t = lws["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 4 and t["restartPolicy"] == "None"
    leader = t["leaderTemplate"]["spec"]["containers"][0]
    rpc = leader["args"][leader["args"].index("--rpc") + 1]
    assert rpc == ",".join(f"$(POD_NAME)-{i}.moe:50052" for i in (1, 2, 3))
    assert not any(a.startswith("devices=") for a in leader["args"])  # the workers' devices are the session's
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health" and "tcpSocket" in leader["livenessProbe"]
    worker = t["workerTemplate"]["spec"]["containers"][0]
    assert worker["args"][:1] == ["rpc-server"] and worker["args"][worker["args"].index("--mem") + 1] == "4"
    assert worker["resources"]["limits"]["memory"] == f"{4 + 1024}Mi" and "tcpSocket" in worker["readinessProbe"]
    init = t["leaderTemplate"]["spec"]["initContainers"][0]
    assert rpc in init["command"][-1]
    assert t["leaderTemplate"]["spec"]["terminationGracePeriodSeconds"] == 40  # the drain contract
    assert svc["spec"]["selector"] == {"app": "moe", "role": "leader"}


def test_the_checks_catch_a_broken_manifest(model):
    """The oracles can fail: a worker without containers, a misspelt field, a port that is not a port."""
    lws, _ = _plan(model, "--rpc-workers", "3", "--worker-mem", "4M")
    broken = copy.deepcopy(lws)
    del broken["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(lws_schema()).validate(broken)
    broken = copy.deepcopy(lws)
    broken["spec"]["leaderWorkerTemplate"]["sise"] = 4
    with pytest.raises(jsonschema.ValidationError):
        validate_lws(broken)
    template = copy.deepcopy(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    template["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, K8S_VERSION, strict=True)


@pytest.mark.parametrize("args, expect", [
    (["--rpc-workers", "2"], "go together"),
    (["--worker-mem", "4M"], "go together"),
    (["--rpc-workers", "2", "--worker-mem", "4M", "--vram", "4M,4M"], "not with --vram"),
    (["--rpc-workers", "2", "--worker-mem", "1536K"], "whole number of MiB"),
])
def test_worker_flags_are_checked(model, args, expect):
    r = CliRunner().invoke(main, ["plan", str(model), "--format", "k8s", *args])
    assert r.exit_code != 0 and expect in r.output, r.output
