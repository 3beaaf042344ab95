"""Where compression pays: exact, fp16, bf16 and PowerSGD across 2 nodes on shaped links.

    python bench/cluster/compression_links.py                      # 1, 10, 25 gbit; ~10 min
    python bench/cluster/compression_links.py --rates 10gbit --models wide --steps 6
    python bench/cluster/compression_links.py report               # rewrite report.md only
    python bench/cluster/compression_links.py hook-profile --hook psgd4 --model wide
    python bench/cluster/compression_links.py --rates 10gbit --threads 8   # cores to spare

For each link rate it brings up 2 nodes x 1 rank (``harness.Cluster``, prefix
``mpidpz``), runs two jobs and tears the nodes down:

- ``probe``: blocking mpi4py ``Allreduce`` of 8 B to 64 MiB between the nodes,
  the median of a few rounds: the link's latency (8 B) and the rate it
  actually delivers (64 MiB moves 64 MiB each way at 2 ranks); ``scale_model.py``
  runs it at 2 and 4 nodes for its alpha and beta;
- ``train``, once per model: mpidp's DDP exact (``exact``) and with
  ``fp16``/``bf16``/``psgd4``/``psgd1`` (PowerSGD rank 4/1, compressing from the
  third step), the compute-only step ``local`` and the same hooks on
  ``MPI.COMM_SELF`` (``self-*``: the hook's local work with no wire), taking
  turns step by step. Per step: the slowest rank's time, ``ddp.stats()`` and
  the bytes n0's ``eth0`` received and sent.

A mode's communication time is its median step minus ``local``'s, as in
bench/train_bench.py. Results append to ``OUT/results.jsonl``; ``OUT/report.md``
is written from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "reports" / "cluster" / "compression"
RATES = ("1gbit", "10gbit", "25gbit")
MODES = ("local", "exact", "fp16", "bf16", "psgd4", "psgd1", "self-exact", "self-bf16",
         "self-psgd4")
PROBE_BYTES = (8, 1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
MARK = "RESULT "
PSGD_START = 2  # exact for the first two steps, as torch requires with error feedback


# -- workers (run across the nodes) ------------------------------------------------------


def emit(record: dict) -> None:
    """Hand a result to the driver through the job's output (the nodes have their own /tmp)."""
    print(MARK + json.dumps(record), flush=True)


def eth0_bytes() -> int:
    """Bytes received plus sent on this node's eth0 (the node's own /sys)."""
    stats = Path("/sys/class/net/eth0/statistics")
    if not stats.exists():
        return 0
    return sum(int((stats / f"{way}_bytes").read_text()) for way in ("rx", "tx"))


