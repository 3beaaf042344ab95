"""Run the MPI test files, the abort check and the examples under a real mpiexec."""

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import launch
import test_doctor as doctor_tests
import test_frtrace
import test_horovod_suite as hvd_suite

# (file, world sizes); 4 ranks run oversubscribed on a 2-core machine.
MPI_FILES = [
    ("tests/mpi/check_comm.py", [1, 2, 3, 4]),
    ("tests/mpi/check_comm_errors.py", [1, 2, 3]),
    ("tests/mpi/check_comm_more.py", [2, 3]),
    # first: a Healer refuses communicators that no owner rebuilds, which a file before might leave
    ("tests/mpi/check_healing.py", [2, 3]),  # the heals themselves: tests/test_healing.py
    ("tests/mpi/check_ddp.py", [1, 2, 3, 4]),
    ("tests/mpi/check_reproducible.py", [1, 2, 3, 4]),  # against one process in each launch
    ("tests/mpi/check_gloo.py", [2, 3]),
    ("tests/mpi/check_errors.py", [3]),
    ("tests/mpi/check_ddp_edges.py", [2, 3]),
    ("tests/mpi/check_join.py", [2, 3]),
    ("tests/mpi/check_syncbn.py", [2, 3]),
    # at 3 ranks both run with every all_reduce chunked (test_..._in_chunks below)
    ("tests/mpi/check_backend.py", [2, 4]),
    ("tests/mpi/check_backend_torch.py", [2]),
    ("tests/mpi/check_backend_fsdp.py", [2, 4]),
    ("tests/mpi/check_zero.py", [2, 3]),  # 4 ranks: zero_reshard.py
    ("tests/mpi/check_hooks.py", [2, 3]),
    ("tests/mpi/check_shm.py", [2, 3]),  # 4: test_shared_memory_across_nodes
    ("tests/mpi/check_engine.py", [2, 3]),
    # before check_rendezvous, whose TCP-store tests leave a listener up in their launch:
    # check_store's port probe must find none of mpidp's (its own TCP test comes last)
    ("tests/mpi/check_store.py", [2, 3]),
    ("tests/mpi/check_rendezvous.py", [2]),
    ("tests/mpi/check_frameworks.py", [2]),  # skips without the frameworks extra
    ("tests/mpi/check_horovod.py", [2, 3]),  # with the training example against one process
    ("tests/mpi/check_preempt.py", [2, 3]),  # the example's launches: tests/test_preemption.py
]
GPU_FILE = "tests/mpi/check_gpu.py"
SERIALIZED = "tests/mpi/check_thread_serialized.py"  # under MPI4PY_RC_THREAD_LEVEL=serialized


def _by_size() -> dict[int, list[str]]:
    """The files of each world size, in MPI_FILES' order.

    The files of one size share one launch: pytest runs them one after the other in
    one mpiexec job, which saves starting torch, MPI and mpidp again for each file
    (a few seconds a rank on 2 cores). Each module's fixtures start and end what it
    uses (process groups, gloo, windows), so each file finds what a launch of its own
    would. A failure aborts the launch naming the test (tests/mpi/conftest.py).
    """
    sizes: dict[int, list[str]] = {}
    for path, counts in MPI_FILES:
        for nprocs in counts:
            sizes.setdefault(nprocs, []).append(path)
    return dict(sorted(sizes.items()))


@pytest.mark.parametrize("nprocs,paths", [
    pytest.param(nprocs, paths, id=f"{nprocs}-ranks",
                 marks=[pytest.mark.quick] if nprocs == 2 else [])  # the quick tier: 2 ranks
    for nprocs, paths in _by_size().items()])
def test_mpi_files(nprocs, paths):
    launch.run_pytest(nprocs, paths, timeout=600)


def test_gpu_file():
    if not torch.cuda.is_available() and os.environ.get("MPIDP_TEST_GPU") != "1":
        pytest.skip("no GPU (MPIDP_TEST_GPU=1 turns this into a failure)")
    launch.run_pytest(2, [GPU_FILE], timeout=300)


def test_host_staging_path():
    """The staging used for device memory without CUDA-aware MPI, exercised on CPU tensors."""
    launch.run_pytest(2, ["tests/mpi/check_comm.py", "tests/mpi/check_ddp.py"], timeout=300,
                      env={"MPIDP_STAGE_CPU": "1"})


def test_shared_memory_across_nodes():
    """Four ranks as two "nodes" of two: the node sums, then MPI between the nodes."""
    launch.run_pytest(4, "tests/mpi/check_shm.py", timeout=300, env={"MPIDP_SHM_NODE_SIZE": "2"})


def test_ddp_through_mpi_alone():
    """The DDP tests with shared memory off: every bucket through MPI's allreduce."""
    launch.run_pytest(2, "tests/mpi/check_ddp.py", timeout=300, env={"MPIDP_SHARED_MEMORY": "0"})


def test_torch_distributed_backend_reduces_large_tensors_in_chunks():
    """MPIDP_CHUNK_MB=0.001: every all_reduce over 1 KiB goes chunk by chunk, async ones in turn.
    torch's DDP under torch.compile is left out here: its all_reduces are the eager DDP's and the
    functional collectives' (both run here), and its compiles take seconds a rank; but for its
    compiled-autograd form, which runs in this launch only (check_backend_torch.py)."""
    launch.run_pytest(3, ["tests/mpi/check_backend.py", "tests/mpi/check_backend_torch.py"],
                      400, "-k", "not test_torch_ddp_under_torch_compile or aot_eager-True",
                      env={"MPIDP_CHUNK_MB": "0.001"})


@pytest.mark.parametrize("nprocs,paths", [(2, ["tests/mpi/check_backend.py", SERIALIZED]),
                                          (3, [SERIALIZED])])
def test_backend_and_ddp_under_mpi_thread_serialized(nprocs, paths):
    """No progress thread there: every collective completes before it returns, messages at
    wait(); DDP takes the strategies that call MPI from the training thread only."""
    result = launch.run_pytest(nprocs, paths, timeout=300, env={"MPI4PY_RC_THREAD_LEVEL": "serialized"})
    assert "MPI4PY_RC_THREAD_LEVEL=serialized" not in result.stdout, result.stdout[-2000:]  # skipped


