"""Where each rank runs: bound cores, NUMA nodes, threads, GPU; and binding warnings.

Slow CPU data parallelism usually comes from binding: more ranks on a node than
cores, ranks bound to cores that overlap, ranks left unbound on a node of
several NUMA domains, a rank whose cores span NUMA domains, or more torch
threads than bound cores. ``topology()`` describes this rank, ``gather()`` every rank, and
``binding_warnings()`` turns a gathered list into plain-language warnings.

At import (in the launched process only), every rank tells the other ranks of
its node which cores it is bound to, and sets torch's intra-op threads to its
share of them: its cores divided by the number of local ranks whose cores
overlap its own, at least 1. Ranks bound to cores of their own get all of
them; ranks that a plain ``mpiexec -n N`` started unbound on the same cores
split them instead of each running one thread per core of the node.
``OMP_NUM_THREADS`` set by the user wins, and ``MPIDP_SET_THREADS=0`` leaves
torch's choice alone.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import warnings
from pathlib import Path

import torch
from mpi4py import MPI

from . import runtime, settings
from . import watchdog as _watchdog

__all__ = ["RankTopology", "topology", "gather", "binding_warnings", "sharing_warnings",
           "threads_warnings", "warn_about_binding", "table", "bind_line",
           "parse_cpulist", "default_threads", "threads_for", "threads_reason",
           "node_affinities", "detect_launcher", "bind_hint"]

NODE_ROOT = Path("/sys/devices/system/node")


@dataclasses.dataclass(frozen=True)
class RankTopology:
    """What one rank runs on."""

    rank: int
    host: str
    local_rank: int
    cores: tuple[int, ...]
    numa_nodes: tuple[int, ...]
    torch_threads: int
    gpu: str | None

    def as_row(self) -> dict:
        """A flat dict for tables and JSON logs."""
        return dict(rank=self.rank, host=self.host, local_rank=self.local_rank,
                    numa=",".join(map(str, self.numa_nodes)) or "-",
                    cores=compress_cpulist(self.cores), torch_threads=self.torch_threads,
                    gpu=self.gpu or "-")


def table(ranks: list[RankTopology]) -> str:
    """One line per rank (``as_row``'s columns, left-aligned) under a header."""
    rows = [r.as_row() for r in ranks]
    cells = [list(rows[0])] + [[str(value) for value in row.values()] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def _cores(count: int) -> str:
    return f"{count} core{'s' if count != 1 else ''}"


def _ranks(count: int) -> str:
    return f"{count} rank{'s' if count != 1 else ''}"


def parse_cpulist(text: str) -> set[int]:
    """Parse a Linux cpulist such as ``0-3,8,10-11``."""
    cores: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def compress_cpulist(cores) -> str:
    """Write cores as a Linux cpulist: ``(0, 1, 2, 5)`` -> ``0-2,5``."""
    ranges, cores = [], sorted(cores)
    for core in cores:
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def numa_nodes_of(cores, root: Path = NODE_ROOT) -> tuple[int, ...]:
    """Return the NUMA nodes that hold any of ``cores`` (empty where sysfs lacks them)."""
    nodes = []
    for path in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpulist = path / "cpulist"
        if cpulist.exists() and parse_cpulist(cpulist.read_text()) & set(cores):
            nodes.append(int(path.name[4:]))
    return tuple(nodes)


def _gpu_of(local_rank: int) -> str | None:
    if not torch.cuda.is_available():
        return None
    index = local_rank % torch.cuda.device_count()
    return f"cuda:{index} {torch.cuda.get_device_name(index)}"


def topology() -> RankTopology:
    """Describe this rank: host, local rank, bound cores, NUMA nodes, torch threads, GPU."""
    cores = tuple(sorted(os.sched_getaffinity(0)))
    return RankTopology(rank=runtime.rank(), host=socket.gethostname(),
                        local_rank=runtime.local_rank(), cores=cores,
                        numa_nodes=numa_nodes_of(cores), torch_threads=torch.get_num_threads(),
                        gpu=_gpu_of(runtime.local_rank()))


def gather(comm: MPI.Comm | None = None) -> list[RankTopology]:
    """Every rank's ``topology()``, on every rank (collective)."""
    return _watchdog.watched("each rank's topology (allgather)",
                             (comm or runtime.world()).allgather, topology())


def detect_launcher() -> str:
    """Whose syntax binding advice uses: "openmpi", "srun" or "mpich" (MPICH, Intel MPI: Hydra)."""
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        return "openmpi"
    if "SLURM_PROCID" in os.environ and "MPI_LOCALNRANKS" not in os.environ:
        return "srun"
    return "mpich"


def bind_hint(ranks: int, cores: int, numa_domains: int, launcher: str = "mpich") -> str:
    """A launch line that gives each of ``ranks`` ranks its own cores on a node.

    One rank per NUMA domain where they are as many; otherwise equal blocks of
    cores (``-bind-to numa`` cannot separate ranks that share one domain).
    """
    per = max(1, cores // ranks)
    numa = numa_domains > 1 and ranks == numa_domains
    if launcher == "openmpi":
        return ("mpiexec --map-by ppr:1:numa --bind-to numa" if numa else
                f"mpiexec --map-by slot:PE={per} --bind-to core")
    if launcher == "srun":
        return f"srun --cpu-bind=cores --cpus-per-task={per}"
    return "mpiexec -bind-to numa" if numa else f"mpiexec -bind-to core:{per}"


def _by_host(ranks: list[RankTopology]) -> dict[str, list[RankTopology]]:
    found: dict[str, list[RankTopology]] = {}
    for rank in ranks:
        found.setdefault(rank.host, []).append(rank)
    return found


def bind_line(ranks: list[RankTopology], launcher: str | None = None) -> str:
    """``bind_hint`` for the node that holds the most ranks, from every rank's ``topology()``."""
    members = max(_by_host(ranks).values(), key=len)
    return bind_hint(len(members), len({c for r in members for c in r.cores}),
                     len({n for r in members for n in r.numa_nodes}), launcher or detect_launcher())


def binding_warnings(ranks: list[RankTopology], *, launcher: str | None = None) -> list[str]:
    """Plain-language warnings about a gathered list of rank topologies.

    Args:
        ranks: every rank's ``topology()``.
        launcher: the syntax of the suggested launch line (default: ``detect_launcher()``).
    """
    return sharing_warnings(ranks, launcher=launcher) + threads_warnings(ranks)


def sharing_warnings(ranks: list[RankTopology], *, launcher: str | None = None) -> list[str]:
    """``binding_warnings``' part on cores: ranks of a node that share cores where that matters,
    ranks across NUMA domains.

    Sharing matters when a node holds more ranks than the cores they may run on, when ranks
    are bound to cores that overlap, and when ranks left unbound share a node of several NUMA
    domains. Ranks a plain ``mpiexec -n N`` left unbound on a node of one NUMA domain pass: the
    kernel spreads them over its cores, and mpidp splits the cores' threads among them
    (``threads_for``).
    """
    found = []
    for host, members in _by_host(ranks).items():
        sharing = sorted({r.rank for a in members for b in members if a.rank != b.rank
                          and set(a.cores) & set(b.cores) for r in (a, b)})
        if sharing:
            cores = {c for r in members for c in r.cores}
            domains = {n for r in members for n in r.numa_nodes}
            if len(members) > len(cores):
                found.append(f"ranks {sharing} on {host} share cores: {len(members)} ranks on "
                             f"{_cores(len(cores))}; run at most {_ranks(len(cores))} per node")
                continue
            if len(domains) <= 1 and all(set(r.cores) == cores for r in members):
                continue
            hint = bind_hint(len(members), len(cores), len(domains), launcher or detect_launcher())
            found.append(f"ranks {sharing} on {host} share cores; give each cores of its own "
                         f"by launching with '{hint} ...' (see jobscripts/)")
    spanning = [r.rank for r in ranks if len(r.numa_nodes) > 1]
    if spanning:
        found.append(f"ranks {spanning} are bound to cores in more than one NUMA domain; "
                     f"their memory traffic crosses domains")
    return found


def threads_warnings(ranks: list[RankTopology]) -> list[str]:
    """``binding_warnings``' part on threads: ranks with more torch threads than bound cores."""
    found = []
    crowded = [r.rank for r in ranks if r.torch_threads > len(r.cores)]
    if crowded:
        found.append(f"ranks {crowded} run more torch threads than the cores they are bound "
                     f"to; set OMP_NUM_THREADS to the cores per rank")
    return found


_warned = False


def warn_about_binding(comm: MPI.Comm | None = None, stacklevel: int = 3) -> list[str]:
    """Gather topologies and warn once, on rank 0, about binding problems (collective).

    Args:
        comm: the ranks to look at (default: the world, ``MPI.COMM_WORLD`` or its survivors).
        stacklevel: passed to ``warnings.warn``; the default names the caller's caller.

    Returns:
        The warnings (the same list on every rank).
    """
    global _warned
    found = binding_warnings(gather(comm))
    if found and not _warned and (comm or runtime.world()).Get_rank() == 0:
        for text in found:
            warnings.warn(f"mpidp: {text}", RuntimeWarning, stacklevel=stacklevel)
    _warned = True
    return found


@functools.cache
def node_affinities() -> tuple[frozenset[int], ...]:
    """The cores every rank of this node is bound to, by local rank (collective on first call)."""
    return tuple(_watchdog.watched("the node's core bindings (allgather)",
                                   runtime._node_comm().allgather, frozenset(os.sched_getaffinity(0))))


def threads_for(cores, node: list) -> int:
    """Threads for a rank bound to ``cores`` among its node's affinities ``node`` (itself included).

    Its cores divided by the ranks that share any of them, at least 1.
    """
    sharing = sum(1 for other in node if set(other) & set(cores))
    return max(1, len(cores) // max(1, sharing))


def default_threads() -> int | None:
    """The intra-op thread count mpidp sets at import, or None to leave torch's choice."""
    if "OMP_NUM_THREADS" in os.environ or not settings.get("MPIDP_SET_THREADS"):
        return None
    return threads_for(os.sched_getaffinity(0), node_affinities())


def threads_reason() -> str:
    """Why this rank runs the torch threads it runs, for ``python -m mpidp info``."""
    if "OMP_NUM_THREADS" in os.environ:
        return f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    if not settings.get("MPIDP_SET_THREADS"):
        return "MPIDP_SET_THREADS is off: torch's own choice"
    cores = os.sched_getaffinity(0)
    sharing = sum(1 for other in node_affinities() if other & cores)
    if sharing > 1:
        return (f"a share of {_cores(len(cores))} that {sharing} ranks use "
                f"({len(cores)} // {sharing}, at least 1)")
    return f"bound to {_cores(len(cores))} that no other rank uses"


def _apply_default_threads() -> None:
    node_affinities()  # collective: every rank takes part, whatever its environment says
    threads = default_threads()
    if threads is not None:
        torch.set_num_threads(threads)
