"""The doctor's checks: each gathers every rank's facts, then judges them alike on every rank.

A check is a function ``check(comm, context) -> Finding`` that every rank calls
in the same order. It reads this rank's facts (never raising: a fact that
cannot be read is a fact too), gathers them through
``mpidp.comm.agreement.watched_allgather``, and judges the gathered list with
a pure function (``judge_*``, unit-tested on facts written by hand), so every
rank returns the same finding. Only ``rendezvous`` and ``fork`` do more than
read: the first listens on rank 0's chosen address and has every rank
connect, the second forks a child as a DataLoader worker under ``fork`` is.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time

import mpi4py
import torch
from mpi4py import MPI

import mpidp
from .. import cuda, rendezvous, runtime, settings, topology
from ..comm import chunking, shm
from ..comm.agreement import by_rank, watched_allgather
from ..comm.handle import collective

__all__ = ["Finding", "CHECKS", "judge_launch", "judge_gpus", "judge_settings", "judge_versions"]

# What a launcher tells each process about the job's size, most specific first:
# Open MPI's mpirun, a PMI launcher (MPICH's and Intel MPI's Hydra, srun --mpi=pmi2),
# then Slurm's own count of the step's tasks (srun with any --mpi).
LAUNCHER_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one check found: the same on every rank.

    Attributes:
        name: the check, one word.
        ok: nothing wrong.
        found: what the check saw, one line (the problem, when not ok).
        fix: what to change (None when ok).
    """

    name: str
    ok: bool
    found: str
    fix: str | None = None


def library() -> str:
    """The MPI library's name and version, one line."""
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def _gather(comm: MPI.Intracomm, read, what: str) -> list:
    try:
        fact = read()
    except Exception as error:  # noqa: BLE001  a fact that cannot be read is reported, not raised
        fact = ("error", f"{type(error).__name__}: {error}")
    return watched_allgather(comm, fact, f"python -m mpidp doctor: {what} (allgather)")


# -- the launch: does MPI see the job the launcher started? ---------------------------------------

def _launcher_size() -> tuple[str | None, str | None, int]:
    for name in LAUNCHER_SIZES:
        if name == "SLURM_STEP_NUM_TASKS" and "SLURM_PROCID" not in os.environ:
            continue
        if os.environ.get(name, "").strip():
            return name, os.environ[name].strip(), MPI.COMM_WORLD.Get_size()
    return None, None, MPI.COMM_WORLD.Get_size()


def judge_launch(facts: list) -> Finding:
    """Every rank's (launcher variable, its value, MPI's size)."""
    size = facts[0][2]
    wrong = [f"{name}={value}" if name else None for name, value, mpi_size in facts
             if name and value != str(mpi_size)]
    if not wrong:
        said = next((f", as {name}={value} says" for name, value, _ in facts if name), "")
        return Finding("launch", True, f"{size} rank{'s' if size > 1 else ''}{said}")
    return Finding(
        "launch", False,
        f"MPI sees {size} rank{'s' if size > 1 else ''} but the launcher started {wrong[0]}: "
        f"the launcher and the MPI library do not share a process-management interface, so "
        f"every process runs as a job of its own",
        f"under Slurm, srun --mpi=pmi2 (MPICH, Intel MPI) or --mpi=pmix (Open MPI) as the "
        f"cluster offers (srun --mpi=list); or launch with the mpiexec of the MPI library that "
        f"mpi4py loads ({library()})")


def check_launch(comm, context) -> Finding:
    return judge_launch(_gather(comm, _launcher_size, "the launcher's size"))


# -- MPI's thread level ----------------------------------------------------------------------------

