"""Runs the real `helm` binary from .venv/bin (installed by `make setup`)."""
from __future__ import annotations

import subprocess
from typing import Any

import yaml
from hi_fixtures import BIN, CHART


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "helm"), *args], capture_output=True, text=True, timeout=120, check=False)


def helm_template(*values: str) -> list[dict[str, Any]]:
    args = ["template", "hi", str(CHART), "--namespace", "hybrid-system", *values]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]
