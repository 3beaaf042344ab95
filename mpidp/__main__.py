"""Command line: ``python -m mpidp info`` under ``mpiexec -n N`` prints the job's layout."""

from __future__ import annotations

import argparse
import sys

import mpi4py
import torch
from mpi4py import MPI

import mpidp
from mpidp import runtime, topology

BFLOAT16_SUM = {"native": "reduced by the MPI library itself",
                "torch": "reduced by torch inside a user-defined MPI op (this MPI library "
                         "has no bfloat16 sum of its own)"}


def format_table(rows: list[dict]) -> str:
    """Left-aligned columns under a header, from dicts that share their keys."""
    header = list(rows[0])
    cells = [header] + [[str(row[key]) for key in header] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def cuda_aware_status() -> str:
    decision = mpidp.cuda.decision()
    return f"{'on' if decision.cuda_aware else 'off'} ({decision.reason})"


def thread_level_status() -> str:
    granted = runtime.thread_level()
    text = f"thread level {runtime.thread_level_name(granted)}"
    if granted != MPI.THREAD_MULTIPLE:
        text += f" (mpi4py.rc.thread_level = {mpi4py.rc.thread_level!r})"
    return text


def threads_lines(ranks: list, reasons: list[str]) -> list[str]:
    """One line per distinct (threads, reason): how many torch threads which ranks run, and why."""
    groups: dict[tuple, list[int]] = {}
    for rank, reason in zip(ranks, reasons):
        groups.setdefault((rank.torch_threads, reason), []).append(rank.rank)
    return [f"threads:       {threads} on rank{'s' if len(members) > 1 else ''} "
            f"{', '.join(map(str, members))}: {reason}"
            for (threads, reason), members in groups.items()]


def info() -> int:
    ranks = topology.gather()
    reasons = MPI.COMM_WORLD.allgather(topology.threads_reason())
    found = topology.binding_warnings(ranks)
    if mpidp.rank() == 0:
        print(format_table([r.as_row() for r in ranks]))
        print()
        print(f"MPI library:   {MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"MPI standard:  {'.'.join(map(str, MPI.Get_version()))}, {thread_level_status()}")
        print(f"versions:      mpi4py {mpi4py.__version__}, "
              f"torch {torch.__version__}, mpidp {mpidp.__version__}")
        print(f"CUDA-aware:    {cuda_aware_status()}")
        print(f"bfloat16 sum:  {BFLOAT16_SUM[mpidp.comm.reduction_path(torch.bfloat16)]}")
        print("\n".join(threads_lines(ranks, reasons)))
        for text in found:
            print(f"warning: {text}")
        if not found:
            print("binding:       no problems found")
        sys.stdout.flush()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpidp", description=__doc__)
    parser.add_argument("command", choices=["info"], help="info: print every rank's layout")
    parser.parse_args(argv)
    return info()


if __name__ == "__main__":
    sys.exit(main())
