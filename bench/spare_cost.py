"""What idle spare ranks cost the trainers: configurations taking turns, paired ratios, run by hand.

    python bench/spare_cost.py                 # the default plan; prints the time it expects
    python bench/spare_cost.py --rounds 4 --steps 400 --mpi ompi    # a short look

Each round launches examples/train_preemptible.py once per configuration, always in
the same order, then a last launch without spares per MPI closes the rounds:

- ``ompi``: Open MPI's ULFM, ``mpirun --with-ft ulfm`` with the flags of
  tests/test_healing.py (``.venv-ompi``); ``ompi-detector`` the same with ULFM's
  heartbeat failure detector on (``--mca mpi_ft_detector true``: off by default);
  ``mpich``: the MPICH wheel's mpiexec (``.venv``), where the spares stand by the
  same way and a lost rank would end the job;
- ``--trainers`` ranks (2: one per core) and 0, 1 or 2 spares (``--spares K``);
- ``--sleepers S``: the trainers beside S processes outside MPI that wake every 50 ms,
  as a standing spare does at most: a process on the node, without mpidp's protocol.

Per launch: the time per step, from the ``--warmup``th step's line to the last
(rank 0's lines as they reach this process: the mean, in which a preempted step
counts whole), and per process over that window its CPU seconds and context switches
(a trainer's involuntary ones: preempted; a spare's voluntary ones: its wake-ups), and a
trainer's wait for a core (the scheduler's run delay, as a share of the window): the way
an idle process on the node takes time from the trainers, seen with less noise than the
step (the other ways, a message to a spare or a communicator with it, are not in a step).
Per configuration: the median over launches, and each launch's paired ratio to the
launches without spares of its MPI on either side of it (the same round's and the
next's, geometric mean), so that a drift of the machine cancels: median, interquartile
range and the order statistics around the median that cover it with >= 95 %
(distribution-free). The ratio of the no-spare launches to their neighbours is the
noise floor. Launches of another MPI's family are not compared.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from heal_soak import _launch as _run, _ranks_of  # noqa: E402
from spare_soak import LINE, SCRIPT, _command as _ulfm_command, _launch_rank  # noqa: E402

SLEEPER = "import time\nwhile True:\n    time.sleep(0.05)"  # mpidp.spares' longest sleep
DETECTOR = ("--mca", "mpi_ft_detector", "true")
STARTUP_GUESS = {"ompi": 5.0, "ompi-detector": 5.0, "mpich": 4.0}  # s a launch, besides its steps


def _command(mpi: str, nprocs: int, directory: str, *extra: str) -> list[str]:
    if mpi == "mpich":
        python = ROOT / ".venv" / "bin" / "python"
        return [str(python.parent / "mpiexec"), "-n", str(nprocs), str(python), SCRIPT,
                "--checkpoint-dir", directory, *extra]
    command = _ulfm_command(nprocs, directory, *extra)
    if mpi == "ompi-detector":
        at = command.index("-n")
        command[at:at] = DETECTOR
    return command


def _usage(pid: int) -> tuple[float, dict]:
    """CPU seconds of process ``pid`` (all its threads, ended ones too), and by thread its
    voluntary and involuntary context switches and seconds runnable but waiting for a core
    (the scheduler's run delay)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    threads = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                switches = {key: int(value) for key, value in
                            (line.split(":") for line in f if "ctxt_switches" in line)}
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                delay = int(f.read().split()[1]) / 1e9
        except (FileNotFoundError, ProcessLookupError):  # the thread ended while read
            continue
        threads[task] = (switches["voluntary_ctxt_switches"],
                         switches["nonvoluntary_ctxt_switches"], delay)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), threads


def _spent(before: tuple, after: tuple) -> tuple[float, int, int, float]:
    """CPU seconds, switches and run delay between two ``_usage`` (threads alive at both)."""
    both = [(before[1][t], after[1][t]) for t in after[1] if t in before[1]]
    return (after[0] - before[0], *(sum(b[k] - a[k] for a, b in both) for k in range(3)))


