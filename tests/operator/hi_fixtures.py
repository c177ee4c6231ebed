"""Shared builders (imported by tests; not a conftest so names stay importable) for operator tests: HybridInference bodies in every shape the tests need."""
from __future__ import annotations

import copy
import pathlib
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "hybridinferences.yaml"
CHART = ROOT / "charts" / "hybrid-inference"
BIN = ROOT / ".venv" / "bin"

GPU = {"name": "gpu", "device": "gpu", "gpus": 1}
CPU = {"name": "cpu", "device": "cpu", "cpus": 16, "memory": "64Gi"}


def stages(n: int, tp: int = 1, layers: bool = False) -> list[dict[str, Any]]:
    """n stages: one GPU stage first, then CPU stages (cpu, cpu2, ...)."""
    out = [dict(GPU, gpus=tp, tensorParallel=tp)]
    for i in range(1, n):
        out.append(dict(CPU, name="cpu" if i == 1 else f"cpu{i}", tensorParallel=tp))
    if layers:
        for s in out:
            s["layers"] = 8
    return out


def make_body(name: str = "llama", namespace: str = "ml", **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"path": "llama-3.1-8b", "volume": {"claimName": "models"}},
        "replicas": 1,
        "stages": stages(2),
    }
    spec.update(copy.deepcopy(spec_overrides))
    return {"apiVersion": "hybrid.inference.dev/v1alpha1", "kind": "HybridInference",
            "metadata": {"name": name, "namespace": namespace, "uid": "0123456789abcdef-uid", "generation": 1},
            "spec": spec}
