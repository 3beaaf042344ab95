"""One profile of the whole job: torch.profiler on every rank, merged into one trace on rank 0.

    mpiexec -n 2 python -m mpidp profile -o job.json train.py [args]

or, around a part of a script, ``with mpidp.profile("job.json"): ...``. Each
rank runs ``torch.profiler.profile`` and exports its Chrome trace; the traces
are gathered to rank 0 (``mpidp.objects.gather_object``), which writes one
trace-event JSON file: each rank is a process of its own (``pid`` = rank,
named ``rank N``), its threads and devices its lanes, so Perfetto
(ui.perfetto.dev) or ``chrome://tracing`` shows every rank on one time axis.

The axis is rank 0's clock, from zero at the earliest event of any rank.
The ranks of one node share a clock; another node's offset from rank 0's is
measured once, at the start: its ranks read their clocks as they leave each
of ``ROUNDS`` barriers, and its offset is the median of their readings minus
rank 0's. So the nodes line up to within the time a barrier takes to release
every rank (a network latency), and a clock that drifts during a long profile
is not followed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import tempfile
import time

import torch
from mpi4py import MPI

from . import objects, runtime
from .comm import agreement as _agreement
from .watchdog import barrier

__all__ = ["profile"]

ROUNDS = 5  # barriers to time each rank's clock against rank 0's
DEVICE_LANES = 1 << 32  # tids of a device's streams, above any thread id of the host
_PROCESS_METADATA = ("process_name", "process_labels", "process_sort_index")


def _clock_offsets() -> list[int]:
    """Each rank's clock minus rank 0's, in ns (collective).

    The ranks of one node share one clock: rank 0's node's offset is 0, and
    another node's is the median, over its ranks and ``ROUNDS`` barriers, of the
    clock read as each barrier let the rank go minus rank 0's reading there.
    """
    readings = []
    for _ in range(ROUNDS):
        barrier()
        readings.append(time.time_ns())
    every = objects.allgather_object((MPI.Get_processor_name(), readings))
    differences: dict[str, list[int]] = {}
    for node, theirs in every:
        differences.setdefault(node, []).extend(
            mine - zero for mine, zero in zip(theirs, every[0][1]))
    offsets = {node: 0 if node == every[0][0] else int(statistics.median(found))
               for node, found in differences.items()}
    return [offsets[node] for node, _ in every]


def _check_output(path: str) -> None:
    """Raise ValueError on every rank if rank 0 could not write ``path``."""
    problem = None
    if runtime.world().Get_rank() == 0:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            problem = f"path {path!r}: folder {folder!r} does not exist"
        elif os.path.isdir(path):
            problem = f"path {path!r} is a folder; give a file name such as job.json"
    _agreement.raise_together(runtime.world(), problem, ValueError, "mpidp.profile:",
                              "mpidp.profile (can rank 0 write the trace?)")


def rank_events(trace: dict, rank: int, size: int, shift_us: float, host_pid: int) -> list:
    """``trace``'s events (torch's export) as rank ``rank``'s process in the merged trace.

    ``pid`` becomes ``rank`` and ``ts`` moves by ``shift_us``. The host's threads
    keep their ids; the other lanes of torch's export (a GPU's streams, the
    profiler's own spans: other ``pid``s there) are renumbered above any thread id
    and named after their process and lane. torch's process names are dropped (the
    merged trace names each rank), flow ids are made unique across ranks, and a
    global instant becomes the rank's own, so that each rank's marks stay in its row.
    """
    events = trace.get("traceEvents", [])
    processes = {event.get("pid"): event.get("args", {}).get("name", "") for event in events
                 if event.get("ph") == "M" and event.get("name") == "process_name"}
    lanes: dict[tuple, int] = {}
    named, merged = set(), []
    for event in events:
        if event.get("ph") == "M" and event.get("name") in _PROCESS_METADATA:
            continue
        event = dict(event)
        pid = event.get("pid")
        if pid != host_pid and "tid" in event:
            event["tid"] = lanes.setdefault((pid, event["tid"]), DEVICE_LANES + len(lanes))
            if event.get("ph") == "M" and event.get("name") == "thread_name":
                event["args"] = {"name": _lane(processes.get(pid, pid), event["args"].get("name"))}
                named.add(event["tid"])
        event["pid"] = rank
        if "ts" in event:
            event["ts"] = event["ts"] + shift_us
        if event.get("ph") in ("s", "t", "f") and isinstance(event.get("id"), int):
            event["id"] = event["id"] * size + rank
        if event.get("ph") == "i" and event.get("s") == "g":
            event["s"] = "p"
        merged.append(event)
    merged += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "ts": 0,
                "args": {"name": _lane(processes.get(pid, pid), lane)}}
               for (pid, lane), tid in lanes.items() if tid not in named]
    return merged


def _lane(process, lane) -> str:
    """A lane's name from its process's and its own in torch's export (either may be empty)."""
    return " ".join(str(part) for part in (process, lane) if part != "") or "profiler"


