"""Runs a whole pipeline as local processes, one `vllm-hybrid serve` per stage (demo, tests, bench)."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from .supervise import on_parent_death


def stop_with_parent() -> None:
    """In a stage's launcher (Popen's preexec_fn): SIGTERM, which it answers by stopping its vLLM, once the process that
    started it dies. Each stage runs in a session of its own, so a test or bench cut by `timeout` (SIGTERM, no exit
    handlers) left its stages running: a GPU test's engine held 46 GB of the GPU through the next call's bench."""
    on_parent_death(signal.SIGTERM)


def free_port(taken: set[int] = frozenset()) -> int:
    """A free port below the ephemeral range: vLLM's processes open many outgoing sockets while
    they start, and one of them could take an ephemeral port a stage is about to listen on."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    while True:
        port = random.randrange(max(1024, low - 12000), low)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def local_ports() -> dict[str, int]:
    ports: set[int] = set()
    while len(ports) < 4:
        ports.add(free_port(ports))
    api, master, sup, metrics = sorted(ports)
    return {"api_port": api, "master_port": master, "supervisor_port": sup, "metrics_port": metrics}


class LocalPipeline:
    """Stage i runs with os.environ + stage_envs[i]; logs go to workdir/stage-i.log."""

    def __init__(self, plan: dict, workdir: str | Path, stage_envs: list[dict[str, str]] | None = None):
        self.plan, self.workdir = plan, Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.plan_path = self.workdir / "plan.yaml"
        self.plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
        self.stage_envs = stage_envs or [{} for _ in plan["stages"]]
        self.procs: list[subprocess.Popen] = []
        # stage i's metrics endpoint; distinct ports since all stages share this host
        taken = {plan.get(k) for k in ("api_port", "master_port", "supervisor_port", "metrics_port")}
        self.metrics_ports = [plan.get("metrics_port", 9100)]
        for _ in plan["stages"][1:]:
            self.metrics_ports.append(free_port(taken | set(self.metrics_ports)))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.plan['api_port']}"

    def metrics_url(self, stage: int) -> str:
        return f"http://127.0.0.1:{self.metrics_ports[stage]}/metrics"

    def log(self, stage: int) -> str:
        return (self.workdir / f"stage-{stage}.log").read_text(errors="replace")

    def start_stage(self, stage: int) -> subprocess.Popen:
        env = {**os.environ, "HYBRID_MASTER_ADDR": "127.0.0.1", "HYBRID_HOST_IP": "127.0.0.1",
               "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
               "HYBRID_METRICS_PORT": str(self.metrics_ports[stage]),
               # distinct per local pipeline: names its /dev/shm bookkeeping and its metrics
               "HYBRID_INSTANCE": f"local-{self.plan['api_port']}",
               # a port names each local pipeline, so a hard-killed one's own next start rarely comes: the next
               # local pipeline's stages clear what it left (supervise.ShmJanitor.sweep)
               "HYBRID_SHM_SWEEP": ".hybrid-local-", **self.stage_envs[stage]}
        out = open(self.workdir / f"stage-{stage}.log", "ab")
        cmd = [env.get("HYBRID_LAUNCHER_PYTHON", sys.executable), "-m", "vllm_hybrid.cli", "serve",
               "--plan", str(self.plan_path), "--stage", str(stage)]
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=stop_with_parent)
        return proc

    def start(self) -> LocalPipeline:
        # headless stages first: they wait for stage 0's rendezvous
        self.procs = [None] * len(self.plan["stages"])  # type: ignore[list-item]
        for i in reversed(range(len(self.procs))):
            self.procs[i] = self.start_stage(i)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 900) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.healthy():
                return time.monotonic() - t0
            dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"stage {dead[0]} exited ({self.procs[dead[0]].returncode}) before ready:\n"
                                   + self.log(dead[0])[-4000:])
            time.sleep(1)
        raise TimeoutError(f"pipeline not ready after {timeout}s:\n" + self.log(0)[-4000:])

    def stop(self, timeout: float = 40) -> list[int | None]:
        for p in self.procs:
            if p and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        return [p.returncode if p else None for p in self.procs]

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def post_json(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())
