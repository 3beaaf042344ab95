"""Soak the concurrency rules: run tests/mpi/check_engine.py N times at 2-4 ranks.

    python bench/soak_engine.py --runs 200 [--timeout 240]

Each run is a fresh mpiexec job; a run that fails is a wrong result (or an error), a
run past --timeout a hang. Prints one line per run and the totals; exits non-zero
if any run failed or hung.
"""

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import launch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--sizes", default="2,3,4")
    args = parser.parse_args()
    sizes = itertools.cycle(int(n) for n in args.sizes.split(","))
    failed = hung = 0
    start = time.time()
    for run, nprocs in zip(range(args.runs), sizes):
        begin = time.time()
        try:
            launch.run_pytest(nprocs, "tests/mpi/check_engine.py", args.timeout)
            outcome = "ok"
        except AssertionError as error:
            hang = "did not finish" in str(error)
            hung += hang
            failed += not hang
            outcome = "HANG" if hang else "FAILED"
            print(str(error)[-2000:], file=sys.stderr)
        print(f"run {run + 1}/{args.runs}: {nprocs} ranks {outcome} ({time.time() - begin:.1f} s)",
              flush=True)
    print(f"{args.runs} runs in {time.time() - start:.0f} s: {failed} failed, {hung} hung")
    return 1 if failed or hung else 0


if __name__ == "__main__":
    sys.exit(main())
