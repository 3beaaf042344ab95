"""Stragglers: how late each rank reaches the end of each synced step, and the late ones named.

A rank that is slow at every step makes every rank slow, since each waits for
it in the step's collectives. Which rank it is shows in how long each rank
waits: the end of a step (its buckets and its bookkeeping allreduce) completes
at about the same moment on every rank, so the rank that arrived last waits
least. A rank's lateness is therefore the longest wait of any rank minus its
own, ``max(wait) - wait[r]``: late relative to the earliest rank, from
durations each rank measures on its own monotonic clock. Nodes' clocks need
not agree; what this assumes is that an allreduce completes on every rank
within a small time of the last rank's arrival (its latency, microseconds to
a millisecond, well under any sensible threshold).

A rank's wait is what its training thread spent waiting for communication
in the step: its bucket starts (blocking under ``overlap="inline"`` and with a
comm hook, a queue or a nonblocking start otherwise) and the time from the end
of its backward pass (``Reducer._finish``) to the end of the step's
bookkeeping allreduce. So a rank slow anywhere in the step (its data, its
forward, its backward) is late, and its wait is known only after that
allreduce: each rank carries its last step's wait, in microseconds, in one
slot of its own in the next step's bookkeeping sum (every other rank adds 0
there). That is ``world + 1`` more int64 in an allreduce the step makes anyway,
and no collective of its own; the lateness of step k is known at step k+1.

A rank is late at a step when its lateness exceeds both ``threshold_ms``
and ``share`` of the step's time (``MPIDP_STRAGGLER_MS``,
``MPIDP_STRAGGLER_SHARE``): 100 ms matter on a 300 ms step, not on a 5 s one,
where the scheduler's or the file system's jitter alone reaches them. The step's
time is the mean over the ranks of each one's time between the ends of its last
two synced steps (they end together, so each measures about the same), carried
as one more slot of the same sum, so every rank judges with the same number. A
rank is named when it was late at more than half of the last ``steps``
measured steps (``MPIDP_STRAGGLER_STEPS``), with the median of its lateness
over them: once,
with a warning on rank 0 of the ``mpidp.stragglers`` logger, until it is late
at half of them or fewer (the episode ends, logged at INFO). Every rank sees
the same sums and so keeps the same record. Nothing here communicates; a step
costs a few numpy operations on arrays of ``world`` entries
(bench/straggler_bench.py).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .. import settings

__all__ = ["Stragglers", "from_settings"]

LOG = logging.getLogger("mpidp.stragglers")


def from_settings() -> tuple[float, int, float]:
    """``(threshold_ms, steps, share)`` from ``MPIDP_STRAGGLER_MS``, ``_STEPS`` and ``_SHARE``.

    Raises:
        ValueError: a value is not a number >= 0, or not an integer >= 1.
    """
    return (settings.get("MPIDP_STRAGGLER_MS"), settings.get("MPIDP_STRAGGLER_STEPS"),
            settings.get("MPIDP_STRAGGLER_SHARE"))


class Stragglers:
    """One reducer's straggler record: the waits it carries and the ranks it names.

    Args:
        rank: this rank in the reducer's communicator.
        world: its size.
        threshold_ms: a rank is late at a step when it arrives this many ms after
            the earliest rank (> 0),
        steps: how many measured steps a rank's lateness is judged over (>= 1).
        share: ... and this share of the step's time after it (>= 0).
    """

    SLOTS_BEYOND_RANKS = 1  # the step's time, summed over the ranks

    def __init__(self, rank: int, world: int, threshold_ms: float, steps: int, share: float = 0.0):
        if threshold_ms <= 0 or steps < 1 or share < 0:
            raise ValueError(f"a straggler record needs threshold_ms > 0, steps >= 1 and "
                             f"share >= 0, got {threshold_ms}, {steps} and {share}")
        self.rank, self.world = rank, world
        self.threshold_ms, self.steps, self.share = threshold_ms, steps, share
        self.named: dict[int, float] = {}  # rank -> median lateness in ms, while named
        # the last `steps` measured steps, a ring: lateness (ms) and whether over the threshold
        self._lateness = np.zeros((steps, world))
        self._late = np.zeros((steps, world), dtype=bool)
        self._counts = np.zeros(world, dtype=np.int64)  # late steps in the ring, per rank
        self._next = self._filled = 0
        self._wait_us = 0  # this rank's last wait + 1 µs (0: no step to report)
        self._period_us = 0  # its time from the end of the step before (0: none yet)
        self._ended: float | None = None  # perf_counter at the end of the last step
        self._step = 0  # the step that wait belongs to
        self.step_ms = 0.0  # the last judged step's time, the ranks' mean

    def fill(self, slots: np.ndarray) -> None:
        """Write this rank's report into the bookkeeping's ``world + 1`` slots, before the sum."""
        slots[:] = 0
        slots[self.rank] = self._wait_us
        slots[self.world] = self._period_us

    def waited(self, step: int, wait_s: float | None) -> None:
        """This rank waited ``wait_s`` at the end of ``step`` (None: a step not to measure)."""
        now = time.perf_counter()
        self._step = step
        self._wait_us = 0 if wait_s is None else int(wait_s * 1e6) + 1
        self._period_us = 0 if self._ended is None else int((now - self._ended) * 1e6)
        self._ended = now

    def read(self, summed: np.ndarray) -> tuple[int, np.ndarray] | None:
        """Take the summed slots: ``(step, lateness in ms per rank)``, or None if unmeasured.

        A step is unmeasured where any rank had nothing to report (the first step,
        or one after a failed or joined step), the same on every rank. Names and
        un-names ranks as a side effect.
        """
        waits, periods = summed[:self.world], summed[self.world]
        if not waits.all():
            return None
        lateness = (waits.max() - waits) / 1e3
        self.step_ms = periods / self.world / 1e3  # 0 at the first measured step
        late = lateness > max(self.threshold_ms, self.share * self.step_ms)
        slot = self._next
        self._counts += late
        self._counts -= self._late[slot]
        self._late[slot], self._lateness[slot] = late, lateness
        self._next = (slot + 1) % self.steps
        self._filled = min(self._filled + 1, self.steps)
        if self._filled == self.steps and (self.named or self._counts.any()):
            self._judge(self._step)
        return self._step, lateness

    def _judge(self, step: int) -> None:
        majority = set(np.flatnonzero(self._counts * 2 > self.steps).tolist())
        for rank in sorted(majority | set(self.named)):
            typical = float(np.median(self._lateness[:, rank]))
            if rank not in majority:
                del self.named[rank]
                if self.rank == 0:
                    LOG.info("mpidp: rank %d is no longer a straggler at step %d (median "
                             "lateness %.0f ms)", rank, step, typical)
                continue
            if rank not in self.named and self.rank == 0:
                LOG.warning("mpidp: rank %d is a straggler: over the last %d synced steps it "
                            "reached their end %.0f ms after the earliest rank (median; late "
                            "at %d of them; step %d of %.0f ms; thresholds MPIDP_STRAGGLER_MS=%g "
                            "and MPIDP_STRAGGLER_SHARE=%g of the step)",
                            rank, self.steps, typical, int(self._counts[rank]), step,
                            self.step_ms, self.threshold_ms, self.share)
            self.named[rank] = typical
