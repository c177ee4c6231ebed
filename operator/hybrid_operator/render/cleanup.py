"""The Job that removes a deleted instance's shared-memory directory from one node (mode hostPath).

The kubelet creates that directory for the pods (hostPath DirectoryOrCreate, a subPath per replica) and
never removes it; the pods cannot either (it is their mount point). Without this, every instance ever
deleted would leave a directory in the node's /dev/shm."""
from __future__ import annotations

import hashlib
from typing import Any

from .. import names
from ..settings import MANAGER, Settings
from .pod import shm_host_dir

HOST = "/host"


def render_shm_cleanup_job(body: dict[str, Any], settings: Settings, node: str, image: str) -> dict[str, Any]:
    meta = body["metadata"]
    parent, root = settings.shm_host_root.rstrip("/").rsplit("/", 1)
    instance_dir = shm_host_dir(body, settings).rsplit("/", 1)[1]
    # rm fails while a terminating pod still has its replica directory mounted: retry until it is unmounted;
    # then the operator's root too, once no instance uses it (rmdir leaves a non-empty one alone)
    script = (f"for i in $(seq 120); do rm -rf {HOST}/{root}/{instance_dir} && break; sleep 1; done; "
              f"rmdir {HOST}/{root} 2>/dev/null; test ! -e {HOST}/{root}/{instance_dir}")
    suffix = hashlib.sha256(node.encode()).hexdigest()[:8]
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": f"{meta['name'][:40]}-shm-cleanup-{suffix}", "namespace": meta["namespace"],
                     "labels": {"app.kubernetes.io/managed-by": MANAGER, names.INSTANCE_LABEL: meta["name"]}},
        "spec": {
            "backoffLimit": 6, "ttlSecondsAfterFinished": 0, "activeDeadlineSeconds": 600,
            "template": {"spec": {
                "nodeName": node,  # the node whose /dev/shm holds the directory, whatever its taints
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "tolerations": [{"operator": "Exists"}],
                "containers": [{
                    "name": "cleanup", "image": image, "command": ["sh", "-c", script],
                    "volumeMounts": [{"name": "shm", "mountPath": HOST}],
                    # no requests: the node may still be full with the instance's terminating pods, and
                    # the kubelet would refuse the pod (OutOfcpu) before they are gone
                    "resources": {"requests": {"cpu": "0", "memory": "0"},
                                  "limits": {"cpu": "100m", "memory": "32Mi"}},
                    # root only to remove what root (the kubelet) created; no capabilities needed for that
                    "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                                        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
                }],
                "volumes": [{"name": "shm", "hostPath": {"path": parent or "/", "type": "Directory"}}],
            }},
        },
    }
