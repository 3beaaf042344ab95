"""Run the MPI test files, the abort check and the examples under a real mpiexec."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import launch

# (file, world sizes); 4 ranks run oversubscribed on a 2-core machine.
MPI_FILES = [
    ("tests/mpi/check_comm.py", [1, 2, 3, 4]),
    ("tests/mpi/check_ddp.py", [1, 2, 3, 4]),
    ("tests/mpi/check_gloo.py", [2, 3]),
    ("tests/mpi/check_errors.py", [2, 3]),
    ("tests/mpi/check_gpu.py", [2]),
]


@pytest.mark.parametrize("path,nprocs", [(path, n) for path, sizes in MPI_FILES for n in sizes],
                         ids=lambda value: str(value).removeprefix("tests/mpi/"))
def test_mpi_file(path, nprocs):
    if "gpu" in path and not torch.cuda.is_available() and os.environ.get("MPIDP_TEST_GPU") != "1":
        pytest.skip("no GPU (MPIDP_TEST_GPU=1 turns this into a failure)")
    launch.run_pytest(nprocs, path, timeout=300)


@pytest.mark.parametrize("path", ["tests/mpi/check_comm.py", "tests/mpi/check_ddp.py"],
                         ids=lambda value: value.removeprefix("tests/mpi/"))
def test_host_staging_path(path):
    """The staging used for device memory without CUDA-aware MPI, exercised on CPU tensors."""
    launch.run_pytest(2, path, timeout=300, env={"MPIDP_STAGE_CPU": "1"})


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


@pytest.mark.parametrize("nprocs", [1, 2])
def test_info_report(nprocs):
    out = launch.run(nprocs, ["-m", "mpidp", "info"], timeout=120).stdout
    lines = out.splitlines()
    assert lines[0].split() == ["rank", "host", "local_rank", "numa", "cores", "torch_threads", "gpu"]
    assert [line.split()[0] for line in lines[1:1 + nprocs]] == [str(r) for r in range(nprocs)]
    assert "MPI library:" in out and "thread level multiple" in out and "CUDA-aware:" in out
    assert "binding:" in out or "warning:" in out


LAB = {
    "lab_1_rank_size.py": ["rank 0 of 2", "rank 1 of 2"],
    "lab_2_send_recv.py": ["blocking:    rank 1 holds\ntensor([[1., 1., 1., 1.]",
                           "nonblocking: rank 1 holds\ntensor([[1., 1., 1., 1.]"],
    "lab_3_allreduce.py": ["tensor([[ 2.,  4.,  6.,  8.],"],
    "lab_4_sampler.py": ["rank 0: [[0, 20], [40, 60], [80]]", "rank 1: [[10, 30], [50, 70], [90]]",
                         "drop_last=True) over the sampler:\n  rank 0: [[0, 20, 40]]\n  rank 1: [[10, 30, 50]]"],
    "lab_5_gradients_by_hand.py": ["2 ranks: |by hand - DDP| ="],
    "lab_6_scaling.py": ["ranks 2 threads/rank 1 epoch 1:"],
}


@pytest.mark.parametrize("script", sorted(LAB))
def test_lab_example(script):
    out = launch.run(2, [f"examples/{script}", *(["--samples", "1024"] if "scaling" in script else [])],
                     timeout=120).stdout
    for expected in LAB[script]:
        assert expected in out, out
    if "by_hand" in script:
        by_hand, sequential = (float(part.split("=")[1].strip(" ,")) for part in
                               out.split("|by hand - DDP|")[1].split("|DDP - sequential|"))
        assert by_hand < 1e-6 and sequential < 1e-5


def test_digits_example_reports_metrics_and_resumes_identically(tmp_path):
    straight = launch.run(2, ["examples/train_digits.py", "--epochs", "3"], timeout=180).stdout
    checkpoint = tmp_path / "ck.pt"
    launch.run(2, ["examples/train_digits.py", "--epochs", "2", "--checkpoint", str(checkpoint)],
               timeout=180)
    assert checkpoint.exists() and not checkpoint.with_name("ck.pt.partial").exists()
    resumed = launch.run(2, ["examples/train_digits.py", "--epochs", "3", "--checkpoint",
                             str(checkpoint), "--resume"], timeout=180).stdout
    assert "epoch 2: train loss" in straight and "validation loss" in straight
    assert "(297 samples, 2 ranks)" in straight  # every validation sample counted once
    assert resumed.startswith("epoch 2:")  # epochs 0 and 1 came from the checkpoint
    last = [line for line in straight.splitlines() if line.startswith(("epoch 2", "final"))]
    assert last == [line for line in resumed.splitlines() if line.startswith(("epoch 2", "final"))]
    accuracy = float(last[0].split("validation loss")[1].split("acc")[1].split()[0])
    assert accuracy > 0.9


JOBSCRIPTS = {"slurm-cpu.sh": "srun --cpu-bind=cores", "slurm-gpu.sh": "srun --cpu-bind=cores --gpu-bind",
              "pbs.sh": "mpiexec -n 4 -ppn 2 -bind-to numa",
              "workstation.sh": f"mpiexec -n 2 -bind-to core:{max(1, len(os.sched_getaffinity(0)) // 2)}"}


@pytest.mark.parametrize("script", sorted(JOBSCRIPTS))
def test_jobscript_parses_and_its_launch_runs_locally(script):
    path = launch.ROOT / "jobscripts" / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    env = dict(os.environ, MPIDP_DRY_RUN="1", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if script == "workstation.sh":
        env["NRANKS"] = "2"
    result = subprocess.run(["bash", str(path)], cwd=launch.ROOT, env=env, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert JOBSCRIPTS[script] in result.stdout.splitlines()[0]
    assert "MPI library:" in result.stdout and "final parameter checksum" in result.stdout
