"""coprocessor: GPU stages compute every layer, streaming the CPU stages' layers with vLLM's prefetch
offloader from a region each CPU stage owns (one copy); for decode-sized steps every product of those
layers is split row-wise with the CPU stage, which computes its rows from the same memory (server.py, run
instead of vLLM on the CPU stage; the GPU side is client.py and patches.py). Prompt chunks stream whole layers: attention and KV stay on the GPU."""
from __future__ import annotations

from ...plan import Plan
from ...planner import ModelShape, Split
from ..base import SHARED_SHM, Layout, Server, StageExtras, Strategy, cpu_pod_server, shm_socket, unquantized
from ..cost import NO_COST, Hardware, StageCost, Workload
from ..streaming import OFFLOADERS, prefetch_cost, prefetch_flags, streamed_layout, streaming_gpu
from .io import BYTES_ENV, SOCKET_ENV

INT8_FORMAT = "W8A8 INT8"  # formats.WeightFormat's name of the one quantized format it splits

# vLLM's prefetch offloader two layers ahead (the CPU's and the copy's times per layer vary by product)
COPROC_PREFETCH_STEP = 2


def coproc_socket(env: dict[str, str], replica: int, cpu_stage: int) -> str:
    """Where cpu stage `cpu_stage`'s product server listens: the replica's shared /dev/shm."""
    return shm_socket(env, replica, cpu_stage, "coproc")


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

    def refused_model(self, shape: ModelShape) -> str | None:
        fmt = shape.weight_format
        if fmt.name == INT8_FORMAT and fmt.detail:  # patches.int8_layer would split none of its products
            return (f"{INT8_FORMAT} as compressed-tensors' W8A8 preset writes it (a weight scale per output row, "
                    f"activations quantized per token at run time, symmetric: what its CPU pod's int8 GEMM and vLLM's "
                    f"CUTLASS kernel compute alike); this checkpoint's have {fmt.detail}")
        if fmt.name == INT8_FORMAT:  # its int8 products: int8.py (the rest of the layer streams whole)
            return None
        if fmt.quantized:
            return (f"unquantized weights (bf16, fp16 or fp32) or {INT8_FORMAT}: its CPU pod computes from plain or "
                    f"int8 weights, and this checkpoint is {fmt.name} ({fmt.method})")
        return unquantized(shape)

    def layout(self, plan: Plan, split: Split) -> Layout:
        self.require_gpu(plan)
        servers = tuple((i, streaming_gpu(plan.stages, i)) for i, s in enumerate(plan.stages) if s.is_cpu)
        return streamed_layout(plan, split, self.name, servers)

    def stage(self, plan, split, lay, ident, env, hw=None) -> StageExtras:
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
        # the streamed layers' weights live in that server's region (patches.py)
        return StageExtras(flags=prefetch_flags(lay.layers[rank], count, step),
                           env=((SOCKET_ENV, sock),
                                (BYTES_ENV, str(streamed + (64 << 20)))),  # + norms and alignment
                           expect_offloader=OFFLOADERS["prefetch"], summary=(("coprocessor", sock),))

    def server(self, plan, lay, ident, env) -> Server | None:
        return cpu_pod_server(plan, lay, ident, env, "coproc", "strategies.coprocessor.server", "coprocessor")

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

    def patch_vllm(self) -> list[str]:
        from .patches import apply  # vLLM's modules: only in a stage's vLLM process
        return apply()
