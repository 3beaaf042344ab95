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
    found = binding_warnings([rank(0, [0, 1], numa=(0, 1)), rank(1, [1, 2]), rank(2, [3], threads=4)],
                             launcher="mpich")
    assert found[0] == ("ranks [0, 1] on n1 share cores; give each cores of its own by launching "
                        "with 'mpiexec -bind-to core:1 ...' (see jobscripts/)")
    assert found[1].startswith("ranks [0] are bound to cores in more than one NUMA domain")
    assert found[2].startswith("ranks [2] run more torch threads than the cores they are bound to")


def test_the_binding_advice_fits_the_machine_and_the_launcher():
    # one NUMA domain: -bind-to numa would bind both ranks to the same cores again
    assert topology.bind_hint(2, 2, 1, "mpich") == "mpiexec -bind-to core:1"
    assert topology.bind_hint(2, 48, 2, "mpich") == "mpiexec -bind-to numa"
    assert topology.bind_hint(4, 48, 2, "mpich") == "mpiexec -bind-to core:12"
    assert topology.bind_hint(2, 48, 2, "openmpi") == "mpiexec --map-by ppr:1:numa --bind-to numa"
    assert topology.bind_hint(3, 48, 2, "openmpi") == "mpiexec --map-by slot:PE=16 --bind-to core"
    assert topology.bind_hint(2, 16, 1, "srun") == "srun --cpu-bind=cores --cpus-per-task=8"
    unbound = [rank(r, [0, 1]) for r in range(3)]
    assert binding_warnings(unbound)[0] == ("ranks [0, 1, 2] on n1 share cores: 3 ranks on 2 cores; "
                                            "run at most 2 ranks per node")
    pinned = [rank(r, [0]) for r in range(2)]
    assert binding_warnings(pinned)[0] == ("ranks [0, 1] on n1 share cores: 2 ranks on 1 core; "
                                           "run at most 1 rank per node")
    assert topology.bind_line(pinned, "mpich") == "mpiexec -bind-to core:1"


def test_unbound_ranks_are_warned_only_where_binding_matters():
    """A plain mpiexec -n N leaves the ranks unbound: on one NUMA domain the kernel spreads them and
    mpidp splits the threads (no warning); on several, their memory crosses domains."""
    assert binding_warnings([rank(r, range(8), threads=4) for r in range(2)]) == []
    two = binding_warnings([rank(r, range(8), numa=(0, 1), threads=4) for r in range(2)],
                           launcher="mpich")
    assert two[0] == ("ranks [0, 1] on n1 share cores; give each cores of its own by launching "
                      "with 'mpiexec -bind-to numa ...' (see jobscripts/)")
    overlapping = binding_warnings([rank(0, [0, 1, 2]), rank(1, [2, 3])], launcher="mpich")
    assert overlapping[0].startswith("ranks [0, 1] on n1 share cores; give each cores of its own")


def test_ranks_that_share_cores_split_them():
    both = [{0, 1}, {0, 1}]
    assert topology.threads_for({0, 1}, both) == 1
    assert topology.threads_for({0}, [{0}, {0}, {0}]) == 1  # at least one
    node = [set(range(4)), set(range(4)), set(range(4, 8))]
    assert [topology.threads_for(cores, node) for cores in node] == [2, 2, 4]
    assert topology.threads_for(set(range(48)), [set(range(48))]) == 48


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
                                          ({"MPIDP_SET_THREADS": "0"}, None),
                                          ({"MPIDP_SET_THREADS": "off"}, None),
                                          ({"MPIDP_SET_THREADS": "yes"}, len(os.sched_getaffinity(0)))])
def test_default_threads_follow_the_binding_unless_told_otherwise(monkeypatch, env, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MPIDP_SET_THREADS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert topology.default_threads() == expected
