"""Handlers against kmock's Kubernetes emulator: create, idempotency, updates, status, retries,
restarts mid-way, deleted children, group restarts."""
from __future__ import annotations

import asyncio
import dataclasses
import json

import kmock as kmock_lib
import pytest
from hi_fixtures import make_body, stages
from hybrid_operator import metrics, names
from hybrid_operator.apply import apply
from hybrid_operator.kube import KubeApi, path_for
from hybrid_operator.reconcile import handle_pod_event, reconcile
from hybrid_operator.render import render_children
from hybrid_operator.settings import Settings

HI = "hybrid.inference.dev/v1alpha1/hybridinferences"
RESOURCES = {
    "v1/configmaps": "ConfigMap", "v1/services": "Service", "v1/pods": "Pod", "v1/events": "Event",
    "apps/v1/statefulsets": "StatefulSet", "networking.k8s.io/v1/networkpolicies": "NetworkPolicy",
    "batch/v1/jobs": "Job", HI: "HybridInference",
}
SETTINGS = Settings(network_policy=True)


@pytest.fixture
async def api(kmock):
    for res, kind in RESOURCES.items():
        kmock.resources[res] = kmock_lib.ResourceInfo(namespaced=True, kind=kind,
                                                      subresources={"status"} if res == HI else set())
    client = KubeApi.for_server(str(kmock.url), retries=4, backoff_s=0.01)
    yield client
    await client.close()


def put_instance(kmock, body):
    kmock.objects[HI, body["metadata"]["namespace"], body["metadata"]["name"]] = body


def live(kmock, res, ns="ml"):
    """{name: raw object} of the non-deleted objects of one resource."""
    out = {}
    for (resource, namespace, name), obj in list(kmock.objects.items()):
        if f"{resource.group}/{resource.version}/{resource.plural}".lstrip("/") == res and namespace == ns \
                and not obj.deleted:
            out[name] = json.loads(json.dumps(obj.raw, default=dict))
    return out


def writes(kmock):
    return [r for r in kmock if r.method.value in ("POST", "PATCH", "DELETE") and "/events" not in str(r.url)]


