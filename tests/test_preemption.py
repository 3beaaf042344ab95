"""examples/train_preemptible.py under a real mpiexec: a signal to one rank, the exit status, resume.

Each run prints ``step S loss L`` (L in repr) on rank 0. An uninterrupted run
at 2 ranks is the reference. A second run gets SIGTERM on one of its ranks,
picked from the processes under mpiexec, once it has printed a few steps; it
must exit with mpidp.preemption.EXIT_STATUS at one step on every rank. Its
checkpoint resumed at 3 ranks (SIGUSR1 to one rank there too), and that one
resumed at 2 again, must follow the reference within float64 summation
noise: the global batches are the same samples in a different summation
order. Run through jobscripts/preemptible.sh, a stop and the relaunch must
print the reference's losses and end with its parameters, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launch import ROOT, launch_argv

EXAMPLE = "examples/train_preemptible.py"
STEPS = 30
ARGS = ["--steps", str(STEPS), "--float64", "--global-batch", "12", "--samples", "120"]
EXIT_STATUS = 75  # mpidp.preemption.EXIT_STATUS (importing mpidp here would start MPI)
RELATIVE = 1e-12
LINE = re.compile(r"^step (\d+) loss (\S+)$", re.M)


def _ranks_of(launcher_pid: int) -> list[int]:
    """The pids of the example's ranks: the python processes below mpiexec."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rpartition(")")[2].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [launcher_pid]
    while stack:
        for pid in children.get(stack.pop(), []):
            stack.append(pid)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if len(argv) > 1 and argv[1].decode().endswith(EXAMPLE):
                found.append(pid)
    return sorted(found)


