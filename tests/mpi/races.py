"""Randomized schedules: several DDPs and ZeRO optimizers, backend groups that share ranks.

One seed draws a whole schedule, the same on every rank: how many models, each one's
overlap strategy, shared memory on or off, bucket size and optimizer (SGD, or ZeRO
stage 1 or 2 over Adam); then, round by round, which models run chained in one
backward (so two DDPs reduce in the same backward) and which async all_reduces (small,
and large enough to be chunked) are in flight on WORLD, a second group over the same
ranks and a subgroup, meanwhile. The order in which a rank waits on its async work is
drawn per rank. Training is compared every round with one process on the whole batch
(float64, so only summation order differs), each all_reduce with its exact sum.

    pytest tests/mpi/check_engine.py -k schedule   (RACE_SEEDS=1,2,3: the seeds; 1-20 by default)
    python tests/mpi/races.py SEED [--raise-at RANK:ROUND]   (under mpiexec)

``--raise-at`` makes one rank raise in the middle of a round, with its async work in
flight and its peers inside collectives: the job must end with that rank's error.
"""

from __future__ import annotations

import argparse
import copy
import random

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

import mpidp

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
ROWS = 4  # rows per rank in each round's batch
WIDTH = 16
LARGE = (4 << 20) // 4 + 3  # floats: just above the 4 MiB chunk, so two chunks


def make_groups() -> list:
    """WORLD, a second group over all ranks, and (3+ ranks) a subgroup without the last."""
    groups = [dist.group.WORLD, dist.new_group(list(range(SIZE)))]
    if SIZE >= 3:
        groups.append(dist.new_group(list(range(SIZE - 1))))
    return groups


def _model(rng: random.Random) -> nn.Module:
    torch.manual_seed(rng.randrange(1 << 30))
    hidden = rng.choice([8, 32, 64])
    return nn.Sequential(nn.Linear(WIDTH, hidden), nn.Tanh(), nn.Linear(hidden, WIDTH)).double()


def _optimizers(name: str, model: nn.Module, reference: nn.Module):
    if name == "sgd":
        make = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
        return make(model.parameters()), make(reference.parameters())
    stage = int(name[-1])
    return (mpidp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=stage,
                                          lr=0.01),
            torch.optim.Adam(reference.parameters(), lr=0.01))


def run(seed: int, groups: list, rounds: int = 6, raise_at: tuple[int, int] | None = None) -> str:
    """Run the schedule of ``seed``; return a one-line description of it."""
    shared = random.Random(seed)  # the same draws on every rank
    mine = random.Random(seed * 7919 + RANK)  # this rank's wait order
    count = shared.randint(2, 3)
    plans, models, references, optimizers = [], [], [], []
    for _ in range(count):
        plan = dict(overlap=shared.choice(["inline", "thread", "nonblocking", "auto"]),
                    shared_memory=SIZE > 1 and shared.random() < 0.5,
                    bucket_cap_mb=shared.choice([0.001, 0.004, 1.0]),
                    optimizer=shared.choice(["sgd", "sgd", "zero1", "zero2"]))
        module = _model(shared)
        reference = copy.deepcopy(module)
        ddp = mpidp.DistributedDataParallel(module, overlap=plan["overlap"],
                                            shared_memory=plan["shared_memory"],
                                            bucket_cap_mb=plan["bucket_cap_mb"])
        plans.append(plan)
        models.append(ddp)
        references.append(reference)
        optimizers.append(_optimizers(plan["optimizer"], ddp, reference))
    try:
        for round_ in range(rounds):
            chain = shared.sample(range(count), shared.randint(1, count))
            ops = [(shared.randrange(len(groups)), LARGE if shared.random() < 0.25 else 7)
                   for _ in range(shared.randint(0, 4))]
            batch = torch.randn(ROWS * SIZE, WIDTH, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(seed * 1000 + round_))
            works = []  # (work, tensor, expected sum)
            for index, (g, numel) in enumerate(ops):
                group = groups[g]
                members = list(range(SIZE - 1)) if g == 2 else list(range(SIZE))
                if RANK not in members:
                    continue
                tensor = torch.full((numel,), float((RANK + 1) * (index + 1)))
                works.append((dist.all_reduce(tensor, group=group, async_op=True), tensor,
                              (index + 1) * sum(r + 1 for r in members)))
            if raise_at == (RANK, round_):
                raise RuntimeError(f"race schedule {seed}: rank {RANK} raises in round {round_} "
                                   f"with {len(works)} async all_reduces in flight")
            for index in chain:
                optimizers[index][0].zero_grad()
                optimizers[index][1].zero_grad()
            out, expected = batch[RANK * ROWS:(RANK + 1) * ROWS], batch
            for index in chain:
                out, expected = models[index](out), references[index](expected)
            out.pow(2).mean().backward()
            expected.pow(2).mean().backward()
            mine.shuffle(works)
            for work, tensor, total in works:
                work.wait()
                assert tensor[0].item() == tensor[-1].item() == total, (seed, round_, total)
            for index in chain:
                optimizers[index][0].step()
                optimizers[index][1].step()
            for index in chain:
                for (name, p), q in zip(models[index].module.named_parameters(),
                                        references[index].parameters()):
                    torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=lambda m: (
                        f"seed {seed} round {round_} model {index} {plans[index]} {name}: {m}"))
    finally:
        for ddp in models:
            ddp.close()
    return f"seed {seed}: " + "; ".join(
        f"{p['overlap']}/{'shm' if p['shared_memory'] else 'mpi'}/{p['bucket_cap_mb']}MB/"
        f"{p['optimizer']}" for p in plans)


def main() -> None:
    parser = argparse.ArgumentParser(description="one race schedule under mpiexec")
    parser.add_argument("seed", type=int)
    parser.add_argument("--raise-at", help="RANK:ROUND: that rank raises in that round")
    args = parser.parse_args()
    raise_at = tuple(int(x) for x in args.raise_at.split(":")) if args.raise_at else None
    mpidp.init_process_group()
    print(run(args.seed, make_groups(), raise_at=raise_at), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
