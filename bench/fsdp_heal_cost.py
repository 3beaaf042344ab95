"""What the Healer's partner copies cost torch's FSDP2 while nothing is lost, by hand.

    .venv-ompi/bin/mpirun --with-ft ulfm --mca pml ob1 --mca btl tcp,self --oversubscribe \\
        --bind-to none -n 4 .venv-ompi/bin/python bench/fsdp_heal_cost.py --blocks 10

examples/torch_fsdp.py's small transformer (width 32, 2 layers; ``--width`` for
others), each layer and the whole model sharded with
``fully_shard`` over "mpidp", Adam. One run alternates blocks of ``--steps`` steps
inside ``Healer.guard()`` (where the job can heal it copies this rank's shards at
the step's start and sends them to the next rank, mpidp/process_group/fsdp.py)
with as many steps without it, the same model going on; each step starts after a
barrier and rank 0 times it. It prints the median step time of each kind and
their ratio. Needs ULFM (``mpirun --with-ft ulfm``), else there is no copy to time.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import mpidp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from torch_fsdp import BATCH, Transformer, global_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args()
    mpidp.init_process_group("mpidp", store="local")
    rank, size = mpidp.rank(), mpidp.size()

    def make():
        torch.manual_seed(0)
        model = Transformer(args.width)
        for layer in model.encoder.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), None

    model, optimizer, _ = make()
    directory = mpidp.broadcast_object(tempfile.mkdtemp(prefix="mpidp-fsdp-cost-")
                                       if rank == 0 else None)
    dataset = TensorDataset(torch.zeros(BATCH, 1))
    checkpointer = mpidp.Checkpointer(directory, model=model, optimizer=optimizer,
                                      sampler=mpidp.DistributedSampler(dataset),
                                      batch_size=BATCH // size, signals=())
    healer = mpidp.Healer(checkpointer, rebuild=make)
    if not healer.active:
        raise SystemExit("the Healer cannot heal here (no ULFM): nothing to time")
    times: dict[bool, list[float]] = {True: [], False: []}
    step = 0
    for block in range(2 * args.blocks + 1):  # block 0 warms up
        copies = block % 2 == 1
        for _ in range(args.steps):
            x, y = global_batch(step)
            x, y = x.chunk(size)[rank], y.chunk(size)[rank]
            mpidp.barrier()
            began = time.perf_counter()
            with healer.guard() if copies else contextlib.nullcontext():
                optimizer.zero_grad()
                F.mse_loss(model(x), y).backward()
                optimizer.step()
            mpidp.barrier()
            if block:
                times[copies].append(time.perf_counter() - began)
            step += 1
    if rank == 0:
        shard = sum(p.to_local().numel() for p in model.parameters())
        with_copies, without = (statistics.median(times[k]) * 1e3 for k in (True, False))
        print(f"{size} ranks, {sum(p.numel() for p in model.parameters())} parameters "
              f"({shard} on rank 0), Adam; {len(times[True])} steps of each kind, "
              f"{args.blocks} blocks interleaved: median step {without:.2f} ms without the "
              f"copies, {with_copies:.2f} ms with them: ratio {with_copies / without:.3f}")
    checkpointer.close()


if __name__ == "__main__":
    main()
