"""Real pods on a real node (tests/e2e/realnode.py): the images built from images/ by `make images`' script,
the chart installed with the operator running in the cluster (its image, ServiceAccount, in-cluster
configuration, liveness probe), and a two-stage CPU HybridInference of SmolLM2-135M-Instruct from a
PersistentVolume, once in a `restricted` namespace (sharedMemory none) and once in a privileged one
(hostPath /dev/shm). Each answers through its client Service, restarts as a group, scales to 0 and back,
and leaves nothing behind when deleted. Tests run in file order and build on each other.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import realnode
from no_skips import unavailable
from vllm_hybrid.realmodel import DEFAULT_DIR

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "hybrid-inference"
QUESTION = "What is the capital of France?"
REPORT: dict[str, dict] = {}
# (namespace labels, spec.sharedMemory, how /cache outlives a pod)
MODES = {
    "restricted": ({"pod-security.kubernetes.io/enforce": "restricted"}, {"mode": "none", "sizeLimit": "1Gi"}, "claim"),
    "privileged": ({"pod-security.kubernetes.io/enforce": "privileged"}, {"mode": "hostPath"}, "hostPath"),
}


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\n[real node] " + json.dumps(REPORT, indent=1))
    if out := os.environ.get("HYBRID_REPORT_DIR"):
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "real_node.json").write_text(json.dumps(REPORT, indent=1))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    if reason := realnode.unavailable_reason():  # CI has ../shared beside the checkout and runs as root
        unavailable(reason)
    n = realnode.RealNode(tmp_path_factory.mktemp("realnode"))
    try:
        REPORT["node"] = {k: round(v, 1) for k, v in n.up().times.items()}
        yield n
    finally:
        n.down()


@pytest.fixture(scope="module")
def images(node):
    """Built as `make images` builds them, on a store that already holds other images by the same short names
    (docker.io/hybrid-inference/NAME:dev: the base image, no operator in it): the build must not pick those up."""
    names, base = ("operator", "runtime-cpu"), node.base_image()
    for name in names:
        realnode.run(["buildah", "tag", base, f"docker.io/hybrid-inference/{name}:dev"])
    built = {name: node.load_image(name) for name in names}
    decoy = realnode.run(["buildah", "images", "--noheading", "--no-trunc", "--format", "{{.ID}}", base]).split()
    for name in names:
        assert built[name]["ref"] == f"localhost/hybrid-inference/{name}:dev"
        assert built[name]["id"] not in {d.removeprefix("sha256:") for d in decoy}, built[name]
        realnode.run(["buildah", "rmi", f"docker.io/hybrid-inference/{name}:dev"])
    return built


@pytest.fixture(scope="module")
def operator(node, images):
    kube = node.cluster
    t0 = time.monotonic()
    kube.helm("install", "hybrid-inference", str(CHART), "--namespace", "hybrid-system", "--create-namespace",
              "--set", f"image.repository={images['operator']['ref'].rsplit(':', 1)[0]}", "--set", "image.tag=dev",
              "--set", "image.pullPolicy=Never", "--set", f"runtimeImages.cpu={images['runtime-cpu']['ref']}",
              "--set", "statusIntervalSeconds=3",
              # the two 1-CPU stages take both cores of this 2-core node: the operator requests none
              "--set-string", "resources.requests.cpu=0")
    kube.kubectl("-n", "hybrid-system", "rollout", "status", "deployment/hybrid-inference-operator", "--timeout=120s")
    pod = kube.get("pods", "-n", "hybrid-system", "-l", "app.kubernetes.io/instance=hybrid-inference")["items"][0]
    REPORT["operator"] = {"helm install to running": round(time.monotonic() - t0, 1)}
    return pod["metadata"]["name"]


@pytest.fixture(scope="module")
def model(node):
    """`vllm-hybrid prepare-model`'s dir (build/ cache shared with `make demo`), run as a user would: in its own
    process (in this one, transformers' GGUF reader left the allocator keeping freed memory, which a later
    RSS-measuring test saw), exposed through a hostPath PersistentVolume."""
    out = ROOT / DEFAULT_DIR
    subprocess.run([str(ROOT / ".venv" / "bin" / "vllm-hybrid"), "prepare-model", "--out", str(out)], check=True,
                   capture_output=True, timeout=600)
    return out


def test_images_build_and_load_into_the_node(images, tmp_path):
    REPORT["images"] = images
    for name, image in images.items():
        assert image["image"].startswith(f"images: localhost/hybrid-inference/{name}:dev {image['id']} built by buildah")
        # a rebuild travels from buildah's store (a fallback to buildah push would say why in `load`)
        assert image["load"] in ("held", "whole archive") or image["load"].startswith("from buildah's store: "), image
    # what RealNode.import_from_store carries: each image's top layer put together from the store is the layer
    # buildah committed (layer_tar checks its digest)
    store = realnode.BuildahStore.here()
    for name, image in images.items():
        top = json.loads(store.manifest(image["id"])[0])["layers"][-1]["digest"]
        assert store.layer_tar(store.layers_by_digest(image["id"])[top], tmp_path / name).stat().st_size > 0


def test_operator_runs_in_the_cluster_with_the_charts_service_account(node, operator):
    kube = node.cluster
    pod = kube.get("pod", operator, "-n", "hybrid-system")
    assert pod["spec"]["serviceAccountName"] == "hybrid-inference-operator"
    assert pod["spec"]["containers"][0]["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # in-cluster configuration: the ServiceAccount token the kubelet mounted, the apiserver through Service kubernetes
    kube.wait(lambda: "Initial authentication has finished" in kube.kubectl("logs", "-n", "hybrid-system", operator).stdout,
              60, "the operator to log in from inside the cluster")


def volumes(name: str, ns: str, path: Path, mode: str) -> list[dict]:
    access = "ReadOnlyMany" if mode == "ReadOnlyMany" else "ReadWriteMany"
    return [{"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-{name}"},
             "spec": {"capacity": {"storage": "2Gi"}, "accessModes": [access], "storageClassName": "",
                      "hostPath": {"path": str(path), "type": "Directory"}, "claimRef": {"namespace": ns, "name": name}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
             "spec": {"accessModes": [access], "storageClassName": "", "volumeName": f"{ns}-{name}",
                      "resources": {"requests": {"storage": "2Gi"}}}}]


def instance(ns: str, shared_memory: dict, cache: dict) -> dict:
    return {"apiVersion": "hybrid.inference.dev/v1alpha1", "kind": "HybridInference",
            "metadata": {"name": "smol", "namespace": ns},
            "spec": {"model": {"path": DEFAULT_DIR.name, "volume": {"claimName": "models"}, "servedModelName": "smollm2",
                               "dtype": "float32", "maxModelLen": 2048},
                     "stages": [{"name": "head", "device": "cpu", "cpus": 1, "memory": "4Gi"},
                                {"name": "tail", "device": "cpu", "cpus": 1, "memory": "4Gi"}],
                     "sharedMemory": shared_memory, "cache": cache, "serving": {"maxNumSeqs": 8},
                     "images": {"pullPolicy": "Never"}}}


def ready(kube, ns: str) -> bool:
    conditions = (kube.get("hi", "smol", "-n", ns).get("status") or {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def pods(kube, ns: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in kube.get("pods", "-n", ns, "-l", "hybrid.inference.dev/instance=smol")["items"]}


def ask(kube, ns: str, timeout: float) -> str:
    """The answer through the client Service's ClusterIP (kube-proxy), as a client in the cluster gets it."""
    ip = kube.get("service", "smol", "-n", ns)["spec"]["clusterIP"]
    body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 20, "temperature": 0}
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:  # the first request right after a Service appears may not reach it yet
            r = httpx.post(f"http://{ip}:8000/v1/chat/completions", json=body, timeout=60)
            if r.status_code == 200:
                return r.json()["choices"][0]["message"]["content"]
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(2)
    raise AssertionError(f"no answer through Service smol in {timeout:.0f} s: {last}")


