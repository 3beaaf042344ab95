"""The ``HOROVOD_*`` environment variables: which mean something here, and what.

| variable                             | here                                                    |
|--------------------------------------|---------------------------------------------------------|
| ``HOROVOD_TIMELINE``                 | ``hvd.start_timeline(path)`` at ``hvd.init``            |
| ``HOROVOD_FUSION_THRESHOLD``         | bytes per gradient bucket of ``DistributedOptimizer``   |
| ``HOROVOD_STALL_CHECK_TIME_SECONDS`` | mpidp's stall watchdog reports after it (no abort)      |
| ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` | the watchdog reports and ends the job after it       |
| ``HOROVOD_STALL_CHECK_DISABLE``      | turns the watchdog off                                  |
| ``HOROVOD_ELASTIC``                  | refused (``ValueError``): no elastic training           |
| the tuning variables in ``_IGNORED`` | a warning at ``hvd.init`` that names them               |

Read once, at ``hvd.init``, with the spelling rules of ``mpidp.settings``.
"""

from __future__ import annotations

import os
import warnings

from .. import settings as _read  # HOROVOD_* variables, by mpidp's spelling rules
from .. import watchdog as _watchdog

__all__ = ["fusion_threshold", "apply"]

# Tuning knobs of Horovod's background thread, its C++ build or its launcher, for
# machinery mpidp does not have: each gets a warning, never silence.
_IGNORED = {
    "HOROVOD_CYCLE_TIME": "mpidp starts each bucket as soon as it is ready, without cycles",
    "HOROVOD_CACHE_CAPACITY": "mpidp has no negotiation to cache",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "MPI's allreduce picks its own algorithm",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "MPI's allgather picks its own algorithm",
    "HOROVOD_AUTOTUNE": "no autotuner; set HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_TIMELINE_MARK_CYCLES": "there are no cycles to mark",
    "HOROVOD_NUM_NCCL_STREAMS": "mpidp talks MPI, not NCCL",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "no fusion kernels here",
    "HOROVOD_THREAD_AFFINITY": "see python -m mpidp info for binding",
    "HOROVOD_DISABLE_GROUP_FUSION": "groups are fused as given",
}


def fusion_threshold(default: int) -> int:
    """``HOROVOD_FUSION_THRESHOLD`` in bytes (0: no fusion), else ``default``."""
    return int(_read.number("HOROVOD_FUSION_THRESHOLD", default, minimum=0, integer=True))


def apply(start_timeline) -> None:
    """Act on the variables at ``hvd.init`` (the same environment on every rank)."""
    if _read.given("HOROVOD_ELASTIC") and _read.flag("HOROVOD_ELASTIC", False):
        raise ValueError("HOROVOD_ELASTIC is set, but mpidp.horovod has no elastic training: "
                         "a job keeps its ranks from start to end (restart it from a checkpoint)")
    ignored = [f"{name} ({why})" for name, why in _IGNORED.items() if _read.given(name)]
    if ignored:
        warnings.warn(f"mpidp.horovod ignores {'; '.join(ignored)}", stacklevel=3)
    fusion_threshold(0)  # checked here, read by each DistributedOptimizer
    _stall_watchdog()
    path = os.environ.get("HOROVOD_TIMELINE", "").strip()
    if path and path.upper() != "DYNAMIC":
        start_timeline(path)


def _stall_watchdog() -> None:
    if _read.flag("HOROVOD_STALL_CHECK_DISABLE", False):
        _watchdog.set_timeout(0)
        return
    shutdown = _read.number("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0)
    if shutdown > 0:
        _watchdog.set_timeout(shutdown, action="abort")
    elif _read.given("HOROVOD_STALL_CHECK_TIME_SECONDS"):
        _watchdog.set_timeout(_read.number("HOROVOD_STALL_CHECK_TIME_SECONDS", 60),
                              action="report")
