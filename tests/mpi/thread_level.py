"""The MPI thread level mpidp asks for, and what it keeps when the user chose first.

    mpiexec -n 2 python tests/mpi/thread_level.py MODE

``serialized``: the user sets ``mpi4py.rc.thread_level = "serialized"`` before
importing mpidp, which must honour it. ``uninitialised``: the user sets
``mpi4py.rc.initialize = False``; mpidp initialises MPI itself, asking for
MPI_THREAD_MULTIPLE, and finalises it at exit. ``user-initialised``: the user
initialises MPI (FUNNELED) before importing mpidp, which takes it as it is.
Every mode then uses mpi4py directly after ``import mpidp`` and prints the level.
"""

import sys

import mpi4py

mode = sys.argv[1]
if mode == "serialized":
    mpi4py.rc.thread_level = "serialized"
elif mode in ("uninitialised", "user-initialised"):
    mpi4py.rc.initialize = False
if mode == "user-initialised":
    from mpi4py import MPI
    MPI.Init_thread(MPI.THREAD_FUNNELED)

import mpidp  # noqa: E402
from mpi4py import MPI  # noqa: E402

expected = {"serialized": MPI.THREAD_SERIALIZED, "uninitialised": MPI.THREAD_MULTIPLE,
            "user-initialised": MPI.THREAD_FUNNELED}[mode]
level = mpidp.runtime.thread_level()
if level != expected:
    raise AssertionError(f"{mode}: thread level {level}, expected {expected}")
token = MPI.COMM_WORLD.bcast(f"from rank 0 of {MPI.COMM_WORLD.Get_size()}", root=0)  # mpi4py directly
print(f"rank {mpidp.rank()}: {mode}: thread level {mpidp.runtime.thread_level_name(level)}, "
      f"bcast {token}", flush=True)