def check_thread_level(comm, context) -> Finding:
    levels = _gather(comm, runtime.thread_level, "the thread level")
    low = [rank for rank, level in enumerate(levels) if level != MPI.THREAD_MULTIPLE]
    if not low:
        return Finding("threading", True, "MPI_THREAD_MULTIPLE on every rank")
    granted = runtime.thread_level_name(min(levels))
    return Finding(
        "threading", False,
        f"ranks {low} got MPI thread level {granted}, below MPI_THREAD_MULTIPLE: DDP's "
        f"overlap='thread', the backend's asynchronous operations and the MPI store need it "
        f"(mpidp falls back to slower paths)",
        f"leave MPI4PY_RC_THREAD_LEVEL and mpi4py.rc.thread_level unset (mpidp asks for "
        f"multiple; now {mpi4py.rc.thread_level!r}); with a library built without it, use one "
        f"with thread support (Cray MPICH: MPICH_MAX_THREAD_SAFETY=multiple)")


# -- cores and threads -----------------------------------------------------------------------------

def check_binding(comm, context) -> Finding:
    ranks, launcher = context["ranks"], context["launcher"]
    found = topology.sharing_warnings(ranks, launcher=launcher)
    if not found:
        shared = [r.rank for r in ranks if any(o.rank != r.rank and o.host == r.host and
                                               set(o.cores) & set(r.cores) for o in ranks)]
        return Finding("binding", True, "every rank has cores of its own" if not shared else
                       f"ranks {shared} are unbound on one NUMA domain: they share its cores, "
                       f"and mpidp splits the threads")
    return Finding("binding", False, "; ".join(found),
                   f"give each rank cores of its own, launching with "
                   f"'{topology.bind_line(ranks, launcher)} ...', and no more ranks per node than "
                   f"it has cores (docs/cluster.md, 'Binding and threads')")


def check_threads(comm, context) -> Finding:
    ranks = context["ranks"]
    found = topology.threads_warnings(ranks)
    for host in dict.fromkeys(r.host for r in ranks):
        members = [r for r in ranks if r.host == host]
        threads = sum(r.torch_threads for r in members)
        cores = len({c for r in members for c in r.cores})
        if threads > cores:
            found.append(f"the {len(members)} rank{'s' if len(members) > 1 else ''} on {host} "
                         f"run {threads} torch threads on {cores} core{'s' if cores > 1 else ''}")
    if not found:
        return Finding("threads", True, "torch threads fit the cores on every node")
    return Finding("threads", False, "; ".join(found),
                   "unset OMP_NUM_THREADS (mpidp gives each rank its share of its cores) or set "
                   "it to the cores per rank, and bind the ranks")


# -- versions ------------------------------------------------------------------------------------

def _versions() -> tuple:
    return (f"python {sys.version.split()[0]}", f"torch {torch.__version__}",
            f"mpidp {mpidp.__version__}", f"mpi4py {mpi4py.__version__}",
            library())


def judge_versions(facts: list) -> Finding:
    """Every rank's ``_versions()``: differences are named per rank."""
    if all(fact == facts[0] for fact in facts):
        return Finding("versions", True, ", ".join(facts[0]))
    differ = [i for i in range(len(facts[0])) if len({fact[i] for fact in facts}) > 1]
    return Finding("versions", False,
                   "the ranks run different software: " +
                   by_rank([", ".join(fact[i] for i in differ) for fact in facts]),
                   "install one environment for every node (a virtual environment on a shared "
                   "filesystem, or the same container image), and launch its python")


def check_versions(comm, context) -> Finding:
    return judge_versions(_gather(comm, _versions, "each rank's versions"))


# -- /dev/shm ------------------------------------------------------------------------------------

def _shm_room(folder: str = "/dev/shm") -> tuple[str, int, int | None]:
    try:
        found = os.statvfs(folder)
        free = found.f_bavail * found.f_frsize if os.access(folder, os.W_OK) else 0
    except OSError:
        free = None
    return socket.gethostname(), runtime.local_size(), free


