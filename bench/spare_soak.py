"""Spare ranks under Open MPI's ULFM: training ranks SIGKILLed at random moments, run by hand.

    python bench/spare_soak.py --launches 20 --spares 1 [--zero] [--seed 0]
    python bench/spare_soak.py --launches 20 --spares 2 --zero
    python bench/spare_soak.py --cost --launches 6      # spares idle against none

Each launch runs examples/train_preemptible.py at 4+K ranks with ``--spares K``
(``--pace`` seconds of sleep in each step, a checkpoint every 4 steps) and
SIGKILLs K training ranks from this process, one after another: a random
training rank (rank 0 among them), a random time after a random step was
printed, whatever it does then (forward, backward, an allreduce, the
checkpoint's write, the pace's sleep, between steps). Every launch must end
with status 0, print one ``going on at 4 ranks`` line per kill, and print for
every step the uninterrupted 4-rank run's loss string (one launch, first). It
prints one line per launch, then matched/total and the times from the kill
to the heal's line (the spare training again) and the Healer's own figure.

``--cost`` (the finer measurement, at 2 trainers: bench/spare_cost.py): launches of 4
ranks, 4+1 and 4+2 with the spares idle, interleaved,
no pace, 300 steps: the time per step from step 50 to 250 (rank 0's lines as they
reach this process), and the CPU seconds each rank used meanwhile.
Needs the Open MPI environment of tests/test_healing.py (``.venv-ompi``).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from heal_soak import _launch as _run, _python, _ranks_of  # noqa: E402

SCRIPT = "examples/train_preemptible.py"
STEPS = 12
LINE = re.compile(r"^step (\d+) loss (\S+)$")
HEALED = re.compile(r"healed in (\S+) s, going on at (\d+) ranks from step (\d+)")


def _command(nprocs: int, directory: str, *extra: str) -> list[str]:
    """mpirun of the example at ``nprocs`` ranks under ULFM (heal_soak's, another script)."""
    python = _python()
    return [str(python.parent / "mpirun"), "--with-ft", "ulfm", "--mca", "pml", "ob1", "--mca",
            "btl", "tcp,self", "--oversubscribe", "--bind-to", "none", "-n", str(nprocs),
            str(python), SCRIPT, "--checkpoint-dir", directory, *extra]


def _launch_rank(pid: int) -> int | None:
    """The launch rank of process ``pid`` (Open MPI's or MPICH's environment), or None once
    it is gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for entry in f.read().split(b"\0"):
                if entry.startswith((b"OMPI_COMM_WORLD_RANK=", b"PMI_RANK=")):
                    return int(entry.split(b"=", 1)[1])
    except OSError:
        return None
    return None


def _launch(command: list[str], plan: list[tuple], timeout: float = 400) -> dict:
    """Run ``command``; ``plan``: (after this many steps' lines, delay, launch rank) per kill."""
    kills: list[float] = []

    def kill(process, lines) -> list[float]:
        steps = sum(1 for _, text in lines if LINE.match(text))
        if len(kills) < len(plan) and LINE.match(lines[-1][1]) and steps >= plan[len(kills)][0]:
            _, delay, victim = plan[len(kills)]
            time.sleep(delay)
            for pid in _ranks_of(process.pid, SCRIPT):
                if _launch_rank(pid) == victim:
                    os.kill(pid, signal.SIGKILL)
            kills.append(time.time())
        return kills

    return _run(command, None, timeout, kill)


def _strings(lines) -> dict[str, str]:
    return dict(m.groups() for _, text in lines if (m := LINE.match(text)))


def soak(args) -> int:
    extra = ["--steps", str(STEPS), "--save-every", "4", "--pace", str(args.pace),
             *(["--zero"] if args.zero else [])]
    with tempfile.TemporaryDirectory() as directory:
        straight = _launch(_command(4, directory, *extra), [])
    want = _strings(straight["lines"])
    assert straight["status"] == 0 and len(want) == STEPS, straight
    draw = random.Random(args.seed)
    matched, to_line, own, late = 0, [], [], 0
    for launch in range(args.launches):
        # after a random step's line (one of steps 1-10; with two kills, 1-5 then at least 3
        # lines later), a random delay; a random training rank, another for the second
        afters = [draw.randrange(1, 11 if args.spares == 1 else 6)]
        if args.spares == 2:
            afters.append(draw.randrange(afters[0] + 3, 12))
        plan = [(after, draw.uniform(0.0, 2 * args.pace), victim)
                for after, victim in zip(afters, draw.sample(range(4), args.spares))]
        with tempfile.TemporaryDirectory() as directory:
            result = _launch(_command(4 + args.spares, directory, *extra,
                                      "--spares", str(args.spares)), plan)
        healed = [(t, m) for t, text in result["lines"] if (m := HEALED.search(text))]
        got = _strings(result["lines"])
        last = max((t for t, text in result["lines"] if LINE.match(text)), default=0.0)
        if len(result["kills"]) < len(plan) or result["kills"][-1] > last:
            late += 1
            print(f"launch {launch}: {plan}: a kill came after the last step; not counted",
                  flush=True)
            continue
        problems = []
        if result["status"] != 0:
            problems.append(f"status {result['status']}")
        if [int(m.group(2)) for _, m in healed] != [4] * len(plan):
            problems.append(f"healed lines {[m.group(0) for _, m in healed]}")
        if got != want:
            problems.append(f"strings differ at steps "
                            f"{sorted(int(s) for s in set(want) | set(got) if want.get(s) != got.get(s))}")
        for kill, (t, m) in zip(result["kills"], healed):
            to_line.append(t - kill)
            own.append(float(m.group(1)))
        matched += not problems
        print(f"launch {launch}: kills (after line, delay, rank) {[(a, round(d, 3), v) for a, d, v in plan]}: "
              f"healed {[m.group(0) for _, m in healed]}: "
              + ("matched" if not problems else "FAILED: " + "; ".join(problems)), flush=True)
        if problems:
            print("\n".join(text for _, text in result["lines"])[-3000:], flush=True)
    counted = args.launches - late
    print(f"{'zero' if args.zero else 'ddp'} spares={args.spares}: {matched}/{counted} matched the "
          f"uninterrupted run string for string ({late} not counted: a kill after the last step)")
    for name, values in (("kill to the heal's line (training again)", to_line),
                         ("the Healer's own (detection to going on)", own)):
        if values:
            print(f"{name}: median {statistics.median(values):.2f} s, max {max(values):.2f} s "
                  f"over {len(values)}")
    return 0 if matched == counted else 1


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cost(args) -> int:
    """The time per step from the 50th step's line to the 250th at 4 ranks, 4+1 and 4+2
    (spares idle), and the CPU seconds each rank used in between."""
    times: dict[int, list[float]] = {0: [], 1: [], 2: []}
    for _ in range(args.launches):
        for spares in times:
            cpu: dict[int, dict[int, float]] = {}  # at step 50, 250: {launch rank: CPU s}

            def read_cpu(process, lines) -> list[float]:
                step = LINE.match(lines[-1][1])
                if step is not None and int(step.group(1)) in (50, 250):
                    cpu[int(step.group(1))] = {_launch_rank(pid): _cpu_seconds(pid)
                                               for pid in _ranks_of(process.pid, SCRIPT)}
                return []

            with tempfile.TemporaryDirectory() as directory:
                result = _run(_command(4 + spares, directory, "--steps", "300", "--samples",
                                       "7200", "--spares", str(spares)), None, 400, read_cpu)
            stamps = [t for t, text in result["lines"] if LINE.match(text)]
            assert result["status"] == 0 and len(stamps) == 300, result["lines"][-20:]
            times[spares].append((stamps[249] - stamps[49]) / 200)  # past the start-up
            used = {rank: round(cpu[250][rank] - cpu[50][rank], 2) for rank in sorted(cpu[250])}
            print(f"spares={spares}: {times[spares][-1] * 1e3:.3f} ms a step; CPU s by launch "
                  f"rank from step 50 to 250: {used}", flush=True)
    base = statistics.median(times[0])
    for spares, values in times.items():
        print(f"spares={spares}: median over launches {statistics.median(values) * 1e3:.3f} ms "
              f"({statistics.median(values) / base - 1:+.1%} against none), over {len(values)}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--spares", type=int, default=1, choices=(1, 2))
    parser.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer, stage 1")
    parser.add_argument("--pace", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost", action="store_true")
    args = parser.parse_args()
    sys.exit(cost(args) if args.cost else soak(args))


if __name__ == "__main__":
    main()
