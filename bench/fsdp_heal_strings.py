"""An FSDP2 heal against a run that changed its size at that step, string for string, by hand.

    python bench/fsdp_heal_strings.py --kill 2:60:allgather --steps 12

Three launches under ``mpirun --with-ft ulfm`` with the Open MPI environment of
tests/test_healing.py (``.venv-ompi``):

1. examples/torch_fsdp.py --checkpoint-dir at 4 ranks, one rank killed inside a
   collective (``MPIDP_TEST_KILL``): the heal's line says from which step S the run
   goes on at 3 ranks.
2. This script at 4 ranks (``--worker``): the example's training to step S, then
   the whole model and optimizer state saved (torch's ``get_model_state_dict`` and
   ``get_optimizer_state_dict``, ``full_state_dict``).
3. This script at 3 ranks: that state loaded (``set_*_state_dict``) into the
   example's model made over 3 ranks, the sampler resumed at step S's position, on
   to the last step.

It prints whether every step's ``step S loss L`` string (float32, as the example
prints it; a step run again after the heal prints again, the last one counts) of
launch 1 equals that of launches 2 and 3, and the steps that differ.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^step (\d+) loss (\S+)$", re.M)
HEALED = re.compile(r"going on at (\d+) ranks from step (\d+)")


def _launch(nprocs: int, args: list[str], env=None) -> str:
    python = ROOT / ".venv-ompi" / "bin" / "python"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **(env or {}))
    done = subprocess.run([str(python.parent / "mpirun"), "--with-ft", "ulfm", "--mca", "pml",
                           "ob1", "--mca", "btl", "tcp,self", "--oversubscribe", "--bind-to",
                           "none", "-n", str(nprocs), str(python), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, errors="replace", timeout=600)
    if done.returncode:
        sys.exit(f"{args[0]} at {nprocs} ranks: status {done.returncode}\n"
                 f"{(done.stdout + done.stderr)[-4000:]}")
    return done.stdout


def worker(steps: int, save: str | None, resume: str | None, start: int) -> None:
    """The example's train_healing without a Healer: from ``resume``'s state at step ``start``
    to ``steps``, then (with ``save``) the whole state saved."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict)
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import mpidp

    sys.path.insert(0, str(ROOT / "examples"))
    from torch_fsdp import BATCH, global_batch, make

    mpidp.init_process_group("mpidp", store="local")
    batches = [global_batch(step) for step in range(steps)]
    dataset = TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    sampler = mpidp.DistributedSampler(dataset, shuffle=False, drop_last=True)
    model, optimizer, _ = make()
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if resume:
        state = torch.load(resume, weights_only=False)
        set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
        set_optimizer_state_dict(model, optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        sampler.resume_from(0, start * BATCH)
    loader = DataLoader(dataset, batch_size=BATCH // mpidp.size(), sampler=sampler)
    for step, (x, y) in zip(range(start + 1, steps + 1), loader):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        loss = mpidp.average(loss.detach())
        if mpidp.rank() == 0:
            print(f"step {step} loss {loss!r}", flush=True)
    if save:
        state = {"model": get_model_state_dict(model, options=whole),
                 "optimizer": get_optimizer_state_dict(model, optimizer, options=whole)}
        if mpidp.rank() == 0:
            torch.save(state, save)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill", default="2:60:allgather", help="MPIDP_TEST_KILL of launch 1")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--show", action="store_true", help="print the launches' outputs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--start", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.save, args.resume, args.start)
        return
    with tempfile.TemporaryDirectory(prefix="mpidp-fsdp-strings-") as folder:
        healed = _launch(4, ["examples/torch_fsdp.py", "--steps", str(args.steps),
                             "--checkpoint-dir", folder], env={"MPIDP_TEST_KILL": args.kill})
        (size, at), = [(int(a), int(b)) for a, b in HEALED.findall(healed)]
        state = os.path.join(folder, "whole.pt")
        first = _launch(4, [__file__, "--worker", "--steps", str(at), "--save", state])
        then = _launch(size, [__file__, "--worker", "--steps", str(args.steps), "--resume", state,
                              "--start", str(at)])
    if args.show:
        print(f"launch 1:\n{healed}\nlaunch 2:\n{first}\nlaunch 3:\n{then}")
    strings = dict(LINE.findall(healed))
    changed = {**dict(LINE.findall(first)), **dict(LINE.findall(then))}
    differ = sorted((int(s) for s in set(strings) | set(changed)
                     if strings.get(s) != changed.get(s)))
    print(f"healed at 4 -> {size} ranks from step {at}; the run that changed its size there: "
          f"{len(strings) - len(differ)} of {len(strings)} steps' strings equal"
          + (f", these differ: {differ}" if differ else ""))
    if differ:
        for step in map(str, differ):
            print(f"  step {step}: healed {strings.get(step)}, changed size {changed.get(step)}")


if __name__ == "__main__":
    main()
