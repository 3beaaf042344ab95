"""Cut a node's link mid-training and time what follows: the watchdog's report, the job's end.

    python bench/cluster/link_down.py [--ppn 2] [--timeout 5] [--limit 60]

Brings up 2 nodes, trains ``train_until_cut.py`` across them with
``MPIDP_TIMEOUT``, sets n1's port on the bridge down once n1 has trained a few
steps, then waits at most ``--limit`` seconds for the launcher to end. Prints
when the stall summary appeared and whether the launcher ended by itself or
was killed by the harness, and how many processes the harness had to kill on
the nodes afterwards. The launcher is the ``mpiexec`` beside this Python: run
it with another environment's Python for Open MPI or Intel MPI.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Cluster, launcher_flavor  # noqa: E402

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ppn", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=5, help="MPIDP_TIMEOUT, seconds")
    parser.add_argument("--limit", type=float, default=60, help="seconds after the cut")
    parser.add_argument("--prefix", default="mpidpcut")
    args = parser.parse_args(argv)
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    with Cluster(2, rate="1gbit", prefix=args.prefix) as cluster:
        job = cluster.launch([sys.executable, HERE / "train_until_cut.py"], ppn=args.ppn,
                             env={"MPIDP_TIMEOUT": f"{args.timeout:g}"})
        try:
            if not job.wait_for(f"step 3 rank {args.ppn}", 180):
                print(job.output[-4000:])
                raise SystemExit("n1 never trained")
            cut = time.monotonic()
            cluster.set_link("n1", up=False)
            job.wait_for("stall summary", args.limit)
            reported = time.monotonic() - cut
            result = job.wait(max(0.0, args.limit - reported))
        finally:
            job.kill()
    summary = re.search(r"stall summary: .*", result.output)
    print(result.output[-2500:])
    print(f"launcher: {launcher_flavor(mpiexec)} ({mpiexec})")
    print(f"stall summary: {'after %.1f s' % reported if summary else 'none'}")
    ended = ("killed by the harness at the limit" if result.timed_out
             else f"ended by itself with status {result.returncode}")
    print(f"job: {ended}, {time.monotonic() - cut:.1f} s after the cut; "
          f"{result.swept} processes left on the nodes, killed by the harness")
    return 0 if summary else 1


if __name__ == "__main__":
    sys.exit(main())
