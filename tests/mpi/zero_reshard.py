"""A ZeroRedundancyOptimizer checkpoint saved at one world size loads at another.

    mpiexec -n 4 python tests/mpi/zero_reshard.py save DIR STAGE
    mpiexec -n 2 python tests/mpi/zero_reshard.py load DIR STAGE

``save`` trains a float64 model 10 AdamW steps under DDP with a stage-1 or
stage-2 ``mpidp.ZeroRedundancyOptimizer``, with small buckets cut in many
chunks (tensors split between ranks), and writes the sharded optimizer state
with ``save_sharded(DIR)`` and the model (rank 0, ``torch.save``). ``load``
builds a differently initialised model and an optimizer with other
hyperparameters and another bucket layout, restores both, checks the
resharded state against one process's plain AdamW after 10 steps, trains 10
more steps and checks the model against one process training 20 steps on the
whole batches (which DDP equals: the global batch of 12 splits evenly over
2, 3 and 4 ranks). Exits non-zero on a mismatch.
"""

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import mpidp

STEPS = 10
BATCH = 12
TOLERANCE = 1e-9  # float64; observed ~1e-15


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 5)).double()


def batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(BATCH, 10, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, 5, generator=gen, dtype=torch.float64))


def train(net, optimizer, steps, rank: int, size: int) -> None:
    for step in steps:
        x, y = batch(step)
        optimizer.zero_grad()
        F.mse_loss(net(x.chunk(size)[rank]), y.chunk(size)[rank]).backward()
        optimizer.step()


def one_process(steps: int):
    """The uninterrupted run: plain AdamW on the whole batches."""
    net = model(0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    train(net, optimizer, range(steps), 0, 1)
    return net, optimizer


def zero(ddp, stage: int, layout: dict, **hyper):
    return mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=stage,
                                         **(layout if stage == 1 else {}), **hyper)


def relative(got, expected) -> float:
    return max(((a.detach() - b.detach()).abs().max() / b.detach().abs().max()).item()
               for a, b in zip(got, expected))


def state_diff(got: dict, expected: dict) -> float:
    assert got["param_groups"] == expected["param_groups"], (got["param_groups"],
                                                             expected["param_groups"])
    assert sorted(got["state"]) == sorted(expected["state"])
    worst = 0.0
    for index, state in expected["state"].items():
        assert sorted(got["state"][index]) == sorted(state)
        for key, value in state.items():
            mine = got["state"][index][key]
            assert mine.shape == value.shape and mine.dtype == value.dtype, (index, key)
            worst = max(worst, ((mine - value).abs().max() / (value.abs().max() or 1.0)).item())
    return worst


def main():
    mode, directory, stage = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    rank, size = mpidp.rank(), mpidp.size()
    if mode == "save":
        small = dict(bucket_cap_mb=0.001, chunk_mb=0.001)  # ~131 elements a chunk
        ddp = mpidp.DistributedDataParallel(model(0), **small)
        optimizer = zero(ddp, stage, small, lr=1e-2, weight_decay=0.1)
        train(ddp, optimizer, range(STEPS), rank, size)
        optimizer.save_sharded(str(directory))
        if rank == 0:
            torch.save(ddp.module.state_dict(), directory / "model.pt")
            print(f"saved at {size} ranks, stage {stage}, to {directory}")
    elif mode == "load":
        net = model(1)  # other weights, until loaded
        net.load_state_dict(torch.load(directory / "model.pt", weights_only=True))
        other = dict(bucket_cap_mb=0.002, chunk_mb=0.0005)  # another layout than the save's
        ddp = mpidp.DistributedDataParallel(net, **other)
        optimizer = zero(ddp, stage, other, lr=0.5, weight_decay=0.0)
        optimizer.load_sharded(str(directory))
        assert optimizer.param_groups[0]["lr"] == 1e-2
        assert optimizer.param_groups[0]["weight_decay"] == 0.1

        reference, reference_optimizer = one_process(STEPS)
        optimizer.consolidate_state_dict(0)
        loaded = 0.0
        if rank == 0:
            loaded = state_diff(optimizer.state_dict(), reference_optimizer.state_dict())
            assert loaded < TOLERANCE, f"the loaded optimizer state differs by {loaded}"
        train(ddp, optimizer, range(STEPS, 2 * STEPS), rank, size)
        train(reference, reference_optimizer, range(STEPS, 2 * STEPS), 0, 1)
        worst = relative(ddp.module.parameters(), reference.parameters())
        moved = relative(ddp.module.parameters(), model(0).parameters())
        if rank == 0:
            print(f"loaded at {size} ranks, stage {stage}: optimizer state vs one process "
                  f"{loaded:.3e}; after {STEPS} more steps, max relative difference from one "
                  f"process training {2 * STEPS} steps = {worst:.3e}")
        assert moved > 1e-2, moved
        assert worst < TOLERANCE, worst
    else:
        raise SystemExit(f"usage: {sys.argv[0]} save|load DIR STAGE")
    ddp.close()


if __name__ == "__main__":
    main()
