"""Horovod's timeline: one Chrome trace event per collective of ``mpidp.horovod``.

``hvd.start_timeline(path)`` (or ``HOROVOD_TIMELINE=path`` at ``hvd.init``)
records, on rank 0 as Horovod does, when each collective started and when
``synchronize`` saw it complete; ``stop_timeline`` writes them to ``path`` as
a JSON array that chrome://tracing and Perfetto open. Horovod's own timeline
also shows its negotiation and fusion phases, which mpidp does not have.
"""

from __future__ import annotations

import json
import threading
import time

__all__ = ["Timeline"]


class Timeline:
    """Events of one recording, written to ``path`` by ``stop``."""

    def __init__(self, path: str, rank: int):
        if not isinstance(path, str) or not path:
            raise ValueError(f"file_path must be a non-empty str, got {path!r}")
        self.path, self.rank = path, rank
        self.events: list[dict] = []
        self._origin = time.perf_counter()
        self._lock = threading.Lock()  # hooks on autograd's threads record too

    def now(self) -> float:
        return time.perf_counter()

    def record(self, kind: str, name: str | None, started: float, process_set_id: int,
               nbytes: int) -> None:
        event = dict(name=kind, cat="collective", ph="X", pid=self.rank, tid=process_set_id,
                     ts=(started - self._origin) * 1e6, dur=(self.now() - started) * 1e6,
                     args=dict(tensor=name or "", bytes=nbytes))
        with self._lock:
            self.events.append(event)

    def stop(self) -> None:
        with self._lock, open(self.path, "w") as out:
            json.dump(self.events, out)
