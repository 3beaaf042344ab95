"""Lab 13.1, task 4: allreduce (SUM) of a 3x4 tensor holding 1..12 on every rank.

    mpiexec -n 3 python examples/lab_3_allreduce.py      # every entry times 3

Each rank's output goes to mpiexec through its own pipe, so lines printed by
several ranks at once can interleave, even mid-line. Rank 0 gathers every
rank's result and prints them all, one after another.
"""

import torch

import mpidp  # mpidp: initialises MPI

tensor = torch.arange(1, 13, dtype=torch.float32).reshape(3, 4)
mpidp.comm.allreduce(tensor, op="sum")  # mpidp: in place, on every rank

results = torch.empty(mpidp.size(), 3, 4)
mpidp.comm.allgather(results, tensor)  # mpidp: every rank's result, to print from one rank
if mpidp.rank() == 0:  # mpidp: print once
    for rank, result in enumerate(results):
        print(f"rank {rank}: allreduce(sum) over {mpidp.size()} ranks =\n{result}")
