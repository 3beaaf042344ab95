"""Run the MPI test files, the abort check and the examples under a real mpiexec."""

import time

import pytest

import launch

# (file, world sizes); 4 ranks run oversubscribed on a 2-core machine.
MPI_FILES = [
    ("tests/mpi/check_comm.py", [1, 2, 3, 4]),
    ("tests/mpi/check_ddp.py", [1, 2, 3, 4]),
    ("tests/mpi/check_gloo.py", [2, 3]),
    ("tests/mpi/check_errors.py", [2, 3]),
]


@pytest.mark.parametrize("path,nprocs", [(path, n) for path, sizes in MPI_FILES for n in sizes],
                         ids=lambda value: str(value).removeprefix("tests/mpi/"))
def test_mpi_file(path, nprocs):
    launch.run_pytest(nprocs, path, timeout=300)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_uncaught_exception_on_one_rank_ends_the_job(nprocs):
    start = time.monotonic()
    result = launch.run(nprocs, ["tests/mpi/raise_on_one_rank.py"], timeout=60, check=False)
    assert result.returncode != 0
    assert f"[mpidp rank 1/{nprocs}] ValueError: boom from rank 1" in result.stderr
    assert "passed a barrier" not in result.stderr
    assert time.monotonic() - start < 60


def test_main_example_trains_on_two_ranks():
    result = launch.run(2, ["examples/train.py", "--epochs", "2"], timeout=300)
    assert "final train loss" in result.stdout