def test_a_rank_raising_in_a_race_schedule_ends_the_job():
    """Rank 1 raises mid-round with async all_reduces in flight and its peers inside DDP's
    and the backend's collectives (tests/mpi/races.py): the job ends with its error."""
    start = time.monotonic()
    result = launch.run(3, ["tests/mpi/races.py", "5", "--raise-at", "1:2"], timeout=120,
                        check=False)
    assert result.returncode != 0
    assert "[mpidp rank 1/3] RuntimeError: race schedule 5: rank 1 raises in round 2" in \
        result.stderr, result.stderr[-4000:]
    print(f"ended {time.monotonic() - start:.1f} s after launch")


@pytest.mark.parametrize("overlap,nprocs", [("inline", 2), ("thread", 3), ("nonblocking", 2)])
def test_a_bucket_reduction_failing_on_one_rank_ends_the_job(overlap, nprocs):
    """The other ranks wait in collectives the failing rank will not issue: catching the
    error cannot line them up again, so mpidp ends the job, naming it (issue 17)."""
    start = time.monotonic()
    result = launch.run(nprocs, ["tests/mpi/reduction_fails_on_one_rank.py", overlap],
                        timeout=90, check=False)
    assert result.returncode != 0
    assert f"[mpidp rank 1/{nprocs}]" in result.stderr, result.stderr[-4000:]
    assert "the gradient reduction of step 3 failed on this rank" in result.stderr
    assert "finished every step" not in result.stdout
    print(f"{overlap}: ended {time.monotonic() - start:.1f} s after launch")


def test_a_conversion_on_one_rank_is_named_by_the_watchdog():
    """ddp.double() on rank 0 alone: its model check waits, and the watchdog names it."""
    result = launch.run(2, ["tests/mpi/convert_one_rank.py"], timeout=120, check=False,
                        env={"MPIDP_TIMEOUT": "2"})
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "waiting in module conversion" in output, output[-4000:]
    assert "went on past a conversion" not in output


def test_import_where_only_some_ranks_see_a_gpu():
    """cuda.decision() runs on every rank, GPU or not: a rank without one does not hang the
    others' import, and every rank decides alike."""
    if not torch.cuda.is_available() and os.environ.get("MPIDP_TEST_GPU") != "1":
        pytest.skip("no GPU (MPIDP_TEST_GPU=1 turns this into a failure)")
    out = launch.run(2, ["tests/mpi/gpu_on_some_ranks.py"], timeout=120).stdout
    assert "rank 1: gpu False" in out and "rank 0: gpu True" in out, out


