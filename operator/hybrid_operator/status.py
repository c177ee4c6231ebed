"""Children's state -> HybridInference status (phase, per-stage counts, conditions). Pure."""
from __future__ import annotations

from typing import Any

from . import names
from .defaults import with_defaults
from .plan import layer_ranges, stages_summary
from .settings import Settings
from .strategy import running_stages

# Pod failures the kubelet/scheduler report that a user must act on (reason -> shown as is).
ADMISSION_FAILURES = {"TopologyAffinityError", "UnexpectedAdmissionError", "OutOfcpu", "OutOfmemory",
                      "OutOfnvidia.com/gpu", "NodeAffinity", "Evicted"}
WAITING_FAILURES = {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
                    "InvalidImageName", "CreateContainerError"}


def pod_problem(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, message) when a pod is stuck in a way that needs a human, else None."""
    name, status = pod["metadata"]["name"], pod.get("status", {})
    if status.get("phase") == "Failed" and status.get("reason") in ADMISSION_FAILURES:
        return status["reason"], f"pod {name}: {status.get('message', status['reason'])}"
    for cond in status.get("conditions", []):
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            return "Unschedulable", f"pod {name}: {cond.get('message', 'unschedulable')}"
    for cs in status.get("initContainerStatuses", []) + status.get("containerStatuses", []):
        waiting = cs.get("state", {}).get("waiting", {})
        if cs.get("lastState", {}).get("terminated", {}).get("reason") == "OOMKilled":
            return "OOMKilled", f"pod {name}: container {cs.get('name')} was OOM-killed"
        if waiting.get("reason") in WAITING_FAILURES:
            kubelet = waiting.get("message", waiting["reason"])
            # a one-stage replica restarts in place (no group restart records its cause): its own words come first
            # where its own exit is what it waits on (an image pull's wait is not about the last run)
            said = waiting["reason"] == "CrashLoopBackOff" and last_line(cs.get("lastState", {}).get("terminated") or {})
            return waiting["reason"], f"pod {name}: {said} ({kubelet})" if said else f"pod {name}: {kubelet}"
    return None


def last_line(terminated: dict[str, Any]) -> str | None:
    """The last line of a finished run's termination message: the launcher's one-line cause (or the log tail the
    kubelet keeps under FallbackToLogsOnError)."""
    lines = [ln.strip() for ln in (terminated.get("message") or "").splitlines() if ln.strip()]
    return lines[-1][-400:] if lines else None


def _event_time(event: dict[str, Any]) -> str:
    """Seconds-resolution UTC time of an event's latest occurrence (core/v1 or events/v1 writers)."""
    stamp = ((event.get("series") or {}).get("lastObservedTime") or event.get("lastTimestamp")
             or event.get("eventTime") or event.get("firstTimestamp") or "")
    return stamp[:19]


def short_of_pods(sts: dict[str, Any]) -> bool:
    """The StatefulSet controller has created fewer pods than the StatefulSet asks for."""
    return (sts.get("status") or {}).get("replicas", 0) < (sts.get("spec") or {}).get("replicas", 0)


