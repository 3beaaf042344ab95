"""Plugin for test files that run on every rank under mpiexec.

A test that fails on one rank while the others pass would leave the others
waiting in the next collective; printing the failure and aborting the job
turns that into a prompt, visible failure instead of a hang.
"""

import sys

import pytest
from mpi4py import MPI


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}):\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
