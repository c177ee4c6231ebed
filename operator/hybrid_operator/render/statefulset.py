"""One StatefulSet per stage; pod i of every stage is pipeline replica i."""
from __future__ import annotations

from typing import Any

from .. import names
from ..settings import Settings
from .common import child_metadata
from .pod import render_pod_template


def render_statefulset(body: dict[str, Any], index: int, settings: Settings, plan_digest: str) -> dict[str, Any]:
    """`body["spec"]` must already carry defaults (see defaults.with_defaults)."""
    spec, name = body["spec"], body["metadata"]["name"]
    stage = spec["stages"][index]["name"]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": child_metadata(body, names.statefulset(name, stage), names.labels(name, stage, index)),
        "spec": {
            "replicas": spec["replicas"],
            "serviceName": names.peers_service(name),
            # All pods of a replica must start together: the pipeline only forms when every stage is up.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": names.stage_selector(name, stage)},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": render_pod_template(body, index, settings, plan_digest),
        },
    }
