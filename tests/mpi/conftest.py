"""Plugin for test files that run on every rank under mpiexec.

A test that fails on one rank while the others pass would leave the others
waiting in the next collective; printing the failure and aborting the job
turns that into a prompt, visible failure instead of a hang.

With ``--outcomes DIR`` (tests/launch.py passes it), each rank writes what
became of every test it ran to ``DIR/rank-N.json``: the launching test
reports the counts, and one that skips on every launch fails the suite
unless it is marked ``may_skip`` with the reason (tests/conftest.py).
"""

import json
import os
import socket
import sys

import pytest
import torch.distributed as dist
from mpi4py import MPI


def pytest_addoption(parser):
    parser.addoption("--outcomes", default=None, metavar="DIR",
                     help="write this rank's test outcomes to DIR/rank-N.json (tests/launch.py)")


def pytest_configure(config):
    config.addinivalue_line("markers", "may_skip(reason): this check may skip in every launch "
                                       "of the suite, for the reason given")


_OUTCOMES: dict[str, dict] = {}  # node id -> {"outcome", "reason", "may_skip"}


def pytest_collection_modifyitems(items):
    for item in items:
        marker = item.get_closest_marker("may_skip")
        _OUTCOMES[item.nodeid] = {"outcome": None, "reason": "",
                                  "may_skip": marker.args[0] if marker else None}


def _note(report) -> None:
    """A test's outcome: failed if any phase failed, else skipped if its setup or call skipped."""
    entry = _OUTCOMES.setdefault(report.nodeid, {"outcome": None, "reason": "", "may_skip": None})
    if report.failed:
        entry["outcome"] = "failed"
    elif report.skipped and entry["outcome"] != "failed":
        entry["outcome"] = "skipped"
        entry["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
    elif report.when == "call" and entry["outcome"] is None:
        entry["outcome"] = "passed"


def pytest_sessionfinish(session):
    folder = session.config.getoption("--outcomes")
    if folder:
        ran = {nodeid: entry for nodeid, entry in _OUTCOMES.items() if entry["outcome"]}
        with open(os.path.join(folder, f"rank-{MPI.COMM_WORLD.Get_rank()}.json"), "w") as file:
            json.dump(ran, file)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    _note(report)
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
