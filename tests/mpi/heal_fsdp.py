"""torch's FSDP2 over "mpidp" that loses ranks on purpose, for tests/test_healing.py.

    mpirun --with-ft ulfm ... -n 4 python tests/mpi/heal_fsdp.py --checkpoint-dir ckpt \\
        --kill 3:5:forward --kill 1:14:between

tests/heal_model.py's float64 model, data and Adam, each layer and the whole
model sharded with ``fully_shard`` over the default group, a Checkpointer and a
Healer given ``rebuild`` (the same ``make`` that built them). Each ``--kill
RANK:STEP:WHERE`` makes launch rank RANK end itself with SIGKILL in step STEP,
in its ``forward``, its ``backward`` (after the last layer's gradients) or
``between`` steps; ``MPIDP_TEST_KILL`` kills inside a collective. Rank 0 prints
``step S loss L`` (repr, the whole global batch's) for every step, as
tests/mpi/heal_train.py does, and before it ``state S digest D``: a digest of the
whole parameters and optimizer state the step starts from. A step run again after
a heal prints its digest again: the state the survivors put together from their
shards and the lost ranks' partner copies must be the one the step began from at
the old size, bit for bit, as in a run that changed its size at that step.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import warnings

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

import mpidp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import heal_model  # noqa: E402 (tests/, beside this folder)

LAUNCH_RANK = mpidp.rank()
# FSDP2 warns of a view returned by the last Linear: nothing here changes it in place
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


def _die(where: str) -> None:
    print(f"rank {LAUNCH_RANK}: SIGKILL in {where} at {time.time():.6f}", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


@torch.no_grad()
def _digest(model, optimizer) -> str | None:
    """A digest of the whole parameters and optimizer state (collective: each DTensor's
    full_tensor(); rank 0's, None elsewhere). Not torch's get_optimizer_state_dict, which
    steps an optimizer that has no state yet to make one."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.full_tensor().numpy().tobytes())
        state = optimizer.state.get(param, {})
        for key in sorted(state):
            value = state[key]
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            digest.update(key.encode() + value.numpy().tobytes())
    return digest.hexdigest()[:16] if mpidp.rank() == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=heal_model.STEPS)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--kill", action="append", default=[], help="RANK:STEP:WHERE")
    args = parser.parse_args()
    kills = {int(step): where for rank, step, where in (k.split(":") for k in args.kill)
             if int(rank) == LAUNCH_RANK}

    mpidp.init_process_group("mpidp", store="local")  # the MPI store cannot heal
    dataset = heal_model.dataset()
    sampler = mpidp.DistributedSampler(dataset, shuffle=True, seed=heal_model.SEED, drop_last=True)
    batch_size = heal_model.GLOBAL_BATCH // mpidp.size()
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                        generator=torch.Generator().manual_seed(0))
    steps_done = [0]  # the Checkpointer's count, for the kill hooks

    def due(where: str):
        def check(*_) -> None:
            if kills.get(steps_done[0] + 1) == where:
                _die(where)
        return check

    def make():
        """The model, optimizer and scheduler over the default group of the moment."""
        model = heal_model.model()
        for layer in model[::2]:  # the Linear layers, each its own all-gather
            fully_shard(layer)
        fully_shard(model)
        model.register_forward_pre_hook(due("forward"))
        model[-1].register_full_backward_hook(due("backward"))
        return (model, *heal_model.optimizers(model.parameters()))

    model, optimizer, scheduler = make()
    checkpointer = mpidp.Checkpointer(args.checkpoint_dir, model=model, optimizer=optimizer,
                                      scheduler=scheduler, sampler=sampler,
                                      batch_size=batch_size, signals=())
    healer = mpidp.Healer(checkpointer, rebuild=make)
    for x, y in healer.batches(loader, steps=args.steps):
        # a heal makes them again (rebuild): take the Checkpointer's at every batch
        model, optimizer, scheduler = checkpointer.model, checkpointer.optimizer, \
            checkpointer.scheduler
        steps_done[0] = checkpointer.steps
        with healer.guard():
            digest = _digest(model, optimizer)
            if digest is not None:
                print(f"state {checkpointer.steps} digest {digest}", flush=True)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            global_loss = mpidp.average(loss.detach())
            if mpidp.rank() == 0:
                print(f"step {checkpointer.steps + 1} loss {global_loss!r}", flush=True)
            checkpointer.step()
            if kills.get(checkpointer.steps) == "between":
                _die("between")
    if mpidp.rank() == 0:
        print(f"done at {mpidp.size()} ranks; heals {healer.heals}", flush=True)
    checkpointer.close()


if __name__ == "__main__":
    main()
