"""Pod Security levels per shared-memory mode (what docs/user-guide.md promises):
hostPath needs a `privileged` namespace; none is admitted by `baseline` and `restricted`."""
from __future__ import annotations

import pytest
from chart_render import helm_template
from hi_fixtures import make_body, stages
from hybrid_operator.render import render_children
from pod_security import baseline, restricted


def pod_specs(mode, n=2, tp=1):
    body = make_body(stages=stages(n, tp), sharedMemory={"mode": mode}, replicas=2)
    return {c["metadata"]["name"]: c["spec"]["template"]["spec"]
            for c in render_children(body) if c["kind"] == "StatefulSet"}


@pytest.mark.parametrize("n,tp", [(1, 1), (2, 1), (3, 2)])
def test_mode_none_is_admitted_by_restricted_and_baseline(n, tp):
    for name, spec in pod_specs("none", n, tp).items():
        assert restricted(spec) == [], name
        assert baseline(spec) == [], name


@pytest.mark.parametrize("n,tp", [(1, 1), (2, 1), (3, 2)])
def test_mode_hostpath_needs_privileged(n, tp):
    for name, spec in pod_specs("hostPath", n, tp).items():
        assert "hostPath volume dshm" in baseline(spec), name
        assert restricted(spec), name


def test_checker_catches_the_usual_suspects():
    spec = pod_specs("none")["llama-cpu"]
    spec["hostNetwork"] = True
    spec["containers"][0]["securityContext"] = {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}
    v = baseline(spec)
    assert "hostNetwork=true" in v and "vllm: privileged" in v and "vllm: capabilities ['SYS_ADMIN']" in v
    assert "vllm: allowPrivilegeEscalation != false" in restricted(spec)


def test_operator_pod_is_admitted_by_restricted():
    (dep,) = [d for d in helm_template() if d["kind"] == "Deployment"]
    assert restricted(dep["spec"]["template"]["spec"]) == []
