"""The "mpidp" torch.distributed backend against raw mpi4py and gloo: run under mpiexec.

    mpiexec -n 2 python bench/backend_bench.py allreduce --out r.jsonl
    mpiexec -n 2 python bench/backend_bench.py fsdp --out r.jsonl [--memory gloo|mpidp]

``allreduce``: time per blocking all_reduce of float32 tensors from 4 B to 64 MiB,
through ``torch.distributed.all_reduce`` on an "mpidp" group and on a gloo group,
through ``mpidp.comm.allreduce``, and as one raw mpi4py ``Allreduce`` on the
tensor's numpy view (the floor). Methods take turns in rounds; a round's time is
the slowest rank's, the figure the median of the rounds.

``fsdp``: step time of FSDP2 (``fully_shard`` on every layer of a small
transformer) over an "mpidp" group and over gloo, steps alternating; with
``--memory BACKEND`` one backend runs alone and the peak resident memory of
the rank is reported (ru_maxrss: run each backend in its own job).

The default group is gloo over loopback TCP; the "mpidp" group is
``new_group(backend="mpidp")`` over the same ranks. Rank 0 appends JSON lines to --out.
"""

import argparse
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

import mpidp
from train_bench import init_gloo  # gloo as the default group, over loopback TCP

COMM = MPI.COMM_WORLD
SIZES = [1, 256, 16384, 262144, 1 << 20, 1 << 22, 1 << 24]  # float32 elements: 4 B .. 64 MiB


def slowest(seconds: float) -> float:
    return COMM.allreduce(seconds, op=MPI.MAX)


def allreduce_methods(raw: MPI.Intracomm, groups: dict) -> dict:
    def raw_call(t):
        raw.Allreduce(MPI.IN_PLACE, [t.numpy(), MPI.FLOAT], MPI.SUM)

    return {"mpi4py": raw_call,
            "mpidp.comm": lambda t: mpidp.comm.allreduce(t),
            "dist/mpidp": lambda t: dist.all_reduce(t, group=groups["mpidp"]),
            "dist/gloo": lambda t: dist.all_reduce(t, group=groups["gloo"])}


def bench_allreduce(args, groups) -> list[dict]:
    raw = COMM.Dup()
    methods = allreduce_methods(raw, groups)
    records = []
    for count in SIZES:
        tensor = torch.ones(count)
        calls = max(3, min(2000, int(2e7 // (count * 4 + 2e4))))
        times = {name: [] for name in methods}
        for name, call in methods.items():  # warm-up
            for _ in range(min(calls, 20)):
                call(tensor)
        for _ in range(args.rounds):
            for name, call in methods.items():
                COMM.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    call(tensor)
                times[name].append(slowest(time.perf_counter() - start) / calls)
        medians = {name: statistics.median(values) for name, values in times.items()}
        record = dict(kind="backend-allreduce", ranks=COMM.size, bytes=count * 4, calls=calls,
                      rounds=args.rounds, us={k: v * 1e6 for k, v in medians.items()},
                      ratio_to_mpi4py={k: v / medians["mpi4py"] for k, v in medians.items()})
        records.append(record)
        if COMM.rank == 0:
            print(f"{count * 4:>10d} B " + "  ".join(
                f"{k} {v * 1e6:9.1f} us ({record['ratio_to_mpi4py'][k]:.2f}x)"
                for k, v in medians.items()), flush=True)
    raw.Free()
    return records


def transformer() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)


class FsdpRunner:
    def __init__(self, group):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        mesh = DeviceMesh.from_group(group, "cpu")
        self.model = transformer()
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(COMM.rank)
        self.x = torch.randn(8, 64, 256, generator=generator)

    def step(self) -> float:
        COMM.Barrier()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.model(self.x).square().mean().backward()
        self.optimizer.step()
        return slowest(time.perf_counter() - start)


def bench_fsdp(args, groups) -> list[dict]:
    if args.memory:
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        runner = FsdpRunner(groups[args.memory])
        for _ in range(args.warmup + args.steps):
            runner.step()
        peaks = COMM.gather((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1024)
        return [dict(kind="backend-fsdp-memory", ranks=COMM.size, backend=args.memory,
                     peak_over_start_mib=max(peaks) if COMM.rank == 0 else None)]
    runners = {name: FsdpRunner(groups[name]) for name in ("gloo", "mpidp")}
    times = {name: [] for name in runners}
    for _ in range(args.warmup):
        for runner in runners.values():
            runner.step()
    for _ in range(args.steps):
        for name, runner in runners.items():
            times[name].append(runner.step())
    medians = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    if COMM.rank == 0:
        print("FSDP2 transformer step: " + ", ".join(f"{k} {v:.1f} ms" for k, v in
                                                     medians.items())
              + f"; mpidp/gloo {medians['mpidp'] / medians['gloo']:.2f}", flush=True)
    return [dict(kind="backend-fsdp", ranks=COMM.size, steps=args.steps, median_ms=medians,
                 mpidp_over_gloo=medians["mpidp"] / medians["gloo"])]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["allreduce", "fsdp"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory", choices=["gloo", "mpidp"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_gloo()
    groups = {"gloo": dist.group.WORLD, "mpidp": dist.new_group(backend="mpidp")}
    records = (bench_allreduce if args.what == "allreduce" else bench_fsdp)(args, groups)
    if COMM.rank == 0:
        with open(args.out, "a") as out:
            for record in records:
                out.write(json.dumps(record) + "\n")
            if args.memory:
                print(f"FSDP2 peak memory over {args.memory}: "
                      f"{records[0]['peak_over_start_mib']:.0f} MiB over start", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
