"""Soak the concurrency rules: tests/mpi/check_engine.py and the race schedules, many times.

    python bench/soak_engine.py --launches 12 --seeds-per-launch 20 [--sizes 2,3,4] [--debug]

Each launch is a fresh mpiexec job of the whole of tests/mpi/check_engine.py with a
fresh block of race-schedule seeds (tests/mpi/races.py), at 2, 3 and 4 ranks in turn;
a failed launch is a wrong result (or an error), one past --timeout a hang. After
every third launch one schedule runs with a rank raising mid-round
(``races.py SEED --raise-at RANK:ROUND``): that job must end, non-zero, with the
rank's error, within --timeout. ``--debug`` runs every job with ``MPIDP_DEBUG=1``.
Prints one line per job and the totals; exits non-zero on any wrong result, hang,
or raise that did not end the job.
"""

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import launch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=12)
    parser.add_argument("--seeds-per-launch", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--sizes", default="2,3,4")
    parser.add_argument("--debug", action="store_true", help="MPIDP_DEBUG=1 in every job")
    args = parser.parse_args()
    debug = {"MPIDP_DEBUG": "1"} if args.debug else {}
    sizes = itertools.cycle(int(n) for n in args.sizes.split(","))
    failed = hung = schedules = raised = unended = 0
    start = time.time()
    seed = args.first_seed
    for launch_index, nprocs in zip(range(args.launches), sizes):
        seeds = list(range(seed, seed + args.seeds_per_launch))
        seed += args.seeds_per_launch
        begin = time.time()
        try:
            launch.run_pytest(nprocs, "tests/mpi/check_engine.py", args.timeout,
                              env={"RACE_SEEDS": ",".join(map(str, seeds)), **debug})
            outcome = "ok"
            schedules += len(seeds)
        except AssertionError as error:
            hang = "did not finish" in str(error)
            hung += hang
            failed += not hang
            outcome = "HANG" if hang else "FAILED"
            print(str(error)[-3000:], file=sys.stderr)
        print(f"launch {launch_index + 1}/{args.launches}: {nprocs} ranks, seeds {seeds[0]}-"
              f"{seeds[-1]}: {outcome} ({time.time() - begin:.1f} s)", flush=True)
        if launch_index % 3 == 2:
            draw = random.Random(seeds[0])
            victim, round_ = draw.randrange(nprocs), draw.randrange(6)
            begin = time.time()
            result = launch.run(nprocs, ["tests/mpi/races.py", str(seeds[0]), "--raise-at",
                                         f"{victim}:{round_}"], args.timeout, check=False,
                                env=debug)
            ended = result.returncode != 0 and f"rank {victim} raises in round {round_}" in \
                result.stdout + result.stderr
            raised += 1
            unended += not ended
            print(f"  raise on rank {victim} in round {round_} of seed {seeds[0]}: "
                  f"{'ended the job' if ended else 'DID NOT END THE JOB'} "
                  f"(exit {result.returncode}, {time.time() - begin:.1f} s)", flush=True)
    print(f"{args.launches} launches{' (MPIDP_DEBUG=1)' if debug else ''}, {schedules} race "
          f"schedules passed, in {time.time() - start:.0f} s: {failed} launches wrong, {hung} hung; "
          f"{raised - unended} of {raised} raising runs ended the job")
    return 1 if failed or hung or unended else 0


if __name__ == "__main__":
    sys.exit(main())
