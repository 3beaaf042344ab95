"""``python -m mpidp doctor``: the misconfigurations that otherwise show as a failed job, checked first.

Run it under the launch line of the job (``mpiexec -n N python -m mpidp
doctor``, ``srun python -m mpidp doctor``). Every rank runs every check of
``mpidp.doctor.checks`` in the same order; each gathers the ranks' facts and
judges them alike everywhere, so every rank reaches the same findings and the
same exit status: 0 when nothing is wrong, 1 otherwise. Rank 0 prints one
report, a line per check and, under a problem, its fix. A launch whose MPI
does not match the launcher runs every process as rank 0 of its own job:
each prints a report, and the ``launch`` check says why.
"""

from __future__ import annotations

import sys

from mpi4py import MPI

from .. import exits, runtime, topology
from ..comm.agreement import watched_allgather
from . import checks
from .checks import CHECKS, Finding

__all__ = ["Finding", "run", "report", "main"]

DEFAULT_GRADIENTS_MB = 100.0


def run(*, gradients_mb: float = DEFAULT_GRADIENTS_MB) -> tuple[list, list[Finding]]:
    """Run every check on every rank (collective over ``COMM_WORLD``); the same everywhere.

    Args:
        gradients_mb: the gradient MB per rank of the model to train (sizes the
            shared-memory windows that the ``shm`` check looks for room for).

    Returns:
        Every rank's ``topology.RankTopology``, and the findings in ``CHECKS``' order.
    """
    runtime.require_mpi()
    comm = MPI.COMM_WORLD
    ranks = topology.gather(comm)
    launchers = watched_allgather(comm, topology.detect_launcher(),
                                  "python -m mpidp doctor: the launcher (allgather)")
    context = dict(ranks=ranks, launcher=launchers[0], gradients_mb=gradients_mb)
    return ranks, [check(comm, context) for check in CHECKS]


def report(ranks: list, findings: list[Finding]) -> str:
    """The report rank 0 prints: the ranks' layout, a line per check, a fix under each problem."""
    hosts = len({rank.host for rank in ranks})
    lines = [topology.table(ranks), "",
             f"mpidp doctor: {len(ranks)} rank{'s' if len(ranks) > 1 else ''} on {hosts} "
             f"host{'s' if hosts > 1 else ''}, {checks.library()}"]
    width = max(len(f.name) for f in findings)
    for finding in findings:
        lines.append(f"  {'ok  ' if finding.ok else 'FAIL'}  {finding.name:<{width}}  "
                     f"{finding.found}")
        if finding.fix:
            lines.append(f"        {'':<{width}}  fix: {finding.fix}")
    bad = [f.name for f in findings if not f.ok]
    lines.append(f"mpidp doctor: {len(bad)} problem{'s' if len(bad) > 1 else ''}: "
                 f"{', '.join(bad)}" if bad else
                 "mpidp doctor: no problems found")
    return "\n".join(lines)


def main(gradients_mb: float = DEFAULT_GRADIENTS_MB) -> int:
    """Run the checks, print rank 0's report; the exit status, the same on every rank."""
    ranks, findings = run(gradients_mb=gradients_mb)
    text = report(ranks, findings)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(text)
        sys.stdout.flush()
    if all(f.ok for f in findings):
        return 0
    # Every rank found the same and ends with status 1 at once: no rank is left waiting,
    # so the exit must not turn into MPI_Abort (mpidp.exits' rule for a rank that fails).
    exits.abort_on_exception(False)
    return 1
