#!/usr/bin/env bash
# `make bench` on the GPU machine (after the vLLM bundle is in /tmp/pack, see tests/gpu/README.md):
#   bash bench/run.sh [CONFIG ...]   CONFIG: a-all-gpu b-offload c-cpu-first d-balanced (the default),
#   b-offload-uva, b-prefetch-plain, e-coproc, e-coproc-huge (strategy coprocessor, 4 KiB / 2 MiB pages), e-coproc-untuned (its split not tuned on timed passes), e-coproc-torch (its server on torch's GEMM, not the packed sgl one), e-coproc-passive (its server's threads asleep between calls), e-auto (the stages measure the node at start and resolve auto on it),
#   c-gpu-first, d-balanced-gpu-first, c-cpu-first-2batches, b-offload-plain (plain `vllm serve
#   --cpu-offload-gb`, no vllm-hybrid). One device call holds about two configurations (10 minutes).
#   HYBRID_BENCH_MODEL=llama-3.1-8b-int8: the same 8B shape as a W8A8 INT8 checkpoint (e-coproc's cpu pod on int8
#   weights, b-offload streaming them; its own HYBRID_BENCH_OUT beside the bf16 run's).
#   Larger than the GPU: HYBRID_BENCH_MODEL=llama-3.1-70b|mixtral-8x7b|qwen2-57b-a14b|qwen3-235b-a22b-w4a16|
#   mixtral-8x7b-w4a16|gpt-oss-120b with p-pipeline p-offload p-balanced p-coproc p-experts p-experts-sgl p-experts-grouped p-experts-kt p-experts-passive p-experts-rows (the pod's step limit from the node's measured MoE call, as under auto)
#   p-auto p-prefetch-plain (split by the planner from this box's memories); at about a second a step use
#   HYBRID_BENCH_CONCURRENCY=1,4,16 HYBRID_BENCH_PROMPT_TOKENS=32 HYBRID_BENCH_OUTPUT_TOKENS=16
#   HYBRID_BENCH_TTFT=1024 HYBRID_BENCH_BATCHED_TOKENS=512 (bench/results/README.md): about 5 minutes each.
#   HYBRID_BENCH_GPU_GIB=24: every configuration within 24 GiB of the GPU (a 4090-class budget on a larger card).
#   HYBRID_EXPERTS_UVA_SHARE=0 (or 1:0.5,4:0.4): p-experts* without the GPU's in-place share of the pod's experts, or
#   with these shares instead of the launcher's (with HYBRID_BENCH_NODE_FIGURES=<the first run's gpu_bench.json> for an
#   A/B on the same figures; bench/results/README.md).
# Results: $HYBRID_BENCH_OUT (default bench/results): cpu_kernels.json, gpu_bench.json, .md, .png.
#   bash bench/run.sh cpu-kernels: only bench/cpu_kernels.py (minutes on a 16-core box), in a call of its own where a
#   configuration needs most of a call (the 235B's p-auto); later calls on the same machine find it measured.
set -uo pipefail
[ -d /tmp/vb/site-gpu ] || bash /tmp/pack/c3/vllm_bundle_install.sh /tmp/pack /tmp/vb || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/hyb ./runtime || exit 1  # this checkout's runtime, every call
export HYBRID_GPU_PYTHONPATH=/tmp/hyb:/tmp/vb/site-gpu:/tmp/vb/deps HYBRID_CPU_PYTHONPATH=/tmp/hyb:/tmp/vb/site-cpu:/tmp/vb/deps
# kt-kernel where the lease carried it (unpacked to /tmp/kt: tests/gpu/README.md): the expert server's second W4A16 kernel
[ -d /tmp/kt/kt_kernel ] && HYBRID_CPU_PYTHONPATH+=:/tmp/kt
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HYBRID_BENCH_OUT=${HYBRID_BENCH_OUT:-bench/results}
mkdir -p "$HYBRID_BENCH_OUT"
# what the CPU stage's GEMMs reach on this box, and which kernel/placement every configuration's CPU stage then uses
# (measured once per machine: a file measured on another box, a committed one included, is measured again); not for
# p-experts*, p-offload and p-prefetch-plain alone: the expert server times its own kernels at start, offloading
# computes nothing on the CPU, and 2 of a 10-minute call's minutes go to it
measure=$(( $# == 0 ))
for config in "$@"; do case $config in p-experts*|p-offload|p-prefetch-plain) ;; *) measure=1 ;; esac; done
if [ "$measure" = 1 ]; then
  # only the batches gpu_bench.cpu_tuning scores (TUNING_MS): all 13 took 4 minutes of a 16-core box's call
  PYTHONPATH=/tmp/hyb:/tmp/vb/site-cpu:/tmp/vb/deps CUDA_VISIBLE_DEVICES= HYBRID_BENCH_MS=${HYBRID_BENCH_MS:-1,4,16,64} \
    VLLM_TARGET_DEVICE=cpu python3 bench/cpu_kernels.py "$HYBRID_BENCH_OUT/cpu_kernels.json" || exit 1
fi
[ "$*" = cpu-kernels ] && exit 0
PYTHONPATH=/tmp/hyb:/tmp/vb/deps:/tmp/vb/site-gpu python3 bench/gpu_bench.py "$@" & bench=$!
# a timeout's SIGTERM (or ^C) reaches the bench, which stops its vLLM stages (they hold the GPU otherwise)
trap 'kill -TERM $bench 2>/dev/null; wait $bench; exit 143' TERM INT
wait $bench
PYTHONPATH=/tmp/hyb python3 bench/report.py "$HYBRID_BENCH_OUT/gpu_bench.json"
