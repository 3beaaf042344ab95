"""Lab 13.1, tasks 2 and 3: send rank 0's 3x4 tensor to rank 1, blocking and nonblocking.

    mpiexec -n 2 python examples/lab_2_send_recv.py
"""

import torch

import mpidp  # mpidp: initialises MPI

rank = mpidp.rank()  # mpidp
if mpidp.size() < 2:  # mpidp
    raise SystemExit("run with at least 2 ranks: mpiexec -n 2 python examples/lab_2_send_recv.py")

# Task 2: blocking send and receive.
tensor = torch.ones(3, 4) if rank == 0 else torch.zeros(3, 4)
if rank == 0:
    mpidp.comm.send(tensor, dest=1)  # mpidp: blocking send
elif rank == 1:
    mpidp.comm.recv(tensor, source=0)  # mpidp: blocking receive into tensor
print(f"blocking:    rank {rank} holds\n{tensor}", flush=True)
mpidp.barrier()  # mpidp: keep the two parts' output apart

# Task 3: the same with nonblocking calls; wait() completes them.
tensor = torch.ones(3, 4) if rank == 0 else torch.zeros(3, 4)
if rank == 0:
    request = mpidp.comm.isend(tensor, dest=1)  # mpidp: returns at once
    request.wait()  # mpidp: tensor may be reused after this
elif rank == 1:
    request = mpidp.comm.irecv(tensor, source=0)  # mpidp: returns at once
    request.wait()  # mpidp: tensor holds the message after this
print(f"nonblocking: rank {rank} holds\n{tensor}", flush=True)
