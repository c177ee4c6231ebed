import os

import pytest
from vllm_hybrid.cpubind import allowed_cpus, format_cpulist, numa_nodes, parse_cpulist, plan_binding


@pytest.mark.parametrize("text,cpus", [("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]), ("5", [5]), ("0-7:2", [0, 2, 4, 6]),
                                       ("1-2\n", [1, 2]), ("", [])])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


def test_format_round_trip():
    assert format_cpulist([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(ValueError):
        parse_cpulist("a-b")


def test_allowed_cpus_reads_cgroup_and_narrows_by_affinity(tmp_path):
    mine = sorted(os.sched_getaffinity(0))
    f = tmp_path / "cpuset.cpus.effective"
    f.write_text(format_cpulist(mine[:1] + [4096]))  # a CPU we cannot run on is dropped
    assert allowed_cpus([str(tmp_path / "missing"), str(f)]) == mine[:1]
    assert allowed_cpus([str(tmp_path / "missing")]) == mine


def fake_sysfs(tmp_path, nodes):
    for n, cpus in nodes.items():
        d = tmp_path / f"node{n}"
        d.mkdir()
        (d / "cpulist").write_text(cpus)
    (tmp_path / "possible").write_text("0-1")  # not a node dir
    return str(tmp_path)


def test_numa_nodes(tmp_path):
    assert numa_nodes(fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"})) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert numa_nodes(str(tmp_path / "none")) == {}


def test_binding_single_node_reserves_a_core_from_four():
    b = plan_binding([0, 1, 2, 3, 4, 5, 6, 7], {0: list(range(8))})
    assert (b.omp_bind, b.threads_per_rank, b.numa_node) == ("0-6", 7, None)
    assert plan_binding([2, 3], {0: [0, 1, 2, 3]}).omp_bind == "2-3"


def test_binding_spanning_nodes_stays_on_the_majority_node():
    nodes = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    b = plan_binding([2, 3, 4, 5, 6, 7], nodes)
    assert (b.omp_bind, b.numa_node) == ("4-6", 1)


def test_binding_tensor_parallel_groups():
    b = plan_binding(list(range(16)), {0: list(range(8)), 1: list(range(8, 16))}, tensor_parallel=2, reserve=0)
    assert b.omp_bind == "0-7|8-15" and b.threads_per_rank == 8
    with pytest.raises(ValueError, match="cannot host 4"):
        plan_binding([0, 1], {}, tensor_parallel=4)


def test_binding_pinned_to_the_specs_numa_node():
    nodes = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    b = plan_binding(list(range(8)), nodes, numa_node=0)
    assert (b.omp_bind, b.numa_node) == ("0-2", 0)
    assert plan_binding(list(range(8)), nodes, numa_node=1).omp_bind == "4-6"
    assert plan_binding([0, 1], {}, numa_node=0).omp_bind == "0-1"  # no NUMA info: nothing to pin
    with pytest.raises(ValueError, match="numaNode 1: none of this container's CPUs 0-3 is on it"):
        plan_binding([0, 1, 2, 3], nodes, numa_node=1)
    with pytest.raises(ValueError, match="numaNode 2: this host has NUMA nodes"):
        plan_binding([0, 1], nodes, numa_node=2)