def _launch(nprocs: int, directory: Path, *extra: str, signal_after: int | None = None,
            signum: int = signal.SIGTERM, timeout: float = 240) -> tuple[int, str, str]:
    """Run the example; with ``signal_after``, signal one rank once that step is printed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [*launch_argv(nprocs), sys.executable, EXAMPLE,
               "--checkpoint-dir", str(directory), *ARGS, *extra]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines, deadline = [], time.monotonic() + timeout
    try:
        for line in process.stdout:
            lines.append(line)
            match = LINE.match(line.strip())
            if signal_after is not None and match and int(match.group(1)) >= signal_after:
                ranks = _ranks_of(process.pid)
                assert len(ranks) == nprocs, f"found rank pids {ranks}"
                os.kill(ranks[-1], signum)  # one rank only
                signal_after = None
            if time.monotonic() > deadline:
                break
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"{' '.join(command)} hung; output:\n{''.join(lines)[-4000:]}")
    return process.returncode, "".join(lines), process.stderr.read()


def _losses(output: str) -> dict[int, str]:
    return {int(step): loss for step, loss in LINE.findall(output)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("preempt")
    status, out, err = _launch(2, base / "straight", "--out", str(base / "straight.pt"))
    assert status == 0, err[-4000:]
    reference = _losses(out)
    assert sorted(reference) == list(range(1, STEPS + 1))
    return base, reference


def _check_stopped(status: int, out: str, err: str) -> int:
    assert status == EXIT_STATUS, f"exit status {status}\n{out[-2000:]}\n{err[-4000:]}"
    stopped = re.search(r"mpidp: stopped at step (\d+)", out)
    assert stopped, out[-2000:]
    return int(stopped.group(1))


def test_sigterm_to_one_rank_stops_every_rank_at_one_step_with_status_75(runs, tmp_path,
                                                                         monkeypatch):
    base, reference = runs
    directory = base / "stopped"
    traces = tmp_path / "trace"
    monkeypatch.setenv("MPIDP_TRACE_DIR", str(traces))  # _launch passes os.environ on
    status, out, err = _launch(2, directory, "--pace", "0.05", signal_after=6)
    stopped = _check_stopped(status, out, err)
    # a stop is no error: the stacks and flight record SIGTERM wrote are gone with the ranks
    assert not traces.exists(), sorted(path.name for path in traces.iterdir())
    assert 6 <= stopped < STEPS
    assert re.search(rf"stopped at step {stopped} \(rank [01]: SIGTERM\)", out), out[-2000:]
    first = _losses(out)
    assert sorted(first) == list(range(1, stopped + 1))
    assert all(first[s] == reference[s] for s in first)
    # one checkpoint, of that step, with every rank's generators
    (name,) = os.listdir(directory)
    assert name == f"step-{stopped:09d}"
    manifest = json.loads((directory / name / "manifest.json").read_text())
    assert manifest["step"] == stopped and manifest["world"] == 2
    assert {"rng-rank00000.pt", "rng-rank00001.pt", "model.pt", "train.pt"} == set(manifest["files"])
    assert manifest["write_seconds"] < 20  # the default deadline


def _close(losses: dict[int, str], reference: dict[int, str]) -> None:
    for step, loss in losses.items():
        want = float(reference[step])
        assert abs(float(loss) - want) <= RELATIVE * abs(want), (step, loss, want)


def test_resume_at_3_then_at_2_follows_the_uninterrupted_run(runs):
    base, reference = runs
    if not (base / "stopped").exists():
        pytest.skip("needs the checkpoint of the test above")
    directory = base / "resize"
    shutil.copytree(base / "stopped", directory)
    saved = int(re.search(r"step-(\d+)", " ".join(os.listdir(directory))).group(1))
    # the same global batch of 12 samples: 4 per rank at 3 ranks, 6 at 2
    status, out, err = _launch(3, directory, "--pace", "0.05", signal_after=saved + 4,
                               signum=signal.SIGUSR1)
    stopped = _check_stopped(status, out, err)
    assert f"resumed at step {saved} on 3 ranks" in out
    at_3 = _losses(out)
    assert sorted(at_3) == list(range(saved + 1, stopped + 1))
    _close(at_3, reference)

    status, out, err = _launch(2, directory, "--out", str(base / "resized.pt"))
    assert status == 0, err[-4000:]
    assert f"resumed at step {stopped} on 2 ranks" in out
    at_2 = _losses(out)
    assert sorted(at_2) == list(range(stopped + 1, STEPS + 1))
    _close(at_2, reference)
    want, got = torch.load(base / "straight.pt"), torch.load(base / "resized.pt")
    for key in want:
        assert (got[key] - want[key]).abs().max() <= RELATIVE * want[key].abs().max(), key


def test_the_jobscript_forwards_the_signal_and_the_relaunch_is_bit_identical(runs, tmp_path):
    """jobscripts/preemptible.sh without a scheduler: SIGUSR1 to the batch shell, as SLURM's
    --signal=B:USR1 sends it, reaches every rank and stops the run with status 75; the
    script relaunches it in place, and the relaunch prints the uninterrupted run's losses
    and ends with its parameters, bit for bit."""
    base, reference = runs
    env = dict(os.environ, MPIDP_DRY_RUN="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               CHECKPOINT_DIR=str(tmp_path / "checkpoints"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("SLURM_JOB_ID", None)
    env.pop("PBS_JOBID", None)
    command = ["bash", "jobscripts/preemptible.sh", *ARGS, "--out", str(tmp_path / "final.pt")]
    shell = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, sent = [], False
    try:
        for line in shell.stdout:
            lines.append(line)
            match = LINE.match(line.strip())
            if not sent and match and int(match.group(1)) >= 5:
                os.kill(shell.pid, signal.SIGUSR1)
                sent = True
        status = shell.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(shell.pid, signal.SIGKILL)
        raise AssertionError("".join(lines)[-4000:]) from None
    output = "".join(lines)
    assert status == 0, output[-4000:]
    assert "launch 0 ended with status 75" in output and "launch 1 ended with status 0" in output
    stopped = int(re.search(r"resumed at step (\d+) on 2 ranks", output).group(1))
    assert stopped >= 5
    printed = LINE.findall(output)
    assert [int(step) for step, _ in printed] == list(range(1, STEPS + 1)), output[-3000:]
    assert {int(step): loss for step, loss in printed} == reference
    want, got = torch.load(base / "straight.pt"), torch.load(tmp_path / "final.pt")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_reproducible_run_stopped_at_2_ranks_and_resumed_at_4_prints_the_same_strings(tmp_path):
    """--reproducible (docs/reproducible.md): the strings of a run stopped by SIGTERM at 2
    ranks and of its resumption at 4 are those of an uninterrupted run in one process, bit for
    bit (6 micro-batches of 2 samples: 3 per rank at 2 ranks, and at 4 dealt unevenly, 2, 2,
    1, 1)."""
    mode = ["--reproducible", "--micro-batches", "6", "--steps", "10"]
    status, out, err = _launch(1, tmp_path / "straight", *mode)
    assert status == 0, err[-4000:]
    reference = _losses(out)
    assert sorted(reference) == list(range(1, 11))
    directory = tmp_path / "stopped"
    status, out, err = _launch(2, directory, *mode, "--pace", "0.05", signal_after=3)
    stopped = _check_stopped(status, out, err)
    first = _losses(out)
    status, out, err = _launch(4, directory, *mode)
    assert status == 0, err[-4000:]
    assert f"resumed at step {stopped} on 4 ranks" in out
    assert {**first, **_losses(out)} == reference