# the log lines that show where a stage's start goes: the launcher's record, vLLM's own timings, serving
MILESTONES = r"vllm-hybrid resolved|\b(took|takes)\b [\d.]+ ?s|Starting vLLM|startup complete|Uvicorn running|[Ww]aiting"


def restart_timeline(kube, ns: str, deleted_at: float) -> dict:
    """Where a group restart's time goes, from the new pods (the API server's clock, whole seconds) and each
    stage's log lines where vLLM times its own start; and every group restart the operator made after the delete,
    with its cause (a group that re-forms more than once shows why: the pods it replaced are gone by then)."""
    def since(stamp: str) -> float:  # RFC 3339, to the second (objects) or the nanosecond (log lines)
        whole, _, frac = stamp.rstrip("Z").partition(".")
        return round(datetime.fromisoformat(whole + "+00:00").timestamp() + float(f"0.{frac or 0}") - deleted_at, 1)
    restarts = sorted((since(at), e.get("count", 1), e["message"][:400]) for e in kube.get("events", "-n", ns)["items"]
                      if e["reason"] == "GroupRestart" and (at := e.get("lastTimestamp") or e.get("eventTime")))
    out = {"group restarts": [f"{at} (x{n}) {message}" for at, n, message in restarts if at >= -1]}
    for name, pod in sorted(pods(kube, ns).items()):
        status = pod.get("status", {})
        started = [c["state"]["running"]["startedAt"] for c in status.get("containerStatuses", [])
                   if "running" in c.get("state", {})]
        ready_at = [c["lastTransitionTime"] for c in status.get("conditions", []) if c["type"] == "Ready"]
        log = kube.kubectl("logs", "--timestamps", "-n", ns, name).stdout
        lines = [(since(m[1]), m[2]) for m in re.finditer(r"^(\d{4}-\d\d-\d\dT[\d:.]+Z) (.*)$", log, re.M)]
        out[name] = {"created": since(pod["metadata"]["creationTimestamp"]),
                     "container started": since(started[0]) if started else None,
                     "ready": since(ready_at[0]) if ready_at else None,
                     "log": [f"{at} {text.split('] ', 1)[-1][:140]}" for at, text in lines
                             if re.search(MILESTONES, text)] + [f"{at} (last line)" for at, _ in lines[-1:]]}
    return out


