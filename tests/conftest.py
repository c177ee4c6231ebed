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


def pytest_collection_modifyitems(config, items):
    """Tests marked vllm_cpu_avx512 run single-process vLLM on CPU with a kernel only its AVX512 build has: on an
    AVX2-only CPU they cannot run at all (vLLM itself refuses the model), so they are deselected, and the summary
    says so; what our code does there instead (a refusal by name, kt-kernel for W4A16) is tested on every CPU."""
    gone = [item for item in items if item.get_closest_marker("vllm_cpu_avx512")]
    if not gone:
        return
    from cpu_servers import PACKED_KERNELS_HERE  # torch: only where such tests were collected
    if PACKED_KERNELS_HERE:
        return
    config.hook.pytest_deselected(items=gone)
    items[:] = [item for item in items if item not in gone]
    config.stash[AVX2_DESELECTED] = [item.nodeid for item in gone]


AVX2_DESELECTED = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if gone := config.stash.get(AVX2_DESELECTED, None):
        terminalreporter.write_line(f"vllm_cpu_avx512: {len(gone)} test(s) deselected: this CPU has neither AMX nor "
                                    "AVX512-BF16, and vLLM's AVX2 build cannot run them: " + ", ".join(gone),
                                    yellow=True)
