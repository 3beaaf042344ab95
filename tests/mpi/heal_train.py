"""Training that loses ranks on purpose, for tests/test_healing.py and bench/heal_soak.py.

    mpirun --with-ft ulfm ... -n 4 python tests/mpi/heal_train.py --steps 24 \\
        --kill 3:6:forward --kill 1:14:allreduce

Each ``--kill RANK:STEP:WHERE`` makes rank RANK (of the world at launch) end
itself with SIGKILL in step STEP, at WHERE: ``forward`` (before the model
runs), ``backward`` (in the middle of the backward, after the last layer's
gradients), ``allreduce`` (with its first bucket's allreduce started), or
``between`` (after the step, before the next). Rank 0 of the world of the
moment prints ``step S loss L`` (L in repr, float64, the whole global
batch's loss) for every step, and the Healer its ``healed`` lines. Without
``--kill`` it is an uninterrupted run; its model, data and in-process
reference are tests/heal_model.py's.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import mpidp
import mpidp.horovod as hvd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import heal_model  # noqa: E402 (tests/, beside this folder)

LAUNCH_RANK = mpidp.rank()
SLOT = [None]  # this rank's number at its first step (a spare's: the lost rank's it took)


def _die(where: str) -> None:
    print(f"rank {LAUNCH_RANK}: SIGKILL in {where} at {time.time():.6f}", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(kills: dict, checkpointer, ddp) -> None:
    """Make this rank die where ``kills`` says (its entries for this launch rank)."""
    def due(where: str) -> bool:
        return kills.get(checkpointer.steps + 1) == where

    def hook(where: str):
        def check(*_) -> None:
            if due(where):
                _die(where)
        return check

    module = getattr(ddp, "module", ddp)  # a DDP's, or the module itself (--horovod)
    module.register_forward_pre_hook(hook("forward"))
    module[-1].register_full_backward_hook(hook("backward"))
    allreduce = mpidp.comm.allreduce

    def dying_allreduce(tensor, *args, **kwargs):
        if due("allreduce"):
            mpidp.comm.iallreduce(tensor.clone(), *args, **kwargs)  # started, never finished
            _die("allreduce")
        return allreduce(tensor, *args, **kwargs)

    mpidp.comm.allreduce = dying_allreduce
    step = checkpointer.step

    def dying_step(*args, **kwargs):
        result = step(*args, **kwargs)
        if kills.get(checkpointer.steps) == "between":
            _die("between")
        return result

    checkpointer.step = dying_step


def _odd_ranks_group_follows(group) -> None:
    """After any heal: torch's world is mpidp's, and the group of the odd ranks at launch holds
    its survivors and the spares in their places (a line with WRONG says otherwise)."""
    from mpidp.process_group.healing import healed

    odd = [r for r in mpidp.allgather_object(SLOT[0]) if r % 2]
    group, wrong = healed(group), []
    if (dist.get_rank(), dist.get_world_size()) != (mpidp.rank(), mpidp.size()):
        wrong.append(f"torch's rank and size {dist.get_rank()}/{dist.get_world_size()}")
    if SLOT[0] % 2:
        total = torch.tensor([float(SLOT[0])])
        dist.all_reduce(total, group=group)
        if total.item() != sum(odd) or dist.get_world_size(group) != len(odd):
            wrong.append(f"the odd ranks' group: sum {total.item()}, size "
                         f"{dist.get_world_size(group)}, survivors {odd}")
    for line in wrong:
        print(f"rank {LAUNCH_RANK}: WRONG {line}", flush=True)


def _odd_ranks_set_follows(odd_set) -> None:
    """After any heal: Horovod's world is mpidp's, and the process set of the odd ranks at
    launch holds its survivors and the spares in their places (a line with WRONG says
    otherwise)."""
    odd = [r for r in mpidp.allgather_object(SLOT[0]) if r % 2]
    wrong = []
    if (hvd.rank(), hvd.size()) != (mpidp.rank(), mpidp.size()):
        wrong.append(f"Horovod's rank and size {hvd.rank()}/{hvd.size()}")
    if odd_set.included() != bool(SLOT[0] % 2):
        wrong.append(f"in the odd ranks' set: {odd_set.included()}")
    if odd_set.included():
        total = hvd.allreduce(torch.tensor([float(SLOT[0])]), op=hvd.Sum,
                              process_set=odd_set)
        if total.item() != sum(odd) or odd_set.size() != len(odd):
            wrong.append(f"the odd ranks' set: sum {total.item()}, size {odd_set.size()}, "
                         f"survivors {odd}")
    for line in wrong:
        print(f"rank {LAUNCH_RANK}: WRONG {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=heal_model.STEPS)
    parser.add_argument("--global-batch", type=int, default=heal_model.GLOBAL_BATCH)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--kill", action="append", default=[], help="RANK:STEP:WHERE")
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--sigterm", default=None, metavar="RANK:STEP",
                        help="rank RANK (of the launch) sends itself SIGTERM in step STEP: "
                             "the Checkpointer stops every rank there, saves and exits 75")
    parser.add_argument("--save-at-end", action="store_true",
                        help="save a checkpoint of the last step (a reference's first half)")
    parser.add_argument("--shared-memory", action="store_true",
                        help="reduce in shared memory (else MPI allreduces, killable in one)")
    parser.add_argument("--zero", action="store_true",
                        help="a ZeroRedundancyOptimizer (stage 1, Adam): a heal rebuilds the "
                             "lost rank's shard from its partner's copy")
    parser.add_argument("--syncbn", action="store_true",
                        help="a SyncBatchNorm in the model (its channel is rebuilt by a heal)")
    parser.add_argument("--horovod", action="store_true",
                        help="the module stepped by mpidp.horovod's DistributedOptimizer (its "
                             "world, process sets and optimizer follow a heal)")
    parser.add_argument("--spares", type=int, default=0,
                        help="the launch's last ranks stand by (mpidp.stand_by) to take a lost "
                             "rank's place")
    parser.add_argument("--torch-ddp", action="store_true",
                        help="torch's DistributedDataParallel over the \"mpidp\" backend (its "
                             "default group is made again over the survivors by a heal)")
    args = parser.parse_args()
    # without spares no stand_by, which a second run in one launch (tests/mpi/run_scripts.py)
    # would call after the first run's communicators over the world
    trains = mpidp.stand_by(spares=args.spares) if args.spares else True
    odd_ranks = list(range(1, mpidp.spares.trainers() or mpidp.size(), 2))
    kills = {}
    for kill in args.kill:
        rank, step, where = kill.split(":")
        if int(rank) == LAUNCH_RANK:
            kills[int(step)] = where

    dataset = heal_model.dataset()
    sampler = mpidp.DistributedSampler(dataset, shuffle=True, seed=heal_model.SEED, drop_last=True)
    batch_size = args.global_batch // mpidp.size()
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                        generator=torch.Generator().manual_seed(0))
    model = heal_model.model(batchnorm=args.syncbn)
    if args.syncbn:
        model = mpidp.SyncBatchNorm.convert_sync_batchnorm(model)
    # small buckets: several allreduces per step, so a kill can fall between two of them
    if args.torch_ddp:
        mpidp.init_process_group("mpidp", store="local")  # the MPI store cannot heal
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    elif args.horovod:
        hvd.init()
        ddp = model
    else:
        ddp = mpidp.DistributedDataParallel(model, bucket_cap_mb=0.004, first_bucket_mb=0.001,
                                            shared_memory=args.shared_memory)
    if args.zero:  # the same Adam and schedule as heal_model.optimizers, sharded
        optimizer = mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    else:
        optimizer, scheduler = heal_model.optimizers(ddp.parameters())
    if args.horovod:  # small buckets, as the DDPs': a kill can fall between two
        os.environ["HOROVOD_FUSION_THRESHOLD"] = "4096"
        optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                             named_parameters=model.named_parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    checkpointer = mpidp.Checkpointer(args.checkpoint_dir, model=ddp, optimizer=optimizer,
                                      scheduler=scheduler, sampler=sampler,
                                      batch_size=batch_size, every=8,
                                      signals=(signal.SIGTERM,) if args.sigterm else ())
    checkpointer.resume()
    healer = mpidp.Healer(checkpointer)
    _arm(kills, checkpointer, ddp)
    # a spare is in no group until it joins: the heal that lets it in makes them (group_over)
    odd = dist.new_group(odd_ranks) if args.torch_ddp and trains else None
    odd_set = hvd.add_process_set(odd_ranks) if args.horovod else None  # a spare's too
    for x, y in healer.batches(loader, steps=args.steps):
        if SLOT[0] is None:
            SLOT[0] = mpidp.rank()
            if args.torch_ddp and not trains:
                odd = mpidp.process_group.healing.group_over(odd_ranks)
        with healer.guard():
            if args.torch_ddp:
                _odd_ranks_group_follows(odd)
            if odd_set is not None:
                _odd_ranks_set_follows(odd_set)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if args.pace:
                time.sleep(args.pace)
            global_loss = mpidp.average(loss.detach())
            if mpidp.rank() == 0:
                print(f"step {checkpointer.steps + 1} loss {global_loss!r}", flush=True)
            if args.sigterm == f"{LAUNCH_RANK}:{checkpointer.steps + 1}":
                os.kill(os.getpid(), signal.SIGTERM)
            checkpointer.step()
    if args.save_at_end:
        checkpointer.save()
    if mpidp.rank() == 0:
        print(f"done at {mpidp.size()} ranks; heals {healer.heals}", flush=True)
    checkpointer.close()


if __name__ == "__main__":
    main()
