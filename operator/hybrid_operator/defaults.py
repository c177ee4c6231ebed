"""The CRD's schema defaults, applied again here so render functions accept un-defaulted specs.

tests/operator/test_crd_schema.py checks these equal the defaults in crds/hybridinferences.yaml.
"""
from __future__ import annotations

import copy
from typing import Any

MODEL = {"dtype": "bfloat16", "maxModelLen": 4096, "loadFormat": "auto"}
SPEC = {"replicas": 1, "strategy": "pipeline"}
STAGE = {"tensorParallel": 1}
ENV_VAR = {"value": ""}
SHARED_MEMORY = {"mode": "hostPath"}
SERVING = {"port": 8000, "maxNumSeqs": 64, "blockSize": 128, "extraArgs": []}
IMAGES = {"pullPolicy": "IfNotPresent"}
MONITORING = {"port": 9100, "scrapeAnnotations": True}
SECRET_KEYS = {"tokenSecretRef": "token", "apiKeySecretRef": "api-key"}
VOLUME = {"readOnly": True}


def _fill(obj: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    for key, value in defaults.items():
        obj.setdefault(key, copy.deepcopy(value))
    return obj


def with_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """Return a deep copy of `spec` with every schema default filled in (like the apiserver does)."""
    spec = _fill(copy.deepcopy(spec), SPEC)
    model = _fill(spec.setdefault("model", {}), MODEL)
    if "volume" in model:
        _fill(model["volume"], VOLUME)
    if "tokenSecretRef" in model:
        _fill(model["tokenSecretRef"], {"key": SECRET_KEYS["tokenSecretRef"]})
    for stage in spec.setdefault("stages", []):
        _fill(stage, STAGE)
        for var in stage.get("env", []):
            _fill(var, ENV_VAR)
    _fill(spec.setdefault("sharedMemory", {}), SHARED_MEMORY)
    serving = _fill(spec.setdefault("serving", {}), SERVING)
    if "apiKeySecretRef" in serving:
        _fill(serving["apiKeySecretRef"], {"key": SECRET_KEYS["apiKeySecretRef"]})
    _fill(spec.setdefault("images", {}), IMAGES)
    _fill(spec.setdefault("monitoring", {}), MONITORING)
    return spec
