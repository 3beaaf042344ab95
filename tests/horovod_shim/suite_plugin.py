"""pytest plugin for Horovod's test suite under mpiexec: each rank's outcomes, and no hang.

Loaded with ``-p suite_plugin`` (this folder on ``PYTHONPATH``). ``HVD_SUITE_DESELECT``
names tests to leave out, comma-separated, exactly (pytest's ``--deselect`` takes
prefixes: ``test_broadcast_state`` would drop ``test_broadcast_state_no_grad`` too). Each rank writes
``{test name: outcome}`` to ``$HVD_SUITE_OUT/rank<r>.json`` as it goes, so a run that
ends early still tells what ran. A test that fails on some ranks only leaves the
others in a collective the failed rank never calls: with ``HVD_SUITE_ABORT=1`` (what
tests/test_horovod_suite.py sets) the failing rank prints its failure and aborts the
job instead, which ends the launch at once, naming the test. The tests named in
``HVD_SUITE_KNOWN_FAILING`` (comma-separated) may fail and the run goes on, but only where
they fail on every rank together: after each of them every rank compares its outcome with
the others' (a nonblocking allreduce on a communicator of this plugin's own, waited for
``_AGREE_SECONDS`` at most), and a known failure on some ranks only, or a peer that never
comes because it waits inside the test, aborts the job as any other failure does.
"""

import array
import json
import os
import sys
import time

import pytest

_outcomes: dict[str, str] = {}


def _rank() -> int:
    for variable in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if variable in os.environ:
            return int(os.environ[variable])
    return 0


def _write() -> None:
    folder = os.environ.get("HVD_SUITE_OUT")
    if folder:
        path = os.path.join(folder, f"rank{_rank()}.json")
        with open(path + ".tmp", "w") as out:
            json.dump(_outcomes, out, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)


def _names(variable: str) -> set[str]:
    return set(filter(None, os.environ.get(variable, "").split(",")))


def pytest_collection_modifyitems(config, items):
    names = _names("HVD_SUITE_DESELECT")
    dropped = [item for item in items if item.name in names]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item.name not in names]


_AGREE_SECONDS = 30.0  # a peer still inside a known-failing test after this is stuck there
_comm = None  # this plugin's own duplicate of COMM_WORLD: nothing of the suite's issues on it


def _failed_on_every_rank_alike(failed: bool) -> bool:
    """Whether every rank's outcome equals this one's (all failed or none); False when a peer
    does not come within _AGREE_SECONDS. Every rank calls it after the same tests."""
    global _comm
    from mpi4py import MPI
    if _comm is None:
        _comm = MPI.COMM_WORLD.Dup()
    # MAX of the flag and of its negative: every rank learns the largest and the smallest
    both, reduced = array.array("l", [int(failed), -int(failed)]), array.array("l", [0, 0])
    request = _comm.Iallreduce(both, reduced, op=MPI.MAX)
    deadline = time.monotonic() + _AGREE_SECONDS
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return reduced[0] == -reduced[1]


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[-1]
    if report.when == "call" or report.outcome != "passed":
        # a failed setup or teardown counts as the test's failure; a skip is reported at setup
        if _outcomes.get(name) != "failed":
            _outcomes[name] = report.outcome
    _write()
    if os.environ.get("HVD_SUITE_ABORT") != "1":
        return
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() == 1:
        return
    why = None
    if name in _names("HVD_SUITE_KNOWN_FAILING"):
        if report.when == "teardown" and \
                not _failed_on_every_rank_alike(_outcomes.get(name) == "failed"):
            why = (f"known-failing test {name} failed on some ranks only (or a peer is still "
                   f"inside it after {_AGREE_SECONDS:g} s): the others would wait for this "
                   f"rank in its next collective")
    elif report.failed:
        why = f"FAILED {name} ({report.when}):\n{report.longreprtext}"
    if why is not None:
        sys.stderr.write(f"\n[rank {_rank()}] {why}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