def shm_entries() -> set[str]:
    return {os.path.join(d, n) for d, dirs, files in os.walk("/dev/shm") for n in dirs + files}


@pytest.mark.parametrize("mode", list(MODES))
def test_instance_answers_restarts_scales_and_leaves_nothing(node, operator, model, mode):
    kube, (labels, shared_memory, cache_kind) = node.cluster, MODES[mode]
    ns, times = f"e2e-{mode}", {}
    REPORT[mode] = times
    cache_dir = node.work / "vllm-cache"  # both instances share it: vLLM keys its cache by model, config and stage
    cache_dir.mkdir(mode=0o777, exist_ok=True)
    cache_dir.chmod(0o777)  # written by uid 1000 (a PersistentVolume's directory is its admin's to prepare)
    shm_before = shm_entries()
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels}})
    objs = volumes("models", ns, model.parent, "ReadOnlyMany")
    cache = {"hostPath": str(cache_dir)}
    if cache_kind == "claim":
        objs += volumes("vllm-cache", ns, cache_dir, "ReadWriteMany")
        cache = {"claimName": "vllm-cache"}
    kube.apply(*objs, instance(ns, shared_memory, cache))

    t0 = time.monotonic()
    times["apply to Ready"] = round(kube.wait(lambda: ready(kube, ns), 600, f"{ns}/smol Ready", interval=2), 1)
    assert "Paris" in ask(kube, ns, 60)
    times["apply to first answer"] = round(time.monotonic() - t0, 1)

    # the stages' logs show the layer split (the launcher's resolved record)
    records = {}
    for i, stage in enumerate(("head", "tail")):
        log = kube.kubectl("logs", "-n", ns, f"smol-{stage}-0").stdout
        line = next(ln for ln in log.splitlines() if ln.startswith("vllm-hybrid resolved "))
        records[stage] = json.loads(line.removeprefix("vllm-hybrid resolved "))
        assert records[stage]["stage"] == i and records[stage]["partition"] == "15,15"
    assert (records["head"]["layers"], records["tail"]["layers"]) == ("0-14", "15-29")
    times["stage cpus"] = {s: r["cpus"] for s, r in records.items()}

    # one stage's pod deleted: the operator restarts the whole group, which serves again
    before = {n: p["metadata"]["uid"] for n, p in pods(kube, ns).items()}
    t0, deleted_at = time.monotonic(), time.time()
    kube.kubectl("delete", "pod", "smol-tail-0", "-n", ns, "--wait=false")
    # the resource stops saying Ready as soon as a pod goes (the pod event refreshes the status)
    times["pod deleted to Ready=False"] = round(kube.wait(lambda: not ready(kube, ns), 5, "Ready=False", 0.1), 1)
    kube.wait(lambda: all(p["metadata"]["uid"] != before.get(n) for n, p in pods(kube, ns).items())
              and len(pods(kube, ns)) == 2, 120, "both pods of the group replaced", interval=1)
    kube.wait(lambda: ready(kube, ns), 600, f"{ns}/smol Ready after the group restart", interval=2)
    assert "Paris" in ask(kube, ns, 60)
    times["pod deleted to answer (group restart)"] = round(time.monotonic() - t0, 1)
    times["group restart timeline (s after the delete)"] = restart_timeline(kube, ns, deleted_at)

    # scale to 0 (no pods) and back to 1: the scale subresource and the StatefulSets do not depend on the pods'
    # security mode, so one mode (the restricted one, where most clusters run) shows it and CI saves a minute
    if mode == "restricted":
        kube.kubectl("scale", "hi", "smol", "-n", ns, "--replicas=0")
        kube.wait(lambda: not pods(kube, ns), 120, f"{ns}: no pods at replicas 0", interval=1)
        t0 = time.monotonic()
        kube.kubectl("scale", "hi", "smol", "-n", ns, "--replicas=1")
        kube.wait(lambda: ready(kube, ns), 600, f"{ns}/smol Ready after scaling back to 1", interval=2)
        assert "Paris" in ask(kube, ns, 60)
        times["scale 0 -> 1 to answer"] = round(time.monotonic() - t0, 1)

    # delete: no pod, no child, no Job left, and nothing new in the host's /dev/shm
    t0 = time.monotonic()
    kube.kubectl("delete", "hi", "smol", "-n", ns)
    selector = "hybrid.inference.dev/instance=smol"

    def leftovers():
        kinds = "pods,statefulsets,services,configmaps,jobs"
        left = [f"{o['kind']}/{o['metadata']['name']}" for o in kube.get(kinds, "-n", ns, "-l", selector)["items"]]
        return left + sorted(shm_entries() - shm_before)
    try:
        kube.wait(lambda: not leftovers(), 180, f"{ns}: nothing left of smol", interval=1)
    except AssertionError as e:
        raise AssertionError(f"{e}: {leftovers()}") from None
    times["delete to nothing left"] = round(time.monotonic() - t0, 1)
    kube.kubectl("delete", "namespace", ns, "--wait=false")
    kube.kubectl("delete", "pv", f"{ns}-models", *([f"{ns}-vllm-cache"] if cache_kind == "claim" else []),
                 "--wait=false")


