"""torch's DistributedSampler, with the replica count and rank taken from MPI."""

from __future__ import annotations

from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from . import runtime

__all__ = ["DistributedSampler"]


class DistributedSampler(_TorchDistributedSampler):
    """Restrict data loading to this rank's share of ``dataset``.

    Exactly torch's ``DistributedSampler`` (shuffle, seed, drop_last,
    ``set_epoch``), except that ``num_replicas`` and ``rank`` default to the
    size and rank of ``MPI.COMM_WORLD`` instead of a torch process group.

    Args:
        dataset: the dataset to sample from.
        num_replicas: number of ranks sharing the data (default: world size).
        rank: this rank's index among them (default: world rank).
        shuffle: reshuffle every epoch (seeded by ``seed + epoch``).
        seed: the shuffling seed; must be the same on every rank.
        drop_last: drop the tail so every rank gets the same count, instead of
            padding it with repeated samples.
    """

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if num_replicas is None:
            num_replicas = runtime.size()
        if rank is None:
            rank = runtime.rank()
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
