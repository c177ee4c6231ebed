"""Helm chart: lint, least-privilege RBAC, hardened operator Deployment, values wiring."""
from __future__ import annotations

import json

import yaml
from chart_render import helm, helm_template
from hi_fixtures import CHART

# Exactly what the operator calls (hybrid_operator/reconcile.py, apply.py, handlers.py via kopf).
EXPECTED_RULES = {
    ("hybrid.inference.dev", "hybridinferences"): {"get", "list", "watch", "patch"},
    ("hybrid.inference.dev", "hybridinferences/status"): {"patch"},
    ("hybrid.inference.dev", "hybridinferences/finalizers"): {"update"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("", "services"): {"get", "create", "patch"},
    ("apps", "statefulsets"): {"get", "list", "create", "patch", "delete"},
    ("", "pods"): {"get", "list", "watch", "patch", "delete"},
    ("", "events"): {"create", "list"},
    ("batch", "jobs"): {"create"},  # the /dev/shm cleanup of a deleted hostPath instance
}
NETWORK_POLICY_RULE = {("networking.k8s.io", "networkpolicies"): {"get", "create", "patch"}}


def granted(docs):
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


def test_helm_lint_passes():
    out = helm("lint", str(CHART), "--strict")
    assert out.returncode == 0, out.stdout + out.stderr


def test_cluster_role_grants_exactly_what_the_operator_needs():
    rules = granted(helm_template())
    assert rules == EXPECTED_RULES
    flat = {v for verbs in rules.values() for v in verbs} | {r for _, r in rules} | {g for g, _ in rules}
    assert "*" not in flat
    assert ("", "secrets") not in rules  # API keys reach pods via secretKeyRef, never via the operator


def test_network_policy_rights_only_when_enabled():
    assert granted(helm_template("--set", "networkPolicy.enabled=true")) == {**EXPECTED_RULES, **NETWORK_POLICY_RULE}


def test_all_namespaces_uses_cluster_role_binding():
    docs = helm_template()
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"][0]["namespace"] == "hybrid-system"
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert "--all-namespaces" in dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_watch_namespaces_bind_per_namespace():
    docs = helm_template("--set", "watchNamespaces={llm,llm-cpu}")
    assert not [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["llm", "llm-cpu"]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=llm" in args and "--namespace=llm-cpu" in args and "--all-namespaces" not in args


def test_operator_deployment_is_hardened():
    (dep,) = [d for d in helm_template() if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["limits"]["cpu"] and c["resources"]["limits"]["memory"]
    assert dep["spec"]["replicas"] == 1  # kopf --standalone: a single operator
    assert c["args"][:2] == ["run", "--standalone"] and c["args"][-2:] == ["-m", "hybrid_operator.handlers"]


def test_values_reach_the_operator_environment():
    (dep,) = [d for d in helm_template("--set", "networkPolicy.enabled=true", "--set", "runtimeImages.cpu=r/cpu:9",
                                       "--set", "clusterDomain=corp.local") if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HYBRID_NETWORK_POLICY"] == "true"
    assert env["HYBRID_CPU_IMAGE"] == "r/cpu:9"
    assert env["HYBRID_CLUSTER_DOMAIN"] == "corp.local"
    assert env["HYBRID_METRICS_PORT"] == "9090"


def test_optional_monitors():
    kinds = {d["kind"] for d in helm_template()}
    assert "ServiceMonitor" not in kinds and "PodMonitor" not in kinds
    docs = helm_template("--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true")
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "hybrid-inference-operator"}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} == {"metrics", "http"}
    assert any(d["kind"] == "ServiceMonitor" for d in docs)


def test_pod_monitor_scrapes_vllm_on_stage0_and_stage_metrics_everywhere():
    (pm,) = [d for d in helm_template("--set", "metrics.podMonitor.enabled=true") if d["kind"] == "PodMonitor"]
    eps = {e["port"]: e for e in pm["spec"]["podMetricsEndpoints"]}
    assert set(eps) == {"metrics", "http"}  # `http` exists only on stage 0 pods (render/pod.py)
    assert all(e["path"] == "/metrics" for e in eps.values())
    assert eps["metrics"]["honorLabels"] is True
    for e in eps.values():  # every target carries the dashboards' and alerts' labels
        targets = {r["targetLabel"]: r["sourceLabels"] for r in e["relabelings"]}
        assert targets == {
            "pipeline": ["__meta_kubernetes_pod_label_hybrid_inference_dev_instance"],
            "stage": ["__meta_kubernetes_pod_label_hybrid_inference_dev_stage_index"],
            "stage_name": ["__meta_kubernetes_pod_label_hybrid_inference_dev_stage"],
            "replica": ["__meta_kubernetes_pod_label_apps_kubernetes_io_pod_index"]}


def test_service_monitor_scrapes_the_operator_metrics_service():
    docs = helm_template("--set", "metrics.serviceMonitor.enabled=true")
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    assert "ServiceMonitor" not in {d["kind"] for d in helm_template("--set", "metrics.serviceMonitor.enabled=true",
                                                                     "--set", "metrics.enabled=false")}


def test_dashboards_are_optional_sidecar_config_maps():
    assert not [d for d in helm_template() if d["kind"] == "ConfigMap"]
    docs = [d for d in helm_template("--set", "monitoring.dashboards.enabled=true") if d["kind"] == "ConfigMap"]
    shipped = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert sorted(shipped) == ["operator.json", "pipeline.json", "service.json"]
    assert len(docs) == len(shipped)
    for cm in docs:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "hybrid-system"
        ((key, text),) = cm["data"].items()
        assert key.startswith("hybrid-inference-") and key.endswith(".json")
        assert json.loads(text) == json.loads((CHART / "dashboards" / key.removeprefix("hybrid-inference-")).read_text())
    custom = helm_template("--set", "monitoring.dashboards.enabled=true", "--set", "monitoring.dashboards.label=dash",
                           "--set", "monitoring.dashboards.labelValue=yes", "--set", "monitoring.dashboards.namespace=grafana",
                           "--set", "monitoring.dashboards.annotations.grafana_folder=LLM")
    for cm in [d for d in custom if d["kind"] == "ConfigMap"]:
        assert cm["metadata"]["labels"]["dash"] == "yes" and "grafana_dashboard" not in cm["metadata"]["labels"]
        assert cm["metadata"]["namespace"] == "grafana"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}


def test_dashboards_are_valid_grafana_json():
    for path in (CHART / "dashboards").glob("*.json"):
        board = json.loads(path.read_text())
        assert board["uid"].startswith("hybrid-inference-") and board["title"]
        assert board["templating"]["list"][0] == {**board["templating"]["list"][0], "name": "datasource",
                                                   "type": "datasource", "query": "prometheus"}
        panels = [p for p in board["panels"] if p["type"] != "row"]
        assert panels and len({p["id"] for p in board["panels"]}) == len(board["panels"])
        for p in panels:
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"])
            assert p["gridPos"]["x"] >= 0 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


def test_prometheus_rule_is_optional_and_carries_the_rule_file():
    assert "PrometheusRule" not in {d["kind"] for d in helm_template()}
    (rule,) = [d for d in helm_template("--set", "monitoring.prometheusRule.enabled=true",
                                        "--set", "monitoring.prometheusRule.labels.release=kps") if d["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"HybridInferenceStageDown", "HybridInferencePipelineDegraded", "HybridInferenceTTFTHigh",
            "HybridInferenceKVCacheNearFull", "HybridInferenceOperatorReconcileErrors"} <= alerts
    (fewer,) = [d for d in helm_template("--set", "monitoring.prometheusRule.enabled=true", "--set",
                                         "monitoring.prometheusRule.disabledAlerts={HybridInferenceTTFTHigh}")
                if d["kind"] == "PrometheusRule"]
    assert {r["alert"] for g in fewer["spec"]["groups"] for r in g["rules"]} == alerts - {"HybridInferenceTTFTHigh"}


def test_lint_with_every_monitoring_option_on():
    out = helm("lint", str(CHART), "--strict", "--set", "monitoring.dashboards.enabled=true", "--set",
               "monitoring.prometheusRule.enabled=true", "--set", "metrics.podMonitor.enabled=true",
               "--set", "metrics.serviceMonitor.enabled=true")
    assert out.returncode == 0, out.stdout + out.stderr
