"""A pod's place in the pipeline: its stage and replica, and where its pipeline's master listens."""
from __future__ import annotations

from dataclasses import dataclass

from .plan import PlanError


@dataclass(frozen=True)
class Identity:
    stage: int
    replica: int
    master_addr: str
    host_ip: str | None


def identity_from_env(env: dict[str, str], stage: int | None = None, replica: int | None = None) -> Identity:
    """Pod identity: explicit arguments win, then HYBRID_* variables (set by the operator)."""
    def number(value, name):
        try:
            return int(value)
        except (TypeError, ValueError):
            raise PlanError(f"{name}: expected a stage/replica index, got {value!r}") from None

    if stage is None:
        if "HYBRID_STAGE" not in env:
            raise PlanError("stage: pass --stage N or set HYBRID_STAGE")
        stage = number(env["HYBRID_STAGE"], "HYBRID_STAGE")
    if replica is None:
        replica = number(env.get("HYBRID_REPLICA", "0"), "HYBRID_REPLICA")
    master = env.get("HYBRID_MASTER_ADDR", "127.0.0.1").replace("{replica}", str(replica))
    return Identity(stage, replica, master, env.get("HYBRID_HOST_IP") or None)
