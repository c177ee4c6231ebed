"""core/v1 Events about a HybridInference (what `kubectl describe hi` shows)."""
from __future__ import annotations

import uuid
from typing import Any

from .settings import API_VERSION, KIND, MANAGER


def build_event(body: dict[str, Any], type_: str, reason: str, message: str, now: str) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid")},
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
        "source": {"component": MANAGER},
        "reportingComponent": MANAGER,
    }
