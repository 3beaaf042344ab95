"""Train a small transformer with torch's FSDP2 (fully_shard) over MPI, through mpidp.

    mpiexec -n 2 python examples/torch_fsdp.py

mpidp registers a torch.distributed backend named "mpidp": after
``mpidp.init_process_group("mpidp")`` every torch.distributed program runs over
MPI, with no MASTER_ADDR to set and no gloo (the rendezvous store is mpidp's
own, served over MPI by rank 0: no port; ``MPIDP_STORE=tcp`` picks torch's
TCPStore instead). Here it is torch's own FSDP2:
each rank holds a shard of every parameter, all-gathers a layer's weights just
before using them and reduce-scatters the gradients.

The task is synthetic: at every position of a sequence of random vectors,
predict the mean of the sequence so far (attention must look back). Every rank
draws the same global batch and trains on its share. At the end every rank
retrains the unsharded model on whole batches in one process and checks that
both give the same parameters; the script exits non-zero if they differ.
Every line that a one-process script would not have is tagged "# mpidp:".

With ``--checkpoint-dir``, the same training goes through a Checkpointer and an
``mpidp.Healer`` given ``rebuild=make`` instead (``train_healing``): launched with
``mpirun --with-ft ulfm`` (Open MPI), a lost rank's shards come back from the
partner copy the next rank keeps, ``make`` shards a new model over the survivors
and the loop goes on with it (docs/healing-frameworks.md, "FSDP2 under a heal"); it prints
``step S loss L`` for every step (L in repr) and checks nothing at the end::

    mpirun --with-ft ulfm -n 4 python examples/torch_fsdp.py --checkpoint-dir ckpt
    # kill -9 one rank's process: "going on at 3 ranks from step S", the run goes on
"""

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import mpidp  # mpidp: registers the backend "mpidp"; an uncaught error on any rank ends the job

BATCH, LENGTH, FEATURES = 48, 8, 4  # 48 sequences: an equal share at 1, 2, 3, 4 or 6 ranks


class Transformer(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Linear(FEATURES, width)
        self.position = nn.Parameter(0.1 * torch.randn(LENGTH, width))
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width,
                                           dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, FEATURES)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(LENGTH))

    def forward(self, x):
        hidden = self.embed(x) + self.position
        return self.head(self.encoder(hidden, mask=self.causal, is_causal=True))


def global_batch(step: int):
    """Step ``step``'s batch, the same on every rank: sequences and their running means."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, LENGTH, FEATURES, generator=gen)
    return x, x.cumsum(1) / torch.arange(1, LENGTH + 1).view(1, -1, 1)


def build() -> nn.Module:
    torch.manual_seed(0)
    return Transformer()


def train(model, steps: int, rank: int = 0, size: int = 1, log: bool = False):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = global_batch(step)
        x, y = x.chunk(size)[rank], y.chunk(size)[rank]  # mpidp: this rank's share
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()  # FSDP2 reduce-scatters the averaged gradients into the shards
        optimizer.step()
        if log and (step % 10 == 0 or step == steps - 1):
            loss = loss.detach()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # mpidp: the whole batch's loss
            if rank == 0:  # mpidp: print once
                print(f"step {step:3d}: loss {loss.item():.4f}", flush=True)


def make():
    """The sharded model, its optimizer and (no) scheduler, over the default group of the
    moment: at the start, and again over the survivors after a heal (mpidp: Healer's rebuild)."""
    model = build()
    for layer in model.encoder.layers:  # mpidp: shard each layer (its own all-gather)...
        fully_shard(layer)  # mpidp
    fully_shard(model)  # mpidp: ... and the rest of the model
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None


def train_healing(steps: int, directory: str, pace: float) -> None:
    """The training of ``train``, through a Checkpointer and a Healer (mpidp)."""
    batches = [global_batch(step) for step in range(steps)]
    dataset = TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    # mpidp: step S's global batch is samples S*BATCH... in order, each rank taking its share
    sampler = mpidp.DistributedSampler(dataset, shuffle=False, drop_last=True)
    loader = DataLoader(dataset, batch_size=BATCH // mpidp.size(), sampler=sampler)
    model, optimizer, _ = make()
    checkpointer = mpidp.Checkpointer(directory, model=model, optimizer=optimizer,  # mpidp
                                      sampler=sampler, batch_size=BATCH // mpidp.size())
    healer = mpidp.Healer(checkpointer, rebuild=make)  # mpidp: a heal calls make() again
    for x, y in healer.batches(loader, steps=steps):  # mpidp: re-split after a lost rank
        model, optimizer = checkpointer.model, checkpointer.optimizer  # mpidp: new after a heal
        with healer.guard():  # mpidp: copies the shards; a rank lost here: heal, run it again
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            time.sleep(pace)
            loss = mpidp.average(loss.detach())  # mpidp: the whole batch's loss
            if mpidp.rank() == 0:  # mpidp: print once
                print(f"step {checkpointer.steps + 1} loss {loss!r}", flush=True)
            checkpointer.step()  # mpidp
    checkpointer.close()  # mpidp


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-dir", help="train through a Checkpointer and a Healer")
    parser.add_argument("--pace", type=float, default=0.0,
                        help="with --checkpoint-dir: seconds to sleep in each step")
    args = parser.parse_args()
    if args.checkpoint_dir:
        # mpidp: "local": the MPI store's server (rank 0's thread) does not follow a heal
        mpidp.init_process_group("mpidp", store="local")
        if BATCH % mpidp.size():
            raise SystemExit(f"run on a number of ranks that divides {BATCH}")
        train_healing(args.steps, args.checkpoint_dir, args.pace)
        dist.destroy_process_group()  # mpidp
        return

    mpidp.init_process_group("mpidp")  # mpidp: torch.distributed over MPI (rank and size from mpiexec)
    rank, size = dist.get_rank(), dist.get_world_size()  # mpidp
    if BATCH % size:  # mpidp: equal shares keep the check below exact
        raise SystemExit(f"run on a number of ranks that divides {BATCH}")

    model, _, _ = make()
    train(model, args.steps, rank, size, log=True)

    # The check: one process training the same model on whole batches.
    reference = build()
    train(reference, args.steps)
    worst = max(((p.full_tensor() - q).abs().max() / q.abs().max()).item()  # mpidp: full_tensor
                for p, q in zip(model.parameters(), reference.parameters()))
    if rank == 0:  # mpidp: print once
        print(f"{size} ranks vs one process: max relative parameter difference {worst:.2e}")
    dist.destroy_process_group()  # mpidp
    if worst > 1e-4:  # float32 sums in another order
        sys.exit(f"rank {rank}: the sharded model differs from one-process training by {worst}")


if __name__ == "__main__":
    main()
