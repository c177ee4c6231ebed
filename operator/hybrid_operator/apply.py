"""Create-or-patch one child idempotently (client-side three-way merge, like `kubectl apply`)."""
from __future__ import annotations

import copy
import json
from typing import Any

from . import names
from .kube import AlreadyExists, KubeApi, object_path, path_for


def removal_patch(last: Any, desired: Any) -> Any:
    """JSON merge patch: all of `desired`, plus null for every key we set last time and no longer want."""
    if not isinstance(last, dict) or not isinstance(desired, dict):
        return copy.deepcopy(desired)
    out: dict[str, Any] = {key: None for key in last if key not in desired}
    for key, value in desired.items():
        out[key] = removal_patch(last.get(key), value)
    return out


def is_subset(desired: Any, actual: Any) -> bool:
    """True if every field we set is already there with our value (the server may add defaults)."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(k in actual and is_subset(v, actual[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(actual, list) and len(desired) == len(actual) and all(
            is_subset(d, a) for d, a in zip(desired, actual))
    return desired == actual


def with_last_applied(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"].setdefault("annotations", {})[names.LAST_APPLIED] = json.dumps(obj, sort_keys=True)
    return out


async def apply(api: KubeApi, obj: dict[str, Any]) -> str:
    """Returns 'created', 'patched' or 'unchanged'. Safe to call any number of times."""
    desired = with_last_applied(obj)
    path = object_path(obj)
    existing = await api.get(path)
    if existing is None:
        try:
            meta = obj["metadata"]
            await api.create(path_for(obj["apiVersion"], obj["kind"], meta.get("namespace")), desired)
            return "created"
        except AlreadyExists:  # raced with another writer (or our own earlier, interrupted run)
            existing = await api.get(path) or {}
    if is_subset(desired, existing):
        return "unchanged"
    raw_last = (existing.get("metadata", {}).get("annotations") or {}).get(names.LAST_APPLIED)
    last = json.loads(raw_last) if raw_last else {}
    await api.patch(path, removal_patch(last, desired))
    return "patched"
