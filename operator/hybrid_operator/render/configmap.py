"""ConfigMap <name>-plan with the runtime plan, mounted at /etc/hybrid/plan.yaml on every stage."""
from __future__ import annotations

from typing import Any

from .. import names
from ..plan import plan_yaml
from .common import child_metadata


def render_configmap(body: dict[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(body, names.plan_configmap(name)),
        "data": {"plan.yaml": plan_yaml(body["spec"])},
    }