def condition(kube, ns: str, kind: str) -> dict:
    conditions = (kube.get("hi", "smol", "-n", ns).get("status") or {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == kind), {})


def test_a_stage_that_cannot_start_says_why_and_a_fixed_spec_recovers(node, operator, model):
    """Each cause shows in Degraded (and `kubectl get hi`'s Phase), led by the stage's own words, soon after its
    failed start while the restarts back off; fixing the spec serves again without deleting the instance. The causes
    fail one-stage instances (one CPU each; the kubelet restarts them in place, status.pod_problem), two namespaces at
    once: the OOM kill beside the others in turn (two-stage instances one after the other took 346 s of a CI run's
    hour; test_k8s_handlers shows a two-stage replica's cause after its group restarts). The fix: two stages."""
    from vllm_hybrid.tinymodel import make_tiny_llama
    kube, times = node.cluster, {}
    REPORT["failures"] = times
    bad = node.work / "bad-models"
    make_tiny_llama(bad / "unreadable", layers=4, dtype="float32")
    (bad / "unreadable" / "model.safetensors").chmod(0o600)  # root's, as a volume prepared carelessly
    # the instance flows' compile cache (a claim: hostPath volumes are not allowed under restricted): the fixed
    # spec starts warm, as a user's instance would after its first start
    cache_dir = node.work / "vllm-cache"
    cache_dir.mkdir(mode=0o777, exist_ok=True)
    cache_dir.chmod(0o777)
    spaces = {"e2e-failures": None, "e2e-failures-b": None}
    for ns in spaces:
        kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": MODES["restricted"][0]}})
        kube.apply(*volumes("models", ns, model.parent, "ReadOnlyMany"), *volumes("bad", ns, bad, "ReadOnlyMany"),
                   *volumes("vllm-cache", ns, cache_dir, "ReadWriteMany"))
        spaces[ns] = instance(ns, MODES["restricted"][1], {"claimName": "vllm-cache"})
    head = spaces["e2e-failures"]["spec"]["stages"][0]
    # a KV cache of the user's own (vLLM's variable) beyond what the stage's memory holds: refused at start, where
    # vLLM alone checks it against the node's free memory (and the kernel OOM-kills the stage if that has room)
    greedy = [dict(head, env=[{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "8"}])]
    model_spec, serving = spaces["e2e-failures"]["spec"]["model"], spaces["e2e-failures"]["spec"]["serving"]
    others = [("plan does not fit", {"stages": [dict(head, memory="3Gi")]}, "does not fit"),
              ("KV cache beyond the stage's memory", {"stages": greedy}, "VLLM_CPU_KVCACHE_SPACE=8 GiB"),
              ("model path missing", {"model": dict(model_spec, path="no-such-model")}, "no-such-model"),
              ("weights unreadable", {"model": dict(model_spec, path="unreadable", volume={"claimName": "bad"})},
               "cannot read model.safetensors"),
              # an abbreviation the admission rule lets through: vLLM's own parser reads it as --max-model-len
              ("extra args overriding the plan", {"serving": dict(serving, extraArgs=["--max-mod", "64"])},
               "spec.model.maxModelLen")]
    # a warm-up step of a million tokens: its activations, far beyond the 4Gi limit, at load
    oom = [("stage OOM-killed at load", {"serving": dict(serving, maxNumBatchedTokens=1 << 20)}, "OOM-killed")]
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(check_failure_cases, kube, ns, one_stage(spaces[ns]), cases, times)
                    for ns, cases in (("e2e-failures", oom), ("e2e-failures-b", others))]
            errors = [str(e) for e in (run.exception() for run in runs) if e]
        assert not errors, "\n".join(errors)
        kube.kubectl("delete", "hi", "smol", "-n", "e2e-failures-b")  # its stage's CPU, for the fixed two stages
        kube.wait(lambda: not pods(kube, "e2e-failures-b"), 120, "e2e-failures-b: no pods", interval=1)
        check_fixed(kube, "e2e-failures", spaces["e2e-failures"], times)
    finally:  # a failed case must not leave its pods holding the node's cores for the tests after it
        for ns in spaces:
            kube.kubectl("delete", "namespace", ns, "--wait=false")
            kube.kubectl("delete", "pv", f"{ns}-models", f"{ns}-bad", f"{ns}-vllm-cache", "--wait=false")


