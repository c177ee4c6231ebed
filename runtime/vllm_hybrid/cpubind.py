"""CPU placement for CPU stages: the container's cpuset (what the kubelet's static CPU manager
granted) and the NUMA node(s) those CPUs live on."""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPUSET_FILES = (
    "/sys/fs/cgroup/cpuset.cpus.effective",          # cgroup v2
    "/sys/fs/cgroup/cpuset/cpuset.effective_cpus",   # cgroup v1
    "/sys/fs/cgroup/cpuset/cpuset.cpus",
)
NUMA_ROOT = "/sys/devices/system/node"
# CPU stages' and servers' torch allocations of 2 MiB and more on transparent huge pages (PyTorch's CPU allocator
# madvises them; honoured where THP is "madvise" or "always"): a pod reading 50 GB of experts takes a TLB miss every
# 4 KiB otherwise. On an H200 box the expert server's kernel took 1.58 ms a 4-token layer step over all 94 layers of
# the 235B's pod with them (bench/experts_serving.py), 2.26 in the served pod on 4 KiB pages an hour before on
# another box. Unsettled: on one box, bench/page_size.py's private placement (bf16 F.linear over 48 GB of torch's
# own memory) read 41-50 GB/s with it against 53-89 without (three runs each, both orders), while the served pod there,
# with it, ran its kernel faster than the last lease's without (1.95 against 2.26 ms, another box). A served A/B on
# one box decides it: THP_MEM_ALLOC_ENABLE=0 in the bench's env overrides this default
THP_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def parse_cpulist(text: str) -> list[int]:
    """Kernel cpulist syntax: '0-3,8,10-11' (also '0-7:2' strides) -> sorted CPU ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        rng, _, stride = part.partition(":")
        lo, _, hi = rng.partition("-")
        try:
            cpus.update(range(int(lo), int(hi or lo) + 1, int(stride or 1)))
        except ValueError as e:
            raise ValueError(f"bad cpulist {text!r}") from e
    return sorted(cpus)


def format_cpulist(cpus: list[int]) -> str:
    """Inverse of parse_cpulist with ranges collapsed: [0,1,2,5] -> '0-2,5'."""
    out, cpus = [], sorted(cpus)
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def allowed_cpus(cgroup_files=CGROUP_CPUSET_FILES) -> list[int]:
    """CPUs this container may run on: the cgroup cpuset, narrowed by the process affinity."""
    affinity = set(os.sched_getaffinity(0))
    for f in cgroup_files:
        try:
            text = Path(f).read_text().strip()
        except OSError:
            continue
        if text:
            cpus = set(parse_cpulist(text)) & affinity
            if cpus:
                return sorted(cpus)
    return sorted(affinity)


def numa_nodes(root: str = NUMA_ROOT) -> dict[int, list[int]]:
    """NUMA node -> its CPUs; one node holding every CPU where sysfs has no NUMA info."""
    nodes = {}
    for d in sorted(Path(root).glob("node[0-9]*")):
        try:
            nodes[int(d.name[4:])] = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


@dataclass(frozen=True)
class CpuBinding:
    omp_bind: str          # VLLM_CPU_OMP_THREADS_BIND: one cpulist per TP rank, '|'-separated; "nobind"
    threads_per_rank: int
    numa_node: int | None  # memory node to bind to, where the host has more than one
    all_cpus: list[int]

    @property
    def pinned(self) -> bool:
        return self.omp_bind != "nobind"


def unpinned_binding(cpus: list[int], threads: int, tensor_parallel: int = 1,
                     numa_node: int | None = None) -> CpuBinding:
    """A cpuset shared with other pods (no exclusive cores): threads float over it, as many as requested."""
    return CpuBinding("nobind", max(1, threads // tensor_parallel), numa_node, cpus)


def plan_binding(cpus: list[int], nodes: dict[int, list[int]], tensor_parallel: int = 1,
                 reserve: int | None = None, numa_node: int | None = None) -> CpuBinding:
    """Split the container's CPUs into one OpenMP group per TP rank, each inside one NUMA node
    where possible, leaving `reserve` CPUs (default: one from 4 CPUs up) for the engine process.
    `numa_node` (the spec's numaNode) keeps threads and memory on that node."""
    if numa_node is not None and nodes:  # no NUMA info in sysfs: one node, nothing to pin
        if numa_node not in nodes:
            raise ValueError(f"numaNode {numa_node}: this host has NUMA nodes {sorted(nodes)}")
        on_node = [c for c in cpus if c in set(nodes[numa_node])]
        if not on_node:
            raise ValueError(f"numaNode {numa_node}: none of this container's CPUs {format_cpulist(cpus)} is on it")
        b = plan_binding(on_node, {numa_node: nodes[numa_node]}, tensor_parallel, reserve)
        return CpuBinding(b.omp_bind, b.threads_per_rank, numa_node if len(nodes) > 1 else None, cpus)
    if not cpus:
        raise ValueError("no CPUs available to this container")
    node_of = {c: n for n, cs in nodes.items() for c in cs}
    multi = len({node_of.get(c) for c in cpus}) > 1 or len(nodes) > 1
    if reserve is None:
        reserve = 1 if len(cpus) >= 4 * tensor_parallel else 0
    # Reserve the last CPU(s): the engine's busy loop should not steal an OpenMP thread's core.
    usable = cpus[: len(cpus) - reserve] if reserve < len(cpus) else cpus
    if tensor_parallel == 1 and multi:
        # Memory bandwidth is per node: keep all threads and memory on the node holding most CPUs.
        node, _ = Counter(node_of.get(c, 0) for c in usable).most_common(1)[0]
        group = [c for c in usable if node_of.get(c, 0) == node]
        return CpuBinding(format_cpulist(group), len(group), node, cpus)
    if len(usable) < tensor_parallel:
        raise ValueError(f"{len(usable)} CPUs cannot host {tensor_parallel} tensor-parallel ranks")
    per = len(usable) // tensor_parallel
    groups = [usable[i * per:(i + 1) * per] for i in range(tensor_parallel)]
    node = Counter(node_of.get(c, 0) for c in groups[0]).most_common(1)[0][0] if multi else None
    return CpuBinding("|".join(format_cpulist(g) for g in groups), per, node, cpus)
