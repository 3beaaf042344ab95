"""Plugin for test files that run on every rank under mpiexec.

A test that fails on one rank while the others pass would leave the others
waiting in the next collective; printing the failure and aborting the job
turns that into a prompt, visible failure instead of a hang.
"""

import socket
import sys

import pytest
import torch.distributed as dist
from mpi4py import MPI


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}):\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture(scope="module")
def gloo():
    """torch.distributed over gloo on the same ranks, to compare with torch's DDP in one run.

    Module-scoped: several check files share one launch (tests/test_mpi.py), and each
    finds torch.distributed as a launch of its own would, uninitialised."""
    comm = MPI.COMM_WORLD
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    yield
    dist.destroy_process_group()
