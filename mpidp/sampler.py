"""torch's DistributedSampler, with the replica count and rank taken from MPI."""

from __future__ import annotations

import math

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

    Resuming (``resume_from``): an epoch's *global order* is the list of
    sample indices that torch's sampler deals out, one to each rank in turn
    (after shuffling, padding or dropping the tail for ``num_replicas``).
    Rank ``r`` takes positions ``start + r``, ``start + r + num_replicas``, ...
    of it, so the samples of a global batch of ``B`` samples are positions
    ``k*B .. (k+1)*B - 1`` whatever the rank count: a run that resumes at
    another count with the same global batch sees the same samples in the
    same global batches (only the padded or dropped tail of the epoch follows
    the new count).
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
        self.start = 0  # where this epoch's iteration begins in its global order
        self._start_epoch = None
        if not pad and not drop_last:
            self.num_samples = len(range(rank, len(dataset), num_replicas))
            self.total_size = len(dataset)

    def resume_from(self, epoch: int, start: int) -> None:
        """Begin epoch ``epoch`` at position ``start`` of its global order (local).

        ``set_epoch`` with another epoch goes back to the start of that epoch.

        Raises:
            ValueError: ``epoch`` or ``start`` negative, or ``start`` not a
                multiple of ``num_replicas`` (the ranks' shares would differ).
        """
        if not _args.is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        if not _args.is_int(start) or start < 0 or start % self.num_replicas:
            raise ValueError(f"start must be a multiple of num_replicas={self.num_replicas} "
                             f"and >= 0, got {start!r}")
        self.epoch, self.start, self._start_epoch = epoch, start, epoch

    def resize(self, num_replicas: int, rank: int) -> None:
        """Deal the epochs to ``num_replicas`` ranks from now on, this one ``rank`` (local).

        The data, seed, shuffle, padding and epoch stay; the position goes back
        to the epoch's start, for ``resume_from`` to set (``mpidp.healing`` does
        both after a lost rank).
        """
        epoch = self.epoch
        self.__init__(self.dataset, num_replicas, rank, shuffle=self.shuffle, seed=self.seed,
                      drop_last=self.drop_last, pad=self.pad)
        self.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the shuffle (as torch's); another epoch begins at 0."""
        if epoch != self._start_epoch:
            self.start, self._start_epoch = 0, None
        super().set_epoch(epoch)

    def __len__(self) -> int:
        if not self.start:
            return self.num_samples
        return len(range(self.start + self.rank, self._global_size(), self.num_replicas))

    def _global_size(self) -> int:
        return self.total_size if (self.pad or self.drop_last) else len(self.dataset)

    def global_order(self) -> list[int]:
        """This epoch's sample indices in the order the ranks are dealt them (as torch's)."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            indices = list(range(len(self.dataset)))
        if self.drop_last:
            return indices[:self.total_size]
        if self.pad and self.total_size > len(indices):
            padding = self.total_size - len(indices)
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return indices

    def __iter__(self):
        return iter(self.global_order()[self.start + self.rank:self._global_size():self.num_replicas])
