"""Per-stage pipeline metrics, served by each stage's first worker on the plan's metrics_port.

vLLM's own /metrics (stage 0's API port) covers requests; these cover the pipeline: how long each
stage takes per step, how much crosses between stages, the KV blocks a stage holds, its binding.
Fed from the hooks in vllm_patches/; the labels come from the launcher's environment.
"""
from __future__ import annotations

import json
import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

LABELS = ("pipeline", "stage", "stage_name", "replica")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30)


def stage_labels(env=os.environ) -> dict[str, str]:
    return {"pipeline": env.get("HYBRID_INSTANCE", "local"), "stage": env.get("HYBRID_STAGE", "0"),
            "stage_name": env.get("HYBRID_STAGE_NAME", ""), "replica": env.get("HYBRID_REPLICA", "0")}


class StageMetrics:
    def __init__(self, labels: dict[str, str], registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, lab = self.registry, list(LABELS)
        self.labels = labels
        self.step = Histogram("hybrid_stage_step_seconds", "Wall time of one engine step on this stage "
                              "(waiting for the previous stage, computing its layers, sending on)",
                              lab, buckets=STEP_BUCKETS, registry=r).labels(**labels)
        self.forward = Histogram("hybrid_stage_forward_seconds", "Time this stage computes its layers per step "
                                 "(step minus inter-stage waits and sends)", lab, buckets=STEP_BUCKETS,
                                 registry=r).labels(**labels)
        self.tokens = Counter("hybrid_stage_tokens", "Tokens processed by this stage", lab, registry=r).labels(**labels)
        xfer = [*lab, "direction"]
        self.bytes = Counter("hybrid_stage_transfer_bytes", "Activation bytes sent/received between stages",
                             xfer, registry=r)
        self.xfer_seconds = Counter("hybrid_stage_transfer_seconds", "Time spent sending to the next stage / "
                                    "waiting for the previous one", xfer, registry=r)
        self.kv_total = Gauge("hybrid_stage_kv_blocks_total", "KV-cache blocks allocated on this stage",
                              lab, registry=r).labels(**labels)
        self.kv_used = Gauge("hybrid_stage_kv_blocks_used", "KV-cache blocks held by running requests",
                             lab, registry=r).labels(**labels)
        self.info = Info("hybrid_stage", "Device, layers, CPU binding and vLLM version of this stage",
                         lab, registry=r).labels(**labels)
        self.pending = Gauge("hybrid_stage_pending_requests", "Requests scheduled on this stage and not finished",
                             lab, registry=r).labels(**labels)
        self.since_progress = Gauge("hybrid_stage_seconds_since_progress", "Seconds since this stage last "
                                    "finished a step while requests are pending (0 when none are)",
                                    lab, registry=r).labels(**labels)
        self.measured = Gauge("hybrid_stage_measured", "What the stage measured of its node at start (figure: "
                              "h2d_gbs, dram_read_gbs, cpu_products_gbs_rows_T, ...)", [*lab, "figure"], registry=r)
        self.set_measured(MEASURED)
        self.stall_timeout = Gauge("hybrid_stage_stall_timeout_seconds", "No progress for this long with requests "
                                   "pending and the stage restarts (0: never)", lab, registry=r).labels(**labels)
        self._recv_wait = 0.0
        self._send = 0.0
        self._blocks: dict[str, int] = {}

    def set_measured(self, figures: dict[str, float]) -> None:
        for figure, value in figures.items():
            self.measured.labels(**self.labels, figure=figure).set(value)

    # -- hooks (called from vllm_patches/worker.py) --
    def transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        self.bytes.labels(**self.labels, direction=direction).inc(nbytes)
        self.xfer_seconds.labels(**self.labels, direction=direction).inc(seconds)
        if direction == "recv":
            self._recv_wait += seconds
        else:
            self._send += seconds

    def begin_step(self) -> float:
        self._recv_wait = self._send = 0.0
        return time.perf_counter()

    def end_step(self, t0: float, scheduler_output) -> None:
        elapsed = time.perf_counter() - t0
        self.step.observe(elapsed)
        self.forward.observe(max(0.0, elapsed - self._recv_wait - self._send))
        self.tokens.inc(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        self.track_blocks(scheduler_output)

    def track_blocks(self, so) -> None:
        """Blocks held by running requests, from the scheduler output every stage receives."""
        for r in getattr(so, "scheduled_new_reqs", ()):
            self._blocks[r.req_id] = len(r.block_ids[0]) if r.block_ids else 0
        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = getattr(cached, "resumed_req_ids", set())
            for rid, new in zip(cached.req_ids, cached.new_block_ids):
                if new:
                    self._blocks[rid] = (0 if rid in resumed else self._blocks.get(rid, 0)) + len(new[0])
        for rid in (*getattr(so, "finished_req_ids", ()), *(getattr(so, "preempted_req_ids", None) or ())):
            self._blocks.pop(rid, None)
        self.kv_used.set(sum(self._blocks.values()))


_METRICS: StageMetrics | None = None
NODE_FIGURES_ENV = "HYBRID_NODE_FIGURES"  # what the launcher measured of the node for strategy auto (node.py), JSON
# node figures measured before the metrics exist: the coprocessor's at load, and the launcher's
MEASURED: dict[str, float] = {k: float(v) for k, v in json.loads(os.environ.get(NODE_FIGURES_ENV) or "{}").items()}


def current() -> StageMetrics | None:
    return _METRICS


def record_measured(figures: dict[str, float], m: StageMetrics | None = None) -> None:
    """Node figures a stage measured: on its metrics now if they exist (`m`, else this worker's), else once made."""
    MEASURED.update(figures)
    if (m := m or _METRICS) is not None:
        m.set_measured(figures)


def start(num_blocks: int, device: str, tp_rank: int, env=os.environ) -> StageMetrics | None:
    """Create this worker's metrics; TP rank 0 of the stage serves them (ranks are symmetric)."""
    global _METRICS
    if env.get("HYBRID_STAGE_METRICS", "1") == "0" or _METRICS is not None:
        return _METRICS
    m = StageMetrics(stage_labels(env))
    m.kv_total.set(num_blocks)
    from vllm import __version__ as vllm_version
    m.info.info({"device": device, "layers": env.get("HYBRID_LAYER_RANGE", ""),
                 "cpus": env.get("VLLM_CPU_OMP_THREADS_BIND", ""), "numa_node": env.get("HYBRID_NUMA_NODE_BOUND", ""),
                 "vllm_version": vllm_version, "tp_rank": str(tp_rank)})
    watch_progress(m, env)
    port = env.get("HYBRID_METRICS_PORT")
    if tp_rank == 0 and port:
        start_http_server(int(port), registry=m.registry)
    _METRICS = m
    return m


def watch_progress(m: StageMetrics, env=os.environ) -> None:
    """The stall gauges read the progress record at scrape time: a stage waiting on a hung one shows
    its wait growing (a hung stage itself no longer answers: StageDown)."""
    from . import progress
    p = progress.current()
    if p is None:
        return
    timeout, grace = map(float, env.get("HYBRID_STALL_TIMEOUT", "0,0").split(","))
    m.pending.set_function(lambda: len(p.running))
    m.since_progress.set_function(p.seconds_since_progress)
    m.stall_timeout.set_function(lambda: grace if p.new_shape else timeout)  # the limit that applies now


def serve_unused(port: int, labels: dict[str, str], strategy: str) -> StageMetrics:
    """A stage the strategy leaves out (its layers stream from the GPU pod's RAM) still answers on its
    metrics port: its pod's probes check that port, and dashboards show why it holds no layers."""
    m = StageMetrics(labels)
    m.info.info({"device": "unused", "layers": "", "strategy": strategy})
    start_http_server(port, registry=m.registry)
    return m


# --- reading a stage's metrics (the demo, the bench and the tests) -------------------------------------------------

def scrape_text(url: str, timeout: float = 10) -> str:
    """A metrics endpoint's Prometheus text (a stage's, a CPU pod server's, vLLM's own)."""
    import urllib.request
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def samples(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="value",...}': value}, labels sorted (prometheus_client's own parser)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def scrape(url: str, timeout: float = 10) -> dict[str, float]:
    return samples(scrape_text(url, timeout))


def total(scraped: dict[str, float], name: str, **labels) -> float:
    """The sum of `name`'s samples with these labels (of any others); 0 where there is none."""
    return sum(v for k, v in scraped.items()
               if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items()))