def _launch(mpi: str, trainers: int, spares: int, sleepers: int, args) -> dict:
    """One launch: its time per step past the warm-up, and each process's use over that window."""
    watched: dict[str, int] = {}  # "rank R" / "sleeper S" -> pid, found at the first step's line
    used: list[dict] = []  # {name: usage} at the window's two ends
    ends = (args.warmup, args.steps - 1)  # the last step's line: the ranks may be ending

    def read(process, lines) -> list:
        step = LINE.match(lines[-1][1])
        if step is None:
            return []
        if not watched:
            watched.update({f"rank {_launch_rank(pid)}": pid
                            for pid in _ranks_of(process.pid, SCRIPT)})
            watched.update({f"sleeper {k}": p.pid for k, p in enumerate(beside)})
        if int(step.group(1)) in ends:
            used.append({name: _usage(pid) for name, pid in watched.items()})
        return []

    beside = [subprocess.Popen([sys.executable, "-c", SLEEPER]) for _ in range(sleepers)]
    try:
        with tempfile.TemporaryDirectory() as directory:
            result = _run(_command(mpi, trainers + spares, directory, "--steps", str(args.steps),
                                   "--samples", "7200", "--global-batch", str(12 * trainers),
                                   "--spares", str(spares)), None, args.timeout, read)
    finally:
        for process in beside:
            process.kill()
            process.wait()
    stamps = {int(m.group(1)): t for t, text in result["lines"] if (m := LINE.match(text))}
    if result["status"] != 0 or len(stamps) != args.steps or len(used) != 2:
        raise SystemExit(f"{mpi} spares={spares} sleepers={sleepers}: status {result['status']}, "
                         f"{len(stamps)} steps:\n" + "\n".join(t for _, t in result["lines"][-20:]))
    window = stamps[args.steps] - stamps[args.warmup]
    spent = {name: _spent(used[0][name], used[1][name]) for name in used[1]}
    others = sum(use[0] for name, use in spent.items() if not _trains(name, trainers))
    waited = statistics.mean(use[3] for name, use in spent.items() if _trains(name, trainers))
    return dict(step=window / (args.steps - args.warmup), window=window, spent=spent,
                trainers=trainers, others=others / window, waited=waited / window)


def _trains(name: str, trainers: int) -> bool:
    return name.startswith("rank ") and int(name.split()[1]) < trainers


def _describe(run: dict) -> str:
    """The launch's use by process: CPU s, and switches per second of the window."""
    parts = []
    for name, (cpu, voluntary, involuntary, waited) in sorted(run["spent"].items()):
        parts.append(f"{name} {cpu:.2f} s "
                     + (f"{involuntary / run['window']:.0f} preempted/s, waited "
                        f"{waited / run['window']:.2%}"
                        if _trains(name, run["trainers"])
                        else f"{voluntary / run['window']:.0f} wake-ups/s"))
    return "; ".join(parts)


def _median_interval(values: list[float]) -> tuple[float, float]:
    """The order statistics around the median that cover it with >= 95 % (for 6 values or more)."""
    ordered, n = sorted(values), len(values)
    k = 0  # the largest k with P(Binomial(n, 1/2) < k + 1) <= 2.5 %
    while sum(math.comb(n, i) for i in range(k + 2)) / 2 ** n <= 0.025:
        k += 1
    return ordered[k], ordered[n - 1 - k]