def _exported(profiler) -> dict:
    """This rank's trace as torch exports it (Chrome trace-event JSON, parsed)."""
    with tempfile.TemporaryDirectory(prefix="mpidp-profile-") as folder:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as file:
            return json.load(file)


def _metadata(size: int) -> str:
    """The merged trace's own events: each rank's process name and place in the list."""
    return json.dumps([{"ph": "M", "name": name, "pid": rank, "tid": 0, "ts": 0, "args": args}
                       for rank in range(size)
                       for name, args in (("process_name", {"name": f"rank {rank}"}),
                                          ("process_sort_index", {"sort_index": rank}))])[1:-1]


def _write(path: str, parts: list[str], other: dict) -> None:
    """Write ``{"traceEvents": [every part's events], **other}``; ``parts`` are JSON lists'
    items, joined as they are (a rank's trace is not parsed again on rank 0)."""
    partial = f"{path}.partial"
    with open(partial, "w") as file:
        file.write('{"traceEvents": [')
        file.write(", ".join(part for part in parts if part))
        file.write("], ")
        file.write(json.dumps(other)[1:])
    os.replace(partial, path)


@contextlib.contextmanager
def profile(path: str, *, activities=None, record_shapes: bool = False,
            profile_memory: bool = False, with_stack: bool = False):
    """Profile the block on every rank and write one trace of the whole job on rank 0 (collective).

    Enter and leave it on every rank at the same point. On entry the ranks
    measure their clocks' offsets (barriers); on leaving, each rank's trace is
    gathered to rank 0, which writes ``path``: Chrome trace-event JSON with each
    rank as a process (``pid`` = rank, named ``rank N``), timestamps in µs on
    rank 0's clock from the earliest event of any rank. mpidp's DDP names each
    bucket's reduction there (``mpidp.DDP bucket ...``). If the block raises,
    nothing is gathered or written and the exception goes on (mpidp ends the
    whole job on an uncaught one).

    Args:
        path: the file rank 0 writes (its folder must exist); ignored elsewhere.
        activities: ``torch.profiler.ProfilerActivity`` values; default CPU, and
            CUDA where torch sees a GPU.
        record_shapes, profile_memory, with_stack: as ``torch.profiler.profile``'s.

    Yields:
        This rank's ``torch.profiler.profile`` (for ``key_averages()`` and the like).

    Raises:
        ValueError: on every rank, if rank 0's ``path`` is a folder or its folder is missing.
    """
    _check_output(path)
    world = runtime.world()
    if activities is None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
    offsets = _clock_offsets()
    with torch.profiler.profile(activities=activities, record_shapes=record_shapes,
                                profile_memory=profile_memory, with_stack=with_stack) as profiler:
        yield profiler
    trace = _exported(profiler)
    rank, size = world.Get_rank(), world.Get_size()
    # torch's ts: µs since its baseTimeNanoseconds, on this rank's clock; the merged
    # trace's zero: the earliest event of any rank, on rank 0's clock
    # (whole ns here: the sum of two such floats would lose a fraction of a µs)
    base_ns = trace.get("baseTimeNanoseconds", 0) - offsets[rank]
    earliest = min((event["ts"] for event in trace.get("traceEvents", []) if "ts" in event),
                   default=0.0)
    zero_ns = min(objects.allgather_object(base_ns + math.floor(earliest) * 1000))
    events = rank_events(trace, rank, size, (base_ns - zero_ns) / 1000, os.getpid())
    parts = objects.gather_object(json.dumps(events)[1:-1])
    if rank == 0:
        other = {"displayTimeUnit": "ms",
                 "otherData": {"source": "mpidp.profile", "ranks": size, "zero_unix_ns": zero_ns,
                               "clock_offsets_ns": offsets}}
        _write(path, [_metadata(size), *parts], other)
