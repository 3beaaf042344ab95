"""``monitored_barrier`` for the ``"mpidp"`` backend: gloo's semantics, over the group's store.

torch's ``dist.monitored_barrier`` refuses every backend but gloo by name.
Here, as in gloo: each rank other than 0 checks in and waits for rank 0's
release; rank 0 waits, within ``timeout``, for every rank to check in and
raises naming the first one that did not ("Rank 2 failed to pass
monitoredBarrier in 2000 ms"; all of them with ``wait_all_ranks``), and the
ranks that arrived fail too, since rank 0 never releases them. The messages
are gloo's. It needs a store that every rank shares (mpidp's rendezvous store,
not ``store="local"``). Each call uses keys of its own (a count per group).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

__all__ = ["monitored_barrier", "run"]

_torch_monitored_barrier = dist.monitored_barrier  # torch's, even if a harness replaces dist's


def _seconds(timeout, group) -> float:
    if timeout is None:
        return group.timeout_seconds() or dist.default_pg_timeout.total_seconds()
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def _innermost(store):
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _arrived(store, key: str, deadline: float) -> bool:
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier`` that also takes groups of the "mpidp" backend.

    Args:
        group: the process group (default: the default group); a rank outside it returns.
        timeout: a ``timedelta`` or seconds; None: the group's timeout.
        wait_all_ranks: rank 0 names every rank that did not arrive, not the first.
    """
    from torch.distributed import distributed_c10d as c10d
    if c10d._rank_not_in_group(group):
        return
    chosen = c10d._get_default_group() if group is None else group
    if getattr(chosen, "getBackendName", lambda: "")() == "mpidp":
        chosen.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
        return
    cpu = chosen._get_backend(torch.device("cpu"))  # gloo inside a device map too
    if not isinstance(cpu, dist.ProcessGroupGloo):
        _torch_monitored_barrier(group, timeout, wait_all_ranks=wait_all_ranks)  # its error
        return
    seconds = _seconds(timeout, chosen) if timeout is not None else \
        dist.default_pg_timeout.total_seconds()
    cpu.monitored_barrier(datetime.timedelta(seconds=seconds), wait_all_ranks=wait_all_ranks)


def run(group, store, timeout=None, wait_all_ranks: bool = False) -> None:
    """Run gloo's monitored barrier over ``group``'s ``store`` (see the module)."""
    if store is None or isinstance(_innermost(store), dist.HashStore):
        raise RuntimeError("monitored_barrier needs a store shared by every rank: start the "
                           "group with mpidp's rendezvous store (store='mpi', the default, or 'tcp')")
    seconds = _seconds(timeout, group)
    count = getattr(group, "_monitor_count", 0)
    group._monitor_count = count + 1
    prefix = f"mpidp/monitored_barrier/{count}"
    rank, size = group.rank(), group.size()
    deadline = time.monotonic() + seconds
    millis = int(seconds * 1000)
    if rank != 0:
        store.set(f"{prefix}/{rank}", "1")
        if not _arrived(store, f"{prefix}/release", deadline):
            raise RuntimeError(f"Rank {rank} successfully reached monitoredBarrier, but received "
                               f"errors while waiting for send/recv from rank 0. Please check "
                               f"rank 0 logs for faulty rank.")
        return
    if seconds <= 0 and size > 1:
        raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {millis} ms")
    missing = []
    for peer in range(1, size):
        if not _arrived(store, f"{prefix}/{peer}", deadline):
            missing.append(peer)
            if not wait_all_ranks:
                break
    if len(missing) == 1:
        raise RuntimeError(f"Rank {missing[0]} failed to pass monitoredBarrier in {millis} ms")
    if missing:
        raise RuntimeError(f"Ranks {', '.join(map(str, missing))} failed to pass "
                           f"monitoredBarrier in {millis} ms")
    store.set(f"{prefix}/release", "1")
