"""Command line: ``python -m mpidp info`` under ``mpiexec -n N`` prints the job's layout."""

from __future__ import annotations

import argparse
import sys

import mpi4py
import torch
from mpi4py import MPI

import mpidp
from mpidp import topology

THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                 MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


def format_table(rows: list[dict]) -> str:
    """Left-aligned columns under a header, from dicts that share their keys."""
    header = list(rows[0])
    cells = [header] + [[str(row[key]) for key in header] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def cuda_aware_status() -> str:
    decision = mpidp.cuda.decision()
    return f"{'on' if decision.cuda_aware else 'off'} ({decision.reason})"


def info() -> int:
    ranks = topology.gather()
    found = topology.binding_warnings(ranks)
    if mpidp.rank() == 0:
        print(format_table([r.as_row() for r in ranks]))
        print()
        print(f"MPI library:   {MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"MPI standard:  {'.'.join(map(str, MPI.Get_version()))}, thread level "
              f"{THREAD_LEVELS.get(MPI.Query_thread(), MPI.Query_thread())}")
        print(f"versions:      mpi4py {mpi4py.__version__}, "
              f"torch {torch.__version__}, mpidp {mpidp.__version__}")
        print(f"CUDA-aware:    {cuda_aware_status()}")
        print(f"bfloat16 sum:  {mpidp.comm.reduction_path(torch.bfloat16)} "
              f"(native = the MPI library reduces it)")
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
