"""Topology parsing and binding warnings, on synthetic layouts (no MPI launch)."""

import os

import pytest

from mpidp import topology
from mpidp.topology import RankTopology, binding_warnings, compress_cpulist, parse_cpulist


def rank(r, cores, numa=(0,), host="n1", threads=None):
    return RankTopology(rank=r, host=host, local_rank=r, cores=tuple(cores), numa_nodes=tuple(numa),
                        torch_threads=threads or len(cores), gpu=None)


def test_cpulists_parse_and_compress():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()
    assert compress_cpulist([5, 0, 1, 2, 8, 9]) == "0-2,5,8-9"


def test_well_bound_ranks_get_no_warning():
    assert binding_warnings([rank(0, range(0, 24)), rank(1, range(24, 48), numa=(1,)),
                             rank(2, range(0, 24), host="n2"), rank(3, range(24, 48), host="n2")]) == []


def test_shared_cores_spanning_numa_and_too_many_threads_are_reported():
    found = binding_warnings([rank(0, [0, 1], numa=(0, 1)), rank(1, [1, 2]), rank(2, [3], threads=4)])
    assert found[0].startswith("ranks [0, 1] on n1 share cores")
    assert found[1].startswith("ranks [0] are bound to cores in more than one NUMA domain")
    assert found[2].startswith("ranks [2] run more torch threads than the cores they are bound to")


def test_numa_nodes_come_from_sysfs(tmp_path):
    for node, cpus in ((0, "0-3"), (1, "4-7"), (10, "8-9")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    assert topology.numa_nodes_of([2, 3], tmp_path) == (0,)
    assert topology.numa_nodes_of([3, 4, 9], tmp_path) == (0, 1, 10)
    assert topology.numa_nodes_of([3], tmp_path / "missing") == ()


def test_this_rank_is_described():
    me = topology.topology()
    assert me.rank == 0 and set(me.cores) == os.sched_getaffinity(0) and me.torch_threads >= 1
    assert set(me.as_row()) == {"rank", "host", "local_rank", "numa", "cores", "torch_threads", "gpu"}


@pytest.mark.parametrize("env,expected", [({}, len(os.sched_getaffinity(0))),
                                          ({"OMP_NUM_THREADS": "3"}, None),
                                          ({"MPIDP_SET_THREADS": "0"}, None)])
def test_default_threads_follow_the_binding_unless_told_otherwise(monkeypatch, env, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MPIDP_SET_THREADS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert topology.default_threads() == expected
