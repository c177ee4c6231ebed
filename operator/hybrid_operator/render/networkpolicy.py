"""Optional NetworkPolicy: only the instance's own pods reach the inter-stage ports."""
from __future__ import annotations

from typing import Any

from .. import names
from ..defaults import with_defaults
from .common import child_metadata


def render_network_policy(body: dict[str, Any]) -> dict[str, Any]:
    name, spec = body["metadata"]["name"], with_defaults(body["spec"])
    own_pods = {"podSelector": {"matchLabels": names.instance_selector(name)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(body, names.network_policy(name)),
        "spec": {
            "podSelector": {"matchLabels": names.instance_selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [own_pods]},  # any port, incl. rendezvous and torch's ephemeral ports
                {"ports": [{"protocol": "TCP", "port": spec["serving"]["port"]},
                           {"protocol": "TCP", "port": spec["monitoring"]["port"]}]},
            ],
        },
    }
