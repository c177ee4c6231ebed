"""What the real API server (tests/kube_cluster.py) admits of a HybridInference, and the defaults it fills.

Dry-run creates with strict field validation, as `kubectl apply` sends them: the server applies the
CRD's defaults, checks the OpenAPI schema and evaluates every x-kubernetes-validations CEL rule.
"""
from __future__ import annotations

import copy
from typing import Any

NAMESPACE = "crd-checks"
PATH = f"/apis/hybrid.inference.dev/v1alpha1/namespaces/{NAMESPACE}/hybridinferences"


def ensure_namespace(kube) -> None:
    if kube.request("GET", f"/api/v1/namespaces/{NAMESPACE}").status_code == 404:
        kube.create_namespace(NAMESPACE)


def dry_run_create(kube, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    obj = copy.deepcopy(body)
    obj["metadata"] = {"name": body["metadata"]["name"], "namespace": NAMESPACE}  # uid/generation are server-set
    resp = kube.request("POST", PATH, json=obj, params={"dryRun": "All", "fieldValidation": "Strict"})
    return resp.status_code, resp.json()


def validate(kube, body: dict[str, Any]) -> list[str]:
    """[] when the server admits `body`; else its messages (the whole one, then one per cause)."""
    status, out = dry_run_create(kube, body)
    if status == 201:
        return []
    causes = (out.get("details") or {}).get("causes") or []
    return [out.get("message", str(out))] + [f"{c.get('field', '')}: {c.get('message', '')}" for c in causes]


def server_spec(kube, body: dict[str, Any]) -> dict[str, Any]:
    """The spec as stored: the CRD's defaults applied, unknown fields refused."""
    status, out = dry_run_create(kube, body)
    assert status == 201, out.get("message", out)
    return out["spec"]
