"""Group restart: a pipeline replica is one unit; if one of its pods dies, all of them restart. Pure."""
from __future__ import annotations

from typing import Any

from . import names
from .status import last_line, pod_index

BACKOFF_S, BACKOFF_MAX_S = 10, 300  # as the kubelet's CrashLoopBackOff: 10 s doubling to 5 min
EXIT_PEER_LOST = 75  # the runtime's exit code when another stage of its replica went away (supervise.py)


def failed_run(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The kubelet's record (`terminated`: exitCode, message, startedAt, finishedAt) of the pod's latest failed run."""
    return next((term for cs in pod.get("status", {}).get("containerStatuses", [])
                 for term in (cs.get("state", {}).get("terminated"), cs.get("lastState", {}).get("terminated"))
                 if term and term.get("exitCode", 0) != 0), None)


def last_failure(pod: dict[str, Any]) -> tuple[int, str, str] | None:
    """(exit code, last line of the termination message, when it ended) of the pod's latest failed run."""
    term = failed_run(pod)
    if term is None:
        return None
    code = term.get("exitCode")
    line = last_line(term) or f"exit code {code} ({term.get('reason', '')})"
    return code, line, term.get("finishedAt") or ""


def replica_peers(trigger: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The other pods of the trigger's replica (same instance, same pod index)."""
    def instance(pod):
        return (pod["metadata"].get("labels") or {}).get(names.INSTANCE_LABEL)
    return [p for p in pods if instance(p) == instance(trigger) and pod_index(p) == pod_index(trigger)
            and p["metadata"]["name"] != trigger["metadata"]["name"]]


def termination_line(pod: dict[str, Any]) -> str | None:
    """The stage's own last words: its container's termination message (the launcher's one-line cause, or
    the log tail the kubelet keeps under FallbackToLogsOnError), last line, with the exit code or reason."""
    failure = last_failure(pod)
    return failure[1] if failure else None


def replica_cause(trigger: dict[str, Any], pods: list[dict[str, Any]]) -> tuple[int, str] | None:
    """(exit code, line): why replica i failed: a stage's own error rather than another stage's "peer lost"
    that followed it."""
    failures = [f for f in map(last_failure, [trigger, *replica_peers(trigger, pods)]) if f]
    # the stage that failed first (RFC 3339 seconds sort as text; ties: the trigger): the others followed it
    own = sorted((f for f in failures if f[0] != EXIT_PEER_LOST), key=lambda f: f[2] or "~")
    return next(((code, line) for code, line, _ in own + failures), None)


def improves(entry: dict[str, Any] | None, code: int) -> bool:
    """Whether a failure with this exit code says more than the recorded one: a stage's own error beats a
    follower's "peer lost" (a group restart's victim can end with its own cause after the restart was recorded)."""
    return entry is not None and (code != EXIT_PEER_LOST or entry.get("exitCode", EXIT_PEER_LOST) == EXIT_PEER_LOST)


def restart_reason(pod: dict[str, Any]) -> str | None:
    """Why this pod's replica must re-form, or None. Pods that never ran (admission errors) don't count."""
    if pod["metadata"].get("deletionTimestamp"):
        return None
    status, name = pod.get("status", {}), pod["metadata"]["name"]
    why = termination_line(pod)
    for cs in status.get("containerStatuses", []):
        if cs.get("restartCount", 0) > 0:
            return f"container {cs.get('name')} of pod {name} restarted" + (f": {why}" if why else "")
    if status.get("phase") == "Failed" and status.get("containerStatuses"):
        return f"pod {name} failed" + (f": {why}" if why else "")
    return None


def backoff_s(restarts: int) -> float:
    """Wait after a replica's n-th failure-driven group restart before the next one."""
    return min(BACKOFF_S * 2 ** max(restarts - 1, 0), BACKOFF_MAX_S)


def retold(failures: list[dict[str, Any]], entry: dict[str, Any], code: int, line: str,
           **fields: Any) -> list[dict[str, Any]]:
    """status.failures with `entry`'s cause replaced (the same failure, better told: its count stays)."""
    return [dict(f, exitCode=code, message=line[:1000], **fields) if f is entry else f for f in failures]


def failure_of(failures: list[dict[str, Any]], replica: int) -> dict[str, Any] | None:
    return next((f for f in failures if f.get("replica") == replica), None)


def record_failure(failures: list[dict[str, Any]], replica: int, pod: str, message: str, now: str,
                   generation: int | None, code: int | None = None) -> list[dict[str, Any]]:
    """status.failures after a failure-driven group restart of `replica` (cleared once it is ready);
    a changed spec (generation) starts the count again."""
    last = failure_of(failures, replica)
    count = last["restarts"] if last and last.get("generation") == generation else 0
    entry = {"replica": replica, "restarts": count + 1, "pod": pod, "message": message[:1000],
             "lastRestart": now, "generation": generation}
    if code is not None:
        entry["exitCode"] = code
    return sorted([f for f in failures if f.get("replica") != replica] + [entry], key=lambda f: f["replica"])


def failed_at(pod: dict[str, Any]) -> str | None:
    """When the pod's last container failure ended (RFC 3339, second resolution), if the kubelet said."""
    ends = [t.get("finishedAt") for cs in pod.get("status", {}).get("containerStatuses", [])
            for t in (cs.get("lastState", {}).get("terminated", {}), cs.get("state", {}).get("terminated", {}))]
    return max((e for e in ends if e), default=None)


def follows_a_restart(trigger: dict[str, Any], pods: list[dict[str, Any]]) -> bool:
    """Whether the trigger's failure is a follower's "peer lost" of a group that is already re-forming: every
    other live pod of its replica was created after that run started, so the stage it lost is already gone and
    replaced. A replacement that joined the old group's stopping stage 0 ends so; deleting the new pods for it
    started the cycle again (the real-node test's group re-formed three times in 90 s). The kubelet's restart of
    its container joins the new group."""
    failed = failed_run(trigger)
    if not failed or failed.get("exitCode") != EXIT_PEER_LOST or not failed.get("startedAt"):
        return False
    peers = [p for p in replica_peers(trigger, pods) if not p["metadata"].get("deletionTimestamp")]
    # RFC 3339 seconds sort as text; a peer created in the run's first second may be the one it lost: not newer
    return all((p["metadata"].get("creationTimestamp") or "") > failed["startedAt"] for p in peers)


def victims(event_type: str | None, trigger: dict[str, Any], pods: list[dict[str, Any]], replicas: int,
            stage_count: int) -> tuple[list[str], str | None]:
    """Names of pods to delete so replica i re-forms, and the reason (for the Event)."""
    if stage_count < 2:
        return [], None  # nothing to re-form: the kubelet restart alone is enough
    index = pod_index(trigger)
    if index is None or index >= replicas:
        return [], None  # scale-down removes that replica anyway
    if event_type == "DELETED":
        if names.GROUP_RESTART in (trigger["metadata"].get("annotations") or {}):
            return [], None  # a pod an earlier group restart removed: its replacements are the new group
        reason, cutoff = f"pod {trigger['metadata']['name']} was deleted", None
    else:
        reason, cutoff = restart_reason(trigger), failed_at(trigger)
        if reason and follows_a_restart(trigger, pods):
            return [], None
    if reason is None:
        return [], None
    instance = trigger["metadata"].get("labels", {}).get(names.INSTANCE_LABEL)
    out = []
    for pod in pods:
        meta = pod["metadata"]
        if meta.get("labels", {}).get(names.INSTANCE_LABEL) != instance or pod_index(pod) != index:
            continue
        if meta.get("deletionTimestamp"):
            continue
        if event_type == "DELETED" and meta["name"] == trigger["metadata"]["name"]:
            continue  # the replacement of the deleted pod itself
        # Pods created after the failure are already its replacements (a late or repeated event).
        if cutoff is None or (meta.get("creationTimestamp") or "") <= cutoff:
            out.append(meta["name"])
    return sorted(out), reason
