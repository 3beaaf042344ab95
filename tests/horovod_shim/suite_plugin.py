"""pytest plugin for Horovod's test suite under mpiexec: each rank's outcomes, and no hang.

Loaded with ``-p suite_plugin`` (this folder on ``PYTHONPATH``). ``HVD_SUITE_DESELECT``
names tests to leave out, comma-separated, exactly (pytest's ``--deselect`` takes
prefixes: ``test_broadcast_state`` would drop ``test_broadcast_state_no_grad`` too). Each rank writes
``{test name: outcome}`` to ``$HVD_SUITE_OUT/rank<r>.json`` as it goes, so a run that
ends early still tells what ran. A test that fails on some ranks only leaves the
others in a collective the failed rank never calls: with ``HVD_SUITE_ABORT=1`` (what
tests/test_horovod_suite.py sets) the failing rank prints its failure and aborts the
job instead, which ends the launch at once, naming the test. The tests named in
``HVD_SUITE_KNOWN_FAILING`` (comma-separated) fail on every rank together, so their
failure is recorded and the run goes on.
"""

import json
import os
import sys

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


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[-1]
    if report.when == "call" or report.outcome != "passed":
        # a failed setup or teardown counts as the test's failure; a skip is reported at setup
        if _outcomes.get(name) != "failed":
            _outcomes[name] = report.outcome
    _write()
    if report.failed and os.environ.get("HVD_SUITE_ABORT") == "1" \
            and name not in _names("HVD_SUITE_KNOWN_FAILING"):
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_size() > 1:
            sys.stderr.write(f"\n[rank {_rank()}] FAILED {name} ({report.when}):\n"
                             f"{report.longreprtext}\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
