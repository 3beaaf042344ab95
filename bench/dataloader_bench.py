"""Epoch time of examples/train_digits.py with DataLoader workers, per start method.

    python bench/dataloader_bench.py                  # 2 ranks, 4 epochs, 2 workers per rank
    python bench/dataloader_bench.py --ranks 2 --epochs 6 --workers 2 --repeats 2

Runs ``mpiexec -n RANKS python examples/train_digits.py`` once per setting
(no workers; fork, spawn and forkserver, with workers started every epoch and
with persistent workers) and reads the seconds rank 0 prints for each epoch.
The example has its fork server preload torch and mpidp. Epoch 0 includes
starting the workers (and, for forkserver, the server);
later epochs show the steady state. Prints a Markdown table with the ratios to
``--workers 0``. Needs the ``examples`` extra (scikit-learn, tqdm).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = [("none", None, False), ("fork", "fork", False), ("spawn", "spawn", False),
            ("forkserver", "forkserver", False), ("fork, persistent", "fork", True),
            ("spawn, persistent", "spawn", True), ("forkserver, persistent", "forkserver", True)]
EPOCH = re.compile(r"^epoch (\d+): .*, ([0-9.]+) s$")


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def epoch_times(ranks: int, epochs: int, workers: int, method: str | None, persistent: bool) -> list[float]:
    """Seconds per epoch of one run, as rank 0 printed them."""
    command = [mpiexec(), "-n", str(ranks), sys.executable, "examples/train_digits.py",
               "--epochs", str(epochs)]
    if method is not None:
        command += ["--workers", str(workers), "--start-method", method]
    if persistent:
        command.append("--persistent-workers")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    times = [float(m.group(2)) for m in map(EPOCH.match, result.stdout.splitlines()) if m]
    if len(times) != epochs:
        raise RuntimeError(f"expected {epochs} epoch lines, got:\n{result.stdout}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4, help="at least 2: epoch 0 is reported apart")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--repeats", type=int, default=1, help="runs per setting, interleaved")
    parser.add_argument("--settings", nargs="+", choices=[name for name, *_ in SETTINGS],
                        help="a subset of the settings ('none' is always run, as the reference)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error(f"--epochs must be >= 2, got {args.epochs}")

    settings = [s for s in SETTINGS if s[0] == "none" or not args.settings or s[0] in args.settings]
    first: dict[str, list[float]] = {name: [] for name, *_ in settings}
    later: dict[str, list[float]] = {name: [] for name, *_ in settings}
    for repeat in range(args.repeats):  # settings take turns, so drifts of the machine hit all alike
        for name, method, persistent in settings:
            times = epoch_times(args.ranks, args.epochs, args.workers, method, persistent)
            first[name].append(times[0])
            later[name].extend(times[1:])
            print(f"repeat {repeat} {name}: {' '.join(f'{t:.2f}' for t in times)} s", file=sys.stderr,
                  flush=True)

    base_first, base_later = statistics.median(first["none"]), statistics.median(later["none"])
    print(f"{args.ranks} ranks, {args.workers} workers per rank, {args.epochs} epochs x {args.repeats} "
          f"runs, median seconds per epoch (ratio to no workers)\n")
    print("| workers | epoch 0 s | ratio | later epochs s | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, *_ in settings:
        a, b = statistics.median(first[name]), statistics.median(later[name])
        print(f"| {name} | {a:.2f} | {a / base_first:.2f} | {b:.2f} | {b / base_later:.2f} |")


if __name__ == "__main__":
    main()
