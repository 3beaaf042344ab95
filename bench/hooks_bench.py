"""Comm hooks against the exact floor: memory bandwidth, step times, a report. Run by hand.

    python bench/hooks_bench.py report --out bench/reports/hooks      # everything below, ~15 min
    mpiexec -n 2 python bench/hooks_bench.py stream --out r.jsonl      # the bandwidth alone

``stream``: a STREAM-style copy (b = a) and add (c = a + b) over 256 MiB arrays,
one thread per rank, every rank at once (a barrier starts each round); the
figure is the aggregate bandwidth of all ranks, STREAM's way (copy moves 2
arrays' bytes, add 3), the best of 5 rounds.

The floor of an exact allreduce of S gradient bytes on 2 ranks sharing memory:
both ranks' gradients must be read (2S) and the result written on both ranks
(2S), 4S bytes at the aggregate add bandwidth. A compressed reduction moves
half the bytes, so its floor is half (the form is the same).

``report`` runs ``stream`` and ``train_bench.py`` at 2 ranks on every model with
the modes local, mpidp (exact, the defaults), mpidp:view=1 (exact, every gradient
in a shared-memory bucket), mpidp:shm=0 (exact, through MPI's allreduce),
mpidp+fp16/bf16/powersgd (mpidp's hooks),
ddp-gloo and ddp-gloo+fp16/bf16 (torch's hooks on torch's DDP over gloo), and writes a table of each mode's step over local next to the floor.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from mpi4py import MPI

COMM = MPI.COMM_WORLD
# Not "ddp-gloo+powersgd": torch's PowerSGD hook on torch's DDP over gloo aborts here
# ("gloo::EnforceNotMet ... Received data size doesn't match expected size"): its
# allreduces, chained in future callbacks on gloo's thread, interleave with the next
# bucket's in a different order on each rank.
# "mpidp": the defaults (CPU buckets in shared memory, gradients of 1 MiB or more in place
# by MPI); "mpidp:view=1": gradient_as_bucket_view, so every gradient in a shared-memory
# bucket; "mpidp:shm=0": shared_memory=False, every reduction through MPI's allreduce.
MODES = ["local", "mpidp", "mpidp:view=1", "mpidp:shm=0", "mpidp+fp16", "mpidp+bf16",
         "mpidp+powersgd", "ddp-gloo", "ddp-gloo+fp16", "ddp-gloo+bf16"]
EXACT = ("mpidp", "mpidp:view=1", "mpidp:shm=0", "ddp-gloo")
GRADIENT_BYTES = {"mlp": 12_595_200 * 4, "cnn": 4_835_658 * 4, "transformer": 13_634_536 * 4,
                  "wide": 25_658_724 * 4}  # float32 parameters of bench/models.py


def stream(args) -> None:
    torch.set_num_threads(1)
    count = (256 << 20) // 4
    a, b, c = torch.ones(count), torch.ones(count), torch.empty(count)
    results = {}
    for name, arrays, call in (("copy", 2, lambda: b.copy_(a)),
                               ("add", 3, lambda: torch.add(a, b, out=c))):
        call()
        best = float("inf")
        for _ in range(5):
            COMM.Barrier()
            start = time.perf_counter()
            call()
            best = min(best, COMM.allreduce(time.perf_counter() - start, op=MPI.MAX))
        results[name] = COMM.size * arrays * count * 4 / best / 1e9
    if COMM.rank == 0:
        record = dict(kind="stream", ranks=COMM.size, threads_per_rank=1,
                      copy_gb_s=results["copy"], add_gb_s=results["add"])
        print(json.dumps(record), flush=True)
        with open(args.out, "a") as out:
            out.write(json.dumps(record) + "\n")


def report(args) -> None:
    args.out = os.path.abspath(args.out)  # the workers run in bench/
    os.makedirs(args.out, exist_ok=True)
    results = os.path.join(args.out, "results.jsonl")
    here = os.path.dirname(os.path.abspath(__file__))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([mpiexec, "-n", "2", sys.executable, os.path.join(here, "hooks_bench.py"),
                    "stream", "--out", results], check=True, env=env, timeout=600)
    for model in args.models:
        subprocess.run([mpiexec, "-n", "2", sys.executable, os.path.join(here, "train_bench.py"),
                        "--model", model, "--steps", str(args.steps), "--out", results,
                        "--modes", *MODES], check=True, env=env, timeout=3600, cwd=here)
    write_report(args.out, results)


def write_report(folder: str, results: str) -> None:
    records = [json.loads(line) for line in open(results)]
    band = [r for r in records if r["kind"] == "stream"][-1]
    train = {(r["model"], r["mode"]): r for r in records if r["kind"] == "train"}
    models = [m for m in GRADIENT_BYTES if (m, "local") in train]
    lines = [f"Aggregate bandwidth, 2 ranks x 1 thread: copy {band['copy_gb_s']:.1f} GB/s, "
             f"add {band['add_gb_s']:.1f} GB/s.", "",
             "| model | gradients (MiB) | floor exact (ms) | floor 16-bit (ms) | local (ms) | "
             + " | ".join(MODES[1:]) + " |",
             "|---|---|---|---|---|" + "---|" * (len(MODES) - 1)]
    for model in models:
        size = GRADIENT_BYTES[model]
        floor = 4 * size / (band["add_gb_s"] * 1e9) * 1e3
        local = train[(model, "local")]["median_ms"]
        cells = [f"{train[(model, mode)]['median_ms'] / local:.3f}x" if (model, mode) in train
                 else "-" for mode in MODES[1:]]
        lines.append(f"| {model} | {size / 2**20:.0f} | {floor:.1f} | {floor / 2:.1f} | "
                     f"{local:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "Exact overhead over local in ms, and as a multiple of the exact floor:", "",
              "| model | " + " | ".join(f"{mode} | / floor" for mode in EXACT) + " |",
              "|---|" + "---|---|" * len(EXACT)]
    for model in models:
        floor = 4 * GRADIENT_BYTES[model] / (band["add_gb_s"] * 1e9) * 1e3
        local = train[(model, "local")]["median_ms"]
        cells = []
        for mode in EXACT:
            extra = train[(model, mode)]["median_ms"] - local if (model, mode) in train else None
            cells += ["-", "-"] if extra is None else [f"{extra:.1f}", f"{extra / floor:.2f}"]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    with open(os.path.join(folder, "report.md"), "w") as out:
        out.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("stream")
    one.add_argument("--out", required=True)
    two = sub.add_parser("report")
    two.add_argument("--out", required=True)
    two.add_argument("--models", nargs="+", default=list(GRADIENT_BYTES))
    two.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    {"stream": stream, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
