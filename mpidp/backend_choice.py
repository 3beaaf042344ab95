"""The default torch.distributed backend: NCCL where each rank has a GPU of its own, else "mpidp".

``mpidp.init_process_group()`` without a backend takes ``default_backend()``;
``mpidp.rendezvous`` re-exports both names, where its users look for them.
"""

from __future__ import annotations

from . import cuda
from . import watchdog as _watchdog

__all__ = ["MPIDP", "NCCL_MAP", "backend_for", "default_backend"]

MPIDP = "mpidp"
NCCL_MAP = "cpu:gloo,cuda:nccl"


def backend_for(gpus, nccl) -> tuple[str, str]:
    """The default backend from every rank's facts, and why: NCCL where each rank has a GPU of
    its own, else "mpidp".

    A pure function of the facts ``mpidp.cuda.placements`` gathers, so every rank
    decides alike. NCCL refuses two ranks on one GPU, and a rank without a GPU
    cannot join it; what each rank sees (one GPU, all of the node's, none) does
    not matter, only whether the GPUs the ranks use are distinct. Not
    "cpu:mpidp,cuda:nccl": torch (2.13) makes a Python process group the group of
    every device of a map and drops the others.

    Args:
        gpus: by rank, the GPU each uses (``mpidp.cuda.gpu_identity``; None: it sees none).
        nccl: by rank, whether its torch has NCCL.
    Returns:
        ``("cpu:gloo,cuda:nccl" or "mpidp", the reason)``.
    """
    if len(gpus) != len(nccl) or not gpus:
        raise ValueError(f"gpus and nccl must list the same ranks, got {len(gpus)} and {len(nccl)}")
    without = [rank for rank, gpu in enumerate(gpus) if gpu is None]
    if len(without) == len(gpus):
        return MPIDP, "no rank sees a GPU"
    if without:
        return MPIDP, f"no GPU visible on {_watchdog._ranks(without)}"
    if not all(nccl):
        return MPIDP, f"torch has no NCCL on {_watchdog._ranks([r for r, n in enumerate(nccl) if not n])}"
    users: dict[str, list[int]] = {}
    for rank, gpu in enumerate(gpus):
        users.setdefault(gpu, []).append(rank)
    shared = [ranks for ranks in users.values() if len(ranks) > 1]
    if shared:
        return MPIDP, "; ".join(f"{_watchdog._ranks(ranks)} share a GPU" for ranks in shared) + \
            " (NCCL refuses two ranks on one GPU)"
    return NCCL_MAP, "each rank has a GPU of its own and torch has NCCL"


def default_backend() -> str:
    """``mpidp.init_process_group()``'s backend when none is named: ``backend_for`` the facts
    gathered at import (the same on every rank; no collective)."""
    return backend_for(*cuda.placements())[0]
