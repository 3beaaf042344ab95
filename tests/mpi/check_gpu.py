"""GPU path under mpiexec: comm on CUDA tensors and DDP on a CUDA model vs a CPU reference.

Skips without a GPU; fails instead when MPIDP_TEST_GPU=1.
"""

import os

import pytest
import torch

import mpidp
from _models import RANK, SIZE, inputs, loss_of, max_rel_diff, mlp, shard

if not torch.cuda.is_available():
    if os.environ.get("MPIDP_TEST_GPU") == "1":
        raise RuntimeError("MPIDP_TEST_GPU=1 but torch sees no GPU")
    pytest.skip("no GPU", allow_module_level=True)

DEVICE = mpidp.cuda.local_device()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.int64], ids=str)
def test_collectives_on_device_tensors(dtype):
    tensor = torch.full((1000,), RANK + 1, dtype=dtype, device=DEVICE)
    mpidp.comm.allreduce(tensor)
    assert torch.all(tensor == SIZE * (SIZE + 1) // 2).item()
    gathered = torch.empty(SIZE * 3, dtype=dtype, device=DEVICE)
    mpidp.comm.allgather(gathered, torch.full((3,), RANK, dtype=dtype, device=DEVICE))
    assert gathered.cpu().tolist() == [r for r in range(SIZE) for _ in range(3)]


@pytest.mark.parametrize("overlap", ["auto", "inline", "thread", "nonblocking"])
def test_ddp_on_the_gpu_matches_the_cpu(overlap):
    torch.manual_seed(RANK)
    model = mlp()
    cpu = mpidp.DistributedDataParallel(model)
    gpu = mpidp.DistributedDataParallel(mlp().to(DEVICE), overlap=overlap, bucket_cap_mb=0.001)
    gpu.module.load_state_dict(cpu.module.state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (cpu, gpu)]
    for step in range(4):
        x, y = inputs("mlp", step)
        for model, optimizer, device in zip((cpu, gpu), optimizers, ("cpu", DEVICE)):
            optimizer.zero_grad()
            loss_of("mlp", model(shard(x).to(device)), shard(y).to(device)).backward()
            optimizer.step()
    assert max_rel_diff(gpu.module.cpu(), cpu.module) < 1e-5


def test_device_ids_of_the_local_gpu_move_cpu_inputs_and_moving_the_wrapper_rebuilds():
    torch.manual_seed(RANK)
    cpu = mpidp.DistributedDataParallel(mlp())
    gpu = mpidp.DistributedDataParallel(mlp().to(DEVICE), device_ids=[DEVICE.index],
                                        output_device=DEVICE.index)
    gpu.module.load_state_dict(cpu.module.state_dict())
    x, y = inputs("mlp", 0)
    loss_of("mlp", gpu(shard(x)), shard(y).to(DEVICE)).backward()  # CPU input moved by DDP
    loss_of("mlp", cpu(shard(x)), shard(y)).backward()
    for p, q in zip(gpu.module.parameters(), cpu.module.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="device_ids\\[0\\] must be the module's device"):
        mpidp.DistributedDataParallel(mlp().to(DEVICE), device_ids=[DEVICE.index + 1])
    moved = mpidp.DistributedDataParallel(mlp()).to(DEVICE)  # the wrapper follows its module
    assert {b.buffer.device for b in moved.reducer.buckets if b.buffer is not None} == {DEVICE}
    loss_of("mlp", moved(shard(x).to(DEVICE)), shard(y).to(DEVICE)).backward()
