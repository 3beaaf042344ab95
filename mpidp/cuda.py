"""Device memory and MPI: can the library read it, and staging through host memory if not.

The decision is made once, at import, and is the same on every rank:

1. ``MPIDP_CUDA_AWARE`` overrides everything (1/true/yes/on or 0/false/no/off);
2. without a GPU visible to torch, communication is host-only;
3. otherwise the library is asked (MPICH's ``MPIX_GPU_query_support``, Open
   MPI's ``MPIX_Query_cuda_support``, Cray MPICH's ``MPICH_GPU_SUPPORT_ENABLED``);
   a library that says no, or says nothing, gets host staging: handing device
   pointers to a library that cannot read them would crash the job;
4. a library that says yes is checked by a small device allreduce against the
   expected sum, and every rank must pass (an allreduce of the verdicts);
5. every rank's facts are gathered first (``job_decision``): the probe runs only when
   every rank would run it, and ``MPIDP_CUDA_AWARE`` set on some ranks only is
   an error on every rank.

``MPIDP_STAGE_CPU=1`` sends CPU tensors through the staging path too; the test
suite uses it to exercise staging where no GPU exists.

The start-up (pinning the local rank's GPU, the decision, every rank's GPU for
the default backend: ``placements``) runs when mpidp is imported in the launched
process, never in a multiprocessing child.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import socket
import threading

import torch
from mpi4py import MPI

from . import runtime, settings
from . import watchdog as _watchdog

__all__ = ["Decision", "cuda_aware", "decision", "device_index", "gpu_identity", "carried",
           "forced", "job_decision", "library_reports_cuda", "local_device", "paths", "placements",
           "rank_decision", "takes_device_memory"]

_MPIX_GPU_SUPPORT_CUDA = 0


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether device buffers go to MPI directly, and why.

    ``nonblocking``: whether nonblocking collectives get them too (where ``cuda_aware``).
    Open MPI reads device memory in point-to-point calls and blocking collectives only:
    its documentation lists the nonblocking collectives among the calls that do not
    work with CUDA-aware support, and an ``MPI_Iallreduce`` of device memory crashed
    inside its reduction (bench/reports/gpu-2026-11-27). Those calls are staged through
    host memory there.
    """

    cuda_aware: bool
    reason: str
    nonblocking: bool = True


def library_reports_cuda() -> bool | None:
    """Ask the loaded MPI library whether it supports CUDA buffers (None: it does not say)."""
    if os.environ.get("MPICH_GPU_SUPPORT_ENABLED") == "1":
        return True
    try:
        library = ctypes.CDLL(MPI.__file__)
    except OSError:
        return None
    query = getattr(library, "MPIX_GPU_query_support", None)
    if query is not None:
        supported = ctypes.c_int(0)
        if query(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(supported)) == 0:
            return bool(supported.value)
    query = getattr(library, "MPIX_Query_cuda_support", None)
    if query is not None:
        return bool(query())
    return None


def rank_decision(override: str | None, has_gpu: bool, reported: bool | None, probe,
                  blocking_only: bool = False) -> Decision:
    """Combine one rank's override, hardware, library's word and the probe (called last).

    Args:
        override: ``MPIDP_CUDA_AWARE`` read by ``mpidp.settings`` and normalised ("0", "1" or None).
        has_gpu: whether torch sees a GPU.
        reported: ``library_reports_cuda()``.
        probe: a callable returning True if a device allreduce gave the right answer
            on every rank; only called when the library says it supports CUDA.
        blocking_only: the library reads device memory in blocking collectives only
            (Open MPI, see ``Decision``): nonblocking ones are staged even when aware.
    """
    decided = _decide(override, has_gpu, reported, probe)
    if decided.cuda_aware and blocking_only:
        return Decision(True, f"{decided.reason}; nonblocking collectives staged (this library "
                              f"reads device memory in blocking ones only)", nonblocking=False)
    return decided


def _decide(override, has_gpu, reported, probe) -> Decision:
    if override is not None:
        if override not in ("0", "1"):
            raise ValueError(f"MPIDP_CUDA_AWARE must be 0 or 1, got {override!r}")
        return Decision(override == "1", f"MPIDP_CUDA_AWARE={override}")
    if not has_gpu:
        return Decision(False, "no GPU visible to torch")
    if reported is None:
        return Decision(False, "the MPI library does not say whether it is CUDA-aware; host "
                               "staging (set MPIDP_CUDA_AWARE=1 to hand it device memory)")
    if not reported:
        return Decision(False, "the MPI library reports no CUDA support; host staging")
    if probe():
        return Decision(True, "the MPI library reports CUDA support and a device allreduce "
                              "checked out on every rank")
    return Decision(False, "the MPI library reports CUDA support but a device allreduce gave "
                           "a wrong answer; host staging")


