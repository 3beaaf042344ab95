"""torch's own distributed test suite over gloo and over "mpidp", driven under mpiexec.

    python bench/torch_conformance.py [--ranks 3] [--backends gloo,mpidp] [-k PATTERN]
        [--limit SECONDS] [--report bench/reports/conformance/torch-conformance.txt]

torch ships ``torch/testing/_internal/distributed/distributed_test.py`` in its
wheel; its harness spawns one process per rank, so this script drives the
test methods of its ``DistributedTest._DistTestBase`` itself: it launches
``mpiexec -n RANKS`` once per backend, every rank runs each test in turn after
``mpidp.init_process_group(backend)`` (mpidp's rendezvous: no MASTER_ADDR), the
ranks agree on the outcome (a pass needs every rank to pass; a skip on any
rank is a skip), and rank 0 prints it. A test that outlives ``--limit`` ends
the job; it counts as failed and the next launch goes on after it.

The suite gates some tests by backend name ("Only gloo backend supports
timeouts", sparse all_reduce, monitored_barrier). To ask "does every test that
passes over gloo pass over mpidp", the "mpidp" run uses the suite as imported
for gloo (its decorators and the tests' own ``BACKEND == "gloo"`` branches, so
``test_get_backend``, which compares the two names, fails by construction), with torch's
``dist.monitored_barrier`` replaced by ``mpidp.monitored_barrier`` (torch's
refuses any backend but gloo by name); a test skipped that way runs as
imported for "mpidp" instead, which adds the tests that gloo skips.

Prints pass/fail/skip counts per backend and the gloo passes that fail over mpidp. torch's test
utilities import ``expecttest`` (``pip install expecttest``); without it every test fails at import.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = "torch/testing/_internal/distributed/distributed_test.py"


# -- the worker: one rank of the mpiexec job ------------------------------------------------------

def _load_suite(name: str, backend: str):
    """A fresh copy of torch's distributed_test module, its decorators evaluated for ``backend``."""
    import torch
    os.environ["BACKEND"] = backend
    spec = importlib.util.spec_from_file_location(name, Path(torch.__file__).parent.parent / SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its classes must pickle (the object collectives' tests)
    spec.loader.exec_module(module)
    return module


def _case(module, test: str, rank: int):
    from mpi4py import MPI
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    class Case(module.DistributedTest._DistTestBase, MultiProcessTestCase):
        world_size = property(lambda self: os.environ["WORLD_SIZE"])

        def _barrier(self, *args, **kwargs):
            MPI.COMM_WORLD.Barrier()

    case = Case(test)
    case.rank, case.file_name = rank, os.path.join(os.environ["TEMP_DIR"], "init_file")
    return case


def _run_one(module, test: str, backend: str) -> tuple[str, str]:
    """('pass'|'fail'|'skip', detail) of ``test`` on this rank."""
    import unittest
    from datetime import timedelta

    import torch.distributed as dist
    from mpi4py import MPI

    import mpidp
    world = MPI.COMM_WORLD
    temp = world.bcast(tempfile.mkdtemp(prefix="conformance-") if world.Get_rank() == 0 else None)
    for sub in ("barrier", "test_dir", "init_dir"):
        os.makedirs(os.path.join(temp, sub), exist_ok=True)
    os.environ["TEMP_DIR"] = temp
    timeout = timedelta(seconds=module.CUSTOM_PG_TIMEOUT.get(test, 60))
    if not hasattr(module.DistributedTest._DistTestBase, test):
        return ("skip", "not defined in this build of torch")
    try:
        mpidp.init_process_group(backend, timeout=timeout)
        world.Barrier()
        # as torch's TestCase.setUp: the same seed on every rank (the DDP tests draw one
        # global batch on each rank and compare with a model trained on all of it)
        from torch.testing._internal.common_utils import set_rng_seed
        set_rng_seed()
        getattr(_case(module, test, world.Get_rank()), test)()
        outcome = ("pass", "")
    except unittest.SkipTest as skip:
        outcome = ("skip", str(skip)[:200])
    except SystemExit as exit_:  # the suite's skips for want of GPUs exit with their codes
        from torch.testing._internal.common_distributed import TEST_SKIPS
        skips = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}
        outcome = ("skip", skips[exit_.code]) if exit_.code in skips else \
            ("fail", f"SystemExit: {exit_.code}")
    except BaseException as error:  # noqa: BLE001  a test's failure, reported
        last = traceback.format_exception(error)[-1].strip()
        outcome = ("fail", last[:300])
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return outcome


def worker(backend: str, tests: list[str], limit: float) -> None:
    from mpi4py import MPI

    import mpidp
    world = MPI.COMM_WORLD
    gated = _load_suite("dt_as_gloo", "gloo")
    own = _load_suite(f"dt_as_{backend}", backend) if backend != "gloo" else None
    if backend == "mpidp":
        import torch.distributed as dist
        dist.monitored_barrier = mpidp.monitored_barrier
    for test in tests:
        watchdog = threading.Timer(limit, lambda: os._exit(3))
        if world.Get_rank() == 0:
            print(f"START {test}", flush=True)
        watchdog.start()
        status, detail = _run_one(gated, test, backend)
        if own is not None and world.allreduce(status == "skip", op=MPI.LOR):
            status, detail = _run_one(own, test, backend)
        watchdog.cancel()
        outcomes = world.gather((status, detail), root=0)
        if world.Get_rank() == 0:
            statuses = {s for s, _ in outcomes}
            final = "fail" if "fail" in statuses else "skip" if "skip" in statuses else "pass"
            why = next((d for s, d in outcomes if s == final and d), "")
            print(f"RESULT {test} {final} {why}".rstrip(), flush=True)


# -- the driver -----------------------------------------------------------------------------------

def _all_tests(pattern: str | None) -> list[str]:
    import torch
    text = (Path(torch.__file__).parent.parent / SUITE).read_text()
    names = re.findall(r"^        def (test_\w+)\(self", text, flags=re.M)
    return sorted({n for n in names if pattern is None or re.search(pattern, n)})


def drive(backend: str, ranks: int, tests: list[str], limit: float) -> dict[str, tuple[str, str]]:
    """Run ``tests`` over ``backend``; relaunch after a test that ends the job."""
    results: dict[str, tuple[str, str]] = {}
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1", MPIDP_TIMEOUT="0", WORLD_SIZE=str(ranks),
               PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    remaining = list(tests)
    while remaining:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as listing:
            listing.write("\n".join(remaining))
        command = [mpiexec, "-n", str(ranks), sys.executable, __file__, "--worker", backend,
                   "--tests", listing.name, "--limit", str(limit)]
        current = None
        with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) as job:
            for line in job.stdout:
                if line.startswith("START "):
                    current = line.split()[1]
                elif line.startswith("RESULT "):
                    _, name, status, *why = line.rstrip("\n").split(" ", 3)
                    results[name] = (status, why[0] if why else "")
                    print(f"  {backend}: {name} {status}", flush=True)
                    current = None
        os.unlink(listing.name)
        if current is not None:
            results[current] = ("fail", f"ended the job (exit {job.returncode}; hang or crash)")
            print(f"  {backend}: {current} fail (ended the job)", flush=True)
        done = set(results)
        remaining = [t for t in remaining if t not in done]
        if current is None and remaining:  # the job ended between tests: give up on the rest
            for name in remaining:
                results[name] = ("fail", f"not run: the job exited {job.returncode}")
            break
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--backends", default="gloo,mpidp")
    parser.add_argument("-k", dest="pattern", help="only tests whose name matches this regex")
    parser.add_argument("--limit", type=float, default=120, help="seconds one test may take")
    parser.add_argument("--report", help="also write the summary to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tests", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Path(args.tests).read_text().split(), args.limit)
        return 0
    tests = _all_tests(args.pattern)
    start = time.monotonic()
    results = {b: drive(b, args.ranks, tests, args.limit) for b in args.backends.split(",")}
    lines = [f"torch's distributed_test.py, {len(tests)} tests, {args.ranks} ranks "
             f"({time.monotonic() - start:.0f} s)"]
    for backend, found in results.items():
        counts = {s: sum(1 for v, _ in found.values() if v == s) for s in ("pass", "fail", "skip")}
        lines.append(f"{backend}: {counts['pass']} passed, {counts['fail']} failed, "
                     f"{counts['skip']} skipped")
    if {"gloo", "mpidp"} <= set(results):
        gloo, mine = results["gloo"], results["mpidp"]
        lost = sorted(t for t in tests if gloo[t][0] == "pass" and mine[t][0] != "pass")
        extra = sorted(t for t in tests if gloo[t][0] == "skip" and mine[t][0] == "pass")
        lines.append(f"gloo passes that pass over mpidp: "
                     f"{sum(1 for t in tests if gloo[t][0] == 'pass') - len(lost)} of "
                     f"{sum(1 for t in tests if gloo[t][0] == 'pass')}; passes over mpidp that "
                     f"gloo skips: {len(extra)}")
        lines.append("gloo passes that fail over mpidp:")
        lines += [f"  {t}: {mine[t][1]}" for t in lost] or ["  none"]
        lines.append("failures over mpidp (all):")
        lines += [f"  {t}: {v[1]}" for t, v in sorted(mine.items()) if v[0] == "fail"] or ["  none"]
    text = "\n".join(lines)
    print(text)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
