#!/usr/bin/env bash
# On the GPU machine, after the three chunks are in /tmp/pack: install, then run the GPU tests.
# Usage: [MARK=gpu2] bash tests/gpu/run_on_device.sh [pytest -k expression]   (gpu2: needs 2 GPUs, nvidia-h200-x2)
set -uo pipefail
[ -d /tmp/vb/site-gpu ] || bash /tmp/pack/c3/vllm_bundle_install.sh /tmp/pack /tmp/vb || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/hyb ./runtime || exit 1  # --upgrade: replace an earlier call's copy
export HYBRID_GPU_PYTHONPATH=/tmp/hyb:/tmp/vb/site-gpu:/tmp/vb/deps
export HYBRID_CPU_PYTHONPATH=/tmp/hyb:/tmp/vb/site-cpu:/tmp/vb/deps
export HYBRID_GPU_OUT=${OUT:-/tmp/hybrid-gpu} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
PYTHONPATH=/tmp/hyb:/tmp/vb/deps timeout ${TEST_TIMEOUT:-560} python3 -m pytest -p no:cacheprovider -m "${MARK:-gpu and not gpu2}" tests/gpu -x -v ${1:+-k "$1"} 2>&1 | tee "$HYBRID_GPU_OUT/pytest.log"
rc=${PIPESTATUS[0]}
cat "$HYBRID_GPU_OUT/gpu_results.json" 2>/dev/null
# keep the stage logs small enough to come back
cd "$HYBRID_GPU_OUT" && for d in */; do tail -c 400000 "$d/stage-0.log" > "${d%/}-stage0.log" 2>/dev/null; tail -c 400000 "$d/stage-1.log" > "${d%/}-stage1.log" 2>/dev/null; rm -rf "$d"; done
exit $rc
