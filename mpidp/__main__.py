"""Command line, under ``mpiexec -n N``: ``info`` prints the job's layout, ``run`` runs a program,
``doctor`` checks the launch, the binding, the versions and more for what would make the job fail
(``mpidp.doctor``; exit status 1 when something is wrong).

``python -m mpidp trace DIR`` (no ``mpiexec``) reads the ranks' flight records in DIR
and names the first collective where they part (``mpidp.trace``).

``python -m mpidp run train.py [args]`` (or ``run -m package.module [args]``) runs
the program as ``__main__`` on every rank, as ``python train.py`` would, after
mpidp's start-up: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...
are exported (also on one rank), so a program written for ``torchrun`` runs
unmodified; an uncaught exception on one rank ends the whole job.

``python -m mpidp profile -o job.json train.py [args]`` runs it the same way under
``torch.profiler`` on every rank and writes one trace of the whole job, each rank a
process of its own (``mpidp.profiler``; open it in Perfetto).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

import mpi4py
import torch
from mpi4py import MPI

import mpidp
from mpidp import doctor, exits, frtrace, profiler, rendezvous, runtime, topology, trace
from mpidp.comm.handle import collective

BFLOAT16_SUM = {"native": "reduced by the MPI library itself",
                "torch": "reduced by torch inside a user-defined MPI op (this MPI library "
                         "has no bfloat16 sum of its own)"}


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


def rendezvous_status() -> str:
    """The default backend of mpidp.init_process_group(), its store and where that listens."""
    where, kind = rendezvous.store_address(), rendezvous.store_kind()
    store = ("store over MPI (no port)" if kind == "mpi" else
             "process-local store" if kind == "local" else
             f"TCP store on {where[0]}:{where[1]} ({where[2]})" if where else
             "TCP store started at the first rendezvous")
    backend, why = rendezvous.backend_for(*mpidp.cuda.placements())
    return f"{backend} by default (mpidp.init_process_group(): {why}); {store}"


def run(target: list[str], module: bool) -> int:
    """Run ``target`` (a script and its arguments, or a module's) as ``__main__``."""
    rendezvous.start_up(force=True)  # one rank too: a torchrun-style program reads the variables
    sys.argv = list(target)
    try:
        if module:
            runpy.run_module(target[0], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as exc:  # sys.exit(3) on one rank must end the job, as when run directly
        exits.abort_for_exit(exc.code)
        raise
    return 0


def profiled(output: str, target: list[str], module: bool) -> int:
    """``run`` under ``mpidp.profile(output)``; a program's ``sys.exit(0)`` still writes it."""
    with profiler.profile(output):
        try:
            run(target, module)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
    return 0


def info() -> int:
    ranks = topology.gather()
    reasons = collective(MPI.COMM_WORLD, "allgather", (topology.threads_reason(),),
                         "python -m mpidp info: each rank's threads (allgather)")
    found = topology.binding_warnings(ranks)
    if mpidp.rank() == 0:
        print(topology.table(ranks))
        print()
        print(f"MPI library:   {MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"MPI standard:  {'.'.join(map(str, MPI.Get_version()))}, {thread_level_status()}")
        print(f"versions:      mpi4py {mpi4py.__version__}, "
              f"torch {torch.__version__}, mpidp {mpidp.__version__}")
        print(f"CUDA-aware:    {cuda_aware_status()}")
        print(f"bfloat16 sum:  {BFLOAT16_SUM[mpidp.comm.reduction_path(torch.bfloat16)]}")
        print(f"torch backend: {rendezvous_status()}")
        print("\n".join(threads_lines(ranks, reasons)))
        for text in found:
            print(f"warning: {text}")
        if not found:
            print("binding:       no problems found")
        sys.stdout.flush()
    return 0


def takes_a_program(parser: argparse.ArgumentParser) -> None:
    """The arguments of a command that runs a program: ``[-m] target [args]``."""
    parser.add_argument("-m", dest="module", action="store_true",
                        help="run a module, as python -m does")
    parser.add_argument("target", nargs=argparse.REMAINDER, help="script.py [args] or module [args]")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpidp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="print every rank's layout")
    takes_a_program(commands.add_parser("run", help="run a program (torchrun-style too) on "
                                                    "every rank"))
    profiling = commands.add_parser("profile", help="run a program under torch.profiler on "
                                                    "every rank; write one trace of all ranks")
    profiling.add_argument("-o", "--output", required=True, metavar="FILE",
                           help="the trace rank 0 writes (trace-event JSON: Perfetto, "
                                "chrome://tracing)")
    takes_a_program(profiling)
    lineup = commands.add_parser("trace", help="line up the ranks' flight records in DIR (no mpiexec)")
    lineup.add_argument("folder", metavar="DIR", help="MPIDP_TRACE_DIR, or mpidp-trace-<job>")
    lineup.add_argument("--torch-fr", metavar="OUT", help="also write them into OUT in torch's "
                        "flight-recorder format, for torch's analyzer: torchfrtrace OUT")
    checkup = commands.add_parser("doctor", help="check the job's setup on every rank; "
                                                 "exit status 1 when something is wrong")
    checkup.add_argument("--gradients-mb", type=float, default=doctor.DEFAULT_GRADIENTS_MB,
                         help="gradient MB per rank of the model you train (the shared-memory "
                              "windows need that times the ranks per node in /dev/shm); "
                              "default %(default)s")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        if not args.gradients_mb > 0:
            parser.error(f"doctor: --gradients-mb must be > 0, got {args.gradients_mb}")
        return doctor.main(args.gradients_mb)
    if args.command == "trace":
        status = trace.main(args.folder)
        return max(status, frtrace.main(args.folder, args.torch_fr)) if args.torch_fr else status
    if args.command == "run":
        if not args.target:
            parser.error("run: give a script (or -m and a module) to run")
        return run(args.target, args.module)
    if args.command == "profile":
        if not args.target:
            parser.error("profile: give a script (or -m and a module) to run")
        return profiled(args.output, args.target, args.module)
    return info()


if __name__ == "__main__":
    sys.exit(main())
