"""Hangs the stall watchdog must report; tests/test_mpi.py runs it with a short MPIDP_TIMEOUT.

    MPIDP_TIMEOUT=2 mpiexec -n 3 python tests/mpi/stall.py MODE [RANK [OVERLAP]]

Modes:

- ``skip``: rank 1 skips an allreduce of the default pool and goes on to the
  next collective, an allreduce on a communicator of its own;
- ``mismatch``: rank 0 enters a broadcast from the last rank (default pool)
  while the others enter an allreduce on another communicator;
- ``differ [RANK]``: ``RANK`` (1) enters a broadcast where the others enter an allreduce, on
  the same communicator (the default pool's second member), with the same count;
- ``sleep RANK [OVERLAP]``: at DDP step 3, ``RANK`` sleeps in user code
  between forward and backward while the others wait in the step's first
  bucket; under ``MPIDP_TIMEOUT_ACTION=report`` it sleeps ``MPIDP_TIMEOUT + 3``
  seconds, wakes up, and the training ends normally;
- ``gil RANK``: as ``sleep``, but ``RANK`` sleeps in C holding the GIL, so no
  thread of it can answer;
- ``kill RANK``: as ``sleep``, but ``RANK`` sends itself SIGKILL (the OOM killer, a node lost);
- ``late RANK``: 16 DDP steps, ``RANK`` sleeps 200 ms before each backward; at the end each
  rank prints ``rank R stragglers {rank: ms}`` (``ddp.stragglers()``);
- ``train [OVERLAP ...]``: DDP training runs that never stall, one per strategy given;
- ``finish`` (4 ranks): rank 0 makes one more allreduce while the others have finished: rank 1
  at the end of the script, rank 2 by ``sys.exit(0)``, rank 3 by ``MPI.Finalize()``.

Set ``STALL_THREAD_LEVEL`` (e.g. "serialized") to initialise MPI at that level,
``STALL_DDP_TIMEOUT`` to pass it to DistributedDataParallel as ``timeout``.
Before the call that hangs, each rank prints ``rank R stalls at T`` (T from
``time.time()``), so the test can measure the time to the report.
"""

import ctypes
import os
import signal
import sys
import time

import mpi4py

if os.environ.get("STALL_THREAD_LEVEL"):
    mpi4py.rc.thread_level = os.environ["STALL_THREAD_LEVEL"]  # before mpidp imports mpi4py.MPI

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

import mpidp  # noqa: E402

RANK, SIZE = mpidp.rank(), mpidp.size()
TIMEOUT = float(os.environ.get("MPIDP_TIMEOUT", "600"))
REPORT_ONLY = os.environ.get("MPIDP_TIMEOUT_ACTION", "abort") == "report"


def stalls() -> None:
    print(f"rank {RANK} stalls at {time.time():.3f}", flush=True)


def skip(other: MPI.Intracomm) -> None:
    mpidp.comm.allreduce(torch.ones(4))  # every rank: the default pool exists
    stalls()
    if RANK != 1:
        mpidp.comm.allreduce(torch.ones(4))  # rank 1 skips this one
    mpidp.comm.allreduce(torch.ones(1, dtype=torch.int64), "max", comm=other)


def mismatch(other: MPI.Intracomm) -> None:
    mpidp.comm.allreduce(torch.ones(4))
    stalls()
    if RANK == 0:
        mpidp.comm.broadcast(torch.zeros(8), SIZE - 1)
    else:
        mpidp.comm.allreduce(torch.ones(2), comm=other)


def differ(odd: int) -> None:
    mpidp.comm.allreduce(torch.ones(4))
    stalls()
    if RANK == odd:
        mpidp.comm.broadcast(torch.ones(4), 0)  # the others make an allreduce here
    else:
        mpidp.comm.allreduce(torch.ones(4))


def _ddp(overlap: str) -> mpidp.DistributedDataParallel:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    timeout = os.environ.get("STALL_DDP_TIMEOUT")
    return mpidp.DistributedDataParallel(model, bucket_cap_mb=0.1, overlap=overlap,
                                         timeout=None if timeout is None else float(timeout))


def train(steps: int, overlap: str, stop_rank: int | None = None, how: str = "sleep") -> None:
    ddp = _ddp(overlap)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    torch.manual_seed(RANK)
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        loss = ddp(torch.randn(32, 64)).square().mean()
        if step == 3 and stop_rank is not None:
            stalls()
            if RANK == stop_rank and how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif RANK == stop_rank and how == "gil":
                ctypes.PyDLL(None).sleep(120)  # libc sleep() through PyDLL keeps the GIL
            elif RANK == stop_rank:
                # every rank answers rank 0 within a period or two of its watchdog (TIMEOUT / 4)
                time.sleep(TIMEOUT + 3 if REPORT_ONLY else 120)
        loss.backward()
        optimizer.step()
    ddp.close()
    print(f"rank {RANK} trained {steps} steps", flush=True)


def late(late_rank: int, steps: int = 16) -> None:
    ddp = _ddp("inline")
    torch.manual_seed(RANK)
    for _ in range(steps):
        loss = ddp(torch.randn(32, 64)).square().mean()
        if RANK == late_rank:
            time.sleep(0.2)
        loss.backward()
    print(f"rank {RANK} stragglers {ddp.stragglers()}", flush=True)
    ddp.close()


def finish() -> None:
    mpidp.comm.allreduce(torch.ones(4))
    stalls()
    if RANK == 0:
        mpidp.comm.allreduce(torch.ones(4))  # one more, after the others finished
    elif RANK == 2:
        sys.exit(0)
    elif RANK == 3:
        MPI.Finalize()


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    other = MPI.COMM_WORLD.Dup()
    if mode == "skip":
        skip(other)
    elif mode == "mismatch":
        mismatch(other)
    elif mode == "differ":
        differ(int(args[0]) if args else 1)
    elif mode in ("sleep", "gil", "kill"):
        train(5, args[1] if len(args) > 1 else "auto", int(args[0]), how=mode)
    elif mode == "late":
        late(int(args[0]))
    elif mode == "finish":
        finish()
        return
    elif mode == "train":
        for overlap in args or ["auto"]:  # one launch, each strategy in turn
            train(40, overlap)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    other.Free()


if __name__ == "__main__":  # check_ddp_edges.py imports train()
    main()
