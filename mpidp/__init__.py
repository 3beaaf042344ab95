"""mpidp: MPI-native data-parallel training for PyTorch.

In the process that ``mpiexec``/``srun`` launched, importing mpidp initialises
MPI through mpi4py (asking for ``MPI_THREAD_MULTIPLE``), makes an uncaught
exception or a non-zero ``sys.exit`` on any rank abort the whole job (see
``mpidp.exits``; ``MPIDP_ABORT_ON_EXCEPTION=0`` turns that off), sets torch's
intra-op threads to this rank's share of its cores unless ``OMP_NUM_THREADS``
is set (see ``mpidp.topology``; ``MPIDP_SET_THREADS=0``), and pins the local
rank's GPU (``mpidp.cuda``). Every rank must import it: the start-up talks to
the other ranks.

In a process that ``multiprocessing`` started (a DataLoader worker under fork,
spawn or forkserver, which re-import the main script), importing mpidp does
none of this and never touches MPI; calling anything that needs MPI there
raises ``RuntimeError``.
"""

import sys

# settings before anything reads one: ``python -m mpidp doctor`` imports this package (with
# sys.argv[0] "-m" meanwhile) before the doctor runs, and the doctor must live to report a bad
# value (settings.problems) rather than die of it at start-up; any other import raises.
from . import settings  # isort: skip
if sys.argv[:2] == ["-m", "doctor"]:
    settings.tolerate_bad_values()

# runtime first: it decides, before anything imports mpi4py.MPI, whether that
# import may initialise MPI (not in a multiprocessing child).
from . import runtime  # isort: skip
from . import (
    comm, cuda, errors, hooks, kernels, objects, optimizer, process_group, topology, watchdog,
    zero,
)
from . import rendezvous, store
from . import checkpoint, generators, healing, preemption, recorder, spares
from .checkpoint import Checkpointer
from .healing import Healer
from .spares import stand_by
from .ddp.data_parallel import DDP, DistributedDataParallel
from .objects import allgather_object, average, broadcast_object
from .optimizer import broadcast_optimizer_state
from .profiler import profile
from .process_group.monitor import monitored_barrier
from .rendezvous import init_process_group
from .runtime import abort_on_exception, local_rank, local_size, rank, size
from .watchdog import barrier
from .sampler import DistributedSampler
from .ddp.syncbn import SyncBatchNorm
from .zero import ZeroRedundancyOptimizer
from .topology import topology as rank_topology

__version__ = "0.1.0"

process_group.register()  # torch.distributed backend "mpidp" and mpidp:// (no MPI call)

__all__ = [
    "DistributedDataParallel", "DDP", "DistributedSampler", "SyncBatchNorm", "Checkpointer",
    "Healer", "stand_by", "ZeroRedundancyOptimizer",
    "broadcast_object", "allgather_object", "average", "broadcast_optimizer_state",
    "profile",
    "rank", "size", "local_rank", "local_size", "barrier", "abort_on_exception",
    "init_process_group", "monitored_barrier",
    "checkpoint", "generators", "healing", "preemption", "recorder", "spares",
    "comm", "cuda", "errors", "hooks", "kernels", "objects", "optimizer", "process_group", "rendezvous", "runtime", "store", "topology",
    "watchdog", "zero",
    "rank_topology",
    "__version__",
]

if not runtime.in_multiprocessing_child():
    runtime._start()  # MPI ready; the abort hooks
    watchdog.start()  # collective: its communicator; then the stall watchdog's thread
    topology._apply_default_threads()  # collective over the node: each rank's share of cores
    cuda._start_up()  # pins this rank's GPU and decides, on every rank alike, how MPI sees it
    rendezvous.start_up()  # collective: the MPI store's communicator (a TCP server only if asked); RANK, MASTER_ADDR, ... exported
    preemption.keep_early()  # SIGUSR1/SIGUSR2 set the stop flag from now on (MPICH swallowed them)
