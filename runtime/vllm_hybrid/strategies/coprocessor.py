"""coprocessor: GPU stages compute every layer, streaming the CPU stages' layers with vLLM's prefetch
offloader from a region each CPU stage owns (one copy); for decode-sized steps every product of those
layers is split row-wise with the CPU stage, which computes its rows from the same memory (coproc.py, run
instead of vLLM on the CPU stage). Prompt chunks stream whole layers: attention and KV stay on the GPU."""
from __future__ import annotations

from ..cpubind import CpuBinding
from ..plan import Plan
from ..planner import Split
from .base import SHARED_SHM, Layout, Server, StageExtras, Strategy, shm_socket, streaming_gpu
from .cost import NO_COST, Hardware, StageCost, Workload
from .offload import OFFLOADERS, prefetch_cost, prefetch_flags, streamed_layout

# vLLM's prefetch offloader two layers ahead (the CPU's and the copy's times per layer vary by product)
COPROC_PREFETCH_STEP = 2


def coproc_socket(env: dict[str, str], replica: int, cpu_stage: int) -> str:
    """Where cpu stage `cpu_stage`'s product server listens: the replica's shared /dev/shm."""
    return shm_socket(env, replica, cpu_stage, "coproc")


WAIT_ENV = "HYBRID_SERVER_WAIT"  # the stage's env may override how the server's threads wait: spin | passive
WAITS = ("spin", "passive")


def server_env(binding: CpuBinding, base: dict[str, str], stage: int, name: str) -> dict[str, str]:
    """Its torch threads one per core of the stage's binding (libgomp places thread i on the i-th CPU), waiting
    between two calls as HYBRID_SERVER_WAIT says, whatever the image sets: spin (the default, libgomp's own: spin
    ~300k rounds, then sleep) or passive (asleep at once)."""
    # woken from sleep at every call, the threads start one after another: one H100 lease, coprocessor's decode
    # 2.5-17% slower (bench/results/gpu_bench-coproc-h100-spin.json), the expert server's replica 70 GB/s against 81
    wait = base.get(WAIT_ENV) or "spin"
    if wait not in WAITS:
        raise ValueError(f"{WAIT_ENV}={wait!r}: one of {', '.join(WAITS)}")
    env = {k: v for k, v in base.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(binding.threads_per_rank), HYBRID_STAGE=str(stage),
               HYBRID_STAGE_NAME=name)
    if wait == "passive":  # never ACTIVE: spinning for ever, each product took 8 ms instead of 1.3 (coproc_probe.json)
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if binding.pinned:
        env["GOMP_CPU_AFFINITY"] = binding.omp_bind.replace(",", " ")
    return env


def cpu_pod_server(plan: Plan, lay: Layout, ident, env: dict[str, str], module: str, role: str) -> Server | None:
    """A cpu stage's server (python -m vllm_hybrid.<module>) for the gpu stage lay.servers pairs it with, on the
    socket shm_socket names by `module`; None on any other stage."""
    served = dict(lay.servers)
    if ident.stage not in served:
        return None
    sock, name = shm_socket(env, ident.replica, ident.stage, module), plan.stages[ident.stage].name
    port = int(env.get("HYBRID_METRICS_PORT", plan.metrics_port))
    return Server(argv=("-m", f"vllm_hybrid.{module}", "--socket", sock, "--metrics-port", str(port)),
                  summary={"role": role, "for_stage": served[ident.stage], "socket": sock},
                  env=lambda binding, base: server_env(binding, base, ident.stage, name))


class Coprocessor(Strategy):
    name = "coprocessor"
    gpu_buffer_layers = COPROC_PREFETCH_STEP

    def refused(self, plan: Plan, shared_shm: bool) -> str | None:
        if not shared_shm:  # the cpu stages hand their weights to the gpu pod over a socket there
            return SHARED_SHM
        if any(s.tensor_parallel > 1 for s in plan.stages if not s.is_cpu):
            return "tensor_parallel 1 on the gpu stages"
        helped = [streaming_gpu(plan.stages, i) for i, s in enumerate(plan.stages) if s.is_cpu]
        if len(set(helped)) < len(helped):  # a gpu stage's offloader streams from one region
            return ("one cpu stage per gpu stage (a gpu stage streams from one cpu stage's region); merge the cpu "
                    "stages or put a gpu stage before each")
        return None

    def layout(self, plan: Plan, split: Split) -> Layout:
        self.require_gpu(plan)
        servers = tuple((i, streaming_gpu(plan.stages, i)) for i, s in enumerate(plan.stages) if s.is_cpu)
        return streamed_layout(plan, split, self.name, servers)

    def stage(self, plan, split, lay, ident, env) -> StageExtras:
        rank = lay.stages.index(ident.stage)
        servers = [cpu for cpu, gpu in lay.servers if gpu == ident.stage]
        if not servers:
            return StageExtras()
        streamed = lay.offload_bytes[rank]
        count = round(streamed / split.shape.layer_bytes)
        # vLLM's offloader puts streamed layer i in buffer slot i % step and prefetches (i + step) % count:
        # unless step divides count, the prefetch across steps overwrites a slot a later layer still needs
        step = COPROC_PREFETCH_STEP if count % COPROC_PREFETCH_STEP == 0 else 1
        # one server per gpu stage for now: the offloader streams from one region
        sock = coproc_socket(env, ident.replica, servers[0])
        # the streamed layers' weights live in that server's region (patches.patch_coprocessor)
        return StageExtras(flags=prefetch_flags(lay.layers[rank], count, step),
                           env=(("HYBRID_COPROC_SOCKET", sock),
                                ("HYBRID_COPROC_BYTES", str(streamed + (64 << 20)))),  # + norms and alignment
                           expect_offloader=OFFLOADERS["prefetch"], summary=(("coprocessor", sock),))

    def server(self, plan, lay, ident, env) -> Server | None:
        return cpu_pod_server(plan, lay, ident, env, "coproc", "coprocessor")

    def cost(self, plan: Plan, split: Split, lay: Layout, k: int, work: Workload, hw: Hardware) -> StageCost:
        streamed, shape, c = lay.offload_bytes[k], split.shape, work.concurrency
        if not streamed:
            return NO_COST
        whole = prefetch_cost(streamed, work, plan, hw)  # prompt chunks and large steps: whole layers
        if c > hw.coproc_max_rows:
            return whole
        # the 2-D products are split with the CPU; a mixture's experts (3-D) stream whole, as in offload
        layers = round(streamed / shape.layer_bytes)
        experts = layers * shape.layer_expert_bytes
        products, gb = (2 if shape.experts else 4) * layers, (streamed - experts) / 1e9
        return StageCost(gb / hw.coproc_gbs + experts / (hw.prefetch_pcie_gbs * 1e9) + products * hw.coproc_call_s
                         + c * gb * hw.coproc_token_s_per_gb / hw.cpu_token_speed, whole.prefill_s)
