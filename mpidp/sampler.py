"""torch's DistributedSampler, with the replica count and rank taken from MPI."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from . import _args, runtime

__all__ = ["DistributedSampler"]


class DistributedSampler(_TorchDistributedSampler):
    """Restrict data loading to this rank's share of ``dataset``.

    Exactly torch's ``DistributedSampler`` (shuffle, seed, drop_last,
    ``set_epoch``), except that ``num_replicas`` and ``rank`` default to the
    size and rank of ``MPI.COMM_WORLD`` instead of a torch process group, and
    that ``pad=False`` gives every sample exactly once.

    Args:
        dataset: the dataset to sample from.
        num_replicas: number of ranks sharing the data (default: world size).
        rank: this rank's index among them (default: world rank).
        shuffle: reshuffle every epoch (seeded by ``seed + epoch``).
        seed: the shuffling seed; must be the same on every rank.
        drop_last: drop the tail so every rank gets the same count, instead of
            padding it with repeated samples.
        pad: with ``drop_last=False``, pad the tail with repeated samples so
            every rank gets the same count (torch's behaviour, the default), or
            not (False): every sample is seen once, and the ranks' shares
            differ by at most one sample, so their batch counts may differ:
            train inside ``DistributedDataParallel.join()``.
    """

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, pad: bool = True):
        if num_replicas is None:
            num_replicas = runtime.size()
        if rank is None:
            rank = runtime.rank()
        _args.check_bool("pad", pad)
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.pad = pad
        if not pad and not drop_last:
            self.num_samples = len(range(rank, len(dataset), num_replicas))
            self.total_size = len(dataset)

    def __iter__(self):
        if self.pad or self.drop_last:
            return super().__iter__()
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            indices = list(range(len(self.dataset)))
        return iter(indices[self.rank:self.total_size:self.num_replicas])
