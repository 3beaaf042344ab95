"""Run several example scripts one after the other in one MPI job, as ``python SCRIPT ARGS`` would.

    mpiexec -n 2 python tests/mpi/run_scripts.py "examples/lab_1_rank_size.py" \
        "examples/lab_6_scaling.py --samples 1024"

Each script runs as ``__main__`` with its own ``sys.argv``, after every rank has
finished the one before (a barrier), so one launch of torch, MPI and mpidp serves
them all. Before each, rank 0 prints ``=== run_scripts: COMMAND`` on a line of
its own: what rank 0 prints for a script comes after its line (another rank's
lines may reach the launcher's output a little earlier or later). A script may
end with ``sys.exit(0)``; a default process group it leaves is destroyed. For
scripts that leave no other global state behind; a script that raises or exits
with another status ends the job as it would alone (mpidp's end of the job).
"""

import runpy
import shlex
import sys

import torch.distributed as dist
from mpi4py import MPI

MARK = "=== run_scripts: "


def sections(output: str) -> dict[str, str]:
    """Split a launch's stdout into {command: what follows its mark}."""
    parts = output.split(MARK)[1:]
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] if "\n" in part else ""
            for part in parts}


def main() -> None:
    for command in sys.argv[1:]:
        script, *args = shlex.split(command)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"{MARK}{command}", flush=True)
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as end:
            if end.code not in (None, 0):
                raise
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()
