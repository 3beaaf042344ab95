"""The quick tier: ``pytest -m quick`` runs these files and the 2-rank launch of the check files.

Files that start no MPI job are quick (but for the docs' snippet runs, which do);
tests/test_mpi.py marks its own quick test (every check file at 2 ranks, in one launch).
"""

import os
import sys

import pytest

import launch

# Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), every rank of every
# launch compiled mpidp from source and pytest rewrote the check files' asserts again: about
# 0.3 s a launch at 2 ranks, over a hundred launches. The suite's processes keep bytecode
# (__pycache__ is ignored by git); Horovod's suite, outside the project, still gets none
# written (tests/test_horovod_suite.py sets the variable for its launches).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

QUICK_FILES = {"test_units.py", "test_docs.py", "test_layers.py", "test_topology.py",
               "test_sampler.py", "test_overlap.py", "test_kernels.py", "test_cuda.py",
               "test_doctor.py", "test_frtrace.py"}
LAUNCHING = {"test_complete_snippets_run",
             "test_doctor_names_each_seeded_misconfiguration"}  # in those files, but each starts an mpiexec job


def _every_launch(config) -> bool:
    """Whether this run makes every launch of the files it runs (no -k, -m or single tests):
    only then does a check that skipped in all of them never run (the quick tier runs the
    2-rank launch alone, where the 3- and 4-rank checks skip)."""
    return (not config.option.keyword and not config.option.markexpr
            and not any("::" in arg for arg in config.args))


def pytest_sessionfinish(session):
    """A check inside the launched files that skipped in every launch fails the suite, unless
    it is marked ``@pytest.mark.may_skip(reason)`` (tests/mpi/conftest.py)."""
    if _every_launch(session.config) and launch.skipped_everywhere():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    lines = launch.counts()
    if lines:
        terminalreporter.section("tests inside the launched check files")
        for line in lines:
            terminalreporter.write_line(line)
    never = launch.skipped_everywhere() if _every_launch(config) else []
    if never:
        terminalreporter.section("FAILED: checks that skipped in every launch")
        for line in never:
            terminalreporter.write_line(f"{line}: run it somewhere, or mark it "
                                        f"@pytest.mark.may_skip(reason)")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in QUICK_FILES and item.originalname not in LAUNCHING:
            item.add_marker(pytest.mark.quick)
