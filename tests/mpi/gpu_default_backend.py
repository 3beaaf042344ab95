"""``mpidp.init_process_group()`` with no backend on GPUs: NCCL where each rank has a GPU, else mpidp.

    mpiexec -n 1 python tests/mpi/gpu_default_backend.py   # one GPU: NCCL
    mpiexec -n 2 python tests/mpi/gpu_default_backend.py   # two ranks on one GPU: "mpidp"
    mpiexec -n 2 env CUDA_VISIBLE_DEVICES=0 python ...     # each rank sees one GPU, the same: "mpidp"

Each rank's GPU is named by its UUID (``mpidp.cuda.gpu_identity``), so the expected backend is
computed here from UUIDs gathered over MPI, not from the GPU count (``srun --gpus-per-task=1``
shows each rank one GPU, different ones: NCCL).

Run by bench/gpu_validate.sh (this needs a GPU; nothing in the CPU suite runs it). Checks that
the backend picked is the same on every rank, that CUDA and CPU tensors reduce right over it, and
that torch's DDP on the GPU over it trains as mpidp's DDP does on the CPU (float64).
"""

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import mpidp

rank, size = mpidp.rank(), mpidp.size()
device = mpidp.cuda.local_device()
mpidp.init_process_group()
picked = dist.get_backend()
uuids = MPI.COMM_WORLD.allgather(str(torch.cuda.get_device_properties(device).uuid))
expected = "cpu:gloo,cuda:nccl" if len(set(uuids)) == size else "mpidp"
assert picked == expected, (picked, expected)
for where in (device, "cpu"):
    tensor = torch.full((1 << 20,), float(rank + 1), device=where)
    dist.all_reduce(tensor)
    assert torch.all(tensor == size * (size + 1) / 2).item(), where

torch.manual_seed(0)
cpu = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5)).double()
gpu = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5)).double()
gpu.load_state_dict(cpu.state_dict())
theirs = TorchDDP(gpu.to(device), device_ids=[device.index])
ours = mpidp.DistributedDataParallel(cpu)
for model, where in ((ours, "cpu"), (theirs, device)):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(4 * size, 10, generator=gen).double(), torch.randn(4 * size, 5, generator=gen).double()
        x, y = x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(where)), y.to(where)).backward()
        opt.step()
diff = max((a.detach().cpu() - b.detach()).abs().max().item()
           for a, b in zip(gpu.parameters(), cpu.parameters()))
assert diff < 1e-12, diff
dist.destroy_process_group()
print(f"rank {rank}/{size}: default backend {picked!r}; all_reduce on {device} and cpu right; "
      f"torch DDP on the GPU over it vs mpidp DDP on the CPU: max |diff| {diff:.1e}", flush=True)
