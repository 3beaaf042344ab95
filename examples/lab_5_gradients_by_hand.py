"""Lab 13.2 and 13.3: average gradients by hand, then let mpidp.DistributedDataParallel do it.

    mpiexec -n 2 python examples/lab_5_gradients_by_hand.py

Both train the same MLP from the same start on the same shards; their
parameters agree to float32 rounding, and both match sequential training.
"""

import copy

import torch
from torch import nn

import mpidp  # mpidp: initialises MPI

rank, size = mpidp.rank(), mpidp.size()  # mpidp
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 10))
by_hand = copy.deepcopy(model)
sequential = copy.deepcopy(model)
ddp = mpidp.DistributedDataParallel(model)  # mpidp: broadcasts rank 0's weights, buckets gradients

optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1)
              for name, m in (("by_hand", by_hand), ("ddp", ddp), ("sequential", sequential))}
loss_fn = nn.CrossEntropyLoss()
gen = torch.Generator().manual_seed(1)
for step in range(5):
    images = torch.randn(8 * size, 1, 28, 28, generator=gen)  # the global minibatch
    labels = torch.randint(0, 10, (8 * size,), generator=gen)
    mine = slice(rank * 8, (rank + 1) * 8)  # this rank's microbatch

    optimizers["by_hand"].zero_grad()
    loss_fn(by_hand(images[mine]), labels[mine]).backward()
    for parameter in by_hand.parameters():  # Listing 13.2.1 with mpidp.comm
        mpidp.comm.allreduce(parameter.grad, op="sum")  # mpidp: sum over ranks
        parameter.grad /= size  # mpidp: ... then average
    optimizers["by_hand"].step()

    optimizers["ddp"].zero_grad()
    loss_fn(ddp(images[mine]), labels[mine]).backward()  # mpidp: averaged during backward
    optimizers["ddp"].step()

    optimizers["sequential"].zero_grad()
    loss_fn(sequential(images), labels).backward()
    optimizers["sequential"].step()


def max_difference(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


if rank == 0:  # mpidp: print once
    print(f"{size} ranks: |by hand - DDP| = {max_difference(by_hand, ddp.module):.2e}, "
          f"|DDP - sequential| = {max_difference(ddp.module, sequential):.2e}")