def _summary(name: str, runs: list[dict], ratios: list[float]) -> str:
    line = (f"| {name} | {len(runs)} | {statistics.median(r['step'] for r in runs) * 1e3:.3f} | "
            f"{statistics.median(r['others'] for r in runs):.2%} | "
            f"{statistics.median(r['waited'] for r in runs):.2%} |")
    if len(ratios) < 2:
        return line + " | | |"
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    low, high = _median_interval(ratios) if len(ratios) >= 6 else (None, None)
    interval = f"{low - 1:+.2%} to {high - 1:+.2%}" if low else "(fewer than 6)"
    return line + (f" {statistics.median(ratios) - 1:+.2%} | {q1 - 1:+.2%} to {q3 - 1:+.2%} | "
                   f"{interval} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mpi", nargs="+", default=["ompi", "mpich"],
                        choices=("ompi", "ompi-detector", "mpich"))
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--spares", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sleepers", type=int, default=2, help="0: no configuration with them")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1100)
    parser.add_argument("--warmup", type=int, default=200,
                        help="steps left out at the start (the spares may still be building then)")
    parser.add_argument("--minutes", type=float, default=11.5,
                        help="start no round that would end past this (the closing launches run)")
    parser.add_argument("--guess-ms", type=float, default=3.0,
                        help="a step's time for the estimate printed first")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    if 0 not in args.spares:
        args.spares.insert(0, 0)
    if args.trainers < 1 or min(args.spares) < 0 or args.sleepers < 0:
        raise SystemExit(f"--trainers must be >= 1, --spares and --sleepers >= 0, got "
                         f"{args.trainers}, {args.spares}, {args.sleepers}")
    if not 0 < args.warmup < args.steps:
        raise SystemExit(f"--warmup must be from 1 to --steps less one, got {args.warmup}")
    plan = [(mpi, spares, 0) for mpi in args.mpi for spares in sorted(args.spares)]
    plan += [(mpi, 0, args.sleepers) for mpi in args.mpi if args.sleepers]
    guess = sum(STARTUP_GUESS[mpi] + args.steps * args.guess_ms / 1e3 for mpi, _, _ in plan)
    print(f"{len(plan)} launches a round, {args.rounds} rounds and {len(args.mpi)} closing: about "
          f"{(guess * args.rounds + guess * len(args.mpi) / len(plan)) / 60:.1f} min expected "
          f"(a step {args.guess_ms} ms, start-up {STARTUP_GUESS['ompi']:.0f} s; "
          f"no round starts past --minutes {args.minutes})", flush=True)
    runs, rounds, took, load = _take_turns(plan, args)
    print(f"\n{args.trainers} trainers, {args.steps} steps a launch (the first {args.warmup} left "
          f"out), {rounds} rounds, {took / 60:.1f} min in all; load average {load:.1f} at the "
          f"start, {os.getloadavg()[0]:.1f} at the end\n")
    _table(plan, runs, rounds)


def _take_turns(plan: list[tuple], args) -> tuple[dict, int, float, float]:
    """Rounds of one launch per configuration, then one closing launch without spares per MPI."""
    runs: dict[tuple, list] = {key: [] for key in plan}
    start, rounds, load = time.monotonic(), 0, os.getloadavg()[0]
    while rounds < args.rounds:
        began = time.monotonic()
        for mpi, spares, sleepers in plan:
            run = _launch(mpi, args.trainers, spares, sleepers, args)
            runs[mpi, spares, sleepers].append(run)
            print(f"round {rounds} {mpi} spares={spares} sleepers={sleepers}: "
                  f"{run['step'] * 1e3:.3f} ms a step; {_describe(run)}", flush=True)
        rounds += 1
        took = time.monotonic() - began
        closing = took * len(args.mpi) / len(plan)
        if rounds == 1:
            print(f"a round takes {took:.0f} s: all {args.rounds} about "
                  f"{(took * args.rounds + closing) / 60:.1f} min", flush=True)
        if time.monotonic() - start + took + closing > args.minutes * 60 and rounds < args.rounds:
            print(f"--minutes {args.minutes}: stopping after {rounds} rounds", flush=True)
            break
    for mpi in args.mpi:  # every round has a launch without spares after it
        run = _launch(mpi, args.trainers, 0, 0, args)
        runs[mpi, 0, 0].append(run)
        print(f"closing {mpi} spares=0: {run['step'] * 1e3:.3f} ms a step", flush=True)
    return runs, rounds, time.monotonic() - start, load


def _table(plan: list[tuple], runs: dict, rounds: int) -> None:
    print("| configuration | launches | median ms a step | spares' or sleepers' CPU, of a core | "
          "a trainer's wait for a core | paired ratio to no spares, median | "
          "interquartile range | >= 95 % interval of the median |")
    print("|---|---|---|---|---|---|---|---|")
    for mpi, spares, sleepers in plan:
        base = [run["step"] for run in runs[mpi, 0, 0]]
        around = [math.sqrt(base[r] * base[r + 1]) for r in range(rounds)]
        mine = runs[mpi, spares, sleepers][:rounds]
        if (spares, sleepers) == (0, 0):  # the noise floor: each to the mean of its neighbours
            name = f"{mpi}, no spares (to its neighbours)"
            ratios = [base[r] / math.sqrt(base[r - 1] * base[r + 1]) for r in range(1, rounds)]
        else:
            name = f"{mpi}, {spares} spare(s)" if spares else f"{mpi}, {sleepers} sleeping processes"
            ratios = [run["step"] / pair for run, pair in zip(mine, around)]
        print(_summary(name, mine, ratios))

if __name__ == "__main__":
    main()
