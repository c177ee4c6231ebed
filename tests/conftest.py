import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for pkg in ("runtime", "operator"):
    sys.path.insert(0, str(ROOT / pkg))
sys.path.insert(0, str(ROOT / "tests"))
from no_skips import unavailable  # noqa: E402 - tests/ is on the path from here

pytest_plugins = ("no_skips",)  # a skipped test fails the run (HYBRID_ALLOW_SKIP=1 allows it)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture(scope="session")
def kube(tmp_path_factory):
    """The real control plane (tests/kube_cluster.py), started once per session (~15 s)."""
    import kube_cluster

    if reason := kube_cluster.unavailable_reason():  # ../shared/kube sits beside every checkout CI makes
        unavailable(reason)
    cluster = kube_cluster.start(tmp_path_factory.mktemp("kube"))
    yield cluster
    cluster.down()


@pytest.fixture(scope="session")
def chart(kube):
    """`helm install` of the chart, as the user guide says; the CRD is Established when this returns."""
    import time

    t0 = time.monotonic()
    out = kube.helm("install", "hybrid-inference", str(ROOT / "charts" / "hybrid-inference"),
                    "--namespace", "hybrid-system", "--create-namespace", "--wait", "--timeout", "120s").stdout
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/hybridinferences.hybrid.inference.dev")
    return {"seconds": time.monotonic() - t0, "output": out, "release": "hybrid-inference",
            "namespace": "hybrid-system"}
