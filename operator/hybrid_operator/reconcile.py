"""The side effects: apply rendered children, prune removed stages, write status, group restarts."""
from __future__ import annotations

import datetime
import logging
from typing import Any

from . import group_restart, metrics, names
from .apply import apply
from .defaults import with_defaults
from .events import build_event
from .kube import ApiError, KubeApi, path_for
from .render import render_children
from .render.cleanup import render_shm_cleanup_job
from .render.pod import shm_host_dir
from .settings import API_VERSION, Settings
from .status import compute_status, pod_ready, short_of_pods
from .strategy import running_stages

log = logging.getLogger(__name__)


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def record_event(api: KubeApi, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    event = build_event(body, type_, reason, message, utcnow())
    try:
        await api.create(path_for("v1", "Event", body["metadata"]["namespace"]), event)
    except Exception as exc:  # noqa: BLE001  an Event is best effort; never fail a reconcile on it
        log.warning("could not record event %s: %s", reason, exc)


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences", []))


async def apply_children(api: KubeApi, body: dict[str, Any], settings: Settings) -> dict[str, str]:
    """Create/patch every child; delete StatefulSets of stages no longer in the spec or not run (offload)."""
    meta = body["metadata"]
    results: dict[str, str] = {}
    children = render_children(body, settings)
    for child in children:
        action = await apply(api, child)
        results[f"{child['kind']}/{child['metadata']['name']}"] = action
        if action != "unchanged":
            metrics.CHILD_WRITES.labels(kind=child["kind"], action=action).inc()
    wanted = {c["metadata"]["name"] for c in children if c["kind"] == "StatefulSet"}
    existing = await api.list(path_for("apps/v1", "StatefulSet", meta["namespace"]),
                              names.instance_selector(meta["name"]))
    for sts in existing:
        if sts["metadata"]["name"] not in wanted and _owned_by(sts, meta["uid"]):
            await api.delete(path_for("apps/v1", "StatefulSet", meta["namespace"], sts["metadata"]["name"]))
            results[f"StatefulSet/{sts['metadata']['name']}"] = "deleted"
    return results


async def refresh_status(api: KubeApi, body: dict[str, Any], settings: Settings) -> dict[str, Any]:
    meta = body["metadata"]
    selector = names.instance_selector(meta["name"])
    statefulsets = await api.list(path_for("apps/v1", "StatefulSet", meta["namespace"]), selector)
    pods = await api.list(path_for("v1", "Pod", meta["namespace"]), selector)
    # Only when a StatefulSet is short of pods: the controller's FailedCreate events say why.
    short = any(map(short_of_pods, statefulsets))
    events = await api.list(path_for("v1", "Event", meta["namespace"]),
                            fields={"involvedObject.kind": "StatefulSet"}) if short else []
    status = compute_status(body, statefulsets, pods, utcnow(), settings, events)
    old = body.get("status") or {}
    if old.get("phase") != status["phase"]:
        kind = "Warning" if status["phase"] == "Degraded" else "Normal"
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        detail = f": {degraded['reason']}: {degraded['message']}" if status["phase"] == "Degraded" else ""
        await record_event(api, body, kind, status["phase"], f"phase {old.get('phase', '-')} -> {status['phase']}{detail}")
    if {k: v for k, v in old.items()} != status:
        await api.patch(path_for(API_VERSION, "HybridInference", meta["namespace"], meta["name"], "status"),
                        {"status": status})
    metrics.set_phase(meta["namespace"], meta["name"], status["phase"])
    return status


async def reconcile(api: KubeApi, body: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """One full pass; idempotent, so create/update/resume/timer all call this."""
    try:
        results = await apply_children(api, body, settings)
        changed = {k: v for k, v in results.items() if v != "unchanged"}
        if changed:
            summary = ", ".join(f"{k} {v}" for k, v in sorted(changed.items()))
            await record_event(api, body, "Normal", "Applied", summary)
        status = await refresh_status(api, body, settings)
        await restart_failed_replicas(api, body)
    except Exception:
        metrics.RECONCILES.labels(result="error").inc()
        raise
    metrics.RECONCILES.labels(result="ok").inc()
    return {"children": results, "phase": status["phase"]}


def seconds_since(stamp: str) -> float:
    then = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    return (datetime.datetime.now(datetime.UTC) - then).total_seconds()


async def handle_pod_event(api: KubeApi, event_type: str | None, pod: dict[str, Any]) -> list[str]:
    """Group restart: delete every pod of the failed pod's pipeline replica. Returns deleted names.
    A replica that keeps failing is restarted after a growing wait (group_restart.backoff_s); each
    failure-driven restart is kept in status.failures with the stage's own last error line."""
    meta = pod["metadata"]
    instance = (meta.get("labels") or {}).get(names.INSTANCE_LABEL)
    if not instance:
        return []
    ns = meta["namespace"]
    if names.GROUP_RESTART in (meta.get("annotations") or {}) and (event_type == "DELETED" or meta.get("deletionTimestamp")):
        await record_victim_cause(api, pod)
        return []
    if event_type != "DELETED" and group_restart.restart_reason(pod) is None:
        return []  # the common case: a status update of a healthy pod; no API calls
    body = await api.get(path_for(API_VERSION, "HybridInference", ns, instance))
    if body is None or body["metadata"].get("deletionTimestamp"):
        return []  # instance is going away; garbage collection removes the pods
    spec = with_defaults(body["spec"])
    running = [spec["stages"][i]["name"] for i in running_stages(spec)]
    if (meta.get("labels") or {}).get(names.STAGE_LABEL) not in running:
        return []  # a stage the strategy no longer runs: its pods go away with its StatefulSet
    pods = await api.list(path_for("v1", "Pod", ns), names.instance_selector(instance))
    doomed, reason = group_restart.victims(event_type, pod, pods, spec["replicas"], len(running))
    failures, index = (body.get("status") or {}).get("failures", []), group_restart.pod_index(pod)
    last = group_restart.failure_of(failures, index) if event_type != "DELETED" else None
    if last and last.get("generation") != body["metadata"].get("generation"):
        last = None  # the spec changed since: a fix gets its chance at once
    if doomed and last and seconds_since(last["lastRestart"]) < group_restart.backoff_s(last["restarts"]):
        # backing off: the periodic resync restarts it once the wait is over; status has the latest cause
        cause = group_restart.replica_cause(pod, pods)
        if cause and cause[1] != last.get("message") and group_restart.improves(last, cause[0]):
            await _write_failures(api, ns, instance, group_restart.retold(failures, last, *cause))
        return []
    deleted = []
    for name in doomed:  # marked first, so their own DELETED events start no second group restart
        try:
            await api.patch(path_for("v1", "Pod", ns, name), {"metadata": {"annotations": {names.GROUP_RESTART: reason}}})
        except ApiError as exc:
            if exc.status == 404:
                continue  # gone already
            raise
        if await api.delete(path_for("v1", "Pod", ns, name)):
            deleted.append(name)
    if deleted:
        metrics.GROUP_RESTARTS.inc()
        await record_event(api, body, "Warning", "GroupRestart",
                           f"replica {index}: {reason}; deleted {', '.join(deleted)} so the pipeline re-forms")
        if event_type != "DELETED":
            code, why = group_restart.replica_cause(pod, pods) or (None, reason)
            await _write_failures(api, ns, instance, group_restart.record_failure(
                failures, index, meta["name"], why, utcnow(), body["metadata"].get("generation"), code))
    return deleted


async def record_victim_cause(api: KubeApi, pod: dict[str, Any]) -> None:
    """A pod a group restart removed ends after the restart was recorded, maybe with its own cause (the
    launcher's OOM line, exit 137) where the stage that triggered the restart only said "peer lost"."""
    failure = group_restart.last_failure(pod)
    if failure is None:
        return
    meta = pod["metadata"]
    ns, instance = meta["namespace"], meta["labels"][names.INSTANCE_LABEL]
    body = await api.get(path_for(API_VERSION, "HybridInference", ns, instance))
    if body is None:
        return
    failures = (body.get("status") or {}).get("failures", [])
    entry = group_restart.failure_of(failures, group_restart.pod_index(pod))
    if (entry is None or entry.get("generation") != body["metadata"].get("generation")
            or entry.get("exitCode") != group_restart.EXIT_PEER_LOST or failure[0] == group_restart.EXIT_PEER_LOST):
        return
    await _write_failures(api, ns, instance, group_restart.retold(failures, entry, *failure[:2], pod=meta["name"]))


async def _write_failures(api: KubeApi, ns: str, instance: str, failures: list[dict[str, Any]]) -> None:
    await api.patch(path_for(API_VERSION, "HybridInference", ns, instance, "status"), {"status": {"failures": failures}})


async def refresh_on_pod_loss(api: KubeApi, event_type: str | None, pod: dict[str, Any], instances: Any,
                              settings: Settings) -> bool:
    """A pod of an instance that says Ready went away or stopped being ready: status says so now, not at the
    next resync (a `kubectl wait --for=condition=Ready` right after a pod's deletion returned at once)."""
    meta = pod["metadata"]
    if event_type != "DELETED" and not meta.get("deletionTimestamp") and pod_ready(pod):
        return False
    key = (meta["namespace"], (meta.get("labels") or {}).get(names.INSTANCE_LABEL))
    stale = [b for b in instances.get(key, []) if (b.get("status") or {}).get("phase") == "Ready"]
    for body in stale:
        await refresh_status(api, body, settings)
    return bool(stale)


async def restart_failed_replicas(api: KubeApi, body: dict[str, Any]) -> None:
    """The resync's part of group restarts: a replica whose restart waited out its backoff."""
    if not (body.get("status") or {}).get("failures"):
        return
    meta = body["metadata"]
    for pod in await api.list(path_for("v1", "Pod", meta["namespace"]), names.instance_selector(meta["name"])):
        if group_restart.restart_reason(pod):
            await handle_pod_event(api, "MODIFIED", pod)


async def clean_shared_memory(api: KubeApi, body: dict[str, Any], settings: Settings) -> list[str]:
    """A deleted hostPath-mode instance: a cleanup Job on every node its pods ran on (render/cleanup.py).
    Returns those nodes. Best effort: a namespace being deleted refuses the Job, and that is logged."""
    meta = body["metadata"]
    if with_defaults(body["spec"])["sharedMemory"]["mode"] != "hostPath":
        return []
    pods = await api.list(path_for("v1", "Pod", meta["namespace"]), names.instance_selector(meta["name"]))
    nodes = {p["spec"]["nodeName"]: p["spec"]["containers"][0]["image"] for p in pods if p["spec"].get("nodeName")}
    for node, image in sorted(nodes.items()):
        job = render_shm_cleanup_job(body, settings, node, image)
        try:
            await api.create(path_for("batch/v1", "Job", meta["namespace"]), job)
        except ApiError as exc:
            if exc.status != 409:  # 409: a cleanup of this node is already under way
                log.warning("%s/%s: cannot clean %s on node %s: %s", meta["namespace"], meta["name"],
                            shm_host_dir(body, settings), node, exc)
    return sorted(nodes)
