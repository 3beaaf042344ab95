"""mpidp: MPI-native data-parallel training for PyTorch.

Importing mpidp initialises MPI through mpi4py and, under ``mpiexec`` with more
than one rank, makes an uncaught exception on any rank abort the whole job
(see ``mpidp.runtime``; ``MPIDP_ABORT_ON_EXCEPTION=0`` turns that off).
"""

from . import comm, kernels, runtime
from .ddp import DDP, DistributedDataParallel
from .runtime import abort_on_exception, barrier, local_rank, local_size, rank, size
from .sampler import DistributedSampler

__version__ = "0.1.0"

__all__ = [
    "DistributedDataParallel", "DDP", "DistributedSampler",
    "rank", "size", "local_rank", "local_size", "barrier", "abort_on_exception",
    "comm", "kernels", "runtime", "__version__",
]

runtime._install_default_hook()
