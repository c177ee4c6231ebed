"""Names and labels of the children of one HybridInference (one place, so every builder agrees)."""
from __future__ import annotations

from .settings import MANAGER

POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller (k8s >= 1.28)
INSTANCE_LABEL = "hybrid.inference.dev/instance"
STAGE_LABEL = "hybrid.inference.dev/stage"
STAGE_INDEX_LABEL = "hybrid.inference.dev/stage-index"
LAST_APPLIED = "hybrid.inference.dev/last-applied"
# On pods a group restart deletes: their own deletion is the restart, not a new failure.
GROUP_RESTART = "hybrid.inference.dev/group-restart"
PLAN_HASH = "hybrid.inference.dev/plan-hash"


def statefulset(instance: str, stage: str) -> str:
    return f"{instance}-{stage}"


def peers_service(instance: str) -> str:
    return f"{instance}-peers"


def client_service(instance: str) -> str:
    return instance


def plan_configmap(instance: str) -> str:
    return f"{instance}-plan"


def network_policy(instance: str) -> str:
    return f"{instance}-pipeline"


def instance_selector(instance: str) -> dict[str, str]:
    return {INSTANCE_LABEL: instance}


def stage_selector(instance: str, stage: str) -> dict[str, str]:
    return {INSTANCE_LABEL: instance, STAGE_LABEL: stage}


def labels(instance: str, stage: str | None = None, stage_index: int | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "hybrid-inference",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/managed-by": MANAGER,
        INSTANCE_LABEL: instance,
    }
    if stage is not None:
        out["app.kubernetes.io/component"] = "stage"
        out[STAGE_LABEL] = stage
        out[STAGE_INDEX_LABEL] = str(stage_index)
    return out


def selector_string(labels_: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels_.items()))