def device_index(local_rank: int, visible: int) -> int:
    """Which of the ``visible`` GPUs a rank uses: its local rank's, modulo their number.

    Where each rank sees one GPU of its own (``srun --gpus-per-task=1``) that is its
    ``cuda:0``; where every rank sees the node's GPUs, the local rank's; where there
    are more ranks than GPUs, ranks share them round robin (``placements`` tells).
    """
    if visible < 1:
        raise ValueError(f"visible must be >= 1 GPU, got {visible}")
    return local_rank % visible


def local_device() -> torch.device:
    """This rank's GPU: ``device_index(local rank, GPUs it sees)``."""
    return torch.device("cuda", device_index(runtime.local_rank(), torch.cuda.device_count()))


def gpu_identity(index: int) -> str:
    """A name of GPU ``index`` that any process seeing that GPU gives alike, and no other GPU.

    Its UUID, which does not depend on ``CUDA_VISIBLE_DEVICES`` or on how a job's
    cgroups renumber the GPUs (each rank's only GPU is ``cuda:0``, yet they differ).
    Where torch gives no UUID: the host and the GPU's entry in ``CUDA_VISIBLE_DEVICES``
    (its index where unset), which can only call two GPUs one, never one GPU two: the
    backend rule then picks "mpidp", slower but never NCCL on a shared GPU.
    """
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid:
        return f"GPU-{uuid}"
    listed = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    entry = listed[index] if index < len(listed) and listed[index] else str(index)
    return f"{socket.gethostname()}:{entry}"


def _placement() -> tuple[str | None, bool]:
    gpu = gpu_identity(local_device().index) if torch.cuda.is_available() else None
    return gpu, torch.distributed.is_available() and torch.distributed.is_nccl_available()


@functools.cache
def placements() -> tuple[tuple[str | None, ...], tuple[bool, ...]]:
    """Every rank's GPU (``gpu_identity`` of the one it uses; None: it sees none) and whether
    its torch has NCCL, by rank: the facts of ``backend_choice.backend_for``.

    Collective on ``MPI.COMM_WORLD`` (one allgather), made at import by ``_start_up`` on
    every rank, so every later call reads the same facts on every rank.
    """
    from .comm import agreement  # noqa: PLC0415  (mpidp.comm imports this module)

    facts = agreement.watched_allgather(MPI.COMM_WORLD, _placement(),
                                        "import mpidp: each rank's GPU (allgather)")
    return tuple(gpu for gpu, _ in facts), tuple(nccl for _, nccl in facts)


def _probe() -> bool:
    from .comm import agreement  # noqa: PLC0415  (mpidp.comm imports this module)

    comm = MPI.COMM_WORLD
    device = local_device()
    tensor = torch.full((4,), float(comm.Get_rank() + 1), device=device)
    torch.cuda.synchronize(device)
    try:
        _watchdog.watched("the CUDA-aware probe (allreduce of device memory)", comm.Allreduce,
                          MPI.IN_PLACE, [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes),
                                         tensor.numel(), MPI.FLOAT])
        expected = comm.Get_size() * (comm.Get_size() + 1) / 2
        ok = bool(torch.all(tensor == expected).item())
    except MPI.Exception:
        ok = False
    return not agreement.any_failed(comm, not ok, "the CUDA-aware probe's verdict (allreduce)")


def job_decision(states: list[tuple], rank: int, probe, blocking_only: bool = False) -> Decision:
    """The decision of ``rank`` from every rank's ``(override, has_gpu, reported)``.

    Every rank calls this with the same gathered states, so every rank takes the
    same branch: the probe (a collective) runs on all ranks or on none. It runs
    only where every rank sees a GPU and a library that claims CUDA support; a
    job where only some do stages device memory through the host everywhere.
    """
    error = _overrides_alike(states)
    if error is not None:
        raise error
    override, has_gpu, reported = states[rank]
    claims = [bool(gpu and said) for _, gpu, said in states]
    if override is None and any(claims) and not all(claims):
        return Decision(False, "not every rank sees a GPU and a CUDA-aware MPI library; host "
                               "staging everywhere")
    return rank_decision(override, has_gpu, reported, probe, blocking_only)


