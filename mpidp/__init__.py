"""mpidp: MPI-native data-parallel training for PyTorch.

Importing mpidp initialises MPI through mpi4py and, under ``mpiexec`` with more
than one rank, makes an uncaught exception on any rank abort the whole job
(see ``mpidp.runtime``; ``MPIDP_ABORT_ON_EXCEPTION=0`` turns that off). It
also sets torch's intra-op threads to the cores this rank is bound to, unless
``OMP_NUM_THREADS`` is set (see ``mpidp.topology``; ``MPIDP_SET_THREADS=0``).
"""

from . import comm, cuda, kernels, runtime, topology
from .ddp import DDP, DistributedDataParallel
from .runtime import abort_on_exception, barrier, local_rank, local_size, rank, size
from .sampler import DistributedSampler
from .topology import topology as rank_topology

__version__ = "0.1.0"

__all__ = [
    "DistributedDataParallel", "DDP", "DistributedSampler",
    "rank", "size", "local_rank", "local_size", "barrier", "abort_on_exception",
    "comm", "cuda", "kernels", "runtime", "topology", "rank_topology", "__version__",
]

runtime._install_default_hook()
topology._apply_default_threads()
cuda._start_up()  # pins this rank's GPU and decides, on every rank alike, how MPI sees it
