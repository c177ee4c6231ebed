"""Metadata shared by every child: namespace, labels, controller owner reference."""
from __future__ import annotations

from typing import Any

from .. import names
from ..settings import API_VERSION, KIND


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    # controller=true lets `kubectl get -o wide`/GC treat us as the owner; deletion cascades.
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def child_metadata(body: dict[str, Any], name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": labels or names.labels(meta["name"]),
        "ownerReferences": [owner_reference(body)],
    }
