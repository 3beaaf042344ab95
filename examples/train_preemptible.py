"""A training run that survives preemption: stop on a signal, requeue, resume at any size.

Under Open MPI's ULFM (``mpirun --with-ft ulfm``) it also survives a lost rank: the others
heal and go on at one rank fewer (docs/healing.md). With ``--spares K``, launched at N+K
ranks, N train and the last K stand by: a spare takes a lost rank's place, and the run goes
on at N ranks with the losses of the uninterrupted run.

    mpiexec -n 2 python examples/train_preemptible.py --checkpoint-dir ckpt --steps 60
    # kill -USR1 <any rank's pid>: every rank stops at the same step, saves, exits 75
    mpiexec -n 3 python examples/train_preemptible.py --checkpoint-dir ckpt --steps 60 \\
        --global-batch 24   # goes on from that step at 3 ranks, same global batches

Rank 0 prints ``step S loss L`` for every step, L the loss of the whole global
batch in Python's ``repr``, so two runs can be compared line by line. With
``--reproducible`` the strings are the same at any rank count up to
``--micro-batches`` (docs/reproducible.md; 6 micro-batches at 4 ranks: 2, 2, 1, 1
per rank): before and after a resume at another size, or a heal. The
model and the data are small and synthetic; ``--pace`` slows each step down
so that there is time to send a signal by hand.
"""

import argparse
import contextlib
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpidp  # mpidp: MPI starts here, on every rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=24,
                        help="samples per step over all ranks (a multiple of the rank count, "
                             "or with --reproducible of --micro-batches)")
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--spares", type=int, default=0,
                        help="the launch's last ranks that stand by to replace a lost one")
    parser.add_argument("--zero", action="store_true", help="mpidp.ZeroRedundancyOptimizer")
    parser.add_argument("--zero-stage", type=int, default=1, choices=(1, 2))
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds to sleep in each step")
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--deadline", type=float, default=20.0)
    parser.add_argument("--out", help="rank 0 writes the final parameters here")
    parser.add_argument("--reproducible", action="store_true",
                        help="the same bits at any rank count (micro-batches summed in order)")
    parser.add_argument("--micro-batches", type=int, default=12,
                        help="with --reproducible: micro-batches per global batch (at least "
                             "the rank count)")
    args = parser.parse_args()
    # mpidp: of the launch's ranks, the last --spares stand by (in healer.batches() below)
    trains = mpidp.stand_by(spares=args.spares)
    world = mpidp.size()
    if args.reproducible and args.global_batch % args.micro_batches:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of "
                         f"--micro-batches {args.micro_batches}")
    if not args.reproducible and args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of {world} ranks")
    dtype = torch.float64 if args.float64 else torch.float32

    data = torch.Generator().manual_seed(1234)
    inputs = torch.randn(args.samples, 16, generator=data, dtype=dtype)
    targets = (inputs @ torch.randn(16, 1, generator=data, dtype=dtype)).tanh()
    dataset = TensorDataset(inputs, targets)
    # mpidp: each rank takes its share of every global batch, in the same global order
    if args.reproducible:  # mpidp: whole micro-batches, the same ones at any rank count (the
        # first ranks take one more where they do not divide): batch_size differs by rank
        micro_size = args.global_batch // args.micro_batches
        sampler = mpidp.DistributedSampler(dataset, shuffle=True, seed=7, drop_last=True,
                                           micro_batches=args.micro_batches,
                                           micro_batch_size=micro_size)
        batch_size = sampler.batch_size
    else:
        sampler = mpidp.DistributedSampler(dataset, shuffle=True, seed=7, drop_last=True)
        batch_size = args.global_batch // world
    # its own generator: iter(loader) draws no number from torch's global one
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                        generator=torch.Generator().manual_seed(0))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(args.dropout),
                          nn.Linear(32, 1)).to(dtype)
    # mpidp: averages gradients over the ranks
    ddp = mpidp.DistributedDataParallel(  # mpidp: micro_batches makes every step's count checked
        model, reproducible=args.reproducible,
        micro_batches=args.micro_batches if args.reproducible else None)
    if args.zero:  # mpidp: each rank keeps a shard of the optimizer state
        optimizer = mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01,
                                                  stage=args.zero_stage)
    else:
        optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)

    # mpidp: a signal on any rank stops every rank at one step, saves, and exits 75
    checkpointer = mpidp.Checkpointer(args.checkpoint_dir, model=ddp, optimizer=optimizer,
                                      scheduler=scheduler, sampler=sampler,
                                      batch_size=batch_size, every=args.save_every,
                                      deadline=args.deadline)
    start = checkpointer.resume()  # mpidp: the last whole checkpoint, if there is one
    if mpidp.rank() == 0 and start and trains:
        print(f"resumed at step {start} on {world} ranks", flush=True)

    # mpidp: a lost rank (only where MPI has ULFM: mpirun --with-ft ulfm) is healed and the
    # run goes on without it; elsewhere this is the plain loop over epochs
    healer = mpidp.Healer(checkpointer)
    for x, y in healer.batches(loader, steps=args.steps):  # mpidp: re-split after a lost rank
        with healer.guard():  # mpidp: a rank lost in this step: heal, then run it again
            optimizer.zero_grad()
            if args.reproducible:  # mpidp: one backward per micro-batch, the last one synced
                losses = micro_batch_steps(ddp, x.split(micro_size), y.split(micro_size))
            else:
                losses = micro_batch_steps(ddp, [x], [y])
            optimizer.step()
            scheduler.step()
            if args.pace:
                time.sleep(args.pace)
            # the loss of the whole global batch, for the printout only (mpidp: in
            # micro-batch order over the ranks)
            global_loss = mpidp.average(losses)
            if mpidp.rank() == 0:
                print(f"step {checkpointer.steps + 1} loss {global_loss!r}", flush=True)
            checkpointer.step()  # mpidp: stops here, on every rank, if a signal came

    if args.out and mpidp.rank() == 0:
        torch.save(model.state_dict(), args.out)
    checkpointer.close()


def micro_batch_steps(ddp, inputs, targets) -> list[float]:
    """Forward and backward each micro-batch; gradients are reduced at the last one."""
    losses = []
    for k, (x, y) in enumerate(zip(inputs, targets)):
        last = k == len(inputs) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():  # mpidp: reduce at the last
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    main()
