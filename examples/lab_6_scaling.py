"""Lab 13.2, task 3: how the time per epoch scales with the number of ranks.

    for n in 1 2 4; do OMP_NUM_THREADS=1 mpiexec -n $n python examples/lab_6_scaling.py; done

Strong scaling: the global batch and the dataset stay fixed, each rank gets
1/n of every batch. On a cluster use one rank per NUMA domain (jobscripts/).
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpidp  # mpidp: initialises MPI, sets torch threads to the bound cores

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=8192)
parser.add_argument("--global-batch", type=int, default=256)
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

size = mpidp.size()  # mpidp
gen = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(args.samples, 784, generator=gen),
                        torch.randint(0, 10, (args.samples,), generator=gen))
sampler = mpidp.DistributedSampler(dataset, seed=0)  # mpidp: 1/size of the data per rank
loader = DataLoader(dataset, batch_size=args.global_batch // size, sampler=sampler)  # mpidp: microbatch

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
model = mpidp.DistributedDataParallel(model)  # mpidp
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loss_fn = nn.CrossEntropyLoss()

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # mpidp
    mpidp.barrier()  # mpidp: start the clock together
    start = time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    mpidp.comm.allreduce(elapsed, op="max")  # mpidp: the slowest rank sets the pace
    if mpidp.rank() == 0:  # mpidp: print once
        print(f"ranks {size} threads/rank {torch.get_num_threads()} epoch {epoch}: "
              f"{elapsed.item():.3f} s, {args.samples / elapsed.item():.0f} samples/s", flush=True)
