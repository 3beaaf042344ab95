"""Train a DDP model step after step until the job is ended, printing each step.

The link-down check (tests/test_cluster.py, bench/cluster/link_down.py) cuts a
node's link while this runs; with ``MPIDP_TIMEOUT`` set, mpidp's stall watchdog
must then report the stalled collective and end the job.

    python bench/cluster/harness.py run --ppn 2 -- python bench/cluster/train_until_cut.py
"""

import socket
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

import mpidp

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000

model = mpidp.DistributedDataParallel(  # mpidp: gradients averaged across ranks and nodes
    nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 8)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(mpidp.rank())
for step in range(STEPS):
    x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    if mpidp.rank() == 0 or mpidp.local_rank() == 0:
        print(f"step {step} rank {mpidp.rank()} on {socket.gethostname()} at {time.time():.2f}",
              flush=True)
    time.sleep(0.05)
