"""Device-to-device allreduce: CUDA-aware MPI against host staging, in one launch.

    mpiexec -n 2 python bench/gpu_allreduce.py --out r.jsonl [--sizes-mib 1 4 16 64 256]

Each rank reduces a float32 CUDA tensor (1 MiB to 256 MiB by default). The methods take
turns, repeat by repeat, on one duplicated communicator:

- ``mpidp-cuda-aware``: ``mpidp.comm.allreduce`` handing MPI the device pointer;
- ``mpidp-staged``: the same call with staging forced (device -> pinned host -> MPI -> device),
  what mpidp does with an MPI that is not CUDA-aware;
- ``mpi4py-device``: ``comm.Allreduce`` on the device pointer after a stream synchronise,
  the library's own figure (the floor for the first line).

The two mpidp lines switch ``mpidp.cuda.cuda_aware`` in this process (a benchmark's aid; a job
decides once at import, ``mpidp.cuda.decision()``). The CUDA-aware lines run only where the
library is CUDA-aware (``mpidp.cuda.library_reports_cuda()``). Reports the median time per call
(the slowest rank's) and the bus bandwidth, 2 (n - 1) / n x bytes / time.
"""

import argparse
import time

import torch
from mpi4py import MPI

import mpidp
from allreduce_bench import report, summarise  # bench/, beside this file
from mpidp import cuda as _cuda


def methods(comm, tensor, aware: bool):
    def with_decision(flag):
        def call():
            saved = _cuda.cuda_aware
            _cuda.cuda_aware = lambda: flag
            try:
                mpidp.comm.allreduce(tensor, comm=comm)
            finally:
                _cuda.cuda_aware = saved
        return call

    def raw():
        torch.cuda.current_stream().synchronize()
        comm.Allreduce(MPI.IN_PLACE, [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes),
                                      tensor.numel(), MPI.FLOAT])

    table = {"mpidp-staged": with_decision(False)}
    if aware:
        table = {"mpidp-cuda-aware": with_decision(True), **table, "mpi4py-device": raw}
    return table


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    device = _cuda.local_device()
    aware = bool(_cuda.library_reports_cuda())
    results = []
    for mib in args.sizes_mib:
        nbytes = int(mib * (1 << 20))
        tensor = torch.ones(nbytes // 4, device=device)
        calls = max(2, min(50, int((64 << 20) // nbytes)))
        table = methods(comm, tensor, aware)
        times = {name: [] for name in table}
        for call in table.values():  # warm up (pinned buffers, IPC handles)
            call()
        for _ in range(args.repeats):
            for name, call in table.items():
                tensor.fill_(comm.rank + 1)
                torch.cuda.synchronize(device)
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                torch.cuda.synchronize(device)
                elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
                times[name].append(elapsed / calls)
                # each call sums in place: size (size + 1) / 2, then times size per call
                expected = comm.size * (comm.size + 1) / 2 * comm.size ** (calls - 1)
                ends = torch.stack([tensor[0], tensor[-1]]).double().cpu()
                if not torch.allclose(ends, torch.full((2,), expected, dtype=torch.float64),
                                      rtol=1e-5):
                    raise AssertionError(f"{name} at {nbytes} B: {ends.tolist()} != {expected}")
        results += summarise(times, nbytes, comm.size, kind="gpu-allreduce",
                             library=MPI.Get_library_version().splitlines()[0].strip(),
                             gpu=torch.cuda.get_device_name(device))
    report(comm, args.out, results)
    comm.Free()


if __name__ == "__main__":
    main()
