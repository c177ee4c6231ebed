"""What the GPU test files share: one gpu_results.json, each file's figures merged into what the others wrote (an
H200 call lost the Marlin test's figures when another file wrote its own alone), and a child process in vLLM's CUDA
build that prints its figures as its last line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OUT = Path(os.environ.get("HYBRID_GPU_OUT", "/tmp/hybrid-gpu"))


def record(figures: dict) -> None:
    """Merge figures (name -> result) into $HYBRID_GPU_OUT/gpu_results.json."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "gpu_results.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **figures}, indent=1))


def run_child(script: str, args: tuple[str, ...], **env: str) -> dict:
    """`python -c script args` on HYBRID_GPU_PYTHONPATH (plus env): the JSON of its last line of output."""
    path = os.environ.get("HYBRID_GPU_PYTHONPATH")
    if not path:
        pytest.fail("set HYBRID_GPU_PYTHONPATH (see tests/gpu/README.md)")
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": path, **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
