"""Rendered children and `helm template` output, admitted by the real API server (tests/kube_cluster.py).

Children go in as server-side dry-run creates with strict field validation; the chart's output goes
through `kubectl apply --dry-run=server`, for every chart option the user guide documents.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import yaml
from chart_render import helm
from hi_fixtures import CHART, make_body, stages
from hybrid_operator.kube import path_for
from hybrid_operator.render import render_children
from hybrid_operator.settings import Settings

NAMESPACE = "render-checks"
SHAPES = list(itertools.product(["hostPath", "none"], [1, 2, 3], [1, 2], [0, 3]))
# The Prometheus Operator's kinds, for the chart's optional monitors. Their real CRDs ship with
# the Prometheus Operator, which no registry here carries: these accept any spec, so the server
# checks our apiVersion/kind/metadata, not those objects' specs (test_k8s_chart.py checks them).
PROMETHEUS_KINDS = [("ServiceMonitor", "servicemonitors"), ("PodMonitor", "podmonitors"),
                    ("PrometheusRule", "prometheusrules")]


@pytest.fixture(scope="module")
def server(kube, chart):
    kube.create_namespace(NAMESPACE)
    for ns in ("watched-a", "watched-b", "grafana"):
        kube.create_namespace(ns)
    kube.apply(*[{
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                 "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
        for kind, plural in PROMETHEUS_KINDS])
    for _, plural in PROMETHEUS_KINDS:
        kube.kubectl("wait", "--for=condition=Established", f"crd/{plural}.monitoring.coreos.com")
    return kube


def admit(kube, obj):
    """(HTTP status, server's answer) of a dry-run create in NAMESPACE."""
    obj = copy.deepcopy(obj)
    obj["metadata"]["namespace"] = NAMESPACE
    resp = kube.request("POST", path_for(obj["apiVersion"], obj["kind"], NAMESPACE), json=obj,
                        params={"dryRun": "All", "fieldValidation": "Strict"})
    return resp.status_code, resp.json()


def assert_admitted(kube, children):
    for child in children:
        status, out = admit(kube, child)
        assert status == 201, f"{child['kind']}/{child['metadata']['name']}: {out.get('message', out)}"


@pytest.mark.parametrize("mode,n,tp,replicas", SHAPES)
def test_rendered_children_are_admitted(server, mode, n, tp, replicas):
    body = make_body(stages=stages(n, tp), replicas=replicas, sharedMemory={"mode": mode, "sizeLimit": "1Gi"},
                     serving={"apiKeySecretRef": {"name": "k"}})
    assert_admitted(server, render_children(body, Settings(network_policy=True)))


@pytest.mark.parametrize("strategy", ["offload", "balanced", "coprocessor", "experts", "auto"])
def test_children_of_every_strategy_are_admitted(server, strategy):
    st = stages(3)
    st[0]["memory"] = "1.5Gi"  # offload adds the cpu stages' memory to it
    body = make_body(stages=st, strategy=strategy, workload={"concurrency": 8, "promptTokens": 512})
    assert_admitted(server, render_children(body, Settings(network_policy=True)))


def test_stage_env_renders_admitted_containers(server):
    st = stages(2)
    st[0]["env"] = [{"name": "HYBRID_BATCHES_IN_FLIGHT", "value": "2"}, {"name": "EMPTY", "value": ""}]
    st[1]["env"] = [{"name": "VLLM_CPU_SGL_KERNEL", "value": "0"}, {"name": "_X"}]
    assert_admitted(server, render_children(make_body(stages=st)))


def test_the_server_check_is_not_vacuous(server):
    sts = next(c for c in render_children(make_body()) if c["kind"] == "StatefulSet")
    bad = copy.deepcopy(sts)
    bad["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    status, out = admit(server, bad)
    assert status >= 400 and 'unknown field "spec.template.spec.containers[0].resourcez"' in out["message"]
    bad = copy.deepcopy(sts)
    bad["spec"]["replicas"] = "three"
    assert admit(server, bad)[0] >= 400


# Every option of docs/user-guide.md's chart tables (section 3 and 7), one set each, then all on.
CHART_OPTIONS = {
    "defaults": [],
    "runtime-images": ["--set", "runtimeImages.gpu=r/gpu:1", "--set", "runtimeImages.cpu=r/cpu:1"],
    "watch-namespaces": ["--set", "watchNamespaces={watched-a,watched-b}"],
    "network-policy": ["--set", "networkPolicy.enabled=true"],
    "metrics-off": ["--set", "metrics.enabled=false"],
    "metrics-port": ["--set", "metrics.port=9191"],
    "monitors": ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true"],
    "cluster-domain": ["--set", "clusterDomain=corp.local"],
    "dashboards": ["--set", "monitoring.dashboards.enabled=true", "--set", "monitoring.dashboards.namespace=grafana",
                   "--set", "monitoring.dashboards.annotations.grafana_folder=LLM"],
    "prometheus-rule": ["--set", "monitoring.prometheusRule.enabled=true",
                        "--set", "monitoring.prometheusRule.disabledAlerts={HybridInferenceTTFTHigh}"],
    "crds-unmanaged": ["--set", "crds.install=false"],
    "crds-not-kept": ["--set", "crds.keep=false"],
    "service-account": ["--set", "serviceAccount.create=false", "--set", "serviceAccount.name=x"],
    "log-level": ["--set", "logLevel=debug"],
}
CHART_OPTIONS["everything"] = [a for k in ("runtime-images", "watch-namespaces", "network-policy", "metrics-port",
                                           "monitors", "cluster-domain", "dashboards", "prometheus-rule", "log-level")
                               for a in CHART_OPTIONS[k]]


@pytest.mark.parametrize("values", CHART_OPTIONS.values(), ids=CHART_OPTIONS)
def test_helm_template_is_admitted_by_kubectl_apply_dry_run_server(server, values):
    out = helm("template", "hi", str(CHART), "--namespace", "hybrid-system", *values)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {"Deployment", "ClusterRole", "ServiceAccount"} & {d["kind"] for d in docs}
    applied = server.kubectl("apply", "--dry-run=server", "-f", "-", input=out.stdout).stdout
    assert len(applied.strip().splitlines()) == len(docs), applied
    assert all(line.endswith("(server dry run)") for line in applied.strip().splitlines()), applied
