"""Profile training steps on the GPU: where a step of each mode spends host and GPU time.

    mpiexec -n 2 python bench/gpu_profile.py --model mlp --out DIR [--modes mpidp ddp-mpidp]

Each mode (as in train_bench.py) warms up, then 3 steps run under torch.profiler
(CPU and CUDA). Rank 0 prints the top operators by host time and by GPU time,
and writes one Chrome trace per mode to DIR (open in chrome://tracing or Perfetto).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import mpidp
import train_bench
from train_bench import COMM, GROUPS, Runner, init_gloo, parse_mode, timed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--modes", nargs="+", default=["mpidp", "ddp-mpidp"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = mpidp.cuda.local_device()
    names = {parse_mode(s)[0] for s in args.modes}
    if names & {"ddp-gloo", "ddp-mpidp"}:
        init_gloo()
        GROUPS["ddp-gloo"] = dist.group.WORLD
    if "ddp-mpidp" in names:
        GROUPS["ddp-mpidp"] = dist.new_group(backend="mpidp")
    os.makedirs(args.out, exist_ok=True)
    for spec in args.modes:
        runner = Runner(spec, args.model, device)
        timed(runner, 5)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            timed(runner, 3)
        if COMM.rank == 0:
            table = prof.key_averages()
            print(f"=== {args.model} {spec}: by host time", flush=True)
            print(table.table(sort_by="cpu_time_total", row_limit=18), flush=True)
            print(f"=== {args.model} {spec}: by GPU time", flush=True)
            print(table.table(sort_by="self_device_time_total", row_limit=12), flush=True)
            prof.export_chrome_trace(os.path.join(args.out, f"trace_{args.model}_{spec.replace(':', '_')}.json"))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    train_bench  # noqa: B018 (the modes live there)
    main()
