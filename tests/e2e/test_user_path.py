"""The user path on a real control plane (tests/kube_cluster.py): helm install, the operator running
with the chart's ServiceAccount (so the chart's RBAC is what is tested), both examples applied
unchanged, status and printer columns, scaling, a namespace that refuses the pods, helm upgrade
with a changed CRD, delete cascade, helm uninstall. Tests run in file order and build on each other.

Nothing runs in the pods: the fake kubelet marks scheduled pods Running/Ready.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "hybrid-inference"
SA = "hybrid-inference-operator"  # the chart's ServiceAccount for release hybrid-inference
STATUS_INTERVAL = 3  # seconds (chart value statusIntervalSeconds; 15 by default)
TIMES: dict[str, float] = {}


def timed(name: str, seconds: float) -> float:
    TIMES[name] = round(seconds, 2)
    print(f"[e2e] {name}: {seconds:.2f} s")
    return seconds


@pytest.fixture(scope="module", autouse=True)
def report_times():
    yield
    print("\n[e2e] times (s): " + json.dumps(TIMES))


@pytest.fixture(scope="module")
def operator(kube, chart, tmp_path_factory):
    """`kopf run` as the chart's Deployment runs it, out of cluster, logged in as the chart's ServiceAccount
    through an exec credential plugin (as EKS and GKE kubeconfigs do) with the CA embedded."""
    work = tmp_path_factory.mktemp("operator")
    token = kube.kubectl("create", "token", SA, "-n", "hybrid-system", "--duration=2h").stdout.strip()
    plugin = work / "credential-plugin"
    plugin.write_text("#!/bin/sh\n" + "printf '%s' " + repr(json.dumps({
        "apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": {"token": token}}))
        + "\n")
    plugin.chmod(0o755)
    kubeconfig = kube.token_kubeconfig(work / "kubeconfig", exec={
        "apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin), "interactiveMode": "Never"})
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HYBRID_STATUS_INTERVAL": str(STATUS_INTERVAL),
           "HYBRID_METRICS_PORT": "0", "PYTHONPATH": f"{ROOT / 'operator'}:{os.environ.get('PYTHONPATH', '')}"}
    log = work / "operator.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces",
                                 "-m", "hybrid_operator.handlers"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        kube.wait(lambda: "Initial authentication has finished" in log.read_text() or proc.poll() is not None,
                  60, "the operator to log in")
        assert proc.poll() is None, log.read_text()[-3000:]
        timed("operator login", time.monotonic() - t0)
        yield {"proc": proc, "log": log, "kubeconfig": kubeconfig}
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"--- operator log (tail)\n{log.read_text()[-3000:]}")


def hi(kube, ns, name):
    return kube.get("hybridinference", name, "-n", ns)


def wait_phase(kube, ns, name, phase, timeout=60):
    return kube.wait(lambda: (hi(kube, ns, name).get("status") or {}).get("phase") == phase, timeout,
                     f"{ns}/{name} phase {phase}")


def test_helm_install(kube, chart):
    timed("helm install", chart["seconds"])
    assert "STATUS: deployed" in chart["output"]
    crd = kube.get("crd", "hybridinferences.hybrid.inference.dev")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    columns = [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert {"Ready", "Replicas", "Stages", "Strategy", "Endpoint"} <= set(columns)
    for kind, name in (("deployment", SA), ("serviceaccount", SA)):
        assert kube.get(kind, name, "-n", "hybrid-system")["metadata"]["name"] == name
    assert kube.get("clusterrolebinding", SA)["subjects"] == [
        {"kind": "ServiceAccount", "name": SA, "namespace": "hybrid-system"}]


def test_the_operator_runs_with_exactly_the_chart_rbac(kube, operator):
    user = f"system:serviceaccount:hybrid-system:{SA}"
    def can(verb, resource, ns="llm"):
        return kube.kubectl("auth", "can-i", verb, resource, "-n", ns, "--as", user, check=False).stdout.strip()
    assert can("watch", "hybridinferences.hybrid.inference.dev") == "yes"
    assert can("create", "statefulsets.apps") == "yes" and can("list", "events") == "yes"
    assert can("get", "secrets") == "no" and can("delete", "services") == "no"
    assert "startup" in operator["log"].read_text() and operator["proc"].poll() is None


def test_examples_reach_ready(kube, operator):
    kube.add_gpus()
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "llm", "labels": {
        "pod-security.kubernetes.io/enforce": "privileged"}}})
    # What the example's comments ask for: the models PVC (bound here to a hostPath PV) and the API key Secret.
    kube.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "models"},
                "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                         "hostPath": {"path": "/models"}, "claimRef": {"namespace": "llm", "name": "models"}}},
               {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": "llm"},
                "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": "models",
                         "resources": {"requests": {"storage": "100Gi"}}}},
               {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "llama-api-key", "namespace": "llm"},
                "stringData": {"api-key": "e2e"}},
               # cpu-only.yaml's cache claim: bound to this volume, as a default StorageClass would provision one
               {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "qwen-cache"},
                "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                         "hostPath": {"path": "/cache"}, "claimRef": {"namespace": "llm-cpu", "name": "qwen-cache"}}})
    t0 = time.monotonic()
    kube.kubectl("apply", "-f", str(ROOT / "examples" / "hybrid.yaml"), "-f", str(ROOT / "examples" / "cpu-only.yaml"))
    wait_phase(kube, "llm", "llama", "Ready", 90)
    wait_phase(kube, "llm-cpu", "qwen", "Ready", 90)
    timed("examples applied -> both Ready", time.monotonic() - t0)

    status = hi(kube, "llm", "llama")["status"]
    assert status["ready"] == "1/1" and status["stagesSummary"] == "gpu:16 cpu:16"
    assert status["endpoint"] == "http://llama.llm.svc:8000/v1"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Degraded": "False"}
    table = kube.kubectl("get", "hi", "-A").stdout.splitlines()
    assert table[0].split() == ["NAMESPACE", "NAME", "READY", "REPLICAS", "STAGES", "STRATEGY", "PHASE", "ENDPOINT",
                                "AGE"]
    rows = {line.split()[1]: line.split()[2:8] for line in table[1:]}
    assert rows["llama"] == ["1/1", "1", "gpu:16", "cpu:16", "pipeline", "Ready"]
    assert rows["qwen"][:2] == ["1/1", "1"]

    pods = {p["metadata"]["name"]: p for p in kube.get("pods", "-n", "llm")["items"]}
    assert set(pods) == {"llama-gpu-0", "llama-cpu-0"}
    assert pods["llama-gpu-0"]["spec"]["nodeName"] == pods["llama-cpu-0"]["spec"]["nodeName"]  # one /dev/shm
    assert pods["llama-cpu-0"]["status"]["qosClass"] == "Guaranteed"  # exclusive cores (static CPU manager)
    assert pods["llama-gpu-0"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def replicas_of(kube, ns, name):
    sts = kube.get("statefulsets", "-n", ns, "-l", f"hybrid.inference.dev/instance={name}")["items"]
    return sorted((s["metadata"]["name"], s["spec"]["replicas"]) for s in sts)


def test_scale_up_and_down(kube, operator):
    t0 = time.monotonic()
    kube.kubectl("scale", "hi", "llama", "-n", "llm", "--replicas=2")
    kube.wait(lambda: hi(kube, "llm", "llama")["status"].get("ready") == "2/2", 60, "2/2 ready")
    timed("scale 1 -> 2 ready", time.monotonic() - t0)
    assert replicas_of(kube, "llm", "llama") == [("llama-cpu", 2), ("llama-gpu", 2)]
    assert kube.get("hi", "llama", "-n", "llm")["status"]["replicas"] == 2

    t0 = time.monotonic()
    kube.kubectl("scale", "hi", "llama", "-n", "llm", "--replicas=0")
    wait_phase(kube, "llm", "llama", "Stopped")
    kube.wait(lambda: not kube.get("pods", "-n", "llm")["items"], 60, "no pods in llm")
    timed("scale 2 -> 0 stopped, pods gone", time.monotonic() - t0)
    assert replicas_of(kube, "llm", "llama") == [("llama-cpu", 0), ("llama-gpu", 0)]

    kube.kubectl("scale", "hi", "llama", "-n", "llm", "--replicas=1")
    wait_phase(kube, "llm", "llama", "Ready")


REFUSALS = {
    # the example's hostPath /dev/shm in a namespace that enforces `restricted`
    "pod-security": ({"pod-security.kubernetes.io/enforce": "restricted"}, None,
                     'violates PodSecurity "restricted:latest"'),
    # a CPU quota: the CPU stage asks more than it allows ("exceeded quota"), the GPU stage states no CPU
    # limit ("must specify limits.cpu"); whichever the controller reports first
    "resource-quota": ({}, {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "small"},
                            "spec": {"hard": {"limits.cpu": "4", "requests.cpu": "4"}}}, "quota: small"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_namespace_that_refuses_the_pods_is_degraded_with_the_controller_message(kube, operator, case):
    labels, extra, expected = REFUSALS[case]
    ns = kube.create_namespace(f"refuse-{case}", labels)
    if extra:
        kube.apply(extra, namespace=ns)
    (instance,) = [d for d in yaml.safe_load_all((ROOT / "examples" / "hybrid.yaml").read_text())
                   if d["kind"] == "HybridInference"]
    instance["metadata"]["namespace"] = ns
    t0 = time.monotonic()
    kube.apply(instance)
    wait_phase(kube, ns, "llama", "Degraded", 4 * STATUS_INTERVAL + 10)
    timed(f"{case}: apply -> Degraded", time.monotonic() - t0)

    status = hi(kube, ns, "llama")["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "FailedCreate"
    assert expected in degraded["message"] and degraded["message"].startswith("statefulset llama-")
    # Within one status interval of the controller's first refusal (both timestamps have 1 s resolution).
    failed = [e for e in kube.get("events", "-n", ns)["items"] if e["reason"] == "FailedCreate"]
    first = min(e.get("firstTimestamp") or e["eventTime"][:19] + "Z" for e in failed)
    lag = _seconds(degraded["lastTransitionTime"]) - _seconds(first)
    timed(f"{case}: first FailedCreate -> Degraded condition", lag)
    assert lag <= STATUS_INTERVAL + 2
    warnings = [e for e in kube.get("events", "-n", ns, "--field-selector",
                                    "involvedObject.kind=HybridInference")["items"] if e["type"] == "Warning"]
    assert any(e["reason"] == "Degraded" and "FailedCreate" in e["message"] and expected in e["message"]
               for e in warnings), warnings
    kube.kubectl("delete", "namespace", ns, "--wait=false")


def _seconds(stamp: str) -> float:
    import datetime
    return datetime.datetime.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S").timestamp()


def test_helm_upgrade_with_a_changed_crd(kube, operator, tmp_path):
    changed = tmp_path / "hybrid-inference"
    shutil.copytree(CHART, changed)
    crd_file = changed / "files" / "crd.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    crd["spec"]["versions"][0]["additionalPrinterColumns"].append(
        {"name": "Generation", "type": "integer", "jsonPath": ".status.observedGeneration"})
    crd_file.write_text(yaml.safe_dump(crd, sort_keys=False))

    t0 = time.monotonic()
    out = kube.helm("upgrade", "hybrid-inference", str(changed), "-n", "hybrid-system", "--wait", "--timeout", "120s")
    timed("helm upgrade (changed CRD)", time.monotonic() - t0)
    assert "has been upgraded" in out.stdout
    served = kube.get("crd", "hybridinferences.hybrid.inference.dev")["spec"]["versions"][0]
    assert served["additionalPrinterColumns"][-1]["name"] == "Generation"
    assert kube.kubectl("get", "hi", "-n", "llm").stdout.splitlines()[0].split()[-1] == "GENERATION"

    kube.helm("upgrade", "hybrid-inference", str(CHART), "-n", "hybrid-system", "--wait", "--timeout", "120s")
    served = kube.get("crd", "hybridinferences.hybrid.inference.dev")["spec"]["versions"][0]
    assert "Generation" not in [c["name"] for c in served["additionalPrinterColumns"]]
    assert hi(kube, "llm", "llama")["status"]["phase"] == "Ready"  # instances live through both upgrades


def test_group_restart(kube, operator):
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube.get("pods", "-n", "llm")["items"]}
    t0 = time.monotonic()
    kube.kubectl("delete", "pod", "llama-gpu-0", "-n", "llm", "--wait=false")

    def both_replaced():
        now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube.get("pods", "-n", "llm")["items"]}
        return set(now) == set(before) and all(now[n] != before[n] for n in now)
    kube.wait(both_replaced, 60, "both pods of replica 0 recreated")
    wait_phase(kube, "llm", "llama", "Ready")
    timed("group restart -> Ready", time.monotonic() - t0)
    new = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube.get("pods", "-n", "llm")["items"]}
    time.sleep(2 * STATUS_INTERVAL)  # the victims' own DELETED events start no second restart
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube.get("pods", "-n", "llm")["items"]} == new
    events = kube.get("events", "-n", "llm", "--field-selector", "reason=GroupRestart")["items"]
    assert [e["count"] for e in events] == [1] and "llama-cpu-0" in events[0]["message"]


def test_deleted_and_drifted_children_are_repaired_by_the_resync(kube, operator):
    t0 = time.monotonic()
    kube.kubectl("delete", "statefulset", "llama-cpu", "-n", "llm", "--cascade=orphan")
    kube.kubectl("patch", "service", "llama", "-n", "llm", "--type=merge", "-p", '{"spec":{"ports":[{"port":1234}]}}')
    kube.wait(lambda: kube.kubectl("get", "statefulset", "llama-cpu", "-n", "llm", check=False).returncode == 0,
              3 * STATUS_INTERVAL + 10, "llama-cpu recreated")
    kube.wait(lambda: kube.get("service", "llama", "-n", "llm")["spec"]["ports"][0]["port"] == 8000,
              3 * STATUS_INTERVAL + 10, "the client Service's port repaired")
    timed("deleted StatefulSet + drifted Service repaired", time.monotonic() - t0)
    wait_phase(kube, "llm", "llama", "Ready")


def test_delete_cascades_to_every_child(kube, operator):
    children = ["statefulsets", "services", "configmaps", "pods"]
    owned = lambda: [item["metadata"]["name"] for kind in children  # noqa: E731
                     for item in kube.get(kind, "-n", "llm", "-l", "hybrid.inference.dev/instance=llama")["items"]]
    assert len(owned()) >= 6  # 2 StatefulSets, 2 Services, 1 ConfigMap, 2 pods
    t0 = time.monotonic()
    kube.kubectl("delete", "hi", "llama", "-n", "llm")
    kube.wait(lambda: not owned(), 90, "the garbage collector to remove llama's children")
    timed("delete -> children gone", time.monotonic() - t0)
    kube.kubectl("delete", "-f", str(ROOT / "examples" / "cpu-only.yaml"))


def test_helm_uninstall_keeps_the_crd_and_reinstall_adopts_it(kube, operator):
    kube.apply({"apiVersion": "hybrid.inference.dev/v1alpha1", "kind": "HybridInference",
                "metadata": {"name": "kept", "namespace": "llm"},
                "spec": {"model": {"repo": "org/m"}, "stages": [{"name": "c", "device": "cpu", "cpus": 1,
                                                                  "memory": "1Gi"}]}})
    kube.helm("uninstall", "hybrid-inference", "-n", "hybrid-system", "--wait")
    assert kube.kubectl("get", "deployment", SA, "-n", "hybrid-system", check=False).returncode != 0
    assert hi(kube, "llm", "kept")["metadata"]["name"] == "kept"  # CRD and instances survive
    # With no operator left to act (its ServiceAccount is gone), an instance still deletes: no finalizer.
    assert hi(kube, "llm", "kept")["metadata"].get("finalizers") is None
    kube.kubectl("delete", "hi", "kept", "-n", "llm", "--timeout=30s")
    kube.helm("install", "hybrid-inference", str(CHART), "-n", "hybrid-system", "--wait", "--timeout", "120s")
    crd = kube.get("crd", "hybridinferences.hybrid.inference.dev")
    assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == "hybrid-inference"
