"""Every child object of one HybridInference, in apply order."""
from __future__ import annotations

import copy
from typing import Any

from ..defaults import with_defaults
from ..plan import plan_hash
from ..settings import Settings
from ..strategy import running_stages
from .configmap import render_configmap
from .networkpolicy import render_network_policy
from .services import render_client_service, render_peers_service
from .statefulset import render_statefulset


def render_children(body: dict[str, Any], settings: Settings | None = None) -> list[dict[str, Any]]:
    settings = settings or Settings()
    body = copy.deepcopy(body)
    body["spec"] = with_defaults(body["spec"])
    digest = plan_hash(body["spec"])
    children = [render_configmap(body), render_peers_service(body), render_client_service(body)]
    if settings.network_policy:
        children.append(render_network_policy(body))
    # offload: cpu stages get no pods; their layers live in a gpu pod (reconcile deletes a left-over StatefulSet).
    children += [render_statefulset(body, i, settings, digest) for i in running_stages(body["spec"])]
    return children
