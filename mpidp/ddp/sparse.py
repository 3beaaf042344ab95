"""Averaging sparse gradients across ranks by gathering their indices and values.

Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``)
touch different rows on different ranks, so they cannot share a dense bucket.
As torch's DDP and Horovod do, every rank gathers every rank's (indices,
values), and the sum is the coalesced sparse tensor of all of them, here
divided by the world size first, like the dense gradients. The gathers are
``mpidp.comm.allgatherv`` (watched, shapes checked across ranks).
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from .. import comm as _comm
from ..comm import chunking as _chunking

__all__ = ["allreduce_average"]


def _empty_like_grad(param: torch.Tensor) -> torch.Tensor:
    # Embedding weights: one sparse dimension (rows), the rest dense.
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64),
                                   torch.empty(0, *param.shape[1:], dtype=param.dtype),
                                   param.shape, check_invariants=False)


def allreduce_average(grad: torch.Tensor | None, param: torch.Tensor, *,
                      comm: MPI.Intracomm, divisor: int | None = None) -> torch.Tensor:
    """Return the average over the ranks of ``comm`` of each rank's sparse ``grad`` (collective).

    Args:
        grad: this rank's gradient of ``param``: sparse COO, dense (converted),
            or None (contributes nothing).
        param: the parameter (gives the shape, dtype and device of the result).
        comm: the ranks to average over; every rank calls this in the same order.
        divisor: what the sum is divided by (default: the size of ``comm``).

    Returns:
        A coalesced sparse COO tensor on ``param``'s device.
    """
    divisor = comm.Get_size() if divisor is None else divisor
    if grad is None:
        grad = _empty_like_grad(param)
    elif not grad.is_sparse:
        grad = grad.to_sparse(1)
    grad = grad.detach().coalesce().cpu()
    if grad.sparse_dim() != 1:
        raise ValueError(f"sparse gradients must have one sparse dimension (embedding rows), "
                         f"got {grad.sparse_dim()} for shape {tuple(grad.shape)}")
    indices = grad.indices()[0].contiguous()
    values = _chunking.divide(grad.values().clone(), divisor).contiguous()
    all_indices, _ = _comm.allgatherv(indices, comm=comm)
    all_values, _ = _comm.allgatherv(values, comm=comm)
    # The indices are the ranks' own coalesced indices of the same parameter: in range.
    total = torch.sparse_coo_tensor(all_indices.unsqueeze(0), all_values, param.shape,
                                    check_invariants=False)
    return total.coalesce().to(param.device)
