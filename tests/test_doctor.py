"""``python -m mpidp doctor``: each misconfiguration seeded in a real launch, and a correct one.

The judges are pure functions of the ranks' facts, checked here on facts written
by hand where a machine without GPUs cannot seed them (GPUs); every other check
runs for real under mpiexec: one launch with eight
misconfigurations at once (a launcher that disagrees with MPI, a low thread
level, two ranks pinned to one core, too many threads, another mpidp on one rank,
a model too big for /dev/shm, an address rank 0 does not have, bad, unknown and
differing MPIDP_* settings, among them values that stop a plain ``import mpidp``),
and a process that MPI sees alone while Slurm says two, with the same bad settings.
A correct setup passes in every job script's dry run (test_mpi.py), which runs the
doctor first.
"""

import os
import re
import signal
import subprocess
import sys

import pytest

import launch
from mpidp import cuda, settings
from mpidp.doctor.checks import judge_gpus, judge_launch, judge_settings, judge_versions


def _doctor(command: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full.update(env)
    for name in [n for n in full if n.startswith("MPIDP_") and n not in env]:
        del full[name]  # the outer run's settings are not the seeded ones
    try:
        return subprocess.run(command, cwd=launch.ROOT, env=full, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{' '.join(command)} did not finish in {timeout} s (hang?)") from None


def _lines(result: subprocess.CompletedProcess) -> dict[str, str]:
    """check name -> its report line (and fix), from rank 0's report."""
    found = {}
    for line in result.stdout.splitlines():
        words = line.split()
        if len(words) > 2 and words[0] in ("ok", "FAIL"):
            found[words[1]] = line
    return found


def doctor_passes(output: str) -> bool:
    """Whether a doctor's report (rank 0's stdout) has its 10 checks and no problem."""
    lines = _lines(subprocess.CompletedProcess([], 0, output, ""))
    return len(lines) == 10 and "FAIL" not in output and "no problems found" in output


# Each bad MPIDP_* name or value, and the start of the finding the doctor makes of it. The
# values of MPIDP_TIMEOUT, MPIDP_CHUNK_MB and MPIDP_TRACE_SIGNALS stop a plain `import mpidp`.
BAD_SETTINGS = {
    "MPIDP_" + "BUCKET_MB": ("-1", "MPIDP_BUCKET_MB is no mpidp setting: mpidp ignores it"),
    "MPIDP_TIMEOUT": ("abc", "MPIDP_TIMEOUT must be a number >= 0, got 'abc'"),
    "MPIDP_CHUNK_MB": ("-1", "MPIDP_CHUNK_MB must be a number >= 0.001, got '-1'"),
    "MPIDP_TRACE_SIGNALS": ("SIGFOO", "MPIDP_TRACE_SIGNALS must name signals that can be caught"),
    "MPIDP_POOL_SIZE": ("0", "MPIDP_POOL_SIZE must be an integer >= 1, got '0'"),
    "MPIDP_TEST_KILL": ("1:0", "MPIDP_TEST_KILL must be RANK:N[:TEXT][,RANK:N[:TEXT]...] "
                               "with N >= 1"),
    "MPIDP_TIMEOUT" + "S": ("5", "did you mean MPIDP_TIMEOUT?"),
}  # the unknown names spelt in two pieces, so that no table of docs/environment.md must list them


def test_doctor_names_each_seeded_misconfiguration():
    mpiexec = launch.mpiexec()
    openmpi = bool(launch._oversubscribe_flags(mpiexec))
    doctor = [sys.executable, "-m", "mpidp", "doctor"]
    bad_settings = {name: value for name, (value, _) in BAD_SETTINGS.items()}

    # a correct setup: every job script's dry run (test_mpi.py) runs the doctor first, bound
    # to cores, and needs its 10 checks to pass (doctor_passes below)
    seeded = dict(OMPI_COMM_WORLD_SIZE="3",  # launch (Hydra passes it on untouched)
                  MPI4PY_RC_THREAD_LEVEL="serialized",  # threading
                  OMP_NUM_THREADS="4",  # threads
                  MPIDP_RDZV_ADDR="198.51.100.1",  # rendezvous: no address of this host
                  **bad_settings)  # settings
    # versions: imported as python -m mpidp doctor imports it (sys.argv "-m", "doctor")
    other_mpidp = ("import sys; sys.argv[:2] = ['-m', 'doctor']; import mpidp; "
                   "mpidp.__version__ = '0.0.other'; "
                   "from mpidp.__main__ import main; sys.exit(main(sys.argv[1:]))")
    shm = ["doctor", "--gradients-mb", "1e9"]  # shm: far more than /dev/shm holds
    pinned = ["taskset", "-c", sorted(os.sched_getaffinity(0))[0]]  # binding: both on one core
    if openmpi:
        pytest.skip("the seeded launch uses MPICH Hydra's per-program -env")
    bad = _doctor([mpiexec, "-n", "1", *map(str, pinned), sys.executable, "-m", "mpidp", *shm, ":",
                   "-n", "1", "-env", "MPIDP_CHUNK_MB", "8",  # settings: differ across ranks
                   *map(str, pinned), sys.executable, "-c", other_mpidp, *shm], seeded)
    lines = _lines(bad)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "aborting" not in bad.stderr, bad.stderr  # every rank ends with 1 together
    failed = sorted(name for name, line in lines.items() if line.split()[0] == "FAIL")
    assert failed == sorted(["launch", "threading", "binding", "threads", "versions", "shm",
                             "rendezvous", "settings"]), bad.stdout
    assert "OMPI_COMM_WORLD_SIZE=3" in lines["launch"]
    assert "serialized" in lines["threading"]
    assert "2 ranks on 1 core; run at most 1 rank per node" in lines["binding"]
    assert "fix: give each rank cores of its own, launching with 'mpiexec -bind-to core:1 ...'" \
        in bad.stdout, bad.stdout
    assert "mpidp 0.0.other" in lines["versions"] and "rank 1" in lines["versions"]
    assert "198.51.100.1" in lines["rendezvous"]
    rank_0 = lines["settings"].split("rank 1:")[0]  # CHUNK_MB differs: the ranks' lists do too
    for text in [finding for _, finding in BAD_SETTINGS.values()]:
        assert text in rank_0, lines["settings"]
    assert "MPIDP_CHUNK_MB differs across ranks: rank 0: '-1'; rank 1: '8'" in lines["settings"]
    assert bad.stdout.count("fix: ") == 8, bad.stdout
    assert "mpidp doctor: 2 ranks on 1 host," in bad.stdout

    # srun --mpi=none; the bad settings at one rank
    alone = _doctor(doctor, dict(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2", **bad_settings))
    assert alone.returncode == 1, alone.stdout + alone.stderr
    assert "MPI sees 1 rank but the launcher started SLURM_STEP_NUM_TASKS=2" in alone.stdout
    assert "mpidp doctor: 1 rank on 1 host," in alone.stdout
    for text in [finding for _, finding in BAD_SETTINGS.values()]:
        assert text in _lines(alone)["settings"], alone.stdout

    # a plain import raises the setting's error on every rank (and the job ends)
    plain = _doctor([mpiexec, "-n", "2", sys.executable, "-c", "import mpidp"],
                    dict(MPIDP_TIMEOUT="abc"), timeout=120)
    assert plain.returncode != 0
    assert plain.stderr.count("ValueError: MPIDP_TIMEOUT must be a number >= 0, got 'abc'") == 2, \
        plain.stderr


def test_the_settings_are_checked_with_the_parser_that_reads_them(monkeypatch):
    for name in [n for n in os.environ if n.startswith("MPIDP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MPIDP_DRY_RUN", "1")  # the job scripts': known, not reported
    assert settings.problems() == []
    for name, (value, finding) in BAD_SETTINGS.items():
        monkeypatch.setenv(name, value)
        found = [p for p in settings.problems() if p.startswith(name + " ")]
        assert len(found) == 1 and finding in found[0], (name, settings.problems())
        if name in settings.SETTINGS:
            with pytest.raises(ValueError, match=re.escape(finding)):
                settings.get(name)
            monkeypatch.setattr(settings, "_tolerant", True)  # the doctor's import: the default
            assert settings.get(name) == settings.SETTINGS[name].default
            monkeypatch.setattr(settings, "_tolerant", False)
        monkeypatch.delenv(name)
    for value, numbers in (("usr1, SIGTERM,TERM", (signal.SIGUSR1, signal.SIGTERM)), ("None", ())):
        monkeypatch.setenv("MPIDP_TRACE_SIGNALS", value)
        assert settings.get("MPIDP_TRACE_SIGNALS") == numbers
    monkeypatch.setenv("MPIDP_TRACE_SIGNALS", "SIGKILL")
    assert "got 'SIGKILL'" in settings.problems()[0]
    monkeypatch.setenv("MPIDP_TEST_KILL", "1:3,0:2:bcast")
    assert settings.get("MPIDP_TEST_KILL") == {(1, ""): 3, (0, "bcast"): 2}


def test_the_launch_judge_takes_the_launchers_word_against_mpis():
    assert judge_launch([("PMI_SIZE", "2", 2), ("PMI_SIZE", "2", 2)]).ok
    assert judge_launch([(None, None, 1)]).ok  # a plain python: nothing to compare
    assert not judge_launch([("SLURM_STEP_NUM_TASKS", "4", 1)]).ok


def test_the_gpu_judge_finds_a_rank_without_its_gpu_and_ranks_on_one_gpu():
    off = cuda.Decision(False, "the MPI library reports no CUDA support; host staging")
    none = ("n1", None, None, None)
    assert judge_gpus([none, none], off).ok
    own = [("n1", None, "GPU-a", False), ("n1", None, "GPU-b", False), ("n2", None, "GPU-a", False)]
    assert judge_gpus(own, off).ok  # GPU-a on n1 and on n2 are two GPUs
    hidden = judge_gpus([("n1", "0", "GPU-a", False), ("n1", "", None, None)], off)
    assert not hidden.ok and "ranks [1] see no GPU while ranks [0] do" in hidden.found
    shared = judge_gpus([("n1", None, "GPU-a", False), ("n1", None, "GPU-a", False)], off)
    assert not shared.ok and "ranks [0, 1] on n1 use one GPU" in shared.found
    forced = judge_gpus([("n1", None, "GPU-a", False)], cuda.Decision(True, "MPIDP_CUDA_AWARE=1"))
    assert not forced.ok and "reports no CUDA support" in forced.found


def test_the_settings_and_versions_judges_name_the_ranks_that_differ():
    assert judge_settings([([], {"MPIDP_TIMEOUT": "60"}), ([], {"MPIDP_TIMEOUT": "60"})]).ok
    differ = judge_settings([([], {"MPIDP_TIMEOUT": "60"}), ([], {})])
    assert not differ.ok and "rank 0: '60'; rank 1: unset" in differ.found
    same = ("python 3.11", "torch 2.13.0", "mpidp 0.1.0", "mpi4py 4.1.2", "MPICH 5.0.2")
    assert judge_versions([same, same]).ok
    other = judge_versions([same, (*same[:1], "torch 2.12.0", *same[2:])])
    assert not other.ok and "rank 1: torch 2.12.0" in other.found
