"""Run several example scripts one after the other in one MPI job, as ``python SCRIPT ARGS`` would.

    mpiexec -n 2 python tests/mpi/run_scripts.py "examples/lab_1_rank_size.py" \
        "examples/lab_6_scaling.py --samples 1024"

Each script runs as ``__main__`` with its own ``sys.argv``, after every rank has
finished the one before (a barrier), so one launch of torch, MPI and mpidp serves
them all. For scripts that leave no process group or other global state behind
(tests/test_mpi.py's lab examples); a script that raises ends the job as it would
alone (mpidp's abort on an uncaught exception).
"""

import runpy
import shlex
import sys

from mpi4py import MPI


def main() -> None:
    for command in sys.argv[1:]:
        script, *args = shlex.split(command)
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
        sys.stdout.flush()
        MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()
