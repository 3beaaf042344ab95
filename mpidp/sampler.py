"""torch's DistributedSampler, with the replica count and rank taken from MPI."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from . import _args, runtime

__all__ = ["DistributedSampler", "micro_batch_counts"]


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

    After ``resume_from``, the loop that drew the samples before the stop runs
    again from its top, and the sampler lets it through to the position: a
    *pass* (one ``iter()``, one loop over the DataLoader) over an epoch that
    came before yields nothing, and the pass at the position deals only the
    rest. ``for epoch in range(epochs): set_epoch(epoch)`` thus goes on where
    it stopped, and so does a loop that starts at ``sampler.epoch``; a loop
    that would skip the position's epoch, or number its epochs by itself
    after one, is refused (``set_epoch``).

    Micro-batches (``micro_batches`` and ``micro_batch_size``, for
    ``DistributedDataParallel(reproducible=True)``): every global batch of
    ``micro_batches * micro_batch_size`` samples is cut into ``micro_batches``
    micro-batches, dealt to the ranks as evenly as they divide
    (``micro_batch_counts``: the first ``micro_batches % num_replicas`` ranks
    take one more), each rank a contiguous run of them in rank order, so that
    rank order then batch order is micro-batch order. Rank ``r`` takes
    ``batch_size = micro_batch_counts(...)[r] * micro_batch_size`` samples of
    every global batch, which may differ by rank; ``num_replicas`` may be any
    count up to ``micro_batches``. The tail of an epoch that makes no whole
    global batch is left out (``pad`` and ``drop_last`` change nothing then),
    so the epochs too are the same at any rank count.
    """

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, pad: bool = True,
                 *, micro_batches: int | None = None, micro_batch_size: int | None = None):
        if num_replicas is None:
            num_replicas = runtime.size()
        if rank is None:
            rank = runtime.rank()
        _args.check_bool("pad", pad)
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.pad = pad
        self.start = 0  # where the pass in progress (or the next, after set_epoch) begins
        self.passes = 0  # passes begun over this epoch number since it was set
        self.rewound = False  # a pass dealt an epoch below one dealt before: set_epoch(e % k)
        self._highest = 0  # the highest epoch a pass dealt samples of
        self._target = None  # (epoch, passes before, start): where a resume goes on from
        self._reached = None  # called when a pass reaches the target
        self._lead = None  # after a resume: "resume", then "pass" if a pass began before set_epoch
        if not pad and not drop_last:
            self.num_samples = len(range(rank, len(dataset), num_replicas))
            self.total_size = len(dataset)
        self.micro_batches, self.micro_batch_size = micro_batches, micro_batch_size
        if micro_batches is not None or micro_batch_size is not None:
            self._deal_micro_batches()

    def _deal_micro_batches(self) -> None:
        micro_batches, size = self.micro_batches, self.micro_batch_size
        _args.check_int("micro_batches", micro_batches, minimum=1)
        _args.check_int("micro_batch_size", size, minimum=1)
        counts = micro_batch_counts(micro_batches, self.num_replicas)
        self.global_batch = micro_batches * size
        self.batch_size = counts[self.rank] * size
        self._first = sum(counts[:self.rank]) * size  # where this rank's run begins
        self.total_size = len(self.dataset) // self.global_batch * self.global_batch
        self.num_samples = self.total_size // self.num_replicas

    def resume_from(self, epoch: int, start: int, *, passes: int = 0, reached=None) -> None:
        """Go on from position ``start`` of epoch ``epoch``'s global order (local).

        The pass at the position is the one after ``passes`` passes over
        ``epoch`` (more than 0 only in a loop that sets no epoch, or the same
        one, each time). Until a pass reaches it, a pass over an earlier epoch,
        or an earlier pass over ``epoch``, yields nothing: the loop that ran
        before the stop runs through to the position again.

        Args:
            epoch: the epoch of the position (set now: ``self.epoch``).
            start: the samples of the epoch's global order taken before it.
            passes: the passes over ``epoch`` before the position's.
            reached: called with no argument when the pass at the position
                begins, before its first index is dealt.

        Raises:
            ValueError: ``epoch``, ``start`` or ``passes`` negative, or ``start``
                not a multiple of ``num_replicas`` (the ranks' shares would differ;
                with micro-batches, not a multiple of the global batch).
        """
        if not _args.is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        unit = ("num_replicas", self.num_replicas) if self.micro_batches is None else \
            ("the global batch", self.global_batch)
        if not _args.is_int(start) or start < 0 or start % unit[1]:
            raise ValueError(f"start must be a multiple of {unit[0]}={unit[1]} "
                             f"and >= 0, got {start!r}")
        _args.check_int("passes", passes, minimum=0)
        self.epoch, self.passes, self._highest = epoch, 0, epoch
        self._target, self._reached, self._lead = (epoch, passes, start), reached, "resume"
        self.start = self._next_start()

    def resize(self, num_replicas: int, rank: int) -> None:
        """Deal the epochs to ``num_replicas`` ranks from now on, this one ``rank`` (local).

        The data, seed, shuffle, padding and epoch stay; the position goes back
        to the epoch's start, for ``resume_from`` to set (``mpidp.healing`` does
        both after a lost rank).
        """
        epoch, highest, rewound = self.epoch, self._highest, self.rewound
        self.__init__(self.dataset, num_replicas, rank, shuffle=self.shuffle, seed=self.seed,
                      drop_last=self.drop_last, pad=self.pad, micro_batches=self.micro_batches,
                      micro_batch_size=self.micro_batch_size)
        self.epoch, self._highest, self.rewound = epoch, highest, rewound

    def dealing_problem(self, num_replicas: int, global_batch: int) -> str | None:
        """Why global batches of ``global_batch`` samples cannot be dealt to ``num_replicas``
        ranks, or None (local; the same on every rank that holds the same sampler).

        With micro-batches any count up to ``micro_batches`` can (``micro_batch_counts``);
        without, the global batch must divide among the ranks.
        """
        if self.micro_batches is not None:
            try:
                micro_batch_counts(self.micro_batches, num_replicas)
            except ValueError as error:
                return str(error)
            return None
        if global_batch % num_replicas:
            return f"the global batch of {global_batch} samples does not divide among " \
                   f"{num_replicas} ranks"
        return None

    def share(self, global_batch: int) -> int:
        """This rank's samples of every global batch of ``global_batch`` samples (local):
        ``batch_size`` with micro-batches (then ``global_batch`` is theirs), else an even share."""
        if self.micro_batches is not None:
            return self.batch_size
        return global_batch // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the shuffle (as torch's); its next pass begins at 0.

        After ``resume_from``, an epoch before the position's yields nothing
        until a pass reaches the position (the class's docstring).

        Raises:
            ValueError: after ``resume_from``, an epoch after the position's
                before a pass reached it (the rest of its epoch would be
                skipped), or, in a loop that began the position's epoch without
                ``set_epoch``, an epoch not after it (the loop counts epochs of
                its own). Every rank that loaded the same position and runs
                the same loop raises it alike.
        """
        self._check_epoch_after_resume(epoch)
        if epoch != self.epoch:
            self.passes = 0
        super().set_epoch(epoch)
        self.start = self._next_start()

    def _check_epoch_after_resume(self, epoch: int) -> None:
        lead, self._lead = self._lead, None
        if self._target is not None and epoch > self._target[0]:
            saved, _, start = self._target
            raise ValueError(
                f"set_epoch({epoch}): the run was resumed in epoch {saved}, at sample {start} "
                f"of its global order, and has not gone on from there yet: epoch {epoch} "
                f"would skip the rest of epoch {saved}. Set the epochs in order, counted from "
                f"0 (for epoch in range(epochs): sampler.set_epoch(epoch)) or from "
                f"sampler.epoch after resume(); either goes on where the run stopped")
        if lead == "pass" and epoch <= self.epoch:
            raise ValueError(
                f"set_epoch({epoch}) after a pass over the resumed epoch {self.epoch}, which "
                f"began without set_epoch: the loop counts its epochs by itself, from before "
                f"the resume, and would deal epoch {epoch} again. Call "
                f"sampler.set_epoch(epoch) before each epoch's loop over the data, with epoch "
                f"counted from 0 or from sampler.epoch after resume()")

    def _next_start(self) -> int:
        """Where the next pass begins: 0, the resume's position, or the end (nothing)."""
        if self._target is None:
            return 0
        epoch, passes, start = self._target
        if self.epoch < epoch or self.passes < passes:
            return self._global_size()  # dealt before the stop
        return start

    def _begin_pass(self) -> None:
        """A pass begins (``iter``): where, and whether it reaches a resume's position."""
        self.start = self._next_start()
        if self._lead == "resume":
            self._lead = "pass"
        reached = self._target is not None and (self.epoch, self.passes) == self._target[:2]
        self.passes += 1
        if reached:
            callback, self._target, self._reached = self._reached, None, None
            if callback is not None:
                callback()
        if self._target is None:  # a pass that deals samples
            self.rewound = self.rewound or self.epoch < self._highest
            self._highest = max(self._highest, self.epoch)

    def __len__(self) -> int:
        if self.micro_batches is not None:
            return (self.total_size - self.start) // self.global_batch * self.batch_size
        if not self.start:
            return self.num_samples
        return len(range(self.start + self.rank, self._global_size(), self.num_replicas))

    def _global_size(self) -> int:
        whole = self.pad or self.drop_last or self.micro_batches is not None
        return self.total_size if whole else len(self.dataset)

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
        self._begin_pass()
        if self.micro_batches is not None:
            return iter(self._micro_batch_order())
        return iter(self.global_order()[self.start + self.rank:self._global_size():self.num_replicas])

    def _micro_batch_order(self) -> list[int]:
        order, low, high = self.global_order(), self._first, self._first + self.batch_size
        mine = []
        for first in range(self.start, self.total_size - self.global_batch + 1, self.global_batch):
            mine += order[first + low:first + high]
        return mine


def micro_batch_counts(micro_batches: int, num_replicas: int) -> list[int]:
    """How many of a global batch's micro-batches each rank takes: as evenly as they divide.

    Rank ``r`` takes ``micro_batches // num_replicas`` of them, one more if
    ``r < micro_batches % num_replicas`` (6 to 4 ranks: 2, 2, 1, 1), a contiguous
    run in rank order. The one rule of the dealing: ``DistributedSampler`` deals
    by it and ``DistributedDataParallel(reproducible=True)`` checks every step's
    counts against it.

    Raises:
        ValueError: ``num_replicas`` above ``micro_batches`` (a rank would take none).
    """
    if num_replicas > micro_batches:
        raise ValueError(f"micro_batches must be at least the number of ranks (each rank takes "
                         f"whole micro-batches, at least one), got micro_batches={micro_batches} "
                         f"for num_replicas={num_replicas}")
    whole, more = divmod(micro_batches, num_replicas)
    return [whole + (rank < more) for rank in range(num_replicas)]
