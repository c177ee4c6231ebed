"""Operator metrics (prometheus-client), served on the port the chart configures."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

REGISTRY = CollectorRegistry()
RECONCILES = Counter("hybrid_operator_reconciles_total", "Reconciles by result.", ["result"], registry=REGISTRY)
CHILD_WRITES = Counter("hybrid_operator_child_writes_total", "Child objects created/patched.",
                       ["kind", "action"], registry=REGISTRY)
ERRORS = Counter("hybrid_operator_errors_total", "Handler errors by handler.", ["handler"], registry=REGISTRY)
GROUP_RESTARTS = Counter("hybrid_operator_group_restarts_total", "Pipeline replicas restarted as a group.",
                         registry=REGISTRY)
INSTANCES = Gauge("hybrid_operator_instances", "HybridInference objects by phase.", ["phase"], registry=REGISTRY)
PHASES = ("Progressing", "Ready", "Degraded", "Stopped")
# Every known label value exists from the start at 0, so rate()/increase() (dashboards, the
# reconcile-errors alert) see the first error instead of a series that is born at 1.
for _result in ("ok", "error"):
    RECONCILES.labels(result=_result)
for _handler in ("reconcile", "resync", "group-restart"):
    ERRORS.labels(handler=_handler)

_phase_of: dict[tuple[str, str], str] = {}


def set_phase(namespace: str, name: str, phase: str | None) -> None:
    """Record one instance's phase (None: deleted) and refresh the per-phase gauge."""
    if phase is None:
        _phase_of.pop((namespace, name), None)
    else:
        _phase_of[(namespace, name)] = phase
    for p in set(PHASES) | set(_phase_of.values()):
        INSTANCES.labels(phase=p).set(sum(1 for v in _phase_of.values() if v == p))


def serve(port: int) -> None:
    start_http_server(port, registry=REGISTRY)