@pytest.mark.parametrize("kind", ["count", "dtype", "backend", "ddp"])
def test_a_mismatched_allreduce_ends_the_job_naming_it(kind):
    """Ranks whose allreduce differs in element count or dtype (issue 17, item 5): MPICH ends
    the process from inside the call, and mpidp's exit report names the collective and
    MPIDP_DEBUG=1; the backend's all_reduce raises on every rank. Never a silent result."""
    start = time.monotonic()
    result = launch.run(2, ["tests/mpi/mismatched_call.py", kind], timeout=120, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert "went on past a mismatched allreduce" not in output, output[-4000:]
    assert result.returncode != -11 and "Segmentation fault" not in output, output[-4000:]
    for rank in (0, 1) if kind == "backend" else (0,):
        assert f"[mpidp rank {rank}/2]" in output, output[-4000:]
    assert "allreduce" in output and "MPIDP_DEBUG=1" in output, output[-4000:]
    print(f"{kind}: ended {time.monotonic() - start:.1f} s after launch")


def test_a_mismatched_allreduce_under_debug_raises_on_every_rank():
    result = launch.run(2, ["tests/mpi/mismatched_call.py", "count"], timeout=120, check=False,
                        env={"MPIDP_DEBUG": "1"})
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"[mpidp rank {rank}/2] ValueError: collective calls differ" in result.stderr, \
            result.stderr[-4000:]


@pytest.mark.parametrize("nprocs", [3])  # 2 ranks: tests/test_runtime.py, the abort message
def test_uncaught_exception_on_one_rank_ends_the_job(nprocs):
    start = time.monotonic()
    result = launch.run(nprocs, ["tests/mpi/raise_on_one_rank.py"], timeout=60, check=False)
    assert result.returncode != 0
    assert f"[mpidp rank 1/{nprocs}] ValueError: boom from rank 1" in result.stderr
    assert "passed a barrier" not in result.stderr
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("mode", ["timeout", "watchdog"])
def test_torch_ddp_over_mpidp_with_a_skipped_step_ends_the_job(mode):
    """A rank skips a step of torch's DDP over "mpidp": the group's timeout (2 s) fails the
    future DDP waits on, or the watchdog (MPIDP_TIMEOUT=2) sees the pending Work; either
    way the job ends with a message that names the all_reduce, never hangs."""
    start = time.time()
    result = launch.run(2, ["tests/mpi/backend_stall.py", mode], timeout=120, check=False,
                        env={"MPIDP_TIMEOUT": "2" if mode == "watchdog" else "0"})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert "without the skipped step being noticed" not in output
    stalled = [float(part.split()[0].rstrip("rank")) for part in output.split(" stalls at ")[1:]]
    if mode == "timeout":
        assert "did not complete within the group's timeout of 2 s" in output, output[-4000:]
    else:
        assert "stall" in output and "allreduce" in output, output[-4000:]
    assert stalled, output[-4000:]
    print(f"{mode}: exit {result.returncode} {time.time() - min(stalled):.1f} s after the stall "
          f"({time.time() - start:.1f} s in all)")


# -- the stall watchdog (mpidp.watchdog): tests/mpi/stall.py hangs on purpose ------------

STALL = "tests/mpi/stall.py"
STALL_TIMEOUT = 1.5  # MPIDP_TIMEOUT of these runs
STALL_SOURCE = (launch.ROOT / STALL).read_text().splitlines()


def _stall(nprocs: int, *args: str, env: dict | None = None):
    """Run stall.py; return (result, seconds from the stall to the end of the job)."""
    result = launch.run(nprocs, [STALL, *args], timeout=240, check=False,
                        env={"MPIDP_TIMEOUT": str(STALL_TIMEOUT), **(env or {})})
    ended = time.time()
    # lines of different ranks may run together: "rank 0 stalls at 17.2rank 1 stalls at 17.2"
    starts = [float(part[:len(part) - len(part.lstrip("0123456789."))])
              for part in result.stdout.split(" stalls at ")[1:]]
    assert len(starts) == nprocs, result.stdout + result.stderr
    seconds = ended - min(starts)
    print(f"stall.py {' '.join(args)} on {nprocs} ranks: exit {result.returncode} "
          f"{seconds:.1f} s after the stall")
    assert seconds < STALL_TIMEOUT + 30, result.stderr
    return result, seconds


def _rank_names(ranks) -> str:
    """As the summary names them: "rank 1", "ranks 0, 2", "ranks 1-2"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {ranks[0]}-{ranks[-1]}" if ranks[-1] - ranks[0] == len(ranks) - 1 else \
        f"ranks {', '.join(map(str, ranks))}"


def _summary(result, nprocs: int) -> dict[str, str]:
    """Rank 0's summary line: {"ranks 0, 2": "waiting in ...", ..., "end": "aborting ..."}."""
    prefix = f"[mpidp rank 0/{nprocs}] stall summary: "
    lines = [line for line in result.stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, result.stderr
    *groups, end = lines[0].removeprefix(prefix).split("; ")
    return dict(group.split(": ", 1) for group in groups) | {"end": end}


def _source_of(report: str) -> str:
    """The line of stall.py that a report names as its call site."""
    number = report.split(f"at {STALL}:", 1)[1]
    return STALL_SOURCE[int(number[:len(number) - len(number.lstrip("0123456789"))]) - 1]


def _check_lines(result, nprocs: int, ranks) -> None:
    for rank in ranks:
        assert f"[mpidp rank {rank}/{nprocs}] stall: waiting " in result.stderr, result.stderr


# What rank 0's summary says the others wait in, when the last rank is late at each kind of
# collective mpidp issues (tests/mpi/stall_kinds.py), in the script's order.
STALL_KINDS = {
    "ddp_bucket": "DDP step 1 bucket 1/1 (0.3 KB): allreduce op=sum dtype=float32 count=81",
    "shared_memory_reduction": "DDP step 1 bucket 1/1 (0.3 KB): shared-memory allreduce op=sum",
    "backend_op": "iallreduce (its call check) dtype=float32 count=16",
    "horovod_op": "hvd allreduce (control message)",
    "sync_batchnorm": "allreduce op=sum dtype=float64 count=10",
    "zero_step": "ZeroRedundancyOptimizer.step()",
    "zero_checkpoint_gather": "ZeroRedundancyOptimizer.consolidate_state_dict() (gather)",
    "object_collective": "broadcast_object (every rank unpickled it?)",
}


def test_watchdog_names_every_kind_of_collective_a_late_rank_holds_up():
    """One launch, the last rank late at each kind in turn; MPIDP_TIMEOUT_ACTION=report lets the
    job go on after each summary, which must name the collective and the late rank's line."""
    result = launch.run(2, ["tests/mpi/stall_kinds.py"], timeout=240,
                        env={"MPIDP_TIMEOUT": "0.75", "MPIDP_TIMEOUT_ACTION": "report"})
    assert "rank 1: every kind done" in result.stdout, result.stdout + result.stderr[-4000:]
    summaries = [line for line in result.stderr.splitlines()
                 if line.startswith("[mpidp rank 0/2] stall summary: ")]
    starts = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("kind ")]
    assert starts == list(STALL_KINDS), starts
    for kind, expected in STALL_KINDS.items():
        found = [line for line in summaries if f"rank 0: waiting in {expected}" in line]
        assert found, f"{kind}: no summary names '{expected}':\n" + "\n".join(summaries)
        assert "rank 1: not in an mpidp collective, main thread at tests/mpi/stall_kinds.py:" \
            in found[0], found[0]


def _trace(folder) -> tuple[int, str]:
    """``python -m mpidp trace folder``, as a user runs it: (exit status, output)."""
    done = subprocess.run([sys.executable, "-m", "mpidp", "trace", str(folder)], cwd=launch.ROOT,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def _torch_names_what_trace_names(folder, out) -> None:
    """The records in torch's format (``python -m mpidp trace DIR --torch-fr OUT``: its command
    line runs in tests/test_frtrace.py), read by torch's own analyzer as a user runs it: its
    first finding is trace's first, the same collective and rank(s)."""
    from mpidp import frtrace, trace
    frtrace.export(str(folder), str(out))
    script = Path(sys.executable).parent / "torchfrtrace"
    command = [str(script)] if script.exists() else \
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
    read = subprocess.run([*command, str(out)], capture_output=True, text=True, timeout=120)
    found = test_frtrace.torch_findings(read.stdout + read.stderr)
    assert read.returncode == 0 and found, read.stdout + read.stderr
    test_frtrace.agree(trace.analyse(trace.load(str(folder)))[0], found[0])


def _findings(output: str) -> list[str]:
    """The numbered findings of a trace and their indented lines, one string each."""
    found: list[str] = []
    for line in output.splitlines():
        if re.match(r"\d+\. ", line):
            found.append(line)
        elif line.startswith("    ") and found and not found[-1].startswith("started"):
            found[-1] += "\n" + line
        elif found:
            found.append(line)
    return found


@pytest.mark.parametrize("nprocs", [2, 3])
def test_watchdog_names_a_rank_that_skipped_a_collective(nprocs, tmp_path):
    result, _ = _stall(nprocs, "skip", env={"MPIDP_TRACE_DIR": str(tmp_path)})
    assert result.returncode != 0
    _check_lines(result, nprocs, range(nprocs))
    groups = _summary(result, nprocs)
    others = groups[_rank_names([r for r in range(nprocs) if r != 1])]
    assert others.startswith(f"waiting in allreduce op=sum dtype=float32 count=4 at {STALL}:")
    assert "rank 1 skips this one" in _source_of(others)
    assert groups["rank 1"].startswith("waiting in allreduce op=max dtype=int64 count=1 at ")
    assert "comm=other" in _source_of(groups["rank 1"])
    assert groups["end"] == "aborting the job (MPIDP_TIMEOUT_ACTION=abort)"
    # every rank wrote its flight record; the trace names the collective rank 1 skipped (and
    # the one it entered instead, which the others never reached: both start at the same
    # moment, so either may come first)
    assert sorted(p.name for p in tmp_path.glob("rank-*.json")) == \
        [f"rank-{r:05d}.json" for r in range(nprocs)]
    status, output = _trace(tmp_path)
    assert status == 1, output
    others = _rank_names([r for r in range(nprocs) if r != 1])
    skipped = [f for f in _findings(output)[:2]
               if f"by {others}: allreduce op=sum count=4 dtype=float32" in f]
    assert len(skipped) == 1 and "never arrived on ranks 0-" in skipped[0], output
    assert "    rank 1 never started it" in skipped[0], output
    if nprocs == 2:
        _torch_names_what_trace_names(tmp_path, tmp_path / "torch-fr")
    assert f"rank 1: allreduce op=max count=1 dtype=int64 on ranks 0-{nprocs - 1} (not made by " \
        f"mpidp) #0, collective #1" in output, output
    # the summary carries each rank's stack, down to the line of stall.py
    assert "stack of rank 1, thread MainThread (innermost first):" in result.stderr
    line = next(n for n, text in enumerate(STALL_SOURCE, 1) if '"max", comm=other' in text)
    assert f"    {STALL}:{line} in skip" in result.stderr, result.stderr


@pytest.mark.parametrize("nprocs", [3])
def test_trace_names_a_rank_that_issued_a_different_collective(nprocs, tmp_path):
    result, _ = _stall(nprocs, "differ", env={"MPIDP_TRACE_DIR": str(tmp_path)})
    assert result.returncode != 0
    status, output = _trace(tmp_path)
    assert status == 1, output
    first = _findings(output)[0]
    others = _rank_names([r for r in range(nprocs) if r != 1])
    assert first.startswith(f"1. first divergence on ranks 0-{nprocs - 1} #"), output
    assert ", collective #1, started " in first, output
    assert f"    {others}: allreduce op=sum count=4 dtype=float32" in first, output
    assert "    rank 1: broadcast root=0 count=4 dtype=float32" in first, output
    assert (tmp_path / "summary.txt").read_text().startswith("stall summary: ")
    _torch_names_what_trace_names(tmp_path, tmp_path / "torch-fr")  # "Culprit rank 1"


@pytest.mark.parametrize("nprocs", [2, 3])
def test_watchdog_names_ranks_in_different_collectives(nprocs):
    result, _ = _stall(nprocs, "mismatch")
    assert result.returncode != 0
    _check_lines(result, nprocs, range(nprocs))
    groups = _summary(result, nprocs)
    assert groups["rank 0"].startswith(f"waiting in broadcast root={nprocs - 1} dtype=float32 "
                                       f"count=8 at {STALL}:")
    assert "broadcast" in _source_of(groups["rank 0"])
    others = groups[_rank_names(list(range(1, nprocs)))]
    assert others.startswith("waiting in allreduce op=sum dtype=float32 count=2 at ")


@pytest.mark.parametrize("nprocs,sleeper,overlap,shm", [(2, 1, "inline", "1"), (3, 0, "inline", "0"),
                                                        (2, 1, "thread", "1"), (2, 1, "nonblocking", "0")])
def test_watchdog_names_ddp_bucket_while_a_rank_is_in_user_code(nprocs, sleeper, overlap, shm):
    result, _ = _stall(nprocs, "sleep", str(sleeper), overlap, env={"MPIDP_SHARED_MEMORY": shm})
    assert result.returncode != 0
    waiting = [r for r in range(nprocs) if r != sleeper]
    _check_lines(result, nprocs, waiting)
    groups = _summary(result, nprocs)
    call = ("shared-memory allreduce op=sum dtype=float32 count=" if shm == "1" else
            "iallreduce op=sum dtype=float32 count=" if overlap == "nonblocking" else
            "allreduce op=sum dtype=float32 count=")
    assert groups[_rank_names(waiting)].startswith("waiting in DDP step 3 bucket 1/")
    assert f"): {call}" in groups[_rank_names(waiting)]
    assert "loss.backward()" in _source_of(groups[_rank_names(waiting)])
    idle = groups[f"rank {sleeper}"]
    assert idle.startswith("not in an mpidp collective, main thread at "), idle
    assert "time.sleep" in _source_of(idle)
    # the waiting ranks' stacks reach the line of stall.py, below DDP's and autograd's frames
    stack = _stack_of(result, nprocs, _rank_names(waiting))
    line = next(n for n, text in enumerate(STALL_SOURCE, 1) if "loss.backward()" in text)
    assert f"{STALL}:{line} in train" in stack, stack
    assert any(frame.startswith("mpidp/ddp/") for frame in stack), stack


def _stack_of(result, nprocs: int, ranks: str) -> list[str]:
    """The frames the summary prints as the stack of ``ranks`` ("ranks 0, 2")."""
    prefix = f"[mpidp rank 0/{nprocs}] "
    lines = [line.removeprefix(prefix) for line in result.stderr.splitlines()
             if line.startswith(prefix)]
    start = next(n for n, line in enumerate(lines) if line.startswith(f"stack of {ranks}, "))
    frames = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        frames.append(line.strip())
    return frames


def test_watchdog_and_trace_say_where_the_other_ranks_finished(tmp_path):
    """The commonest real hang: rank 0 makes one more allreduce after the others finished, rank 1
    at the end of the script, rank 2 by sys.exit(0), rank 3 by MPI.Finalize(). Each told rank 0
    before it left MPI: the summary and the trace name each as finished, and where."""
    result, _ = _stall(4, "finish", env={"MPIDP_TRACE_DIR": str(tmp_path)})
    assert result.returncode != 0
    groups = _summary(result, 4)
    assert groups["rank 0"].startswith(f"waiting in allreduce op=sum dtype=float32 count=4 at ")
    assert "one more" in _source_of(groups["rank 0"])

    def line_of(code: str) -> int:
        return next(n for n, text in enumerate(STALL_SOURCE, 1) if text.strip() == code)

    finished = {1: f"finished at {STALL}:{line_of('main()')} (the end of the script, status 0)",
                2: f"finished at {STALL}:{line_of('sys.exit(0)')} (sys.exit(0), status 0)",
                3: f"finished at {STALL}:{line_of('MPI.Finalize()')} (MPI_Finalize())"}
    for rank, text in finished.items():
        assert groups[f"rank {rank}"] == text, groups
    _, output = _trace(tmp_path)
    for rank, text in finished.items():
        assert f"\nrank {rank}: {text}\n" in output, output


def test_watchdog_report_action_prints_and_the_job_goes_on():
    result, _ = _stall(3, "sleep", "1", env={"MPIDP_TIMEOUT_ACTION": "report"})
    assert result.returncode == 0, result.stderr
    _check_lines(result, 3, [0, 2])
    groups = _summary(result, 3)
    assert groups["ranks 0, 2"].startswith("waiting in DDP step 3 bucket 1/")
    assert groups["end"] == "going on (MPIDP_TIMEOUT_ACTION=report)"
    assert all(f"rank {r} trained 5 steps" in result.stdout for r in range(3))


def test_watchdog_ddp_timeout_governs_its_steps():
    result, seconds = _stall(2, "sleep", "1", env={"MPIDP_TIMEOUT": "600",
                                                   "STALL_DDP_TIMEOUT": "2"})
    assert result.returncode != 0
    assert re.search(r"\[mpidp rank 0/2\] stall: waiting [23]\.", result.stderr), result.stderr
    assert "(timeout 2 s from DistributedDataParallel(timeout=)) in DDP step 3" in result.stderr
    assert seconds < 2 + 30


def test_watchdog_says_which_rank_cannot_answer(tmp_path):
    # rank 1 sleeps in C with the GIL held
    result, _ = _stall(3, "gil", "1", env={"MPIDP_TRACE_DIR": str(tmp_path)})
    assert result.returncode != 0
    groups = _summary(result, 3)
    assert groups["ranks 0, 2"].startswith("waiting in DDP step 3 bucket 1/")
    # faulthandler's own thread wrote its stacks, down to the line that holds the GIL, before
    # rank 0 summarised: the summary and the trace say so, not "dead"
    held = f"a thread of it held the GIL: faulthandler wrote its stacks to {tmp_path}/rank-00001"
    assert groups["rank 1"].startswith(f"no report ({held}"), groups
    line = next(n for n, text in enumerate(STALL_SOURCE, 1) if "keeps the GIL" in text)
    stacks = (tmp_path / "rank-00001.stacks.txt").read_text()
    assert f'tests/mpi/stall.py", line {line} in train' in stacks, stacks
    assert f"\nrank 1: {held}" in _trace(tmp_path)[1]


def test_a_launcher_that_ends_the_job_leaves_every_ranks_stacks_and_record(tmp_path):
    """SIGTERM to mpiexec (what srun and mpiexec do at a time limit) long before MPIDP_TIMEOUT:
    rank 0 sits in C in a DDP bucket, rank 1 in Python; both write stacks and flight record."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MPIDP_TIMEOUT="600",
               MPIDP_TRACE_DIR=str(tmp_path), MPIDP_SHARED_MEMORY="0")
    job = subprocess.Popen([*launch.launch_argv(2), sys.executable, STALL, "sleep", "1"],
                           cwd=launch.ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen, deadline = "", time.time() + 120
        while seen.count(" stalls at ") < 2 and time.time() < deadline:
            seen += job.stdout.readline()
        assert seen.count(" stalls at ") == 2, seen
        time.sleep(2)  # both inside their stall
        job.send_signal(signal.SIGTERM)
        output = seen + job.communicate(timeout=60)[0]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0, output
    for rank in range(2):
        stacks = (tmp_path / f"rank-{rank:05d}.stacks.txt").read_text()
        assert 'tests/mpi/stall.py", line' in stacks and " in train" in stacks, stacks
    assert "in _fence" in (tmp_path / "rank-00000.stacks.txt").read_text() or \
        "in _start" in (tmp_path / "rank-00000.stacks.txt").read_text()
    status, trace = _trace(tmp_path)
    assert "flight records of ranks 0-1 of 2" in trace, trace + output
    assert "rank 0: allreduce op=sum" in trace and "(DDP step 3 bucket 1/" in trace, trace


def test_a_killed_rank_leaves_its_pid_file_and_the_black_boxes_name_it(tmp_path):
    """Rank 1 killed by SIGKILL at step 3: MPICH's hydra SIGKILLs rank 0 at once, so no watchdog
    can report, and names one process by pid and host (not always the killed one: soak runs named
    rank 0's). Each rank's rank-NNNNN.pid names its rank, pid and host, so a pid (hydra's, the
    kernel's OOM message) gives its rank; and the ranks' black boxes (mpidp.recorder), written as
    the collectives went, let `python -m mpidp trace` name rank 1 as the one that never came."""
    result, _ = _stall(2, "kill", "1", "inline", env={"MPIDP_TRACE_DIR": str(tmp_path)})
    assert result.returncode != 0
    heads = {rank: (tmp_path / f"rank-{rank:05d}.pid").read_text().strip() for rank in range(2)}
    for rank, head in heads.items():
        assert re.fullmatch(rf"mpidp rank {rank}/2, pid \d+ on \S+", head), heads
    output = result.stdout + result.stderr
    named = re.search(r"PID (\d+) RUNNING AT (\S+)", output)  # MPICH's and Intel MPI's hydra
    if named is None:  # Open MPI names the rank itself
        assert re.search(r"process\s+rank\s+1\s+with\s+PID", output), output[-3000:]
    else:
        assert any(head.endswith(f", pid {named[1]} on {named[2]}") for head in heads.values()), \
            (heads, named[0])
    status, trace = _trace(tmp_path)
    assert status == 1 and "rank 1 never started it" in trace, trace + output[-3000:]
    assert re.search(r"^rank 1: dead: process \d+ on \S+ ended without a clean exit", trace,
                     re.M), trace


def test_watchdog_ranks_end_the_job_when_rank_0_cannot():
    result, _ = _stall(3, "gil", "0")
    assert result.returncode != 0
    assert "stall summary" not in result.stderr
    _check_lines(result, 3, [1, 2])
    assert "rank 0 did not end the job after this rank's stall report" in result.stderr


def test_watchdog_below_thread_multiple_reports_locally_and_ends_the_job():
    result, _ = _stall(2, "skip", env={"STALL_THREAD_LEVEL": "serialized"})
    assert result.returncode != 0
    assert "stall summary" not in result.stderr
    _check_lines(result, 2, [0, 1])
    assert "no summary below MPI_THREAD_MULTIPLE" in result.stderr
    assert "by os._exit(124)" in result.stderr


UNEVEN = {"shards": "examples/train_uneven.py --epochs 2",
          "sampler": "examples/train_uneven.py --epochs 2 --sampler"}


@pytest.fixture(scope="module")
def uneven_examples() -> dict[str, str]:
    """What rank 0 printed for each of UNEVEN's commands, run one after the other in one
    3-rank launch (tests/mpi/run_scripts.py): the example leaves nothing behind but what its
    model.close() releases."""
    out = launch.run(3, ["tests/mpi/run_scripts.py", *UNEVEN.values()], timeout=300).stdout
    return _sections(out)


@pytest.mark.parametrize("source,steps", [("shards", "[10, 15, 19]"), ("sampler", "[15, 15, 14]")])
def test_uneven_example_joins_and_ends_with_one_model(source, steps, uneven_examples):
    out = uneven_examples[UNEVEN[source]]
    assert f"epoch 1: steps per rank {steps}" in out, out
    sums = out.split("final parameter checksums per rank: ")[1].splitlines()[0]
    assert len(set(sums.strip("[]").split(", "))) == 1, sums
    assert float(out.split("epoch 1:")[1].split("test accuracy")[1].split()[0]) > 0.85


LAB = {
    "lab_1_rank_size.py": ["rank 0 of 2", "rank 1 of 2"],
    "lab_2_send_recv.py": ["blocking:    rank 1 holds\ntensor([[1., 1., 1., 1.]",
                           "nonblocking: rank 1 holds\ntensor([[1., 1., 1., 1.]"],
    "lab_3_allreduce.py": ["rank 0: allreduce(sum) over 2 ranks =\ntensor([[ 2.,  4.,  6.,  8.],",
                           "rank 1: allreduce(sum) over 2 ranks =\ntensor([[ 2.,  4.,  6.,  8.],"],
    "lab_4_sampler.py": ["rank 0: [[0, 20], [40, 60], [80]]", "rank 1: [[10, 30], [50, 70], [90]]",
                         "drop_last=True) over the sampler:\n  rank 0: [[0, 20, 40]]\n  rank 1: [[10, 30, 50]]"],
    "lab_5_gradients_by_hand.py": ["2 ranks: |by hand - DDP| ="],
    "lab_6_scaling.py": ["ranks 2 threads/rank 1 epoch 1:"],
}


# The 2-rank examples that leave no global state behind but a process group run in one
# launch (tests/mpi/run_scripts.py): the lab scripts, the main example, the Horovod-API
# benchmark and the FSDP2 example. Accelerate's and the Trainer's keep state of their own.
HOROVOD_BENCHMARK = "horovod_benchmark.py --batch-size 4 --warmup 1 --steps 2 --rounds 2"
TWO_RANK_EXAMPLES = [*(f"examples/{script}" + (" --samples 1024" if "scaling" in script else "")
                       for script in sorted(LAB)),
                     "examples/train.py --epochs 2", f"examples/{HOROVOD_BENCHMARK}",
                     "examples/torch_fsdp.py --steps 30"]
# Horovod's own two examples, unchanged, from ../shared (test_horovod_suite.py), short: with the
# shim first on PYTHONPATH (`horovod.torch` is mpidp.horovod, `torchvision` a stand-in)
HOROVOD_MNIST = shlex.join([str(hvd_suite.EXAMPLES / "pytorch_mnist.py"), "--epochs", "2",
                            "--batch-size", "32", "--lr", "0.05", "--log-interval", "100"])
HOROVOD_SYNTHETIC = shlex.join([str(hvd_suite.EXAMPLES / "pytorch_synthetic_benchmark.py"),
                                "--batch-size", "4", "--num-warmup-batches", "1",
                                "--num-batches-per-iter", "1", "--num-iters", "2"])


@pytest.fixture(scope="module")
def two_rank_examples(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """(the launch's whole stdout, what rank 0 printed for each command). HOME is a temporary
    folder: Horovod's MNIST example takes a file lock in ``~`` and writes its data there."""
    home = tmp_path_factory.mktemp("home")
    horovods = [f"{HOROVOD_MNIST} --data-dir {home}", HOROVOD_SYNTHETIC] \
        if hvd_suite.EXAMPLES.is_dir() else []
    # the Trainer last: it leaves Accelerate's state behind (so accelerate_train.py runs alone)
    trainer = [TRAINER] if importlib.util.find_spec("transformers") else []
    out = launch.run(2, ["tests/mpi/run_scripts.py", *TWO_RANK_EXAMPLES, *horovods, *trainer],
                     timeout=400,
                     env=hvd_suite.shim_env(HOME=str(home))).stdout
    return out, _sections(out)


def _sections(output: str) -> dict[str, str]:
    """What rank 0 printed for each command of a tests/mpi/run_scripts.py launch."""
    sys.path.insert(0, str(launch.ROOT / "tests" / "mpi"))
    import run_scripts
    sys.path.pop(0)
    return run_scripts.sections(output)


def test_main_example_trains_on_two_ranks(two_rank_examples):
    assert "final train loss" in two_rank_examples[1]["examples/train.py --epochs 2"]


TRAINER = "examples/trainer_train.py --steps 4"  # in two_rank_examples' launch
FRAMEWORK_EXAMPLES = {  # script and arguments -> what its last lines say
    "accelerate_train.py --epochs 1": "2 processes, backend mpidp",
    TRAINER.removeprefix("examples/"): "2 processes, backend mpidp: mean training loss",
    HOROVOD_BENCHMARK: "img/sec on 2 ranks (per rank: ",
}


@pytest.mark.parametrize("command", sorted(FRAMEWORK_EXAMPLES), ids=lambda c: c.split()[0])
def test_framework_example_runs_on_two_ranks(command, request):
    """The examples of docs/launch.md and docs/horovod.md run as the docs show them (short)."""
    if command != HOROVOD_BENCHMARK:
        framework = "accelerate" if "accelerate" in command else "transformers"
        if importlib.util.find_spec(framework) is None:  # not imported here: only the ranks need it
            pytest.skip(f"needs the frameworks extra ({framework})")
    if f"examples/{command}" in (f"examples/{HOROVOD_BENCHMARK}", TRAINER):
        out = request.getfixturevalue("two_rank_examples")[1][f"examples/{command}"]
    else:
        script, *args = command.split()
        out = launch.run(2, [f"examples/{script}", *args], timeout=240).stdout
    assert FRAMEWORK_EXAMPLES[command] in out, out[-3000:]


def test_accelerates_own_self_test_passes_under_python_m_mpidp_run():
    """What `accelerate test` runs (accelerate.test_utils.scripts.test_script), unchanged, on 2
    ranks through `python -m mpidp run -m`, on the CPU (ACCELERATE_USE_CPU: docs/launch.md)."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("needs the frameworks extra (accelerate)")
    out = launch.run(2, ["-m", "mpidp", "run", "-m", "accelerate.test_utils.scripts.test_script"],
                     timeout=240, env={"ACCELERATE_USE_CPU": "true"}).stdout
    assert out.count("Num processes: 2") == 2, out[-3000:]
    assert "Distributed environment: DistributedType.MULTI_CPU" in out, out[-3000:]
    assert "Training yielded the same results on one CPU or distributed setup with batch split." \
        in out, out[-3000:]
    assert "**Test reinstantiated state**" in out, out[-3000:]


def test_torch_fsdp_example_equals_one_process(two_rank_examples):
    """torch's FSDP2 over the "mpidp" backend; the script itself checks its final model."""
    out = two_rank_examples[1]["examples/torch_fsdp.py --steps 30"]
    assert "step  29: loss" in out
    assert "2 ranks vs one process: max relative parameter difference" in out


def test_horovods_own_examples_run_unchanged_at_2_ranks(two_rank_examples):
    """pytorch_mnist.py learns the stand-in digits; pytorch_synthetic_benchmark.py prints its total."""
    if not hvd_suite.EXAMPLES.is_dir():
        pytest.skip(f"Horovod's examples are not at {hvd_suite.EXAMPLES} (set HOROVOD_SUITE)")
    printed = two_rank_examples[1]
    mnist = next(printed[command] for command in printed if command.startswith(HOROVOD_MNIST))
    tests = re.findall(r"Test set: Average loss: ([\d.]+), Accuracy: ([\d.]+)%", mnist)
    assert len(tests) == 2, mnist[-3000:]  # rank 0 tests after each epoch
    (first_loss, _), (loss, accuracy) = [(float(a), float(b)) for a, b in tests]
    assert loss < first_loss and accuracy > 50, mnist[-3000:]  # chance: 10 %
    benchmark = printed[HOROVOD_SYNTHETIC]
    assert "Model: resnet50\nBatch size: 4\nNumber of CPUs: 2" in benchmark
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+", benchmark), benchmark


@pytest.fixture(scope="module")
def reshards(tmp_path_factory) -> dict[str, str]:
    """Saves at one size, loads at another: FSDP2's state through torch.distributed.checkpoint
    (4 -> 2 ranks) and ZeroRedundancyOptimizer.save_sharded (4 -> 2 at stage 2, 2 -> 4 at
    stage 1), in three launches (tests/mpi/run_scripts.py). {command: what rank 0 printed};
    "dir dcp" and "dir zero-4" / "dir zero-2": the folders."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("dcp", "zero-4", "zero-2")}
    dcp, zero = "tests/mpi/dcp_reshard.py", "tests/mpi/zero_reshard.py"
    launches = [(4, [f"{dcp} save {folders['dcp']}", f"{zero} save {folders['zero-4']} 2"]),
                (2, [f"{dcp} load {folders['dcp']}", f"{zero} load {folders['zero-4']} 2",
                     f"{zero} save {folders['zero-2']} 1"]),
                (4, [f"{zero} load {folders['zero-2']} 1"])]
    sys.path.insert(0, str(launch.ROOT / "tests" / "mpi"))
    import run_scripts
    sys.path.pop(0)
    found = {f"dir {name}": str(folder) for name, folder in folders.items()}
    for nprocs, commands in launches:
        out = launch.run(nprocs, ["tests/mpi/run_scripts.py", *commands], timeout=300).stdout
        found |= run_scripts.sections(out)
    return found


def test_distributed_checkpoint_saved_at_4_ranks_loads_at_2(reshards):
    """FSDP2 sharded state through torch.distributed.checkpoint, resharded from 4 ranks to 2;
    and the same state through mpidp.Checkpointer (whole), resumed at 2 ranks."""
    folder = reshards["dir dcp"]
    assert "saved at 4 ranks" in reshards[f"tests/mpi/dcp_reshard.py save {folder}"]
    assert (Path(folder) / ".metadata").exists()
    assert len(list(Path(folder).glob("ckpt/step-000000002/optimizer.pt"))) == 1
    out = reshards[f"tests/mpi/dcp_reshard.py load {folder}"]
    assert "loaded at 2 ranks: max |loaded - saved| = 0.0e+00" in out, out
    assert "the Checkpointer's resume: max |resumed - saved| = 0.0e+00, the same step" in out, out


@pytest.mark.parametrize("saved,loaded,stage", [(4, 2, 2), (2, 4, 1)])
def test_zero_sharded_checkpoint_reshards(reshards, saved, loaded, stage):
    """ZeroRedundancyOptimizer.save_sharded at one world size, load_sharded at another; the
    script checks the loaded state and 10 more steps against one process training straight."""
    folder = reshards[f"dir zero-{saved}"]
    out = reshards[f"tests/mpi/zero_reshard.py save {folder} {stage}"]
    assert f"saved at {saved} ranks, stage {stage}" in out, out
    assert len(list(Path(folder).glob("zero-rank*-of-*.pt"))) == saved
    out = reshards[f"tests/mpi/zero_reshard.py load {folder} {stage}"]
    assert f"loaded at {loaded} ranks, stage {stage}: optimizer state vs one process" in out, out
    assert "max relative difference from one process training 20 steps = " in out, out


def test_lab_examples(two_rank_examples):
    """The six lab scripts, in the launch of the 2-rank examples (rank 1's lines too)."""
    out = two_rank_examples[0]
    for script in sorted(LAB):
        for expected in LAB[script]:
            assert expected in out, (script, out)
    by_hand, sequential = map(float, re.search(
        r"\|by hand - DDP\| = (\S+), \|DDP - sequential\| = (\S+)", out).groups())
    assert by_hand < 1e-6 and sequential < 1e-5


def test_digits_example_reports_metrics_and_resumes_identically(tmp_path):
    # The uninterrupted run shards the gradients and the momentum (ZeRO stage 2),
    # the first part of the resumed one only the momentum (stage 1), whose
    # consolidated checkpoint holds a plain SGD state, and the resumed part
    # trains plain: all three must give the same numbers.
    checkpoint = tmp_path / "ck.pt"
    commands = ["examples/train_digits.py --epochs 3 --zero 2",
                # no checkpoint yet: starts afresh
                f"examples/train_digits.py --epochs 2 --checkpoint {checkpoint} --resume --zero 1",
                f"examples/train_digits.py --epochs 3 --checkpoint {checkpoint} --resume"]
    done = launch.run(2, ["tests/mpi/run_scripts.py", *commands], timeout=300)  # one after another
    straight, first, resumed = (_sections(done.stdout)[command] for command in commands)
    assert first.startswith(f"no checkpoint at {checkpoint} yet: starting from epoch 0\nepoch 0:")
    assert done.stderr.count("\r") <= 3 * 4  # stderr is no terminal: no stream of bar updates
    assert checkpoint.exists() and not checkpoint.with_name("ck.pt.partial").exists()
    assert "epoch 2: train loss" in straight and "validation loss" in straight
    assert "(297 samples, 2 ranks)" in straight  # every validation sample counted once
    assert resumed.startswith("epoch 2:")  # epochs 0 and 1 came from the checkpoint
    def metrics(out):  # without the epoch's time in seconds
        return [line.rsplit(", ", 1)[0] if line.startswith("epoch") else line
                for line in out.splitlines() if line.startswith(("epoch 2", "final"))]
    last = metrics(straight)
    assert last == metrics(resumed)
    accuracy = float(last[0].split("validation loss")[1].split("acc")[1].split()[0])
    assert accuracy > 0.9


JOBSCRIPTS = {"slurm-cpu.sh": "srun --mpi=pmi2 --cpu-bind=cores",
              "slurm-gpu.sh": "srun --mpi=pmi2 --cpu-bind=cores --gpu-bind",
              "pbs.sh": "mpiexec -n 4 -ppn 2 -bind-to numa",
              "workstation.sh": f"mpiexec -n 2 -bind-to core:{max(1, len(os.sched_getaffinity(0)) // 2)}"}
# The cluster scripts' dry runs hand the same two commands to one local stand-in launch
# (LAUNCH=(mpiexec -n 2 -bind-to core)): the first of them runs it, the others show they would
# run exactly what it ran (a few seconds of doctor and training each, on CI's 2 cores).
STAND_IN = ["mpiexec -n 2 -bind-to core python -m mpidp doctor",
            "mpiexec -n 2 -bind-to core python examples/train_digits.py --epochs 1"]
STAND_IN_RUNS = "slurm-cpu.sh"
# What a jobscript hands to mpiexec, from where and with how many threads: this mpiexec, first
# on PATH, writes it down, then runs the real one (JOBSCRIPT_MPIEXEC) or nothing.
RECORDING_MPIEXEC = """#!/bin/bash
echo "$PWD OMP_NUM_THREADS=${OMP_NUM_THREADS:-} mpiexec $*" >> "$JOBSCRIPT_RECORD"
if [[ -n "${JOBSCRIPT_MPIEXEC:-}" ]]; then exec "$JOBSCRIPT_MPIEXEC" "$@"; fi
"""


@pytest.mark.parametrize("script", sorted(JOBSCRIPTS))
def test_jobscript_parses_and_its_launch_runs_locally(script, tmp_path):
    path = launch.ROOT / "jobscripts" / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    env = dict(os.environ, MPIDP_DRY_RUN="1", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if script == "workstation.sh":
        env["NRANKS"] = "2"
    runs = script in ("workstation.sh", STAND_IN_RUNS)
    if runs:
        env["JOBSCRIPT_MPIEXEC"] = shutil.which("mpiexec", path=env["PATH"])
    (tmp_path / "mpiexec").write_text(RECORDING_MPIEXEC)
    (tmp_path / "mpiexec").chmod(0o755)
    env.update(PATH=f"{tmp_path}{os.pathsep}{env['PATH']}",
               JOBSCRIPT_RECORD=str(tmp_path / "record"))
    result = subprocess.run(["bash", str(path)], cwd=launch.ROOT, env=env, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert JOBSCRIPTS[script] in result.stdout.splitlines()[0]
    recorded = (tmp_path / "record").read_text().splitlines()
    if script != "workstation.sh":
        assert recorded == [f"{launch.ROOT} OMP_NUM_THREADS=1 {line}" for line in STAND_IN], \
            recorded
    if runs:
        # the doctor passes a correct setup (its seeded misconfigurations: test_doctor.py)
        assert doctor_tests.doctor_passes(result.stdout), result.stdout
        assert "mpidp doctor: no problems found" in result.stdout, result.stdout
        assert "final parameter checksum" in result.stdout
