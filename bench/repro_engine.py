"""Run issue 17's reproductions many times each: right result or a clear error, never a hang.

    python bench/repro_engine.py --runs 20 [--only 1,2,3,4] [--timeout 120]

1. Two DDPs reducing in one backward (a GAN step), overlap="thread", shared memory on,
   3 ranks: gradients equal one process (tests/mpi/check_engine.py, that case).
2. Async all_reduces above the chunk size on two groups of the same ranks, waited in a
   per-rank random order, 3 ranks, ``MPIDP_CHUNK_MB=0.05`` (every tensor chunked).
3. torch's DDP over "mpidp", one rank skips a step, ``MPIDP_TIMEOUT=8``: the watchdog
   ends the job with a stall report naming the all_reduce (tests/mpi/backend_stall.py).
4. The same with the group's timeout (4 s): the job ends with torch's DistBackendError
   naming the timeout; and (5) ``wait()`` on a late peer raises after a 2 s group timeout.
6, 7. An allreduce whose element count differs across ranks, through mpidp.comm and through
   torch.distributed (tests/mpi/mismatched_call.py): the job ends naming the collective
   and ``MPIDP_DEBUG=1``, never a silent result.

Each run is a fresh mpiexec job. A run that passes its check is "ok"; one that ends
otherwise is "WRONG"; one past --timeout is "HANG". Prints one line per run, then per
reproduction the count and the seconds (to the end of a run, or from the stall to the
end of the job for 3 and 4). Exits non-zero on any WRONG or HANG.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import launch  # noqa: E402

ENGINE = "tests/mpi/check_engine.py"


def _pytest(nprocs, selection, env=None):
    def run(timeout):
        result = launch.run(nprocs, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                                     ENGINE, "-k", selection], timeout, env=env, check=False)
        return result.returncode == 0 and " passed" in result.stdout, None
    return run


def _stall(mode, needle):
    def run(timeout):
        result = launch.run(2, ["tests/mpi/backend_stall.py", mode], timeout, check=False,
                            env={"MPIDP_TIMEOUT": "8" if mode == "watchdog" else "0"})
        ended = time.time()
        output = result.stdout + result.stderr
        stalls = [float(part.split()[0].rstrip("rank"))
                  for part in result.stdout.split(" stalls at ")[1:]]
        ok = (result.returncode != 0 and needle in output and stalls
              and "without the skipped step being noticed" not in output)
        return ok, (ended - min(stalls)) if stalls else None
    return run


def _mismatch(kind):
    def run(timeout):
        result = launch.run(2, ["tests/mpi/mismatched_call.py", kind], timeout, check=False)
        output = result.stdout + result.stderr
        named = "allreduce" in output and "MPIDP_DEBUG=1" in output
        return (result.returncode != 0 and named and "[mpidp rank 0/2]" in output
                and "went on past a mismatched allreduce" not in output), None
    return run


REPRODUCTIONS = {
    1: ("two DDPs in one backward, thread, shm on, 3 ranks",
        _pytest(3, "two_ddps and thread and True")),
    2: ("async chunked all_reduces on two groups, any wait order, 3 ranks",
        _pytest(3, "two_groups_in_any_wait_order", env={"MPIDP_CHUNK_MB": "0.05"})),
    3: ("torch DDP over mpidp, a skipped step, MPIDP_TIMEOUT=8", _stall("watchdog", "stall")),
    4: ("torch DDP over mpidp, a skipped step, group timeout 4 s",
        _stall("timeout", "did not complete within the group's timeout of 4 s")),
    5: ("wait() past a 2 s group timeout raises DistBackendError, 2 ranks",
        _pytest(2, "group_timeout_fails_wait")),
    6: ("mpidp.comm.allreduce of 1000 against 1500 floats (MPICH ends the process)",
        _mismatch("count")),
    7: ("torch.distributed all_reduce of 1000 against 1500 floats over mpidp",
        _mismatch("backend")),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--only", default=",".join(map(str, REPRODUCTIONS)))
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    bad = 0
    summary = []
    for key in (int(k) for k in args.only.split(",")):
        name, run = REPRODUCTIONS[key]
        counts = {"ok": 0, "WRONG": 0, "HANG": 0}
        seconds = []
        for index in range(args.runs):
            begin = time.time()
            try:
                ok, after_stall = run(args.timeout)
                outcome = "ok" if ok else "WRONG"
            except AssertionError:  # launch.run: past the timeout
                outcome, after_stall = "HANG", None
            took = after_stall if after_stall is not None else time.time() - begin
            seconds.append(took)
            counts[outcome] += 1
            print(f"{key}. {name}: run {index + 1}/{args.runs}: {outcome} ({took:.1f} s)",
                  flush=True)
        bad += counts["WRONG"] + counts["HANG"]
        summary.append(f"{key}. {name}: {counts['ok']}/{args.runs} ok, {counts['WRONG']} wrong, "
                       f"{counts['HANG']} hung; seconds median {statistics.median(seconds):.1f}, "
                       f"max {max(seconds):.1f}")
    print("\n".join(summary))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