def _overrides_alike(states: list[tuple]) -> ValueError | None:
    overrides = sorted({str(state[0]) for state in states})
    if len(overrides) > 1:
        return ValueError(f"MPIDP_CUDA_AWARE must be set alike on every rank, got "
                          f"{', '.join(overrides)} (None: unset)")
    return None


def _blocking_only() -> bool:
    """Whether the library is one that reads device memory in blocking collectives only."""
    return MPI.Get_library_version().lstrip().startswith("Open MPI")


@functools.cache
def decision() -> Decision:
    """The start-up decision: one allgather on ``MPI.COMM_WORLD``, on every rank alike.

    Every rank takes part, GPU or not, and ``_start_up`` makes it at import on
    every rank, so later calls (``python -m mpidp info`` on rank 0, the first
    staged transfer) only read the cached answer. A node where no GPU is visible
    must not leave the others waiting in the probe's allreduce (``job_decision``).
    """
    from .comm import agreement  # noqa: PLC0415  (mpidp.comm imports this module)

    runtime.require_mpi()
    has_gpu = torch.cuda.is_available()
    override = settings.get("MPIDP_CUDA_AWARE")  # any accepted spelling, normalised for rank_decision
    override = None if override is None else str(int(override))
    reported = library_reports_cuda() if has_gpu else None
    states = agreement.decide(MPI.COMM_WORLD, (override, has_gpu, reported), _overrides_alike,
                              "import mpidp: each rank's GPU and CUDA-aware setting (allgather)")
    return job_decision(states, MPI.COMM_WORLD.Get_rank(), _probe, _blocking_only())


_forced: list[Decision] = []  # innermost last: ``forced`` blocks in force in this process


@contextlib.contextmanager
def forced(decided: Decision):
    """Within the block this process takes ``decided`` in place of the start-up decision.

    For benchmarks and tests that time or check both paths in one launch
    (``bench/gpu_allreduce.py``); every rank should enter it alike. Handing device
    memory to a library that cannot read it crashes the job, as ``MPIDP_CUDA_AWARE=1``
    would.
    """
    if not isinstance(decided, Decision):
        raise TypeError(f"forced takes a Decision, got {type(decided).__name__}")
    _forced.append(decided)
    try:
        yield decided
    finally:
        _forced.remove(decided)


def _in_force() -> Decision:
    return _forced[-1] if _forced else decision()


def cuda_aware() -> bool:
    """Whether device buffers are handed to MPI directly (in blocking collectives at least)."""
    return _in_force().cuda_aware


def takes_device_memory(nonblocking: bool) -> bool:
    """Whether a collective of this kind (nonblocking: an ``I``-form) gets device memory as it is.

    The one rule for pointer or staged: ``mpidp.comm``'s staging, DDP's communication
    thread and the backend's progress thread all ask it.
    """
    decided = _in_force()
    return decided.cuda_aware and (decided.nonblocking or not nonblocking)


_paths = {"pointer": 0, "staged": 0}
_paths_lock = threading.Lock()


def carried(path: str, calls: int = 1) -> None:
    """Count ``calls`` MPI calls whose device memory went as a ``"pointer"`` or ``"staged"``."""
    if path not in _paths:
        raise ValueError(f"path must be 'pointer' or 'staged', got {path!r}")
    with _paths_lock:
        _paths[path] += calls


def paths() -> dict[str, int]:
    """How many MPI calls on device memory this process made so far, by path taken.

    ``{"pointer": n, "staged": m}``: the device pointer handed to MPI, or the bytes
    copied through host memory first. Counted where the bytes leave (``comm``'s
    staging: one per call; DDP's staged pipeline: one per chunk; the backend's host
    mirror: one per tensor), so a test or a benchmark can tell which path carried
    them: compare the kinds, not the totals, of two readings' differences.
    """
    with _paths_lock:
        return dict(_paths)


def stage_cpu() -> bool:
    """Testing aid: route CPU tensors through the staging path (``MPIDP_STAGE_CPU=1``)."""
    return settings.get("MPIDP_STAGE_CPU")


def _start_up() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_device())  # each rank uses the GPU of its local rank
    decision()  # collective on every rank, GPU or not; cached for every later call
    placements()  # collective too: the default backend's facts
