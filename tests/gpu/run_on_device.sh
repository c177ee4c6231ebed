#!/usr/bin/env bash
# On the GPU machine, after the three chunks are in /tmp/pack: install, then run the GPU tests.
# Usage: [MARK=gpu2] bash tests/gpu/run_on_device.sh [pytest -k expression] [another -k expression ...]
#   one expression: one pytest on all GPUs (gpu2: needs 2 GPUs, nvidia-h200-x2);
#   several: one pytest per expression at once, each on its own GPU and its own 7 cores (as many GPUs as expressions).
# $OUT gets pytest-<i>.log and gpu_results-<i>.json per shard, and the stage logs in stage-logs.tar.xz (few files:
# the device tool brings back at most 8).
set -uo pipefail
[ -d /tmp/vb/site-gpu ] || bash /tmp/pack/c3/vllm_bundle_install.sh /tmp/pack /tmp/vb || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/hyb ./runtime || exit 1  # --upgrade: replace an earlier call's copy
export HYBRID_GPU_PYTHONPATH=/tmp/hyb:/tmp/vb/site-gpu:/tmp/vb/deps
export HYBRID_CPU_PYTHONPATH=/tmp/hyb:/tmp/vb/site-cpu:/tmp/vb/deps
# kt-kernel where the lease carried it (unpacked to /tmp/kt: tests/gpu/README.md), as bench/run.sh
[ -d /tmp/kt/kt_kernel ] && HYBRID_CPU_PYTHONPATH+=:/tmp/kt
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/hybrid-gpu}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; lscpu | grep -i -m1 "numa node(s)"
exprs=("$@"); [ ${#exprs[@]} -gt 0 ] || exprs=("")
shards=${#exprs[@]} per=$(( $(nproc) / ${#exprs[@]} ))
for i in "${!exprs[@]}"; do
  (
    if [ "$shards" -gt 1 ]; then export CUDA_VISIBLE_DEVICES=$i; fi
    # core 0 of each share stays for the GPU stage's own threads
    export HYBRID_GPU_TEST_CPUS="$(( i * per + 1 ))-$(( i * per + 7 ))" HYBRID_GPU_OUT="$OUT/shard-$i"
    mkdir -p "$HYBRID_GPU_OUT"
    PYTHONPATH=/tmp/hyb:/tmp/vb/deps timeout ${TEST_TIMEOUT:-560} python3 -m pytest -p no:cacheprovider \
      -m "${MARK:-gpu and not gpu2}" tests/gpu -v ${exprs[$i]:+-k "${exprs[$i]}"} > "$OUT/pytest-$i.log" 2>&1
    echo "shard $i (${exprs[$i]}, cores $HYBRID_GPU_TEST_CPUS): exit $?" >> "$OUT/pytest-$i.log"
  ) &
done
wait
rc=0
for i in "${!exprs[@]}"; do
  tail -n 40 "$OUT/pytest-$i.log"
  tail -n 1 "$OUT/pytest-$i.log" | grep -q "exit 0$" || rc=1
  cp "$OUT/shard-$i/gpu_results.json" "$OUT/gpu_results-$i.json" 2>/dev/null && cat "$OUT/gpu_results-$i.json"
done
# each stage log's last 400 kB, in one archive
cd "$OUT" && for d in shard-*/*/; do for f in "$d"stage-*.log; do [ -f "$f" ] && tail -c 400000 "$f" > "$f.tail" && mv "$f.tail" "$f"; done; done
tar -cJf stage-logs.tar.xz shard-*/*/stage-*.log 2>/dev/null; rm -rf shard-*
exit $rc