def probe(args) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = []
    for size in PROBE_BYTES:
        data = np.ones(max(size // 4, 2), dtype=np.float32)
        out = np.empty_like(data)
        rounds = 20 if size <= 1 << 20 else 5
        times = []
        for _ in range(rounds + 1):  # the first round warms the connection up
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(data, out)
            times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        rows.append(dict(bytes=data.nbytes, median_s=statistics.median(times[1:]),
                         min_s=min(times[1:])))
    if comm.rank == 0:
        emit(dict(kind="probe", rate=args.rate, ranks=comm.size, rows=rows))
        for row in rows:
            print(f"allreduce {row['bytes']:>10} B  {row['median_s'] * 1e3:9.3f} ms", flush=True)


class Mode:
    """One copy of the model under one mode: DDP (or none), its hook, SGD."""

    def __init__(self, name: str, model_name: str):
        import torch
        from mpi4py import MPI

        import mpidp
        from mpidp import hooks
        from models import build

        self.name = name
        model, self.batches, self.loss = build(model_name, MPI.COMM_WORLD.rank)
        self.ddp = None
        if name != "local":
            comm = MPI.COMM_SELF if name.startswith("self-") else MPI.COMM_WORLD
            self.ddp = model = mpidp.DistributedDataParallel(model, process_group=comm)
            hook = name.removeprefix("self-")
            if hook.startswith("psgd"):
                state = hooks.PowerSGDState(comm, matrix_approximation_rank=int(hook[4:]),
                                            start_powerSGD_iter=PSGD_START)
                model.register_comm_hook(state, hooks.powerSGD_hook)
            elif hook in ("fp16", "bf16"):
                model.register_comm_hook(comm, getattr(hooks, f"{hook}_compress_hook"))
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.index = 0

    def step(self) -> dict:
        x, y = self.batches[self.index % len(self.batches)]
        self.index += 1
        wire = eth0_bytes()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.loss(self.model(x), y).backward()
        self.optimizer.step()
        seconds = time.perf_counter() - start
        record = dict(s=seconds, wire=eth0_bytes() - wire)
        if self.ddp is not None:
            stats = self.ddp.stats()[-1]
            record.update(reduction_s=stats["reduction_s"], wait_s=stats["wait_s"],
                          bucket_bytes=stats["bytes"])
        return record


def train(args) -> None:
    import torch
    from mpi4py import MPI

    sys.path.insert(0, str(HERE.parent))  # bench/models.py
    comm = MPI.COMM_WORLD
    torch.set_num_threads(args.threads)
    modes = [Mode(name, args.model) for name in args.modes]
    records = {mode.name: [] for mode in modes}
    for mode in modes:
        for _ in range(args.warmup):
            comm.Barrier()
            mode.step()
    for _ in range(args.steps):  # modes take turns: the machine's drifts hit all alike
        for mode in modes:
            comm.Barrier()
            records[mode.name].append(mode.step())
    for mode in modes:
        steps = records[mode.name]
        slowest = [max(ranks) for ranks in zip(*comm.allgather([r["s"] for r in steps]))]
        if comm.rank != 0:
            continue
        result = dict(kind="train", rate=args.rate, model=args.model, mode=mode.name,
                      ranks=comm.size, threads=args.threads, steps=len(steps), median_ms=statistics.median(slowest) * 1e3,
                      min_ms=min(slowest) * 1e3,
                      wire_mb=statistics.median(r["wire"] for r in steps) / 1e6)
        if mode.ddp is not None:
            result.update({key: statistics.median(r[key] for r in steps) * 1e3
                           for key in ("reduction_s", "wait_s")},
                          bucket_mb=steps[-1]["bucket_bytes"] / 1e6)
            result["reduction_ms"] = result.pop("reduction_s")
            result["wait_ms"] = result.pop("wait_s")
        emit(result)
        print(f"{args.rate:7} {args.model:5} {mode.name:11} {result['median_ms']:9.1f} ms  "
              f"wire {result['wire_mb']:8.1f} MB/step", flush=True)


def hook_profile(args) -> str:
    """torch.profiler's table of a hook's steps on one rank: its local work, by operator."""
    import torch
    from torch.profiler import profile as profiler

    sys.path.insert(0, str(HERE.parent))
    torch.set_num_threads(args.threads)
    mode = Mode(f"self-{args.hook}", args.model)
    for _ in range(args.warmup):
        mode.step()
    with profiler() as prof:
        for _ in range(args.steps):
            mode.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    text = (f"python bench/cluster/compression_links.py hook-profile --hook {args.hook} "
            f"--model {args.model} --steps {args.steps} --threads {args.threads}: {args.steps} "
            f"steps of the DDP with the hook on MPI.COMM_SELF, {args.threads} torch "
            f"thread(s)\n\n{table}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"hook_profile_{args.hook}_{args.model}.txt").write_text(text)
    return text


# -- the driver --------------------------------------------------------------------------


def run_rate(rate: str, args) -> None:
    sys.path.insert(0, str(HERE))
    from harness import Cluster

    with Cluster(2, rate=rate, prefix=args.prefix) as cluster:
        here = str(Path(__file__).resolve())
        common = ["--rate", rate]
        jobs = [[sys.executable, here, "probe", *common]]
        for model in args.models:
            jobs.append([sys.executable, here, "train", *common, "--model", model,
                         "--steps", str(args.steps), "--warmup", str(args.warmup),
                         "--threads", str(args.threads),
                         "--modes", *args.modes])
        for argv in jobs:
            result = cluster.run(["nice", "-n", "5", *argv], ppn=1, timeout=args.timeout)
            result.check()
            with open(args.results, "a") as out:
                out.writelines(line[len(MARK):] + "\n" for line in result.output.splitlines()
                               if line.startswith(MARK))


def load(results: Path) -> tuple[dict, dict]:
    probes, train = {}, {}
    for line in results.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "probe":
            probes[record["rate"]] = record  # the last run of each rate wins
        else:
            train[(record["rate"], record["model"], record["mode"])] = record
    return probes, train


def link_figures(probe: dict) -> dict:
    """Latency (8 B allreduce, the best round) and delivered rate (64 MiB, the median round)."""
    rows = {row["bytes"]: row for row in probe["rows"]}
    small = rows[min(rows)]["min_s"]  # the median of a small one measures the neighbours' load
    big = max(rows)
    seconds = rows[big]["median_s"]
    return dict(latency_us=small * 1e6, gbit_s=big * 8 / (seconds - small) / 1e9,
                big_mib=big / 2**20, big_ms=seconds * 1e3)


def write_report(out: Path) -> str:
    probes, train = load(out / "results.jsonl")
    rates = [r for r in RATES if r in probes] + sorted(set(probes) - set(RATES))
    lines = ["# Compression across 2 nodes x 1 rank on shaped links", "",
             "Written by `python bench/cluster/compression_links.py` from `results.jsonl`. "
             "A step is the slowest rank's, the median over the timed steps; "
             "comm = step - local (same launch); wire = bytes n0's eth0 received + sent per "
             "step; speed-up = exact's comm / the mode's comm.", "",
             "## The links", "",
             "| tbf rate | 8 B allreduce (latency, best) | 64 MiB allreduce (median) | delivered |",
             "|---|---|---|---|"]
    for rate in rates:
        f = link_figures(probes[rate])
        lines.append(f"| {rate} | {f['latency_us']:.0f} µs | {f['big_ms']:.1f} ms | "
                     f"{f['gbit_s']:.2f} Gbit/s |")
    models = sorted({model for _, model, _ in train}, key=lambda m: ("mlp", "wide").index(m)
                    if m in ("mlp", "wide") else 9)
    for model in models:
        lines += ["", f"## {model}", "",
                  "| link | mode | step (ms) | comm (ms) | speed-up on comm | wire (MB/step) | "
                  "DDP reduction_s (ms) |", "|---|---|---|---|---|---|---|"]
        for rate in rates:
            local = train.get((rate, model, "local"))
            exact = train.get((rate, model, "exact"))
            if local is None:
                continue
            base = exact["median_ms"] - local["median_ms"] if exact else None
            for mode in MODES:
                r = train.get((rate, model, mode))
                if r is None:
                    continue
                comm = r["median_ms"] - local["median_ms"]
                gain = (f"{base / comm:.2f}x" if base and comm > 0 and mode != "local"
                        and not mode.startswith("self-") else "")
                lines.append(f"| {rate} | {mode} | {r['median_ms']:.1f} | "
                             f"{comm:.1f} | {gain} | {r['wire_mb']:.1f} | "
                             f"{r.get('reduction_ms', float('nan')):.1f} |")
    lines += break_even(train, rates, models)
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def break_even(train: dict, rates: list[str], models: list[str]) -> list[str]:
    """Below which link rate each scheme pays, and meets issue 19's targets, from its local work.

    Per model, over every launch: B, the bytes exact puts on the link each way
    per step (half of rx + tx); o, the DDP's own local work (self-exact - local);
    w, a hook's local work (self-HOOK - self-exact), the median over the launches.
    At R bytes/s exact's comm is B/R + o, a 16-bit hook's B/2R + o + w, PowerSGD's
    about o + w (its bytes are negligible). So a 16-bit hook pays below B/(2w),
    is 1.5x faster below B/(2o + 6w), PowerSGD pays below B/w and is 3x faster
    below B/(2o + 3w).
    """
    lines = ["", "## Why: the hooks' local work against the wire time they save", "",
             "From the `self-*` modes (the same DDP and hooks on `MPI.COMM_SELF`: all the "
             "local work, no wire), medians over the launches above. B: bytes exact sends "
             "each way per step; o: the DDP's own local work; w: the hook's. A 16-bit hook pays "
             "below B/(2w) and is 1.5x faster than exact on comm below B/(2o + 6w); PowerSGD "
             "pays below B/w and is 3x faster below B/(2o + 3w) (rates as delivered, Gbit/s).",
             "", "| model | B (MB) | o (ms) | hook | w (ms) | pays below | target met below |",
             "|---|---|---|---|---|---|---|"]
    for model in models:
        def median_ms(mode):
            values = [train[(r, model, mode)]["median_ms"] for r in rates
                      if (r, model, mode) in train]
            return statistics.median(values) if values else None
        wires = [train[(r, model, "exact")]["wire_mb"] for r in rates
                 if (r, model, "exact") in train]
        if not wires or median_ms("self-exact") is None:
            continue
        size = statistics.median(wires) / 2 * 1e6
        own = max(0.0, median_ms("self-exact") - median_ms("local")) / 1e3
        for hook, factor, target in (("bf16", 2, 6), ("psgd4", 1, 3)):
            base = median_ms(f"self-{hook}")
            if base is None:
                continue
            work = max(1e-9, (base - median_ms("self-exact")) / 1e3)
            pays = size / (factor * work) * 8 / 1e9
            met = size / (2 * own + target * work) * 8 / 1e9
            lines.append(f"| {model} | {size / 1e6:.0f} | {own * 1e3:.0f} | {hook} | "
                         f"{work * 1e3:.0f} | {pays:.1f} | {met:.1f} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="run",
                        choices=["run", "report", "probe", "train", "hook-profile"])
    parser.add_argument("--hook", default="psgd4", help="(hook-profile) bf16, psgd4, ...")
    parser.add_argument("--rates", nargs="+", default=list(RATES))
    parser.add_argument("--rate", help="(workers) the rate being measured")
    parser.add_argument("--models", nargs="+", default=["mlp", "wide"])
    parser.add_argument("--model", help="(train worker) the model")
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (1: one core per rank, as on the 2-core "
                             "machine; a rank on a NUMA domain has many)")
    parser.add_argument("--prefix", default="mpidpz", help="the cluster's prefix")
    parser.add_argument("--timeout", type=float, default=300, help="limit of each job (s)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.command == "probe":
        probe(args)
    elif args.command == "train":
        train(args)
    elif args.command == "hook-profile":
        print(hook_profile(args))
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        args.results = args.out / "results.jsonl"
        if args.command == "run":
            for rate in args.rates:
                run_rate(rate, args)
        print(write_report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
