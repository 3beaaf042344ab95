"""Signals at random moments, relaunch until done, compare with an uninterrupted run (not in the suite).

    python tests/preempt_soak.py --nprocs 2 --runs 20 --signal TERM --out soak.json

Each run launches examples/train_preemptible.py (float64, a save every 3
steps, so that some signals land inside a write, 0.2 s a step), waits a random time, and
sends the signal to one random rank or to every rank (start-up, forward,
backward, an allreduce, a save and the gaps between all get hit). Whatever
the launch then does, it is launched again on the same directory, as
jobscripts/preemptible.sh does after a signal, until one launch finishes.
The printed losses of the sequence, step by step, must equal the
uninterrupted run's in repr; the save times come from the stop messages.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import ROOT, mpiexec  # noqa: E402
from test_preemption import ARGS, EXAMPLE, LINE, _ranks_of  # noqa: E402

SAVED = re.compile(r"mpidp: stopped at step (\d+) .*checkpoint saved in ([\d.]+) s")


def launch(nprocs: int, directory: str, delay: float | None, signum: int, everyone: bool):
    """One launch; after ``delay`` seconds signal one rank (or all). Returns (status, stdout)."""
    command = [mpiexec(), "-n", str(nprocs), sys.executable, EXAMPLE, "--checkpoint-dir",
               directory, *ARGS, "--save-every", "3", "--pace", "0.2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    if delay is not None:
        end = time.monotonic() + delay
        while time.monotonic() < end and process.poll() is None:
            time.sleep(0.005)
        ranks = _ranks_of(process.pid)
        for pid in (ranks if everyone else random.sample(ranks, min(1, len(ranks)))):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
    out, _ = process.communicate(timeout=600)
    return process.returncode, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--signal", default="TERM", choices=["TERM", "USR1"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    random.seed(args.seed)
    signum = getattr(signal, "SIG" + args.signal)
    with tempfile.TemporaryDirectory() as base:
        started = time.monotonic()
        status, out = launch(args.nprocs, os.path.join(base, "reference"), None, 0, False)
        length = time.monotonic() - started
        assert status == 0, out[-2000:]
        reference = LINE.findall(out)
        results = []
        for run in range(args.runs):
            directory = os.path.join(base, f"run{run}")
            delay, everyone = random.uniform(0, length), random.random() < 0.5
            statuses, printed, saves = [], [], []
            status, out = launch(args.nprocs, directory, delay, signum, everyone)
            while True:
                statuses.append(status)
                printed += LINE.findall(out)
                saves += [float(s) for _, s in SAVED.findall(out)]
                if status == 0 or len(statuses) > 5:
                    break
                status, out = launch(args.nprocs, directory, None, 0, False)
            # every step printed by any launch, a step printed again after a relaunch too
            want = {int(step): loss for step, loss in reference}
            same = (statuses[-1] == 0 and {int(step) for step, _ in printed} == set(want)
                    and all(want[int(step)] == loss for step, loss in printed))
            results.append(dict(delay=round(delay, 3), everyone=everyone, statuses=statuses,
                                saves=saves, same=same))
            print(json.dumps(results[-1]), flush=True)
    saves = [s for r in results for s in r["saves"]]
    summary = dict(nprocs=args.nprocs, signal=args.signal, runs=len(results),
                   identical=sum(r["same"] for r in results),
                   stops=len(saves), save_seconds_median=statistics.median(saves) if saves else None,
                   save_seconds_max=max(saves) if saves else None, results=results)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))


if __name__ == "__main__":
    main()
