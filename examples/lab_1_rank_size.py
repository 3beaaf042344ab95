"""Lab 13.1, task 1: every process prints its rank and the number of processes.

    mpiexec -n 4 python examples/lab_1_rank_size.py

torch.distributed needs init_process_group("mpi") and a torch built with MPI;
mpidp needs only the import.
"""

import mpidp  # mpidp: initialises MPI (no init_process_group)

print(f"rank {mpidp.rank()} of {mpidp.size()} "  # mpidp: rank and size of MPI_COMM_WORLD
      f"(local rank {mpidp.local_rank()} of {mpidp.local_size()} on this node)", flush=True)
