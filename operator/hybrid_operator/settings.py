"""Operator-wide settings, read once from the environment (set by the Helm chart)."""
from __future__ import annotations

import dataclasses
import os

GROUP = "hybrid.inference.dev"
VERSION = "v1alpha1"
PLURAL = "hybridinferences"
KIND = "HybridInference"
API_VERSION = f"{GROUP}/{VERSION}"
MANAGER = "hybrid-inference-operator"
MASTER_PORT = 29500  # torch rendezvous on stage 0; fixed so the NetworkPolicy can name it
SUPERVISOR_PORT = 29501  # stage heartbeat, stage 0 listens (runtime default master_port + 1)


@dataclasses.dataclass(frozen=True)
class Settings:
    gpu_image: str = "ghcr.io/hybrid-inference/runtime-gpu:0.1.0"
    cpu_image: str = "ghcr.io/hybrid-inference/runtime-cpu:0.1.0"
    cluster_domain: str = "cluster.local"
    # Host tmpfs under which each instance gets <ns>.<name>.<uid8>/replica-<i> (mode hostPath).
    shm_host_root: str = "/dev/shm/hybrid-inference"
    network_policy: bool = False
    status_interval_s: float = 15.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        d = cls()
        return cls(
            gpu_image=env.get("HYBRID_GPU_IMAGE", d.gpu_image),
            cpu_image=env.get("HYBRID_CPU_IMAGE", d.cpu_image),
            cluster_domain=env.get("HYBRID_CLUSTER_DOMAIN", d.cluster_domain),
            shm_host_root=env.get("HYBRID_SHM_HOST_ROOT", d.shm_host_root),
            network_policy=env.get("HYBRID_NETWORK_POLICY", "false").lower() in ("1", "true", "yes"),
            status_interval_s=float(env.get("HYBRID_STATUS_INTERVAL", d.status_interval_s)),
        )
