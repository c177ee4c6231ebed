"""Pod Security levels per shared-memory mode (what docs/user-guide.md promises), decided by the real
API server's PodSecurity admission: each rendered pod template is dry-run created as a Pod in
namespaces that enforce `restricted` and `baseline`."""
from __future__ import annotations

import pytest
from chart_render import helm_template
from hi_fixtures import make_body, stages
from hybrid_operator.render import render_children

LEVELS = ("restricted", "baseline")


@pytest.fixture(scope="module")
def server(kube):
    for level in LEVELS:
        kube.create_namespace(f"psa-{level}", {"pod-security.kubernetes.io/enforce": level})
    return kube


def admit_pod(kube, level, name, pod_spec):
    """None when the `level` namespace admits the pod, else the server's refusal."""
    ns = f"psa-{level}"
    resp = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", params={"dryRun": "All"},
                        json={"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
                              "spec": pod_spec})
    return None if resp.status_code == 201 else resp.json()["message"]


def pod_specs(mode, n=2, tp=1):
    body = make_body(stages=stages(n, tp), sharedMemory={"mode": mode}, replicas=2)
    return {c["metadata"]["name"]: c["spec"]["template"]["spec"]
            for c in render_children(body) if c["kind"] == "StatefulSet"}


@pytest.mark.parametrize("n,tp", [(1, 1), (2, 1), (3, 2)])
def test_mode_none_is_admitted_by_restricted_and_baseline(server, n, tp):
    for name, spec in pod_specs("none", n, tp).items():
        for level in LEVELS:
            assert admit_pod(server, level, name, spec) is None, (name, level)


@pytest.mark.parametrize("n,tp", [(1, 1), (2, 1), (3, 2)])
def test_mode_hostpath_needs_privileged(server, n, tp):
    for name, spec in pod_specs("hostPath", n, tp).items():
        for level in LEVELS:
            refusal = admit_pod(server, level, name, spec)
            assert refusal and f'violates PodSecurity "{level}:latest"' in refusal, (name, level, refusal)
            assert 'volume "dshm"' in refusal and "hostPath" in refusal, refusal


def test_the_server_refuses_the_usual_suspects(server):
    spec = pod_specs("none")["llama-cpu"]
    spec["hostNetwork"] = True
    spec["containers"][0]["securityContext"] = {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}
    refusal = admit_pod(server, "baseline", "suspect", spec)
    assert "host namespaces (hostNetwork=true)" in refusal and 'privileged (container "vllm"' in refusal
    assert 'non-default capabilities (container "vllm" must not include "SYS_ADMIN"' in refusal


def test_operator_pod_is_admitted_by_restricted(server):
    (dep,) = [d for d in helm_template() if d["kind"] == "Deployment"]
    spec = dep["spec"]["template"]["spec"]
    server.apply({"apiVersion": "v1", "kind": "ServiceAccount",
                  "metadata": {"name": spec["serviceAccountName"], "namespace": "psa-restricted"}})
    assert admit_pod(server, "restricted", "operator", spec) is None
