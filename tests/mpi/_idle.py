"""A barrier whose waiting ranks sleep: for ranks that wait while one rank runs a nested job.

MPI_Barrier spins in the library's progress loop, so a rank waiting in it takes a
core from the job that rank 0 starts on the same cores (on 2 cores, a nested
2-rank launch took 2.4 s instead of 1.5 s beside one spinning process).
"""

import time

from mpi4py import MPI


def barrier(comm: MPI.Intracomm, poll: float = 0.01) -> None:
    """``comm.Barrier()``, tested every ``poll`` seconds instead of waited in."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll)
