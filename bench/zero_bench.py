"""ZeRO stages against DDP: memory per parameter and step time. Run by hand.

    python bench/zero_bench.py report --out bench/reports/zero     # every job below, then the table and plot
    mpiexec -n 2 python bench/zero_bench.py memory --mode zero2 --out r.jsonl
    mpiexec -n 2 python bench/zero_bench.py time --model mlp --out r.jsonl

``memory``: one mode per job, AdamW on a 50.4M-parameter MLP (12 x Linear(2048,
2048)), a batch of 4, three steps. The figure is the rank's peak resident set
(ru_maxrss) over its value just before the model is built, divided by the
parameter count, next to ZeRO's formula for float32 Adam at N ranks: DDP 16
(weights 4, gradients 4, two moments 8), stage 1 4 + 4 + 8/N, stage 2
4 + 12/N, stage 3 16/N. Modes: ``ddp`` (mpidp DDP with
gradient_as_bucket_view=True, so the buckets are the gradients, + AdamW),
``zero1`` (the same DDP + ``ZeroRedundancyOptimizer``), ``zero2``
(``stage=2``), ``fsdp`` (torch's FSDP2 ``fully_shard`` on every layer and the
root, over mpidp's torch.distributed backend, built on the meta device so the
whole model never exists on one rank).

``time``: at N ranks, steps of ``ddp``, ``zero1``, ``zero2`` (as above, AdamW),
``torch-ddp`` (torch DDP over gloo + AdamW) and ``torch-zero`` (torch DDP over
gloo + torch's ZeroRedundancyOptimizer over gloo) take turns; a step's time is
the slowest rank's, the figure the median. Ratios: the ZeRO stages to
``ddp``, torch's ZeRO to ``torch-ddp``.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from mpi4py import MPI
from torch import nn

import mpidp
from models import build

COMM = MPI.COMM_WORLD
FORMULA = {"ddp": lambda n: 16.0, "zero1": lambda n: 8 + 8 / n, "zero2": lambda n: 4 + 12 / n,
           "fsdp": lambda n: 16 / n}
LABEL = {"ddp": "DDP", "zero1": "ZeRO stage 1", "zero2": "ZeRO stage 2",
         "fsdp": "stage 3 (FSDP2 over mpidp)"}


def mlp(device="cpu"):
    with torch.device(device):
        return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(12)])


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_mode(mode: str):
    """(model, optimizer, model the forward runs) for ``mode``."""
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        model = mlp("meta")
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().normal_(0, 0.02)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    model = mlp()
    if mode == "ddp":
        ddp = mpidp.DistributedDataParallel(model, gradient_as_bucket_view=True)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    if mode == "zero1":
        ddp = mpidp.DistributedDataParallel(model, gradient_as_bucket_view=True)
        return ddp, mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-4)
    if mode == "zero2":
        ddp = mpidp.DistributedDataParallel(model)
        return ddp, mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-4,
                                                  stage=2)
    raise ValueError(f"unknown mode {mode!r}")


def memory(args) -> None:
    torch.set_num_threads(1)
    if args.mode == "fsdp":
        mpidp.init_process_group()
    torch.ones(8).sum()  # load the CPU kernels before the baseline
    baseline = peak_bytes()
    model, optimizer = build_mode(args.mode)
    params = 12 * (2048 * 2048 + 2048)  # (a DTensor's numel() is the whole tensor's)
    x = torch.randn(4, 2048)
    for _ in range(3):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    peaks = COMM.gather(peak_bytes() - baseline)
    if COMM.rank == 0:
        measured = max(peaks) / params
        formula = FORMULA[args.mode](COMM.size)
        record = dict(kind="zero-memory", mode=args.mode, ranks=COMM.size, params=params,
                      peak_over_start_mib=max(peaks) / 2**20, bytes_per_param=measured,
                      formula=formula, ratio=measured / formula,
                      extra_mib=(measured - formula) * params / 2**20)
        print(json.dumps(record), flush=True)
        with open(args.out, "a") as out:
            out.write(json.dumps(record) + "\n")


class Runner:
    def __init__(self, mode: str, model_name: str, groups: dict):
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

        self.mode = mode
        model, self.batches, self.loss = build(model_name, COMM.rank)
        if mode.startswith("torch-"):
            self.model = nn.parallel.DistributedDataParallel(model, process_group=groups["gloo"])
            if mode == "torch-zero":
                self.optimizer = TorchZero(self.model.parameters(), torch.optim.AdamW, lr=1e-4)
            else:
                self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
            return
        stage = {"ddp": 0, "zero1": 1, "zero2": 2}[mode]
        self.model = mpidp.DistributedDataParallel(model)
        if stage:
            self.optimizer = mpidp.ZeroRedundancyOptimizer(self.model.parameters(),
                                                           torch.optim.AdamW, lr=1e-4, stage=stage)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.index = 0

    def step(self) -> float:
        x, y = self.batches[getattr(self, "index", 0) % len(self.batches)]
        self.index = getattr(self, "index", 0) + 1
        COMM.Barrier()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.loss(self.model(x), y).backward()
        self.optimizer.step()
        return COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)

    def parameters(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


def timing(args) -> None:
    import torch.distributed as dist
    from train_bench import init_gloo

    torch.set_num_threads(1)
    init_gloo()
    runners = [Runner(mode, args.model, {"gloo": dist.group.WORLD}) for mode in args.modes]
    for runner in runners:
        for _ in range(args.warmup):
            runner.step()
    times = {runner.mode: [] for runner in runners}
    for _ in range(args.steps):  # modes take turns, so drifts of the machine hit all alike
        for runner in runners:
            times[runner.mode].append(runner.step())
    medians = {mode: statistics.median(values) * 1e3 for mode, values in times.items()}
    reference = next((r for r in runners if r.mode == "ddp"), None)
    for runner in runners:
        base = "torch-ddp" if runner.mode.startswith("torch-") else "ddp"
        record = dict(kind="zero-time", model=args.model, mode=runner.mode, ranks=COMM.size,
                      steps=args.steps, median_ms=medians[runner.mode],
                      ratio=medians[runner.mode] / medians[base] if base in medians else None,
                      ratio_to=base)
        if reference is not None and not runner.mode.startswith("torch-"):
            record["max_abs_diff_to_ddp"] = (runner.parameters()
                                             - reference.parameters()).abs().max().item()
        if COMM.rank == 0:
            print(json.dumps(record), flush=True)
            with open(args.out, "a") as out:
                out.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


def report(args) -> None:
    """Run every job (each under its own mpiexec), then write the table and the plot."""
    os.makedirs(args.out, exist_ok=True)
    results = os.path.join(args.out, "results.jsonl")
    here = os.path.dirname(os.path.abspath(__file__))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    # glibc raises its mmap threshold after freeing a big block, and later big
    # blocks then stay in the heap after they are freed, counting in the peak
    # resident set as if live: keep every block over 64 KiB in its own mapping.
    # (Step times are taken without it: a mapping per allocation costs page faults.)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def launch(n, *rest, **extra):
        command = [mpiexec, "-n", str(n), sys.executable, os.path.join(here, "zero_bench.py"),
                   *rest, "--out", results]
        subprocess.run(command, check=True, env=dict(env, **extra), timeout=1800)

    if not args.skip_memory:
        for n in args.ranks:
            for mode in FORMULA:
                launch(n, "memory", "--mode", mode, MALLOC_MMAP_THRESHOLD_="65536")
    if not args.skip_time:
        for model in ("mlp", "transformer"):
            launch(2, "time", "--model", model, "--steps", str(args.steps))
    write_report(args.out, results)


def write_report(folder: str, results: str) -> None:
    records = [json.loads(line) for line in open(results)]
    memory_rows = [r for r in records if r["kind"] == "zero-memory"]
    lines = ["| mode | ranks | measured B/param | formula B/param | measured / formula | "
             "above formula (MiB) |", "|---|---|---|---|---|---|"]
    for r in sorted(memory_rows, key=lambda r: (list(FORMULA).index(r["mode"]), r["ranks"])):
        lines.append(f"| {LABEL[r['mode']]} | {r['ranks']} | {r['bytes_per_param']:.2f} | "
                     f"{r['formula']:.2f} | {r['ratio']:.3f} | {r['extra_mib']:.0f} |")
    lines += ["", "| model | mode | median step (ms) | ratio | to |", "|---|---|---|---|---|"]
    for r in (r for r in records if r["kind"] == "zero-time"):
        lines.append(f"| {r['model']} | {r['mode']} | {r['median_ms']:.1f} | "
                     f"{r['ratio']:.3f} | {r['ratio_to']} |")
    with open(os.path.join(folder, "report.md"), "w") as out:
        out.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: pip install -e '.[bench]' for the plot")
        return
    figure, axes = plt.subplots(figsize=(6, 4))
    ranks = range(1, 9)
    for k, mode in enumerate(FORMULA):
        color = f"C{k}"
        axes.plot(list(ranks), [FORMULA[mode](n) for n in ranks], "--", color=color, alpha=0.6)
        rows = sorted((r["ranks"], r["bytes_per_param"]) for r in memory_rows if r["mode"] == mode)
        if rows:
            axes.plot(*zip(*rows), "o", color=color, label=f"{LABEL[mode]} (measured)")
    axes.set_xlabel("ranks N")
    axes.set_ylabel("bytes per parameter per rank")
    axes.set_title("AdamW, float32, 50.4M parameters; dashed: ZeRO's formulas")
    axes.set_ylim(0, 18)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(os.path.join(folder, "memory.png"), dpi=110)


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("memory")
    one.add_argument("--mode", choices=list(FORMULA), required=True)
    one.add_argument("--out", required=True)
    two = sub.add_parser("time")
    two.add_argument("--model", default="mlp")
    two.add_argument("--modes", nargs="+", default=["ddp", "zero1", "zero2", "torch-ddp", "torch-zero"])
    two.add_argument("--steps", type=int, default=20)
    two.add_argument("--warmup", type=int, default=3)
    two.add_argument("--out", required=True)
    three = sub.add_parser("report")
    three.add_argument("--out", required=True, help="folder for results.jsonl, report.md, memory.png")
    three.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    three.add_argument("--steps", type=int, default=20)
    three.add_argument("--skip-memory", action="store_true")
    three.add_argument("--skip-time", action="store_true")
    args = parser.parse_args()
    {"memory": memory, "time": timing, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
