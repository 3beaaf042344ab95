"""Lab 13.1, task 4: allreduce (SUM) of a 3x4 tensor holding 1..12 on every rank.

    mpiexec -n 3 python examples/lab_3_allreduce.py      # every entry times 3
"""

import torch

import mpidp  # mpidp: initialises MPI

tensor = torch.arange(1, 13, dtype=torch.float32).reshape(3, 4)
mpidp.comm.allreduce(tensor, op="sum")  # mpidp: in place, on every rank
print(f"rank {mpidp.rank()}: allreduce(sum) over {mpidp.size()} ranks =\n{tensor}", flush=True)
