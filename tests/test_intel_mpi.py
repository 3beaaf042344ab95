"""Intel MPI on every change: the engine's concurrency rules and DDP's overlap strategies.

CI installs the mpich wheel, which runs the whole suite; Open MPI runs the healing tests
(tests/test_healing.py). Here the ``impi-rt`` wheel's Intel MPI runs the check files whose
behaviour depends most on the library: tests/mpi/check_engine.py (two of everything at once
under MPI_THREAD_MULTIPLE, calls that differ across ranks, a spoilt group) and check_ddp.py's
overlap strategies against one process. Its environment, ``.venv-impi`` (or the Python
``MPIDP_TEST_IMPI`` names), is made from the running one by tests/launch.py.
"""

import pytest

import launch

# One host: shared memory alone (Intel MPI's default asks libfabric for a network provider).
SHARED_MEMORY = {"I_MPI_FABRICS": "shm"}


def _impi_python():
    try:
        return launch.library_python("impi")
    except RuntimeError as why:
        if "no virtual environment" in str(why):
            pytest.skip(str(why))
        raise


def test_intel_mpi_runs_the_engine_and_ddps_overlap_strategies():
    python = _impi_python()
    result = launch.run_pytest(2, ["tests/mpi/check_engine.py", "tests/mpi/check_ddp.py"], 300,
                               "-k", "check_engine or every_overlap_strategy",
                               env=SHARED_MEMORY, python=python)
    assert "Intel(R) MPI" in launch.run(1, ["-c", "from mpi4py import MPI; "
                                               "print(MPI.Get_library_version())"], 120,
                                        env=SHARED_MEMORY, python=python).stdout, result.stdout
