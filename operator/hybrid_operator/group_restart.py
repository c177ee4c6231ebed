"""Group restart: a pipeline replica is one unit; if one of its pods dies, all of them restart. Pure."""
from __future__ import annotations

from typing import Any

from . import names
from .status import pod_index


def restart_reason(pod: dict[str, Any]) -> str | None:
    """Why this pod's replica must re-form, or None. Pods that never ran (admission errors) don't count."""
    if pod["metadata"].get("deletionTimestamp"):
        return None
    status = pod.get("status", {})
    for cs in status.get("containerStatuses", []):
        if cs.get("restartCount", 0) > 0:
            return f"container {cs.get('name')} of pod {pod['metadata']['name']} restarted"
    if status.get("phase") == "Failed" and status.get("containerStatuses"):
        return f"pod {pod['metadata']['name']} failed"
    return None


def failed_at(pod: dict[str, Any]) -> str | None:
    """When the pod's last container failure ended (RFC 3339, second resolution), if the kubelet said."""
    ends = [t.get("finishedAt") for cs in pod.get("status", {}).get("containerStatuses", [])
            for t in (cs.get("lastState", {}).get("terminated", {}), cs.get("state", {}).get("terminated", {}))]
    return max((e for e in ends if e), default=None)


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
