"""One 64 MB allreduce (float32) with plain mpi4py, timed; every rank checks the sum.

Run across cluster nodes to see where the bytes go:

    python bench/cluster/harness.py run --nodes 2 -- python bench/cluster/allreduce_bytes.py
"""

import socket
import sys
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
megabytes = float(sys.argv[1]) if len(sys.argv) > 1 else 64
count = int(megabytes * 2**20) // 4
data = np.full(count, comm.Get_rank() + 1, dtype=np.float32)
result = np.empty_like(data)
comm.Barrier()
start = time.perf_counter()
comm.Allreduce(data, result)
seconds = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
expected = comm.Get_size() * (comm.Get_size() + 1) / 2
if not np.all(result == expected):
    raise SystemExit(f"rank {comm.Get_rank()}: wrong sum")
hosts = comm.gather(socket.gethostname())
if comm.Get_rank() == 0:
    print(f"allreduce of {megabytes:g} MB over {comm.Get_size()} ranks on hosts {hosts}: "
          f"{seconds:.3f} s, sum correct")
