"""A Lightning fit over gloo, then the same fit over "mpidp", in one job; tests/test_lightning.py runs it.

    mpiexec -n 2 python tests/mpi/lightning_fit.py ddp|fsdp2

``fsdp2``: Lightning's ModelParallelStrategy with torch's ``fully_shard`` applied
over its data-parallel mesh (Lightning's FSDPStrategy, FSDP1, requires a GPU).

Lightning finds the ranks through its MPIEnvironment (mpi4py) and calls
torch.distributed.init_process_group itself, with the backend the strategy
names. Each fit trains float64 from the same seed on the same data; the script
prints the largest relative difference of the final parameters between the two
fits, and between each fit and single-process training on the whole batch, and
exits non-zero past the tolerance.
"""

import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpidp  # noqa: F401  registers the "mpidp" backend

STEPS, BATCH, LR = 4, 6, 0.1  # BATCH per rank
RANK, SIZE = mpidp.rank(), mpidp.size()


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * BATCH * SIZE, 8, generator=generator, dtype=torch.float64)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True).sin())


def model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = model()

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_model(self):
        if self.device_mesh is not None:
            from torch.distributed.fsdp import fully_shard
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit(strategy_name: str, backend: str) -> list[torch.Tensor]:
    strategy = (DDPStrategy(process_group_backend=backend) if strategy_name == "ddp" else
                ModelParallelStrategy(data_parallel_size=SIZE, tensor_parallel_size=1,
                                      process_group_backend=backend))
    module = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=SIZE, num_nodes=1, strategy=strategy,
                        max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    shard = DistributedSampler(data(), num_replicas=SIZE, rank=RANK, shuffle=False)
    trainer.fit(module, DataLoader(data(), batch_size=BATCH, sampler=shard))
    assert dist.get_backend() == backend, dist.get_backend()
    result = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for p in module.net.parameters()]  # FSDP2: DTensor shards -> full parameters
    dist.destroy_process_group()
    return result


def single_process() -> list[torch.Tensor]:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = data().tensors
    for step in range(STEPS):
        # rank r's step-th batch is rows [step*BATCH, (step+1)*BATCH) of its shard (rows r, r+SIZE, ...)
        rows = [r + SIZE * i for r in range(SIZE) for i in range(step * BATCH, (step + 1) * BATCH)]
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def difference(a, b) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


def main() -> int:
    strategy = sys.argv[1]
    over_gloo = fit(strategy, "gloo")
    over_mpidp = fit(strategy, "mpidp")
    reference = single_process()
    figures = {"mpidp vs gloo": difference(over_mpidp, over_gloo),
               "mpidp vs single process": difference(over_mpidp, reference),
               "gloo vs single process": difference(over_gloo, reference)}
    if RANK == 0:
        print(f"lightning {strategy} at {SIZE} ranks: "
              + ", ".join(f"{name} {value:.1e}" for name, value in figures.items()), flush=True)
    return 0 if max(figures.values()) < 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())