def one_stage(good: dict) -> dict:
    """The instance with its first stage alone: one CPU, so two such instances fail side by side on the node."""
    return {**good, "spec": {**good["spec"], "stages": good["spec"]["stages"][:1]}}


def check_failure_cases(kube, ns: str, base: dict, cases: list, times: dict) -> None:
    for case, change, needle in cases:
        t0 = time.monotonic()
        kube.apply({**base, "spec": {**base["spec"], **change}})
        try:
            kube.wait(lambda: condition(kube, ns, "Degraded").get("status") == "True"
                      and needle in condition(kube, ns, "Degraded").get("message", ""), 240,
                      f"Degraded naming {needle!r}", interval=1)
        except AssertionError as e:
            raise AssertionError(f"{ns}: {e}: {condition(kube, ns, 'Degraded')}") from None
        degraded = condition(kube, ns, "Degraded")
        shown = kube.kubectl("get", "hi", "smol", "-n", ns).stdout
        assert "Degraded" in shown, shown
        times[case] = {"apply to Degraded s": round(time.monotonic() - t0, 1), "reason": degraded["reason"],
                       "message": degraded["message"]}


def check_fixed(kube, ns: str, good: dict, times: dict) -> None:
    t0 = time.monotonic()
    kube.apply(good)
    kube.wait(lambda: ready(kube, ns), 600, f"{ns}/smol Ready after the fix", interval=2)
    assert "Paris" in ask(kube, ns, 60)
    assert condition(kube, ns, "Degraded")["status"] == "False"
    times["fixed spec to answer s"] = round(time.monotonic() - t0, 1)
    restarts = [e["message"] for e in kube.get("events", "-n", ns)["items"] if e["reason"] == "GroupRestart"]
    times["group restarts"] = len(restarts)


