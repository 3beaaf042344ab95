"""mpidp's benchmark suite: one command, results in a folder it names.

    python bench/run.py                 # the full suite, about 10 minutes on 2 cores
    python bench/run.py --quick         # a smoke run: few steps, small sweeps

Launches ``mpiexec -n 2`` (``--np``) runs of ``train_bench.py`` and
``allreduce_bench.py`` with one thread per rank, then writes, under
``bench/results/<timestamp>/``: ``results.jsonl`` (every measurement),
``report.md`` (tables and the targets) and PNG plots.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = ("mlp", "cnn", "transformer", "wide")
MAIN_MODES = ["local", "naive", "flat", "ddp-gloo", "mpidp"]
SWEEPS = {
    "bucket": ["mpidp:bucket=1", "mpidp:bucket=5", "mpidp", "mpidp:bucket=100"],
    "bucket, every gradient in a bucket": ["mpidp:inplace=0,bucket=1", "mpidp:inplace=0,bucket=5",
                                           "mpidp:inplace=0", "mpidp:inplace=0,bucket=100"],
    "pool (nonblocking)": ["mpidp:overlap=0,pool=1", "mpidp:overlap=0,pool=2", "mpidp:overlap=0,pool=4"],
    "overlap": ["mpidp", "mpidp:overlap=1", "mpidp:overlap=0"],
    "in-place threshold": ["mpidp", "mpidp:inplace=0"],
    "chunk": ["mpidp:chunk=1", "mpidp", "mpidp:chunk=16", "mpidp:chunk=64"],
}
MEMORY_MODES = ["local", "naive", "flat", "ddp-gloo", "mpidp", "mpidp:view=1"]
ORDER_MODES = ["local", "mpidp", "mpidp:predict=0", "mpidp:overlap=1", "mpidp:overlap=1,predict=0"]


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def launch(nprocs: int, script: str, *args: str) -> None:
    command = [mpiexec(), "-n", str(nprocs), sys.executable, str(HERE / script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(HERE))
    print("$", " ".join(command[3:]) if len(command) > 3 else command, flush=True)
    subprocess.run(command, env=env, check=True)


def unique(items):
    return list(dict.fromkeys(items))


def run_suite(args, results: Path) -> None:
    steps = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    for model in args.models:
        modes = unique(MAIN_MODES + [m for sweep in SWEEPS.values() for m in sweep])
        if args.quick:
            modes = MAIN_MODES
        launch(args.np, "train_bench.py", "--model", model, "--out", str(results), *steps,
               "--modes", *modes)
    launch(args.np, "train_bench.py", "--model", "mlp-reverse", "--out", str(results), *steps,
           "--modes", *ORDER_MODES)
    launch(args.np, "allreduce_bench.py", "--out", str(results),
           "--repeats", "5" if args.quick else "15")
    for model in args.models:
        for mode in MEMORY_MODES:
            launch(args.np, "train_bench.py", "--model", model, "--out", str(results), "--memory",
                   "--steps", "3", "--warmup", "1", "--modes", mode)


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def index(records, kind):
    return {(r["model"], r["mode"]): r for r in records if r["kind"] == kind}


def table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def report(records: list[dict], args) -> str:
    train = index(records, "train")
    memory = index(records, "memory")
    out = ["# mpidp benchmark report\n",
           f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, {os.cpu_count()} cores, "
           f"{args.np} ranks x 1 thread, {args.steps} timed steps per mode (modes interleaved step "
           f"by step), step time = slowest rank. Command: `python bench/run.py"
           f"{' --quick' if args.quick else ''}`.\n"]
    out.append("## Step time (median ms; ratio = median / local median)\n")
    rows = []
    for model in args.models:
        local = train[(model, "local")]["median_ms"]
        gloo = train[(model, "ddp-gloo")]["median_ms"]
        for mode in MAIN_MODES:
            r = train[(model, mode)]
            rows.append([model, mode, f"{r['median_ms']:.1f}", f"{r['p90_ms']:.1f}",
                         f"{r['median_ms'] / local:.2f}", f"{gloo / r['median_ms']:.2f}",
                         r.get("identical_to_mpidp", "-")])
    out.append(table(["model", "mode", "median", "p90", "x local", "speed-up vs ddp-gloo",
                      "params identical to mpidp"], rows))
    out.append("\n## Where the time goes (ms, median per phase, mean of ranks)\n")
    rows = []
    for model in args.models:
        for mode in MAIN_MODES:
            b = train[(model, mode)]["breakdown_ms"]
            rows.append([model, mode] + [("n/a" if v != v else f"{v:.1f}") for v in
                                          (b["forward"], b["backward"], b["wait"], b["optimizer"])])
    out.append("`wait` is communication after backward (for mpidp: inside backward, the end-of-"
               "backward callback; torch DDP's cannot be separated).\n")
    out.append(table(["model", "mode", "forward", "backward", "wait", "optimizer"], rows))
    if not args.quick:
        for name, modes in SWEEPS.items():
            out.append(f"\n## Sweep: {name} (median ms)\n")
            rows = [[model] + [f"{train[(model, m)]['median_ms']:.1f}" for m in modes]
                    for model in args.models]
            out.append(table(["model"] + modes, rows))
    out.append("\n## Gradient order prediction (mlp-reverse: layers run last-registered first)\n")
    out.append("`first allreduce at` = how far into the backward pass the first allreduce started "
               "(median; 0 = at once, 1 = at the end).\n")
    out.append(table(["mode", "median ms", "p90 ms", "first allreduce at", "identical to mpidp"],
                     [[m, f"{train[('mlp-reverse', m)]['median_ms']:.1f}",
                       f"{train[('mlp-reverse', m)]['p90_ms']:.1f}",
                       _fraction(train[("mlp-reverse", m)].get("first_allreduce_at")),
                       train[("mlp-reverse", m)].get("identical_to_mpidp", "-")] for m in ORDER_MODES]))
    out.append("\n## Peak memory per rank (MiB; growth = peak minus the process before the model)\n")
    rows = [[model, mode, f"{memory[(model, mode)]['peak_mib']:.0f}",
             f"{memory[(model, mode)]['peak_over_start_mib']:.0f}"]
            for model in args.models for mode in MEMORY_MODES if (model, mode) in memory]
    out.append(table(["model", "mode", "peak", "growth"], rows))
    out.append("\n## Allreduce (float32, median per call)\n")
    ar = [r for r in records if r["kind"] == "allreduce"]
    by = {(r["method"], r["bytes"]): r for r in ar}
    sizes = sorted({r["bytes"] for r in ar})
    rows = []
    for size in sizes:
        raw, mine = by[("mpi4py", size)], by[("mpidp", size)]
        nb = by[("mpidp-nonblocking", size)]
        rows.append([size, f"{raw['us_per_call']:.1f}", f"{mine['us_per_call']:.1f}",
                     f"{nb['us_per_call']:.1f}", f"{raw['bus_gbps']:.2f}", f"{mine['bus_gbps']:.2f}",
                     f"{mine['bus_gbps'] / raw['bus_gbps']:.3f}",
                     f"{mine['us_per_call'] - raw['us_per_call']:.1f}"])
    out.append(table(["bytes", "mpi4py us", "mpidp us", "mpidp nonblocking us", "mpi4py GB/s",
                      "mpidp GB/s", "bandwidth ratio", "added us"], rows))
    out.append("\n## Targets\n")
    out.append(table(["target", "measured", "met"], targets(train, by, sizes, args)))
    return "\n".join(out) + "\n"


def _fraction(value):
    return "-" if value is None else f"{value:.2f}"


def targets(train, by, sizes, args):
    rows = []
    for model in args.models:
        mine = train[(model, "mpidp")]["median_ms"]
        best = min(train[(model, "naive")]["median_ms"], train[(model, "ddp-gloo")]["median_ms"])
        rows.append([f"{model}: mpidp <= best of naive, ddp-gloo", f"{mine:.1f} vs {best:.1f} ms",
                     mine <= best])
        local = train[(model, "local")]["median_ms"]
        limit = 1.4 if model == "wide" else 1.05
        rows.append([f"{model}: mpidp <= {limit} x local", f"{mine / local:.2f} x", mine / local <= limit])
        if model in ("mlp", "wide"):
            speedup = train[(model, "ddp-gloo")]["median_ms"] / mine
            rows.append([f"{model}: >= 1.25 x faster than ddp-gloo", f"{speedup:.2f} x", speedup >= 1.25])
    big = [s for s in sizes if s >= 1 << 20]
    worst = min(by[("mpidp", s)]["bus_gbps"] / by[("mpi4py", s)]["bus_gbps"] for s in big)
    rows.append(["allreduce >= 0.95 x mpi4py bandwidth at >= 1 MiB", f"worst {worst:.3f}", worst >= 0.95])
    small = sizes[0]
    added = by[("mpidp", small)]["us_per_call"] - by[("mpi4py", small)]["us_per_call"]
    rows.append([f"added per-call overhead <= 10 us ({small} B)", f"{added:.1f} us", added <= 10])
    return rows


def plots(records, args, folder: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    train = index(records, "train")
    figure, axes = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(MAIN_MODES)
    for k, mode in enumerate(MAIN_MODES):
        values = [train[(m, mode)]["median_ms"] / train[(m, "local")]["median_ms"] for m in args.models]
        axes.bar([i + k * width for i in range(len(args.models))], values, width, label=mode)
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(args.models))], args.models)
    axes.set_ylabel("step time / local")
    axes.axhline(1.0, color="black", linewidth=0.5)
    axes.legend(fontsize=8)
    axes.set_title(f"Training step, {args.np} ranks (lower is better)")
    figure.tight_layout()
    figure.savefig(folder / "step_time.png", dpi=120)
    if not args.quick:
        figure, axes = plt.subplots(figsize=(6, 4))
        caps = [1, 5, 25, 100]
        for k, model in enumerate(args.models):
            local = train[(model, "local")]["median_ms"]
            color = f"C{k}"
            axes.plot(caps, [train[(model, m)]["median_ms"] / local for m in SWEEPS["bucket"]],
                      marker="o", color=color, label=f"{model}")
            axes.plot(caps, [train[(model, m)]["median_ms"] / local
                             for m in SWEEPS["bucket, every gradient in a bucket"]],
                      marker="x", linestyle="--", color=color, label=f"{model}, no in-place")
        axes.set_xscale("log")
        axes.set_xlabel("bucket_cap_mb")
        axes.set_ylabel("step time / local")
        axes.set_title("Step time vs bucket size (mpidp defaults otherwise)")
        axes.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(folder / "bucket_size.png", dpi=120)
    ar = [r for r in records if r["kind"] == "allreduce"]
    figure, axes = plt.subplots(figsize=(6, 4))
    for method in ("mpi4py", "mpidp", "mpi4py-nonblocking", "mpidp-nonblocking"):
        points = sorted((r["bytes"], r["bus_gbps"]) for r in ar if r["method"] == method)
        axes.plot(*zip(*points), marker="o", label=method)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message bytes")
    axes.set_ylabel("bus bandwidth GB/s")
    axes.set_title("Allreduce, float32")
    axes.legend()
    figure.tight_layout()
    figure.savefig(folder / "allreduce.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, help="results folder (default bench/results/<timestamp>)")
    parser.add_argument("--report-only", action="store_true", help="rebuild report and plots")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 5 if args.quick else 25
    folder = args.out or HERE / "results" / f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    folder.mkdir(parents=True, exist_ok=True)
    results = folder / "results.jsonl"
    if not args.report_only:
        results.unlink(missing_ok=True)
        run_suite(args, results)
    records = load(results)
    (folder / "report.md").write_text(report(records, args))
    plots(records, args, folder)
    print(f"\nwrote {folder}/report.md, results.jsonl and plots")


if __name__ == "__main__":
    main()
