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


def victims(event_type: str | None, trigger: dict[str, Any], pods: list[dict[str, Any]], replicas: int,
            stage_count: int) -> tuple[list[str], str | None]:
    """Names of pods to delete so replica i re-forms, and the reason (for the Event)."""
    if stage_count < 2:
        return [], None  # nothing to re-form: the kubelet restart alone is enough
    index = pod_index(trigger)
    if index is None or index >= replicas:
        return [], None  # scale-down removes that replica anyway
    if event_type == "DELETED":
        reason = f"pod {trigger['metadata']['name']} was deleted"
    else:
        reason = restart_reason(trigger)
    if reason is None:
        return [], None
    born = trigger["metadata"].get("creationTimestamp") or ""
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
        # Only pods of the same generation or older: replacements made after the trigger are left alone,
        # so one failure causes exactly one group restart.
        if (meta.get("creationTimestamp") or "") <= born:
            out.append(meta["name"])
    return sorted(out), reason
