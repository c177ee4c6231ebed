"""Headless peer Service (stable pod DNS for rendezvous) and the client Service (OpenAI API)."""
from __future__ import annotations

from typing import Any

from .. import names
from ..defaults import with_defaults
from ..settings import MASTER_PORT, SUPERVISOR_PORT
from .common import child_metadata


def _ports(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"name": "http", "port": spec["serving"]["port"], "targetPort": "http", "protocol": "TCP"},
        {"name": "metrics", "port": spec["monitoring"]["port"], "targetPort": "metrics", "protocol": "TCP"},
    ]


def render_peers_service(body: dict[str, Any]) -> dict[str, Any]:
    name, spec = body["metadata"]["name"], with_defaults(body["spec"])
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(body, names.peers_service(name)),
        "spec": {
            "clusterIP": "None",
            # Stages must resolve each other while still loading, long before any is Ready.
            "publishNotReadyAddresses": True,
            "selector": names.instance_selector(name),
            "ports": [{"name": "master", "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"},
                      {"name": "supervisor", "port": SUPERVISOR_PORT, "targetPort": SUPERVISOR_PORT,
                       "protocol": "TCP"},
                      *_ports(spec)],
        },
    }


def render_client_service(body: dict[str, Any]) -> dict[str, Any]:
    name, spec = body["metadata"]["name"], with_defaults(body["spec"])
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(body, names.client_service(name)),
        "spec": {
            "type": "ClusterIP",
            "selector": {**names.instance_selector(name), names.STAGE_INDEX_LABEL: "0"},
            "ports": _ports(spec)[:1],
        },
    }