def creation_failures(statefulsets: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """("FailedCreate", controller's message) for each StatefulSet short of pods whose last create failed.

    Admission refusals of pods (Pod Security, ResourceQuota, LimitRange, webhooks) leave no pod to
    look at: the StatefulSet controller reports them only as events on the StatefulSet."""
    out = []
    for sts in statefulsets:
        meta = sts["metadata"]
        if not short_of_pods(sts):
            continue
        mine = [e for e in events if e.get("involvedObject", {}).get("name") == meta["name"]
                and e.get("involvedObject", {}).get("uid") in (None, meta.get("uid"))]
        failed = max((e for e in mine if e.get("reason") == "FailedCreate"), key=_event_time, default=None)
        created = max((_event_time(e) for e in mine if e.get("reason") == "SuccessfulCreate"), default="")
        if failed is not None and _event_time(failed) >= created:
            out.append(("FailedCreate", f"statefulset {meta['name']}: {failed.get('message', 'FailedCreate')}"))
    return out


def pod_ready(pod: dict[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conds = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def pod_index(pod: dict[str, Any]) -> int | None:
    label = pod["metadata"].get("labels", {}).get(names.POD_INDEX_LABEL)
    suffix = pod["metadata"]["name"].rsplit("-", 1)[-1]
    raw = label if label is not None else suffix
    return int(raw) if raw.isdigit() else None


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int | None,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = previous.get(ctype)
    # lastTransitionTime only moves when the status flips (Kubernetes condition convention).
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    cond = {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _rolling_out(sts: dict[str, Any] | None, wanted: int) -> bool:
    if sts is None:
        return True
    st, gen = sts.get("status", {}), sts.get("metadata", {}).get("generation")
    if gen is not None and st.get("observedGeneration", gen) < gen:
        return True
    if st.get("updateRevision") and st.get("currentRevision") != st.get("updateRevision"):
        return True
    return st.get("replicas", 0) != wanted


def compute_status(body: dict[str, Any], statefulsets: list[dict[str, Any]], pods: list[dict[str, Any]],
                   now: str, settings: Settings | None = None,
                   events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    settings = settings or Settings()
    meta, spec = body["metadata"], with_defaults(body["spec"])
    name, ns, generation = meta["name"], meta["namespace"], meta.get("generation")
    # Only the stages that get pods (offload leaves cpu stages out): a replica is ready without them.
    wanted, stages = spec["replicas"], [spec["stages"][i] for i in running_stages(spec)]
    by_name = {s["metadata"]["name"]: s for s in statefulsets}
    ranges = layer_ranges(spec)

    stage_status, ready_by_stage = [], []
    for i, stage in enumerate(stages):
        sts = by_name.get(names.statefulset(name, stage["name"]))
        st = (sts or {}).get("status", {})
        stage_pods = [p for p in pods if p["metadata"].get("labels", {}).get(names.STAGE_LABEL) == stage["name"]]
        ready_by_stage.append({pod_index(p) for p in stage_pods if pod_ready(p)})
        stage_status.append({"name": stage["name"], "device": stage["device"], "replicas": st.get("replicas", 0),
                             "readyReplicas": st.get("readyReplicas", 0), "layers": ranges[i]})

    # A pipeline replica is ready only when pod i of every stage is ready.
    ready_replicas = {i for i in range(wanted) if all(i in r for r in ready_by_stage)} if stages else set()
    ready = len(ready_replicas)
    # failure-driven group restarts (reconcile.handle_pod_event): forgotten once the replica serves again
    failures = [f for f in body.get("status", {}).get("failures", [])
                if f.get("replica") not in ready_replicas and f.get("replica", 0) < wanted]
    current = min((s["replicas"] for s in stage_status), default=0)
    # Refused pod creations first: nothing else can progress until they are fixed.
    problems = creation_failures(sorted(statefulsets, key=lambda s: s["metadata"]["name"]), events or []) + [
        p for p in (pod_problem(pod) for pod in sorted(pods, key=lambda p: p["metadata"]["name"])) if p]
    # a stage that failed again after its group restart: what it said, before the kubelet's own view
    problems[:0] = [("StageFailing", f"replica {f['replica']}: pod {f['pod']} failed {f['restarts']} times, "
                                     f"restarting with backoff; last error: {f['message']}")
                    for f in failures if f.get("restarts", 0) >= 2]
    rolling = any(_rolling_out(by_name.get(names.statefulset(name, s["name"])), wanted) for s in stages)

    previous = {c["type"]: c for c in body.get("status", {}).get("conditions", [])}
    if wanted == 0:
        ready_cond = (False, "ScaledToZero", "spec.replicas is 0")
    elif ready == wanted:
        ready_cond = (True, "AllReplicasReady", f"{ready}/{wanted} pipeline replicas ready")
    else:
        ready_cond = (False, "ReplicasNotReady", f"{ready}/{wanted} pipeline replicas ready")
    if rolling:
        progressing = (True, "RollingOut", "StatefulSets are being created or updated")
    elif ready < wanted and not problems:
        progressing = (True, "WaitingForPods", "pods are starting (loading weights can take long)")
    else:
        progressing = (False, "Stable", "nothing in progress")
    if problems:
        degraded = (True, problems[0][0], "; ".join(m for _, m in problems[:3]))
    else:
        degraded = (False, "AsExpected", "no pod problems found")

    if wanted == 0:
        phase = "Stopped"
    elif problems:
        phase = "Degraded"
    elif ready == wanted and not rolling:
        phase = "Ready"
    else:
        phase = "Progressing"
    port = spec["serving"]["port"]
    return {
        "phase": phase,
        "observedGeneration": generation,
        "replicas": current,
        "readyReplicas": ready,
        "ready": f"{ready}/{wanted}",
        "selector": names.selector_string({**names.instance_selector(name), names.STAGE_INDEX_LABEL: "0"}),
        "endpoint": f"http://{names.client_service(name)}.{ns}.svc:{port}/v1",
        "stagesSummary": stages_summary(spec),
        "stages": stage_status,
        "failures": failures,
        "conditions": [
            _condition("Ready", *ready_cond, generation, previous, now),
            _condition("Progressing", *progressing, generation, previous, now),
            _condition("Degraded", *degraded, generation, previous, now),
        ],
    }
