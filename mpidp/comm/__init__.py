"""Collective and point-to-point communication of torch tensors over mpi4py.

Every function takes tensors that do not require grad, works in place where
MPI allows it, and comes in a blocking form and a nonblocking ``i``-form that
returns a ``Handle``. ``comm`` may be an ``mpi4py`` communicator (used as it
is), a ``Pool`` (its next member, round-robin), or None (the default pool over
``MPI.COMM_WORLD``). Round-robin over duplicated communicators lets several
collectives progress at once, as the DDP paper's round-robin process groups
do; collectives must still be issued in the same order on every rank.

Tensors may live on the CPU or a CUDA device, contiguous or not; what MPI
cannot take as it is gets staged (``staging``). The supported dtypes and ops,
and how each (dtype, op) is reduced, are in ``dtypes``. Arguments are checked
before anything collective happens, and ``MPIDP_DEBUG=1`` checks that every
rank makes the same call (``checks``).

Every blocking MPI call here (and ``Handle.wait``) records what it is for the
stall watchdog, which reports a call that waits past ``MPIDP_TIMEOUT``; see
``mpidp.watchdog``.

The package, one concept a module:

- ``collectives``: the collectives of equal blocks (allreduce ... scatter, barrier);
- ``uneven``: ``alltoall`` with splits and ``allgatherv``, whose sizes differ by rank;
- ``p2p``: send and recv;
- ``handle``: where a collective starts: ``issue`` (where every collective mpidp makes
  starts), ``collective`` (blocking calls on what is not a tensor: control words, pickled
  objects) and ``_start``;
- ``operation``: ``Operation`` (public name ``Handle``), the one kind of operation in
  flight: it owns its tensors, recorder ticket, watchdog label and MPI error mapping, over
  one or several requests, or in parts (``Staged``: a chunked reduction);
- ``progress``: the one driver that completes any set of operations (``test``,
  ``test_all``, ``wait``, ``wait_all``) with the one back-off policy (``Backoff``);
- ``pool``: ``Pool``, ``default_pool`` and what a ``comm`` argument stands for;
- ``dtypes``: dtype and op tables, MPI datatypes and buffers, ``reduction_path``;
- ``staging``: host and contiguous stand-ins for tensors MPI cannot take as they are;
- ``checks``: argument checks and the ``MPIDP_DEBUG`` check;
- ``chunking``: the one rule for chunk sizes and cutting a buffer into chunks;
- ``agreement``: the one way ranks reach the same decision (``decide``, ``agree``...);
- ``shm``: the shared-memory window a DDP reduces in on one node.

Every layer above starts its collectives here: DDP's buckets under each overlap
strategy (``mpidp.ddp.overlap``), the backend's operations and call checks
(``mpidp.process_group``), Horovod's requests and control messages, ZeRO, the
hooks, SyncBatchNorm, the object collectives and the Checkpointer. They differ
in who waits, not in how a collective starts. Below this layer, the runtime's
start-up exchanges (``mpidp.topology``, ``mpidp.cuda``, ``mpidp.barrier``) go
through ``mpidp.watchdog.watched``; the stall watchdog's reports and the MPI
store are point-to-point channels on communicators of their own.

The switches ``checks._DEBUG`` and ``staging._STAGE_CPU`` are read where they
live, at call time: set them on those modules, not on this package.
"""

from __future__ import annotations

from mpi4py import MPI as MPI  # mpidp.comm.MPI: the lab examples reach mpi4py through it

from .collectives import (
    allgather, allreduce, barrier, broadcast, gather, iallgather, iallreduce, ibarrier, ibroadcast,
    igather, ireduce, ireduce_scatter, iscatter, reduce, reduce_scatter, scatter,
)
from .dtypes import OPS, reduction_path
from .handle import Handle
from .p2p import irecv, isend, recv, send
from .pool import Pool, default_pool
from .uneven import allgatherv, alltoall, iallgatherv, ialltoall

# Private names other mpidp modules and the tests use (the redundant alias marks a re-export).
from .checks import _check_root as _check_root
from .checks import _check_same_call as _check_same_call
from .checks import _debug_from_env as _debug_from_env
from .checks import _overlap as _overlap
from .checks import _ranks as _ranks
from .dtypes import _DATATYPES as _DATATYPES
from .operation import _in_flight as _in_flight
from .p2p import _irecv as _irecv
from .pool import _base as _base
from .pool import _collective_comm as _collective_comm
from .staging import _stage as _stage

__all__ = [
    "OPS", "Handle", "Pool", "default_pool",
    "allreduce", "iallreduce", "broadcast", "ibroadcast", "allgather", "iallgather",
    "reduce_scatter", "ireduce_scatter", "reduce", "ireduce", "gather", "igather",
    "scatter", "iscatter", "alltoall", "ialltoall", "allgatherv", "iallgatherv",
    "barrier", "ibarrier", "send", "recv", "isend", "irecv", "reduction_path",
]