async def test_create_makes_every_child_with_owner_references(kmock, api):
    body = make_body(stages=stages(3))
    put_instance(kmock, body)
    result = await reconcile(api, body, SETTINGS)
    assert set(live(kmock, "apps/v1/statefulsets")) == {"llama-gpu", "llama-cpu", "llama-cpu2"}
    assert set(live(kmock, "v1/services")) == {"llama", "llama-peers"}
    assert set(live(kmock, "v1/configmaps")) == {"llama-plan"}
    assert set(live(kmock, "networking.k8s.io/v1/networkpolicies")) == {"llama-pipeline"}
    for res in ("apps/v1/statefulsets", "v1/services", "v1/configmaps"):
        for obj in live(kmock, res).values():
            assert obj["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
    assert set(result["children"].values()) == {"created"}
    events = live(kmock, "v1/events")
    assert any(e["reason"] == "Applied" and e["involvedObject"]["name"] == "llama" for e in events.values())


async def test_rerun_is_idempotent_no_duplicates_no_writes(kmock, api):
    body = make_body()
    put_instance(kmock, body)
    await reconcile(api, body, SETTINGS)
    before = len(writes(kmock))
    body = live(kmock, HI)["llama"]  # with the status the first pass wrote
    result = await reconcile(api, body, SETTINGS)
    assert set(result["children"].values()) == {"unchanged"}
    assert len(writes(kmock)) == before
    assert len(live(kmock, "apps/v1/statefulsets")) == 2


async def test_spec_change_patches_statefulsets_and_removes_dropped_fields(kmock, api):
    st = stages(2)
    st[1]["nodeSelector"] = {"pool": "cpu"}
    body = make_body(stages=st)
    put_instance(kmock, body)
    await reconcile(api, body, SETTINGS)
    assert live(kmock, "apps/v1/statefulsets")["llama-cpu"]["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}

    body2 = make_body(stages=stages(2), replicas=3, serving={"maxNumSeqs": 16})
    body2["metadata"]["generation"] = 2
    result = await reconcile(api, body2, SETTINGS)
    assert result["children"]["StatefulSet/llama-cpu"] == "patched"
    sts = live(kmock, "apps/v1/statefulsets")
    assert sts["llama-gpu"]["spec"]["replicas"] == 3 == sts["llama-cpu"]["spec"]["replicas"]
    assert "nodeSelector" not in sts["llama-cpu"]["spec"]["template"]["spec"]  # null in the merge patch
    assert "max_num_seqs: 16" in live(kmock, "v1/configmaps")["llama-plan"]["data"]["plan.yaml"]
    assert [r for r in kmock if r.method.value == "PATCH" and "statefulsets/llama-gpu" in str(r.url)]


async def test_removed_stage_statefulset_deleted(kmock, api):
    body = make_body(stages=stages(3))
    put_instance(kmock, body)
    await reconcile(api, body, SETTINGS)
    result = await reconcile(api, make_body(stages=stages(2)), SETTINGS)
    assert result["children"]["StatefulSet/llama-cpu2"] == "deleted"
    assert set(live(kmock, "apps/v1/statefulsets")) == {"llama-gpu", "llama-cpu"}


async def test_pipeline_to_offload_deletes_cpu_statefulsets_and_back(kmock, api):
    st = stages(3)
    st[0]["memory"] = "16Gi"
    body = make_body(stages=st)
    put_instance(kmock, body)
    await reconcile(api, body, SETTINGS)
    assert set(live(kmock, "apps/v1/statefulsets")) == {"llama-gpu", "llama-cpu", "llama-cpu2"}
    kmock.objects["apps/v1/statefulsets", "ml", "llama-other"] = {  # same labels, not ours: left alone
        "apiVersion": "apps/v1", "kind": "StatefulSet", "spec": {"replicas": 1},
        "metadata": {"name": "llama-other", "namespace": "ml", "labels": names.instance_selector("llama")}}

    offload = make_body(stages=st, strategy="offload")
    offload["metadata"]["generation"] = 2
    put_instance(kmock, offload)
    result = await reconcile(api, offload, SETTINGS)
    assert result["children"]["StatefulSet/llama-cpu"] == result["children"]["StatefulSet/llama-cpu2"] == "deleted"
    assert result["children"]["StatefulSet/llama-gpu"] == "patched"
    sts = live(kmock, "apps/v1/statefulsets")
    assert set(sts) == {"llama-gpu", "llama-other"}
    res = sts["llama-gpu"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"] == "144Gi"  # 16Gi + 2 x 64Gi of cpu weights
    assert "strategy: offload" in live(kmock, "v1/configmaps")["llama-plan"]["data"]["plan.yaml"]
    status = live(kmock, HI)["llama"]["status"]
    assert [s["name"] for s in status["stages"]] == ["gpu"] and status["stagesSummary"] == "gpu:auto"
    again = await reconcile(api, live(kmock, HI)["llama"], SETTINGS)
    assert set(again["children"].values()) == {"unchanged"}  # converged: nothing deleted twice

    back = make_body(stages=st)
    back["metadata"]["generation"] = 3
    result = await reconcile(api, back, SETTINGS)
    assert result["children"]["StatefulSet/llama-cpu"] == "created"
    res = live(kmock, "apps/v1/statefulsets")["llama-gpu"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["memory"] == "16Gi"


async def test_offload_to_coprocessor_brings_back_the_cpu_pods_and_shrinks_the_gpu_pod(kmock, api):
    """coprocessor computes every layer on the gpu stage like offload, but the weights stay in the cpu pods."""
    st = stages(2)
    st[0]["memory"] = "16Gi"
    offload = make_body(stages=st, strategy="offload")
    put_instance(kmock, offload)
    await reconcile(api, offload, SETTINGS)
    assert set(live(kmock, "apps/v1/statefulsets")) == {"llama-gpu"}

    coprocessor = make_body(stages=st, strategy="coprocessor")
    coprocessor["metadata"]["generation"] = 2
    put_instance(kmock, coprocessor)
    result = await reconcile(api, coprocessor, SETTINGS)
    assert result["children"]["StatefulSet/llama-cpu"] == "created"
    assert result["children"]["StatefulSet/llama-gpu"] == "patched"
    sts = live(kmock, "apps/v1/statefulsets")
    assert set(sts) == {"llama-gpu", "llama-cpu"}
    for name, memory in (("llama-gpu", "16Gi"), ("llama-cpu", "64Gi")):
        res = sts[name]["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"]["memory"] == res["limits"]["memory"] == memory, name
    assert "strategy: coprocessor" in live(kmock, "v1/configmaps")["llama-plan"]["data"]["plan.yaml"]
    status = live(kmock, HI)["llama"]["status"]
    assert [s["name"] for s in status["stages"]] == ["gpu", "cpu"]


def ready_pod(stage, index, i, ready=True, **status):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"llama-{stage}-{index}", "namespace": "ml",
                         "creationTimestamp": "2026-01-01T00:00:00Z",
                         "labels": {**names.labels("llama", stage, i), names.POD_INDEX_LABEL: str(index)}},
            "status": {"phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "vllm", "restartCount": 0, "state": {"running": {}}}],
                       **status}}


async def test_status_written_with_conditions_and_counts(kmock, api):
    body = make_body(stages=stages(2, layers=True))
    put_instance(kmock, body)
    await reconcile(api, body, SETTINGS)
    status = live(kmock, HI)["llama"]["status"]
    assert status["phase"] == "Progressing" and status["observedGeneration"] == 1
    assert status["stagesSummary"] == "gpu:8 cpu:8"
    assert [s["layers"] for s in status["stages"]] == ["0-7", "8-15"]
    assert status["endpoint"] == "http://llama.ml.svc:8000/v1"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "False", "Progressing": "True", "Degraded": "False"}

    # The StatefulSet controller and kubelet do their part...
    for name in ("llama-gpu", "llama-cpu"):
        kmock.objects["apps/v1/statefulsets", "ml", name].patch(
            {"status": {"replicas": 1, "readyReplicas": 1, "observedGeneration": 1,
                        "currentRevision": "r1", "updateRevision": "r1"}})
    kmock.objects["v1/pods", "ml", "llama-gpu-0"] = ready_pod("gpu", 0, 0)
    kmock.objects["v1/pods", "ml", "llama-cpu-0"] = ready_pod("cpu", 0, 1)
    await reconcile(api, live(kmock, HI)["llama"], SETTINGS)
    status = live(kmock, HI)["llama"]["status"]
    assert status["phase"] == "Ready" and status["ready"] == "1/1" and status["readyReplicas"] == 1
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Degraded": "False"}
    assert metrics.INSTANCES.labels(phase="Ready")._value.get() >= 1


async def test_offload_replica_is_ready_with_only_its_gpu_pods(kmock, api):
    body = make_body(stages=stages(3, layers=True), strategy="offload")
    put_instance(kmock, body)
    await reconcile(api, body, SETTINGS)
    kmock.objects["apps/v1/statefulsets", "ml", "llama-gpu"].patch(
        {"status": {"replicas": 1, "readyReplicas": 1, "observedGeneration": 1,
                    "currentRevision": "r1", "updateRevision": "r1"}})
    kmock.objects["v1/pods", "ml", "llama-gpu-0"] = ready_pod("gpu", 0, 0)
    await reconcile(api, live(kmock, HI)["llama"], SETTINGS)
    status = live(kmock, HI)["llama"]["status"]
    assert status["phase"] == "Ready" and status["ready"] == "1/1"
    assert status["stages"] == [{"name": "gpu", "device": "gpu", "replicas": 1, "readyReplicas": 1, "layers": "0-23"}]
    assert status["stagesSummary"] == "gpu:24"


async def test_topology_affinity_error_surfaces_as_degraded_condition_and_event(kmock, api):
    body = make_body()
    put_instance(kmock, body)
    await reconcile(api, body, SETTINGS)
    pod = ready_pod("cpu", 0, 1, ready=False)
    pod["status"] = {"phase": "Failed", "reason": "TopologyAffinityError",
                     "message": "Resources cannot be allocated with Topology locality"}
    kmock.objects["v1/pods", "ml", "llama-cpu-0"] = pod
    await reconcile(api, live(kmock, HI)["llama"], SETTINGS)
    status = live(kmock, HI)["llama"]["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert status["phase"] == "Degraded"
    assert degraded["status"] == "True" and degraded["reason"] == "TopologyAffinityError"
    assert "llama-cpu-0" in degraded["message"]
    assert any(e["type"] == "Warning" and e["reason"] == "Degraded" for e in live(kmock, "v1/events").values())


async def test_deleted_child_is_recreated(kmock, api):
    body = make_body()
    put_instance(kmock, body)
    await reconcile(api, body, SETTINGS)
    await api.delete(path_for("apps/v1", "StatefulSet", "ml", "llama-cpu"))
    await api.delete(path_for("v1", "Service", "ml", "llama"))
    result = await reconcile(api, live(kmock, HI)["llama"], SETTINGS)
    assert result["children"]["StatefulSet/llama-cpu"] == "created"
    assert result["children"]["Service/llama"] == "created"
    assert "llama-cpu" in live(kmock, "apps/v1/statefulsets")


async def test_drifted_child_is_repaired(kmock, api):
    body = make_body()
    put_instance(kmock, body)
    await reconcile(api, body, SETTINGS)
    kmock.objects["apps/v1/statefulsets", "ml", "llama-cpu"].patch({"spec": {"replicas": 7}})
    result = await reconcile(api, live(kmock, HI)["llama"], SETTINGS)
    assert result["children"]["StatefulSet/llama-cpu"] == "patched"
    assert live(kmock, "apps/v1/statefulsets")["llama-cpu"]["spec"]["replicas"] == 1


async def test_conflicts_and_transient_errors_are_retried(kmock, api):
    body = make_body()
    put_instance(kmock, body)
    await reconcile(api, body, SETTINGS)
    failures = {"patch": 0, "post": 0}

    def conflict_twice(request):
        if failures["patch"] < 2:
            failures["patch"] += 1
            raise kmock_lib.KubernetesError(status=409, reason="Conflict", message="the object has been modified")
        # fall through to the emulator

    def unavailable_once(request):
        if failures["post"] < 1:
            failures["post"] += 1
            raise kmock_lib.KubernetesError(status=503, reason="ServiceUnavailable", message="etcd leader change")

    kmock["patch", kmock_lib.resource("apps/v1/statefulsets")] << conflict_twice
    kmock["post", kmock_lib.resource("v1/services")] << unavailable_once
    await api.delete(path_for("v1", "Service", "ml", "llama"))
    result = await reconcile(api, make_body(replicas=2), SETTINGS)
    assert failures == {"patch": 2, "post": 1}
    assert result["children"]["StatefulSet/llama-gpu"] == "patched"
    # kmock stores the object even when the reaction fails the request: like a write whose response
    # got lost. The retry then meets 409 AlreadyExists, which apply() treats as "already there".
    assert result["children"]["Service/llama"] in ("created", "unchanged")
    assert "llama" in live(kmock, "v1/services")
    assert live(kmock, "apps/v1/statefulsets")["llama-gpu"]["spec"]["replicas"] == 2


async def test_operator_restart_between_steps_converges_without_duplicates(kmock, api):
    """The old process died after applying some children (one of them left by an even older
    version without our bookkeeping annotation); the new process finishes without duplicates."""
    body = make_body(stages=stages(3))
    put_instance(kmock, body)
    children = render_children(body, SETTINGS)
    for child in children[:5]:  # ConfigMap, Services, NetworkPolicy, first StatefulSet: then "killed"
        await apply(api, child)
    kmock.objects["apps/v1/statefulsets", "ml", "llama-cpu2"] = {  # stale leftover, no annotations
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "llama-cpu2", "namespace": "ml"}, "spec": {"replicas": 5}}
    fresh = KubeApi.for_server(str(kmock.url), retries=2, backoff_s=0.01)  # the restarted operator
    try:
        first = await reconcile(fresh, body, SETTINGS)
        second = await reconcile(fresh, live(kmock, HI)["llama"], SETTINGS)
    finally:
        await fresh.close()
    assert first["children"]["StatefulSet/llama-gpu"] == "unchanged"
    assert first["children"]["StatefulSet/llama-cpu"] == "created"
    assert first["children"]["StatefulSet/llama-cpu2"] == "patched"
    assert set(second["children"].values()) == {"unchanged"}
    assert set(live(kmock, "apps/v1/statefulsets")) == {"llama-gpu", "llama-cpu", "llama-cpu2"}
    assert live(kmock, "apps/v1/statefulsets")["llama-cpu2"]["spec"]["replicas"] == 1
    creates = [r for r in kmock if r.method.value == "POST" and "statefulsets" in str(r.url)]
    assert len(creates) == 2  # gpu by the old process, cpu by the new one; nothing twice


def pod(stage, index, i, created="2026-01-01T00:00:00Z", restarts=0, phase="Running"):
    p = ready_pod(stage, index, i)
    p["metadata"]["creationTimestamp"] = created
    p["status"]["phase"] = phase
    p["status"]["containerStatuses"][0]["restartCount"] = restarts
    return p


async def test_group_restart_deletes_every_pod_of_the_replica_and_records_event(kmock, api):
    body = make_body(replicas=2)
    put_instance(kmock, body)
    pods = [pod("gpu", 0, 0), pod("cpu", 0, 1, restarts=1), pod("gpu", 1, 0), pod("cpu", 1, 1)]
    for p in pods:
        kmock.objects["v1/pods", "ml", p["metadata"]["name"]] = p
    before = metrics.GROUP_RESTARTS._value.get()
    deleted = await handle_pod_event(api, "MODIFIED", pods[1])
    assert deleted == ["llama-cpu-0", "llama-gpu-0"]
    assert set(live(kmock, "v1/pods")) == {"llama-gpu-1", "llama-cpu-1"}  # replica 1 untouched
    assert metrics.GROUP_RESTARTS._value.get() == before + 1
    (event,) = [e for e in live(kmock, "v1/events").values() if e["reason"] == "GroupRestart"]
    assert event["type"] == "Warning" and "replica 0" in event["message"]


async def test_group_restart_after_deletion_spares_replacements(kmock, api):
    body = make_body(replicas=1)
    put_instance(kmock, body)
    gone = pod("gpu", 0, 0, created="2026-01-01T00:00:00Z")
    peer = pod("cpu", 0, 1, created="2026-01-01T00:00:01Z")  # a second younger: the same replica all the same
    replacement = pod("gpu", 0, 0, created="2026-01-01T00:05:00Z")
    kmock.objects["v1/pods", "ml", "llama-cpu-0"] = peer
    kmock.objects["v1/pods", "ml", "llama-gpu-0"] = replacement
    patches = []
    kmock["patch /api/v1/namespaces/ml/pods/llama-cpu-0"] << (lambda req: patches.append(req.data) or {})
    assert await handle_pod_event(api, "DELETED", gone) == ["llama-cpu-0"]
    # marked before deletion: what the watch then delivers as the peer's DELETED object
    assert patches == [{"metadata": {"annotations": {names.GROUP_RESTART: "pod llama-gpu-0 was deleted"}}}]
    peer["metadata"]["annotations"] = {names.GROUP_RESTART: "pod llama-gpu-0 was deleted"}
    # ...and that event must not touch the new gpu pod.
    assert await handle_pod_event(api, "DELETED", peer) == []
    assert "llama-gpu-0" in live(kmock, "v1/pods")


async def test_a_late_restart_event_spares_pods_created_after_the_failure(kmock, api):
    put_instance(kmock, make_body(replicas=1))
    crashed = pod("cpu", 0, 1, created="2026-01-01T00:00:00Z", restarts=1)
    crashed["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"finishedAt": "2026-01-01T00:10:00Z"}}
    sibling_after = pod("gpu", 0, 0, created="2026-01-01T00:10:05Z")  # a replacement already
    for p in (crashed, sibling_after):
        kmock.objects["v1/pods", "ml", p["metadata"]["name"]] = p
    assert await handle_pod_event(api, "MODIFIED", crashed) == ["llama-cpu-0"]
    assert "llama-gpu-0" in live(kmock, "v1/pods")


async def test_pods_of_stages_offload_does_not_run_cause_no_group_restart(kmock, api):
    """pipeline -> offload deletes the cpu StatefulSet; its pods going away must not restart the gpu pods."""
    put_instance(kmock, make_body(strategy="offload"))
    gpu, cpu = pod("gpu", 0, 0), pod("cpu", 0, 1)
    for p in (gpu, cpu):
        kmock.objects["v1/pods", "ml", p["metadata"]["name"]] = p
    assert await handle_pod_event(api, "DELETED", cpu) == []
    assert "llama-gpu-0" in live(kmock, "v1/pods")
    # A single running stage: the kubelet's restart is enough, nothing to re-form.
    assert await handle_pod_event(api, "MODIFIED", pod("gpu", 0, 0, restarts=1)) == []


async def test_healthy_pod_updates_cause_no_api_calls(kmock, api):
    put_instance(kmock, make_body())
    before = len(list(kmock))
    assert await handle_pod_event(api, "MODIFIED", pod("cpu", 0, 1)) == []
    assert len(list(kmock)) == before


async def test_kopf_handlers_are_registered_and_delegate(kmock, api):
    """The kopf layer: the right resources/causes are wired, and each handler drives reconcile."""
    import logging

    import kopf
    from hybrid_operator import handlers

    registry = kopf.get_default_registry()
    mine = [h for h in registry._changing.get_all_handlers() if h.fn.__name__ == "reconcile_instance"]
    reasons = {str(h.reason.value) if h.reason else None for h in mine}
    assert {"create", "update"} <= reasons
    assert any(h.reason is None and h.initial for h in mine)  # on.resume: operator restarts
    assert all(h.selector.group == "hybrid.inference.dev" and h.selector.any_name == "hybridinferences"
               for h in mine)
    # No timers or daemons: kopf would put a finalizer on every instance, and deleting one with the
    # operator down would hang. The periodic resync walks an index instead.
    assert not registry._spawning.get_all_handlers()
    assert [h.fn.__name__ for h in registry._indexing.get_all_handlers()] == ["instances"]
    watching = [h for h in registry._watching.get_all_handlers() if h.fn.__name__ == "pod_changed"]
    assert watching and watching[0].labels == {"app.kubernetes.io/managed-by": "hybrid-inference-operator"}

    body = make_body()
    put_instance(kmock, body)
    memo = kopf.Memo(api=api, config=SETTINGS)
    await handlers.reconcile_instance(body=body, memo=memo, logger=logging.getLogger("t"))
    assert set(live(kmock, "apps/v1/statefulsets")) == {"llama-gpu", "llama-cpu"}
    await api.delete(path_for("apps/v1", "StatefulSet", "ml", "llama-gpu"))
    memo.config = dataclasses.replace(SETTINGS, status_interval_s=0.05)
    resync = asyncio.create_task(handlers.resync_instances(memo, {("ml", "llama"): [live(kmock, HI)["llama"]]}))
    for _ in range(100):
        await asyncio.sleep(0.05)
        if "llama-gpu" in live(kmock, "apps/v1/statefulsets"):
            break
    resync.cancel()
    assert "llama-gpu" in live(kmock, "apps/v1/statefulsets")

    restarted = pod("gpu", 0, 0, restarts=2)
    for p in (restarted, pod("cpu", 0, 1)):
        kmock.objects["v1/pods", "ml", p["metadata"]["name"]] = p
    await handlers.pod_changed(event={"type": "MODIFIED", "object": restarted}, memo=memo)
    assert not live(kmock, "v1/pods")


async def test_a_deleted_hostpath_instance_gets_a_cleanup_job_on_each_node_its_pods_ran_on(kmock, api):
    """The kubelet made its /dev/shm directory on every node that ran a pod; the DELETED event's handler
    asks each of those nodes to remove it (tests/e2e/test_real_node.py watches it happen on a real node)."""
    import logging

    import kopf
    from hybrid_operator import handlers

    body = make_body(stages=stages(3))
    for name, node, image in (("llama-gpu-0", "gpu-node", "r/gpu:1"), ("llama-cpu-0", "gpu-node", "r/cpu:1"),
                              ("llama-cpu2-0", "cpu-node", "r/cpu:1")):
        p = pod(name.split("-")[1], 0, 0)
        p["metadata"]["name"] = name
        p["spec"] = {"nodeName": node, "containers": [{"name": "vllm", "image": image}]}
        kmock.objects["v1/pods", "ml", name] = p
    memo = kopf.Memo(api=api, config=SETTINGS)
    await handlers.forget_instance(event={"type": "MODIFIED", "object": body}, memo=memo, logger=logging.getLogger("t"))
    assert not live(kmock, "batch/v1/jobs")  # only the DELETED event
    await handlers.forget_instance(event={"type": "DELETED", "object": body}, memo=memo, logger=logging.getLogger("t"))
    jobs = live(kmock, "batch/v1/jobs")
    nodes = {j["spec"]["template"]["spec"]["nodeName"]: j for j in jobs.values()}
    assert set(nodes) == {"gpu-node", "cpu-node"}
    for job in jobs.values():
        spec = job["spec"]["template"]["spec"]
        assert job["spec"]["ttlSecondsAfterFinished"] == 0 and spec["restartPolicy"] == "Never"
        assert spec["volumes"] == [{"name": "shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}}]
        assert "rm -rf /host/hybrid-inference/ml.llama.01234567 " in spec["containers"][0]["command"][2]
    assert nodes["cpu-node"]["spec"]["template"]["spec"]["containers"][0]["image"] == "r/cpu:1"

    private = make_body(name="other", sharedMemory={"mode": "none", "sizeLimit": "1Gi"})
    await handlers.forget_instance(event={"type": "DELETED", "object": private}, memo=memo,
                                   logger=logging.getLogger("t"))
    assert len(live(kmock, "batch/v1/jobs")) == 2  # a private /dev/shm leaves nothing on the node


def failed_pod(stage, index, i, message, created="2026-01-01T00:00:00Z", finished="2026-01-01T00:01:00Z"):
    p = pod(stage, index, i, created=created, restarts=1)
    p["status"]["containerStatuses"][0]["lastState"] = {"terminated": {
        "exitCode": 2, "reason": "Error", "finishedAt": finished, "message": message}}
    return p


async def test_a_replica_that_keeps_failing_backs_off_and_says_why_in_status(kmock, api):
    """Every failure-driven group restart is counted in status.failures with the stage's own last error line;
    the next one waits 10 s doubling to 5 min (as CrashLoopBackOff); from the second, Degraded says why."""
    from hybrid_operator import group_restart
    from hybrid_operator.reconcile import refresh_status
    assert [group_restart.backoff_s(n) for n in (1, 2, 3, 5, 6, 9)] == [10, 20, 40, 160, 300, 300]
    body = make_body()
    put_instance(kmock, body)
    why = "vllm-hybrid: the model does not fit: 30 layers, capacity 0 ... add memory or stages"
    pods = [failed_pod("cpu", 0, 1, f"INFO starting\n{why}\n"), pod("gpu", 0, 0)]
    for p in pods:
        kmock.objects["v1/pods", "ml", p["metadata"]["name"]] = p
    assert await handle_pod_event(api, "MODIFIED", pods[0]) == ["llama-cpu-0", "llama-gpu-0"]
    (failure,) = live(kmock, HI)["llama"]["status"]["failures"]
    assert failure["restarts"] == 1 and failure["message"] == why and failure["pod"] == "llama-cpu-0"
    event = next(e for e in live(kmock, "v1/events").values() if e["reason"] == "GroupRestart")
    assert why in event["message"]

    # the replacements fail again at once: the second group restart waits out the first backoff
    pods = [failed_pod("cpu", 0, 1, why, created="2026-01-01T00:02:00Z", finished="2026-01-01T00:03:00Z"),
            pod("gpu", 0, 0, created="2026-01-01T00:02:00Z")]
    for p in pods:
        kmock.objects["v1/pods", "ml", p["metadata"]["name"]] = p
    assert await handle_pod_event(api, "MODIFIED", pods[0]) == []  # within 10 s of the first
    kmock.objects[HI, "ml", "llama"].patch({"status": {"failures": [dict(failure, lastRestart="2026-01-01T00:00:00Z")]}})
    assert await handle_pod_event(api, "MODIFIED", pods[0]) == ["llama-cpu-0", "llama-gpu-0"]
    (failure,) = live(kmock, HI)["llama"]["status"]["failures"]
    assert failure["restarts"] == 2
    status = await refresh_status(api, live(kmock, HI)["llama"], SETTINGS)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert status["phase"] == "Degraded" and degraded["reason"] == "StageFailing"
    assert degraded["message"].startswith("replica 0: pod llama-cpu-0 failed 2 times") and why in degraded["message"]

    # once the replica serves again, the record goes
    for p in (ready_pod("gpu", 0, 0), ready_pod("cpu", 0, 1)):
        kmock.objects["v1/pods", "ml", p["metadata"]["name"]] = p
    status = await refresh_status(api, live(kmock, HI)["llama"], SETTINGS)
    assert status["failures"] == [] and live(kmock, HI)["llama"]["status"]["failures"] == []


async def test_a_one_stage_instance_that_keeps_failing_says_why_in_status(kmock, api):
    """One stage: nothing to re-form, so no group restart records the cause; the kubelet restarts the container in
    place and backs off. Degraded still leads with the stage's own last line, before the kubelet's back-off."""
    from hybrid_operator.reconcile import refresh_status
    body = make_body(stages=stages(1))
    put_instance(kmock, body)
    why = "vllm-hybrid: model: no config.json at /models/no-such-model (missing model files?)"
    crashing = failed_pod("gpu", 0, 0, f"INFO starting\n{why}\n")
    back_off = "back-off 40s restarting failed container=vllm pod=llama-gpu-0_ml(uid)"
    crashing["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": back_off}}
    kmock.objects["v1/pods", "ml", "llama-gpu-0"] = crashing
    assert await handle_pod_event(api, "MODIFIED", crashing) == []
    status = await refresh_status(api, live(kmock, HI)["llama"], SETTINGS)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert status["phase"] == "Degraded" and status["failures"] == []
    assert degraded["reason"] == "CrashLoopBackOff"
    assert degraded["message"] == f"pod llama-gpu-0: {why} ({back_off})"
    # a wait that is not about the last run (a new image that cannot be pulled) is the kubelet's alone
    pulling = "Back-off pulling image \"runtime:v2\""
    crashing["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "ImagePullBackOff", "message": pulling}}
    status = await refresh_status(api, live(kmock, HI)["llama"], SETTINGS)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["reason"], degraded["message"]) == ("ImagePullBackOff", f"pod llama-gpu-0: {pulling}")
    # killed by the kernel for its memory limit: said as such, whatever the back-off
    crashing["status"]["containerStatuses"][0]["lastState"]["terminated"]["reason"] = "OOMKilled"
    status = await refresh_status(api, live(kmock, HI)["llama"], SETTINGS)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["reason"], degraded["message"]) == ("OOMKilled", "pod llama-gpu-0: container vllm was OOM-killed")


async def test_a_lost_pod_of_a_ready_instance_shows_in_status_at_once(kmock, api):
    """Not at the next resync: the pod event itself refreshes the status of an instance that says Ready."""
    from hybrid_operator.reconcile import refresh_on_pod_loss, refresh_status
    body = make_body()
    put_instance(kmock, body)
    await reconcile(api, body, SETTINGS)
    for name in ("llama-gpu", "llama-cpu"):
        kmock.objects["apps/v1/statefulsets", "ml", name].patch(
            {"status": {"replicas": 1, "readyReplicas": 1, "observedGeneration": 1,
                        "currentRevision": "r1", "updateRevision": "r1"}})
    pods = [ready_pod("gpu", 0, 0), ready_pod("cpu", 0, 1)]
    for p in pods:
        kmock.objects["v1/pods", "ml", p["metadata"]["name"]] = p
    assert (await refresh_status(api, live(kmock, HI)["llama"], SETTINGS))["phase"] == "Ready"
    index = {("ml", "llama"): [live(kmock, HI)["llama"]]}
    assert not await refresh_on_pod_loss(api, "MODIFIED", pods[0], index, SETTINGS)  # still ready: no calls
    del kmock.objects["v1/pods", "ml", "llama-gpu-0"]
    assert await refresh_on_pod_loss(api, "DELETED", pods[0], index, SETTINGS)
    ready = next(c for c in live(kmock, HI)["llama"]["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"


def test_the_cause_of_a_replica_failure_is_a_stages_own_error_not_the_peer_lost_that_followed():
    from hybrid_operator import group_restart
    own = failed_pod("gpu", 0, 0, "vllm-hybrid: stages[0] (gpu): does not fit: 16 layers need 9.1 GiB")
    peer = failed_pod("cpu", 0, 1, "peer lost (stage 0 closed its heartbeat): stopping this stage")
    peer["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] = group_restart.EXIT_PEER_LOST
    other_replica = failed_pod("gpu", 1, 0, "vLLM exited with code 1: RuntimeError: boom")
    assert group_restart.replica_cause(peer, [own, peer, other_replica])[1].endswith("does not fit: 16 layers need 9.1 GiB")
    assert group_restart.replica_cause(peer, [peer]) == (75, peer["status"]["containerStatuses"][0]["lastState"][
        "terminated"]["message"])  # nothing better known
    # two stages' own errors: the one that ended first is the cause (the other's engine lost it as it started)
    first = failed_pod("cpu", 0, 1, "vLLM exited with code -9: killed by the kernel's OOM killer",
                       finished="2026-01-01T00:00:50Z")
    then = failed_pod("gpu", 0, 0, "vLLM exited with code 1: RuntimeError: Engine core initialization failed")
    assert "OOM" in group_restart.replica_cause(then, [then, first])[1]
    assert "OOM" in group_restart.replica_cause(first, [then, first])[1]


async def test_a_replacement_that_lost_the_old_groups_stage_0_does_not_restart_the_new_group(kmock, api):
    """The tail's pod is deleted; its replacement starts at once and joins the old head, which the group restart
    then deletes: the new tail ends "peer lost" (exit 75). Its peers are all newer than that run, so the group is
    already re-forming: its kubelet restart joins the new head and nothing is deleted. A "peer lost" whose head is
    older than the run is a real loss: the replica re-forms."""
    from hybrid_operator import group_restart
    body = make_body()
    put_instance(kmock, body)

    def follower(head_created):
        tail = pod("cpu", 0, 1, created="2026-01-01T00:00:00Z", restarts=1)
        tail["status"]["containerStatuses"][0]["lastState"] = {"terminated": {
            "exitCode": group_restart.EXIT_PEER_LOST, "reason": "Error", "startedAt": "2026-01-01T00:00:01Z",
            "finishedAt": "2026-01-01T00:00:05Z", "message": "peer lost (stage 0 closed its heartbeat)"}}
        for p in (tail, pod("gpu", 0, 0, created=head_created)):
            kmock.objects["v1/pods", "ml", p["metadata"]["name"]] = p
        return tail

    assert await handle_pod_event(api, "MODIFIED", follower("2026-01-01T00:00:03Z")) == []
    assert set(live(kmock, "v1/pods")) == {"llama-cpu-0", "llama-gpu-0"}
    assert not [e for e in live(kmock, "v1/events").values() if e["reason"] == "GroupRestart"]
    assert "failures" not in live(kmock, HI)["llama"].get("status", {})
    # a head created before the tail's run, or in its first second: the tail may have lost a stage of its own group
    for head_created in ("2025-12-31T23:59:00Z", "2026-01-01T00:00:01Z"):
        assert await handle_pod_event(api, "MODIFIED", follower(head_created)) == ["llama-cpu-0", "llama-gpu-0"]
        kmock.objects[HI, "ml", "llama"].patch({"status": {"failures": []}})  # no backoff between the two cases


async def test_a_group_restart_victim_that_ends_with_its_own_cause_replaces_the_peer_lost_in_status(kmock, api):
    """The tail's worker is OOM-killed at load; the head's engine fails on it and its stage says "peer lost"
    (exit 75), which starts the group restart. The tail, terminating as its victim, ends with its own cause
    (exit 137, the OOM line): status.failures names that instead."""
    from hybrid_operator import group_restart
    body = make_body()
    put_instance(kmock, body)
    head = failed_pod("gpu", 0, 0, "peer lost (stage 1 closed its heartbeat); vLLM exited with code 1: RuntimeError")
    head["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] = group_restart.EXIT_PEER_LOST
    tail = pod("cpu", 0, 1)
    for p in (head, tail):
        kmock.objects["v1/pods", "ml", p["metadata"]["name"]] = p
    assert await handle_pod_event(api, "MODIFIED", head) == ["llama-cpu-0", "llama-gpu-0"]
    (failure,) = live(kmock, HI)["llama"]["status"]["failures"]
    assert failure["exitCode"] == 75 and failure["message"].startswith("peer lost")

    oom = "vLLM is running: a process was killed by the kernel's OOM killer (the pod's memory limit is too small)"
    tail["metadata"].update(deletionTimestamp="2026-01-01T00:01:05Z", annotations={names.GROUP_RESTART: "restart"})
    tail["status"]["containerStatuses"][0]["state"] = {"terminated": {
        "exitCode": 137, "reason": "Error", "finishedAt": "2026-01-01T00:01:04Z", "message": oom + "\n"}}
    peer_lost = dict(tail, status={"containerStatuses": [{"name": "stage", "restartCount": 0, "state": {"terminated": {
        "exitCode": 75, "finishedAt": "2026-01-01T00:01:04Z", "message": "peer lost (stage 0 closed its heartbeat)"}}}]})
    assert await handle_pod_event(api, "MODIFIED", peer_lost) == []  # a follower's words change nothing
    assert live(kmock, HI)["llama"]["status"]["failures"][0]["message"].startswith("peer lost")
    assert await handle_pod_event(api, "DELETED", tail) == []
    (failure,) = live(kmock, HI)["llama"]["status"]["failures"]
    assert failure["exitCode"] == 137 and failure["message"] == oom and failure["pod"] == "llama-cpu-0"
    assert failure["restarts"] == 1  # the same failure, better told

    # and a later "peer lost" of the same replica does not hide it again
    head2 = failed_pod("gpu", 0, 0, "peer lost (stage 1 closed its heartbeat)", created="2026-01-01T00:02:00Z",
                       finished="2026-01-01T00:03:00Z")
    head2["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] = group_restart.EXIT_PEER_LOST
    kmock.objects["v1/pods", "ml", "llama-gpu-0"] = head2
    assert await handle_pod_event(api, "MODIFIED", head2) == []  # backing off
    assert live(kmock, HI)["llama"]["status"]["failures"][0]["message"] == oom