def check_shm(comm, context) -> Finding:
    facts = _gather(comm, _shm_room, "/dev/shm's free space")
    gradients = int(context["gradients_mb"] * chunking.MB)
    if settings.get("MPIDP_SHARED_MEMORY") is False:
        return Finding("shm", True, "shared-memory reduction turned off (MPIDP_SHARED_MEMORY=0)")
    if all(local_size == 1 for _, local_size, _ in facts):
        return Finding("shm", True, "not used: one rank per node")
    short = {}
    for host, local_size, free in facts:
        need = shm.window_bytes(gradients, local_size)
        if local_size > 1 and (free is None or free < need):
            short[host] = (need, free)
    if not short:
        return Finding("shm", True, f"/dev/shm holds the windows of {context['gradients_mb']:g} "
                                    f"MB of gradients per rank on every node")
    text = "; ".join(f"{host}: {'no writable /dev/shm' if free is None or not free else f'{free / 2**20:.0f} MiB free'}"
                     f" where {need / 2**20:.0f} MiB are needed" for host, (need, free) in short.items())
    return Finding("shm", False,
                   f"/dev/shm is too small for DDP's shared-memory buckets of "
                   f"{context['gradients_mb']:g} MB of gradients per rank ({text}); a write past "
                   f"its end kills the rank with SIGBUS",
                   "give /dev/shm more room (docker run --shm-size, a Kubernetes emptyDir with "
                   "medium: Memory), or MPIDP_SHARED_MEMORY=0 (MPI reduces instead); "
                   "--gradients-mb tells the doctor your model's size")


# -- the rendezvous address ------------------------------------------------------------------------

def _listen() -> tuple:
    """Rank 0: (a socket listening on the address mpidp chooses, (address, why)) or (None, problem)."""
    try:
        host, why = rendezvous._choose(MPI.COMM_WORLD)  # collective
    except Exception as error:  # noqa: BLE001  every rank must hear of it
        return None, f"rank 0 could not choose an address: {type(error).__name__}: {error}"
    if MPI.COMM_WORLD.Get_rank() != 0:
        return None, None
    try:
        return rendezvous._bound_socket(host, True), (host, why)
    except OSError as error:
        return None, f"rank 0 cannot listen on {host} ({why}): {error}"


def _reach(where: tuple) -> str | None:
    host, port = where[0], where[1]
    try:
        with socket.create_connection((host, port), timeout=min(
                5.0, settings.get("MPIDP_RDZV_TIMEOUT"))):
            return None
    except OSError as error:
        return f"cannot connect to {host}:{port}: {error}"


def check_rendezvous(comm, context) -> Finding:
    listener, found = _listen()
    try:
        if listener is not None:
            found = (*found, listener.getsockname()[1])
        found = collective(comm, "bcast", (found, 0),
                           "python -m mpidp doctor: the rendezvous address (broadcast)")
        if isinstance(found, str):
            problems = [found]
        else:
            reports = _gather(comm, lambda: _reach((found[0], found[2])),
                              "reaching the rendezvous address")
            problems = [by_rank(reports)] if any(reports) else []
    finally:
        if listener is not None:
            listener.close()
    fix = ("set MPIDP_RDZV_ADDR to an address of rank 0's host that every node reaches, or "
           "MPIDP_RDZV_IFACE to its interface (e.g. ib0); let TCP between the job's nodes "
           "through the firewall")
    if problems:
        return Finding("rendezvous", False, "; ".join(problems), fix)
    return Finding("rendezvous", True, f"every rank reaches {found[0]} ({found[1]})")


# -- MPIDP_* settings ------------------------------------------------------------------------------

def judge_settings(facts: list) -> Finding:
    """Every rank's (``settings.problems()``, ``settings.values()``)."""
    problems = [("; ".join(found) or None) for found, _ in facts]
    text = [by_rank(problems)] if any(problems) else []
    names = sorted({name for _, values in facts for name in values})
    for name in names:
        seen = [values.get(name) for _, values in facts]
        if len(set(seen)) > 1:
            text.append(f"{name} differs across ranks: " +
                        by_rank([repr(v) if v is not None else "unset" for v in seen]))
    if not text:
        given = (f"{len(names)} MPIDP_* settings" if len(names) != 1 else "1 MPIDP_* setting")
        return Finding("settings", True, f"{given} given, valid and alike")
    return Finding("settings", False, "; ".join(text),
                   "docs/environment.md lists each MPIDP_* variable and its rule; unset the "
                   "names mpidp does not read; export the same values to every rank "
                   "(mpiexec -genv, srun --export=ALL)")


