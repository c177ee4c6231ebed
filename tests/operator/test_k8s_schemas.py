"""Rendered children and `helm template` output against the Kubernetes OpenAPI schemas (offline)."""
from __future__ import annotations

import copy
import itertools

import kubernetes_validate
import pytest
from chart_render import helm_template
from hi_fixtures import make_body, stages
from hybrid_operator.render import render_children
from hybrid_operator.settings import Settings

# 1.29: first release with podAffinity matchLabelKeys; 1.37: newest schemas shipped.
VERSIONS = ["1.29.0", "1.37.0"]
SHAPES = list(itertools.product(["hostPath", "none"], [1, 2, 3], [1, 2], [0, 3]))


def check(obj, version):
    kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mode,n,tp,replicas", SHAPES)
def test_rendered_children_are_valid_kubernetes_objects(version, mode, n, tp, replicas):
    body = make_body(stages=stages(n, tp), replicas=replicas, sharedMemory={"mode": mode, "sizeLimit": "1Gi"},
                     serving={"apiKeySecretRef": {"name": "k"}})
    for child in render_children(body, Settings(network_policy=True)):
        check(child, version)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("strategy", ["offload", "balanced", "auto"])
def test_children_of_every_strategy_are_valid_kubernetes_objects(version, strategy):
    st = stages(3)
    st[0]["memory"] = "1.5Gi"  # offload adds the cpu stages' memory to it
    body = make_body(stages=st, strategy=strategy, workload={"concurrency": 8, "promptTokens": 512})
    for child in render_children(body, Settings(network_policy=True)):
        check(child, version)


@pytest.mark.parametrize("version", VERSIONS)
def test_stage_env_renders_valid_containers(version):
    st = stages(2)
    st[0]["env"] = [{"name": "HYBRID_BATCHES_IN_FLIGHT", "value": "2"}, {"name": "EMPTY", "value": ""}]
    st[1]["env"] = [{"name": "VLLM_CPU_SGL_KERNEL", "value": "0"}, {"name": "_X"}]
    for child in render_children(make_body(stages=st)):
        check(child, version)


def test_validator_is_not_vacuous():
    sts = next(c for c in render_children(make_body()) if c["kind"] == "StatefulSet")
    bad = copy.deepcopy(sts)
    bad["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        check(bad, VERSIONS[-1])
    bad = copy.deepcopy(sts)
    bad["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        check(bad, VERSIONS[-1])


PROMETHEUS_KINDS = {"ServiceMonitor", "PodMonitor"}  # CRDs of the Prometheus Operator: no built-in schema


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("values", [
    [],
    ["--set", "networkPolicy.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
     "--set", "metrics.podMonitor.enabled=true", "--set", "watchNamespaces={a,b}", "--set", "logLevel=debug"],
    ["--set", "metrics.enabled=false", "--set", "serviceAccount.create=false", "--set", "serviceAccount.name=x"],
])
def test_helm_template_output_is_valid(version, values):
    docs = helm_template(*values, include_crds=True)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole"} <= kinds
    for doc in docs:
        if doc["kind"] in PROMETHEUS_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]
            continue
        check(doc, version)
