"""Signals at random moments, relaunch until done, compare with an uninterrupted run (not in the suite).

    python tests/preempt_soak.py --nprocs 2 --runs 20 --signal TERM --out soak.json

Each run launches examples/train_preemptible.py (float64, a save every 3
steps, so that some signals land inside a write, 0.2 s a step) and sends the
signal to one random rank or to every rank at a random moment: a quarter of
the runs during start-up, the others a random time after a random step
(forward, backward, an allreduce, a save and the gaps between all get hit). Whatever
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
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import ROOT, launch_argv  # noqa: E402
from test_preemption import ARGS, EXAMPLE, LINE, _ranks_of  # noqa: E402

SAVED = re.compile(r"mpidp: stopped at step (\d+) .*checkpoint saved in ([\d.]+) s")


def launch(nprocs: int, directory: str, moment, signum: int, everyone: bool):
    """One launch; at ``moment`` signal one rank (or all). Returns (status, stdout, first step's time).

    ``moment``: None (no signal), ("start-up", seconds after the launch) or ("step", k, seconds
    after rank 0 printed step k: inside step k+1's forward, backward, allreduces or save).
    """
    command = [*launch_argv(nprocs), sys.executable, EXAMPLE, "--checkpoint-dir",
               directory, *ARGS, "--save-every", "3", "--pace", "0.2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    lines, first, printed = [], [None], threading.Event()
    wanted = moment[1] if moment and moment[0] == "step" else None

    def read():
        for line in process.stdout:
            lines.append(line)
            match = LINE.match(line.strip())
            if match and first[0] is None:
                first[0] = time.monotonic() - started
            if match and int(match.group(1)) == wanted:
                printed.set()

    reader = threading.Thread(target=read)
    reader.start()
    if moment is not None:
        if moment[0] == "start-up":
            time.sleep(moment[1])
        else:
            printed.wait(timeout=600)
            time.sleep(moment[2])
        ranks = _ranks_of(process.pid)
        for pid in (ranks if everyone else random.sample(ranks, min(1, len(ranks)))):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
    process.wait(timeout=600)
    reader.join()
    return process.returncode, "".join(lines), first[0]


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
        status, out, first_step = launch(args.nprocs, os.path.join(base, "reference"), None, 0,
                                         False)
        assert status == 0, out[-2000:]
        reference = LINE.findall(out)
        results = []
        for run in range(args.runs):
            directory = os.path.join(base, f"run{run}")
            everyone = random.random() < 0.5
            if random.random() < 0.25:
                moment = ("start-up", round(random.uniform(0, first_step), 3))
            else:
                moment = ("step", random.randrange(1, len(reference)), round(random.uniform(0, 0.25), 3))
            statuses, printed, saves = [], [], []
            status, out, _ = launch(args.nprocs, directory, moment, signum, everyone)
            while True:
                statuses.append(status)
                printed += LINE.findall(out)
                saves += [float(s) for _, s in SAVED.findall(out)]
                if status == 0 or len(statuses) > 5:
                    break
                status, out, _ = launch(args.nprocs, directory, None, 0, False)
            # every step printed by any launch, a step printed again after a relaunch too
            want = {int(step): loss for step, loss in reference}
            same = (statuses[-1] == 0 and {int(step) for step, _ in printed} == set(want)
                    and all(want[int(step)] == loss for step, loss in printed))
            results.append(dict(moment=moment, everyone=everyone, statuses=statuses,
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