def test_a_node_set_up_for_cpu_stages_gives_a_guaranteed_stage_its_own_core(node, operator, model):
    """The kubelet's static CPU manager (reservedSystemCPUs 0): a Guaranteed 1-CPU stage gets core 1 to itself
    and the launcher pins exactly it; on the default policy (the tests above) threads were left unpinned."""
    kube, ns = node.cluster, "e2e-static"
    assert all(c.startswith("unpinned") for mode in MODES if mode in REPORT for c in REPORT[mode]["stage cpus"].values())
    REPORT["static cpu manager"] = times = {"node restart s": round(node.restart("static"), 1)}
    kube.kubectl("-n", "hybrid-system", "rollout", "status", "deployment/hybrid-inference-operator", "--timeout=180s",
                 timeout=200)
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": MODES["restricted"][0]}})
    one = instance(ns, MODES["restricted"][1], {"hostPath": "/unused"})
    del one["spec"]["cache"]
    one["spec"]["stages"] = [{"name": "head", "device": "cpu", "cpus": 1, "memory": "4Gi"}]
    # pinning is what this shows: eager skips a cold compile of a new one-stage graph on one core (about 2 minutes)
    one["spec"]["serving"] = dict(one["spec"]["serving"], extraArgs=["--enforce-eager"])
    kube.apply(*volumes("models", ns, model.parent, "ReadOnlyMany"), one)
    t0 = time.monotonic()
    kube.wait(lambda: ready(kube, ns), 600, f"{ns}/smol Ready", interval=2)
    assert "Paris" in ask(kube, ns, 60)
    times["apply to answer s"] = round(time.monotonic() - t0, 1)
    log = kube.kubectl("logs", "-n", ns, "smol-head-0").stdout
    record = json.loads(next(ln for ln in log.splitlines() if ln.startswith("vllm-hybrid resolved "))
                        .removeprefix("vllm-hybrid resolved "))
    assert record["cpus"] == "1", record  # the exclusive core, not the shared one (0)
    assert "core ids=[1]" in log
    times["stage cpus"] = record["cpus"]
    kube.kubectl("delete", "namespace", ns, "--wait=false")
    kube.kubectl("delete", "pv", f"{ns}-models", "--wait=false")


def test_the_operator_stayed_healthy(node, operator):
    (pod,) = node.cluster.get("pods", "-n", "hybrid-system", "-l", "app.kubernetes.io/instance=hybrid-inference")["items"]
    status = pod["status"]["containerStatuses"][0]  # a new pod since the node restart; its liveness probe held
    assert status["ready"] and status["restartCount"] == 0, status
