"""Device-to-device allreduce: the device pointer handed to MPI against host staging, in one launch.

    mpiexec -n 2 python bench/gpu_allreduce.py --out r.jsonl [--sizes-mib 1 4 16 64 256]

Each rank reduces a float32 CUDA tensor (1 MiB to 256 MiB by default). The methods take
turns, repeat by repeat, on one duplicated communicator:

- ``allreduce-pointer`` / ``iallreduce-pointer``: ``mpidp.comm.allreduce`` (``iallreduce`` and
  ``wait``) with MPI handed the device pointer;
- ``allreduce-staged`` / ``iallreduce-staged``: the same calls through pinned host memory
  (device -> host -> MPI -> device), what mpidp does with an MPI that cannot read device memory;
- ``mpi4py-device``: ``comm.Allreduce`` on the device pointer after a stream synchronise,
  the library's own figure (the floor for the pointer lines).

Each mpidp line runs under ``mpidp.cuda.forced`` (the switch that every route to MPI asks,
``mpidp.cuda.takes_device_memory``), and its ``path`` column is what ``mpidp.cuda.paths()``
counted during its calls: a line whose calls took another path than its name stops the run.
The pointer lines run only where the library says it reads device memory
(``mpidp.cuda.library_reports_cuda()``); ``iallreduce-pointer`` not on a library that reads it in
blocking collectives only (Open MPI: its nonblocking reductions crashed on device memory).
Reports the median time per call (the slowest rank's) and the bus bandwidth,
2 (n - 1) / n x bytes / time.
"""

import argparse
import time

import torch
from mpi4py import MPI

import mpidp
from allreduce_bench import report, summarise  # bench/, beside this file
from mpidp import cuda as _cuda

POINTER = _cuda.Decision(True, "bench/gpu_allreduce.py: the device pointer")
STAGED = _cuda.Decision(False, "bench/gpu_allreduce.py: staged through host memory")


def methods(comm, tensor, aware: bool, nonblocking_aware: bool) -> dict:
    """name: (call, the path its device memory must take; None: not mpidp's, not counted)."""
    def through(decided, nonblocking):
        def call():
            with _cuda.forced(decided):
                if nonblocking:
                    mpidp.comm.iallreduce(tensor, comm=comm).wait()
                else:
                    mpidp.comm.allreduce(tensor, comm=comm)
        return call

    def raw():
        torch.cuda.current_stream().synchronize()
        comm.Allreduce(MPI.IN_PLACE, [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes),
                                      tensor.numel(), MPI.FLOAT])

    table = {}
    if aware:
        table["allreduce-pointer"] = (through(POINTER, False), "pointer")
    table["allreduce-staged"] = (through(STAGED, False), "staged")
    if nonblocking_aware:
        table["iallreduce-pointer"] = (through(POINTER, True), "pointer")
    table["iallreduce-staged"] = (through(STAGED, True), "staged")
    if aware:
        table["mpi4py-device"] = (raw, None)
    return table


def taken(before: dict, after: dict) -> set:
    """The paths counted between two readings of ``mpidp.cuda.paths()``."""
    return {path for path in after if after[path] > before[path]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    device = _cuda.local_device()
    aware = bool(_cuda.library_reports_cuda())
    nonblocking_aware = aware and not _cuda._blocking_only()
    results = []
    for mib in args.sizes_mib:
        nbytes = int(mib * (1 << 20))
        tensor = torch.ones(nbytes // 4, device=device)
        calls = max(2, min(50, int((64 << 20) // nbytes)))
        table = methods(comm, tensor, aware, nonblocking_aware)
        times = {name: [] for name in table}
        paths = {name: set() for name in table}
        for call, _ in table.values():  # warm up (pinned buffers, IPC handles)
            call()
        for _ in range(args.repeats):
            for name, (call, _) in table.items():
                tensor.fill_(comm.rank + 1)
                torch.cuda.synchronize(device)
                comm.Barrier()
                before = _cuda.paths()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                torch.cuda.synchronize(device)
                elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
                paths[name] |= taken(before, _cuda.paths())
                times[name].append(elapsed / calls)
                # each call sums in place: size (size + 1) / 2, then times size per call
                expected = comm.size * (comm.size + 1) / 2 * comm.size ** (calls - 1)
                ends = torch.stack([tensor[0], tensor[-1]]).double().cpu()
                if not torch.allclose(ends, torch.full((2,), expected, dtype=torch.float64),
                                      rtol=1e-5):
                    raise AssertionError(f"{name} at {nbytes} B: {ends.tolist()} != {expected}")
        for name, (_, want) in table.items():
            if want is not None and paths[name] != {want}:
                raise AssertionError(f"{name} at {nbytes} B: its device memory went "
                                     f"{sorted(paths[name])}, not {want}")
        rows = summarise(times, nbytes, comm.size, kind="gpu-allreduce",
                         library=MPI.Get_library_version().splitlines()[0].strip(),
                         gpu=torch.cuda.get_device_name(device))
        results += [{**row, "path": table[row["method"]][1] or "pointer (mpi4py, not counted)"}
                    for row in rows]
    report(comm, args.out, results)
    if comm.rank == 0:
        print("paths: " + ", ".join(f"{r['method']} {r['path']}" for r in rows), flush=True)
    comm.Free()


if __name__ == "__main__":
    main()
