"""Where MPI starts and how a rank ends, under a real mpiexec.

DataLoader workers under every start method, the thread level, threads per
rank under a plain ``mpiexec -n N``, a non-zero ``sys.exit`` on one rank, and
the abort message reaching the user on every run.
"""

import os
import subprocess
import sys
import time

import pytest

import launch
from mpidp import topology

CORES = len(os.sched_getaffinity(0))


def run_unbound(nprocs: int, args: list[str], *flags: str, timeout: float = 120):
    """``mpiexec [flags] -n N python args`` as a user types it: no OMP_NUM_THREADS, no binding."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    command = [launch.mpiexec(), *flags, "-n", str(nprocs), sys.executable, *args]
    result = subprocess.run(command, cwd=launch.ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout, start_new_session=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("nprocs,methods", [(2, ["fork", "spawn", "forkserver"]),
                                            (3, ["forkserver-preload"])],
                         ids=["2-fork-spawn-forkserver", "3-forkserver-preload"])
def test_dataloader_workers_train_like_no_workers_under_every_start_method(nprocs, methods):
    out = launch.run(nprocs, ["tests/mpi/train_with_workers.py", *methods], timeout=300).stdout
    for method in methods:
        assert f"{method}: 2 workers per rank on {nprocs} ranks, parameters equal to num_workers=0" in out


@pytest.mark.parametrize("mode,level", [("serialized", "serialized"), ("uninitialised", "multiple"),
                                        ("user-initialised", "funneled")])
def test_thread_level_is_requested_or_respected_and_mpi4py_works_after_mpidp(mode, level):
    out = launch.run(2, ["tests/mpi/thread_level.py", mode], timeout=120).stdout
    for rank in range(2):
        assert f"rank {rank}: {mode}: thread level {level}, bcast from rank 0 of 2" in out


def test_unbound_ranks_share_the_cores_and_are_warned_only_where_binding_matters():
    """A plain ``mpiexec -n 2``, as the README's first command launches: on a node of one NUMA
    domain no binding warning (DDP warns from the same ``binding_warnings``); on several, the
    advised launch line; and that line gives each rank cores of its own."""
    readme = (launch.ROOT / "README.md").read_text()
    assert "/mpiexec -n 2 .venv/bin/python examples/train.py\n" in readme  # this launch's flags
    out = run_unbound(2, ["-m", "mpidp", "info"])
    threads = [int(line.split()[5]) for line in out.splitlines()[1:3]]
    share = max(1, CORES // 2)
    assert threads == [share] * 2, out
    assert f"threads:       {share} on ranks 0, 1: a share of {CORES} cores that 2 ranks use" in out
    if CORES < 2:
        return  # one core: no binding can give two ranks their own
    domains = len(topology.numa_nodes_of(os.sched_getaffinity(0)))
    launcher = "openmpi" if launch._oversubscribe_flags(launch.mpiexec()) else "mpich"
    line = topology.bind_hint(2, CORES, domains, launcher)
    if domains > 1:
        assert "warning: ranks [0, 1] on" in out and f"'{line} ...'" in out, out
    else:
        assert "binding:       no problems found" in out and "warning" not in out, out
    bound = run_unbound(2, ["-m", "mpidp", "info"], *line.split()[1:])
    assert "binding:       no problems found" in bound, bound
    assert [int(line.split()[5]) for line in bound.splitlines()[1:3]] == [CORES // 2] * 2, bound


@pytest.mark.parametrize("nprocs,mode,status", [(2, "sys.exit", 3), (3, "sys.exit", 3), (2, "exit", 3),
                                                (3, "message", 1), (2, "finally", 3)])
def test_a_nonzero_exit_on_one_rank_ends_the_job(nprocs, mode, status):
    start = time.monotonic()
    result = launch.run(nprocs, ["tests/mpi/exit_on_one_rank.py", mode], timeout=60, check=False)
    assert result.returncode != 0, result.stdout + result.stderr
    assert f"[mpidp rank 1/{nprocs}] exiting with status {status} " in result.stderr, result.stderr
    assert "got past a collective" not in result.stderr
    assert time.monotonic() - start < 60


def test_a_caught_exit_does_not_end_the_job():
    out = launch.run(2, ["tests/mpi/exit_on_one_rank.py", "caught"], timeout=60).stdout
    assert "rank 0 done, allreduce gave 2" in out and "rank 1 done, allreduce gave 2" in out


def test_the_abort_message_reaches_the_user_on_every_run():
    """The one-line summary comes first and arrives on every run (it was lost in 1 of 30);
    the other rank never passes the barrier rank 1 does not reach (tests/test_mpi.py: 3 ranks)."""
    for runs in range(1, 4):
        result = launch.run(2, ["tests/mpi/raise_on_one_rank.py"], timeout=60, check=False)
        assert result.returncode != 0
        assert "passed a barrier" not in result.stderr
        ours = [line for line in result.stderr.splitlines() if line.startswith("[mpidp rank")]
        assert ours[:1] == ["[mpidp rank 1/2] ValueError: boom from rank 1"], (runs, result.stderr)
        assert ours[-1] == "[mpidp rank 1/2] ValueError: boom from rank 1", (runs, result.stderr)
