"""Helm chart: lint, least-privilege RBAC, hardened operator Deployment, values wiring."""
from __future__ import annotations

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
    ("", "pods"): {"get", "list", "watch", "delete"},
    ("", "events"): {"create"},
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
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert any(d["kind"] == "ServiceMonitor" for d in docs)
