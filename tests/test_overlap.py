"""Which overlap strategy is legal under which MPI thread level (no MPI job needed)."""

import pytest
import torch
from mpi4py import MPI

from mpidp.ddp import overlap

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU


@pytest.mark.parametrize("level,cpu,gpu", [
    (MPI.THREAD_MULTIPLE, "inline", "thread"),
    (MPI.THREAD_SERIALIZED, "inline", "inline"),
    (MPI.THREAD_FUNNELED, "inline", None),
    (MPI.THREAD_SINGLE, "inline", None),
])
def test_auto_picks_a_legal_strategy(level, cpu, gpu):
    assert overlap.resolve("auto", CPU, level) == cpu
    if gpu is None:
        with pytest.raises(ValueError, match="a CUDA model needs MPI_THREAD_SERIALIZED or higher"):
            overlap.resolve("auto", GPU, level)
    else:
        assert overlap.resolve("auto", GPU, level) == gpu


@pytest.mark.parametrize("level", [MPI.THREAD_SINGLE, MPI.THREAD_FUNNELED, MPI.THREAD_SERIALIZED])
def test_thread_strategy_needs_thread_multiple(level):
    with pytest.raises(ValueError, match="overlap='thread' .* needs MPI_THREAD_MULTIPLE, but the "
                                         "MPI library granted MPI_THREAD_"):
        overlap.resolve("thread", CPU, level)
    assert overlap.resolve("nonblocking", CPU, level) == "nonblocking"
    assert overlap.resolve("inline", CPU, level) == "inline"


def test_unknown_name():
    with pytest.raises(ValueError, match="overlap must be one of 'auto', 'inline', 'thread', "
                                         "'nonblocking', got 'fast'"):
        overlap.resolve("fast", CPU)