def check_settings(comm, context) -> Finding:
    return judge_settings(_gather(comm, lambda: (settings.problems(), settings.values()),
                                  "the MPIDP_* settings"))


# -- GPUs ------------------------------------------------------------------------------------------

def _gpu() -> tuple:
    host, visible = socket.gethostname(), os.environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        return host, visible, None, None
    device = cuda.local_device()
    uuid = cuda.gpu_identity(device.index)  # the default backend's name for it too
    return host, visible, uuid, cuda.library_reports_cuda()


def judge_gpus(facts: list, decision: cuda.Decision) -> Finding:
    """Every rank's (host, CUDA_VISIBLE_DEVICES, its GPU's uuid or None, library says CUDA)."""
    with_gpu = [rank for rank, fact in enumerate(facts) if fact[2] is not None]
    if not with_gpu:
        return Finding("gpus", True, "no GPU visible to any rank: CPU training")
    problems = []
    without = [rank for rank, fact in enumerate(facts) if fact[2] is None]
    if without:
        problems.append(f"ranks {without} see no GPU while ranks {with_gpu} do "
                        f"(CUDA_VISIBLE_DEVICES: {by_rank([repr(f[1]) for f in facts])})")
    users: dict[tuple, list[int]] = {}
    for rank, (host, _, uuid, _) in enumerate(facts):
        if uuid is not None:
            users.setdefault((host, uuid), []).append(rank)
    shared = [f"ranks {ranks} on {host} use one GPU" for (host, _), ranks in users.items()
              if len(ranks) > 1]
    problems += shared
    if decision.cuda_aware and any(fact[3] is False for fact in facts):
        problems.append("MPIDP_CUDA_AWARE=1 hands device memory to an MPI library that "
                        "reports no CUDA support")
    aware = f"CUDA-aware MPI: {'on' if decision.cuda_aware else 'off'} ({decision.reason})"
    if not problems:
        return Finding("gpus", True, f"one GPU per rank; {aware}")
    return Finding("gpus", False, "; ".join(problems) + f"; {aware}",
                   "one rank per GPU: as many ranks per node as GPUs (srun --gpus-per-task=1, "
                   "or CUDA_VISIBLE_DEVICES listing every GPU of the node; mpidp picks the "
                   "local rank's); unset MPIDP_CUDA_AWARE unless the library is CUDA-aware")


def check_gpus(comm, context) -> Finding:
    return judge_gpus(_gather(comm, _gpu, "each rank's GPU"), cuda.decision())


# -- DataLoader workers under fork -----------------------------------------------------------------

def _worker(seconds: float = 20.0) -> str | None:
    """Fork a child as a DataLoader worker under ``fork`` is; None if it worked."""
    pid = os.fork()
    if pid == 0:  # the child: refuses MPI (mpidp.runtime), computes, leaves without cleanup
        status = 3
        try:
            torch.set_num_threads(1)  # as DataLoader's workers do
            refused = False
            try:
                runtime.require_mpi()
            except RuntimeError:
                refused = True
            status = 0 if refused and float(torch.ones(4).sum()) == 4 else 2
        finally:
            os._exit(status)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return None if code == 0 else f"a forked worker ended with status {code}"
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return f"a forked worker did not finish in {seconds:.0f} s"


def check_fork(comm, context) -> Finding:
    reports = _gather(comm, _worker, "a forked worker")
    if not any(reports):
        return Finding("fork", True, "a forked DataLoader worker runs, and MPI goes on after it")
    return Finding("fork", False, by_rank(reports),
                   "start DataLoader workers with multiprocessing_context='forkserver' and "
                   "multiprocessing.set_forkserver_preload(['torch', 'mpidp']) (docs/cluster.md, "
                   "'DataLoader workers')")


CHECKS = (check_launch, check_thread_level, check_binding, check_threads, check_versions,
          check_shm, check_rendezvous, check_settings, check_gpus, check_fork)
