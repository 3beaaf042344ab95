"""An alpha-beta model of a DDP step, checked on the cluster harness, projected to 256 nodes.

    python bench/cluster/scale_model.py                 # profile + check + report, ~10 min
    python bench/cluster/scale_model.py profile         # local: compute, gradient ready times
    python bench/cluster/scale_model.py check           # 2 and 4 nodes x 1 rank, 1 and 10 gbit
    python bench/cluster/scale_model.py report          # model, tables, plot from the files

The model of one step on P ranks (one per node unless said otherwise):

- compute: the local step (forward, backward, optimizer) measured with no
  communication; each gradient's ready time in the backward, measured with
  ``register_post_accumulate_grad_hook`` (``profile``);
- buckets: mpidp's defaults, in the order gradients become ready: a gradient
  of 1 MiB or more is reduced on its own, in place; the others fill buckets
  of 1 MiB (the first) and 25 MiB; each is reduced in 4 MiB chunks, one
  allreduce per chunk;
- an allreduce of S bytes, MPICH's choice: recursive doubling below 2 KiB,
  ``ceil(log2 P) (alpha + S beta + S gamma)``, else Rabenseifner's
  reduce-scatter + allgather, ``2 log2 P alpha + 2 (P-1)/P S beta +
  (P-1)/P S gamma``; a ring is ``2 (P-1) alpha`` + the same bandwidth terms.
  alpha: an 8 B allreduce between 2 nodes (best round); beta: seconds per byte sent, from
  the 1 to 64 MiB allreduces between 2 nodes less the sum's share; gamma: seconds per
  byte summed, from ``torch.add`` on one core;
- overlap: ``inline`` (mpidp's CPU default: each bucket reduced inside the
  backward, blocking, so step = compute + sum of the reductions) or
  ``overlap`` (reductions run beside the backward, as a communication thread
  or a GPU stream would: bucket i starts at max(its ready time, bucket i-1's
  end), and the step waits for the last);
- compression: fp16/bf16 send half the bytes (an alltoall and an allgather
  of S/2, ``(P-1) alpha + (P-1)/P S/2 beta`` each) plus local work measured
  per byte; PowerSGD rank r allreduces P (n r) and Q (m r) per n x m matrix
  and the vectors exactly, plus local work measured per byte;
- G ranks per node: ``flat`` Rabenseifner over N G ranks puts G times the
  inter-node bytes on each node's link (the first log2 N halvings cross
  nodes for every rank), a ``ring`` ordered by node puts one rank's, and
  ``hierarchical`` (mpidp's shared memory) reduces within the node through
  memory (2 G S bytes at the node's memory bandwidth) and then allreduces
  1/G of the buffer per local rank across nodes.

Measurements go to ``bench/reports/cluster/scale/`` (``profile.json``,
``check.jsonl``, whose 2-node link probes calibrate alpha and beta per rate).
``report`` writes ``report.md`` and ``projection.png`` there.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "reports" / "cluster" / "scale"
MODELS = ("mlp", "cnn", "transformer", "wide")
MiB = 1 << 20
SHORT_MSG = 2048  # MPICH's MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE: recursive doubling below
CHUNK = 4 * MiB  # mpidp's chunk_mb
FIRST_BUCKET, BUCKET_CAP, SOLO = 1 * MiB, 25 * MiB, 1 * MiB  # mpidp's defaults on CPU
NODE_MEMORY_BYTES_S = 31.9e9  # 2 ranks' add bandwidth, bench/reports/hooks/report.md
CHECK = [(2, "1gbit"), (2, "10gbit"), (4, "1gbit"), (4, "10gbit")]
CHECK_MODES = ("local", "exact", "bf16", "psgd4", "self-exact", "self-bf16", "self-psgd4")
PROJECT_NODES = (8, 16, 32, 64, 128, 256)
PROJECT_RATES = (10, 25, 100)  # Gbit/s
BUCKET_SWEEP_MIB = (1, 4, 16, 25, 64, 256)


# -- measurements ------------------------------------------------------------------------


def profile_model(name: str, rounds: int = 7) -> dict:
    """Local step phases and each gradient's ready time (seconds after backward starts)."""
    import torch

    from models import build

    model, batches, loss_fn = build(name, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    params = [p for p in model.parameters() if p.requires_grad]
    ready = [0.0] * len(params)
    mark = [0.0]
    for i, param in enumerate(params):
        param.register_post_accumulate_grad_hook(
            lambda _, i=i: ready.__setitem__(i, time.perf_counter() - mark[0]))
    phases, readies = [], []
    for step in range(rounds + 2):
        x, y = batches[step % len(batches)]
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        mark[0] = t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if step >= 2:
            phases.append((t1 - t0, t2 - t1, t3 - t2))
            readies.append(list(ready))
    forward, backward, opt = (statistics.median(p) for p in zip(*phases))
    median_ready = [statistics.median(r) for r in zip(*readies)]
    grads = sorted(((median_ready[i], p.numel() * p.element_size(), list(p.shape))
                    for i, p in enumerate(params)), key=lambda g: g[0])
    return dict(forward_s=forward, backward_s=backward, optimizer_s=opt,
                grads=[dict(ready_s=r, bytes=b, shape=s) for r, b, s in grads])


def gamma_s_per_byte() -> float:
    """Seconds per float32 byte summed (c = a + b over 64 MiB, one core, best of 5)."""
    import torch

    a, b = torch.ones(16 * MiB), torch.ones(16 * MiB)
    c = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.add(a, b, out=c)
        best = min(best, time.perf_counter() - start)
    return best / (a.numel() * 4)


def profile(args) -> None:
    """Local profile of every model, and the hooks' local work (a 1-rank DDP)."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE.parent))
    result = dict(gamma_s_per_byte=gamma_s_per_byte(),
                  models={name: profile_model(name) for name in MODELS})
    # The hooks' local work: compression_links' train worker on 1 rank, in turns.
    mpiexec = Path(sys.executable).parent / "mpiexec"
    result["hook_runs"] = []
    for model in args.models:
        run = subprocess.run(
            ["nice", "-n", "5", str(mpiexec), "-n", "1", sys.executable,
             str(HERE / "compression_links.py"), "train", "--rate", "none", "--steps", "10",
             "--modes", "local", "self-exact", "self-bf16", "self-psgd4", "--model", model],
            capture_output=True, text=True, timeout=600, check=True)
        result["hook_runs"] += [json.loads(line[len("RESULT "):]) for line in
                                run.stdout.splitlines() if line.startswith("RESULT ")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'profile.json'}")


def check(args) -> None:
    """2 and 4 nodes x 1 rank: link probes and steps (compression_links' workers)."""
    sys.path.insert(0, str(HERE))
    import compression_links
    from harness import Cluster

    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "check.jsonl"
    for nodes, rate in CHECK:
        with Cluster(nodes, rate=rate, prefix=args.prefix) as cluster:
            script = str(HERE / "compression_links.py")
            jobs = [[script, "probe", "--rate", rate]]
            jobs += [[script, "train", "--rate", rate, "--model", model, "--steps",
                      str(args.steps), "--modes", *CHECK_MODES] for model in args.models]
            for job in jobs:
                result = cluster.run(["nice", "-n", "5", sys.executable, *job], ppn=1,
                                     timeout=args.timeout).check()
                with open(results, "a") as out:
                    for line in result.output.splitlines():
                        if line.startswith(compression_links.MARK):
                            record = json.loads(line[len(compression_links.MARK):])
                            out.write(json.dumps(dict(record, nodes=nodes)) + "\n")
                print(f"{nodes} nodes {rate}: {job[1]} {job[5] if len(job) > 5 else ''} "
                      f"{result.seconds:.0f} s", flush=True)


# -- the model ---------------------------------------------------------------------------


@dataclass
class Link:
    """alpha: seconds per message; beta: seconds per byte sent; gamma: per byte summed."""

    alpha: float
    beta: float
    gamma: float


def allreduce_s(nbytes: float, ranks: int, link: Link, algorithm: str = "auto") -> float:
    """Seconds of one allreduce of ``nbytes`` over ``ranks`` (see the module's docstring)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    steps = math.ceil(math.log2(ranks))
    share = (ranks - 1) / ranks
    if algorithm == "auto":
        algorithm = "doubling" if nbytes < SHORT_MSG else "rabenseifner"
    if algorithm == "doubling":
        return steps * (link.alpha + nbytes * (link.beta + link.gamma))
    bandwidth = 2 * share * nbytes * link.beta + share * nbytes * link.gamma
    latency = 2 * steps if algorithm == "rabenseifner" else 2 * (ranks - 1)
    return latency * link.alpha + bandwidth


def chunked_s(nbytes: float, ranks: int, link: Link, chunk: float = CHUNK) -> float:
    """An mpidp bucket: one allreduce per ``chunk`` bytes."""
    full, rest = divmod(nbytes, chunk)
    return full * allreduce_s(chunk, ranks, link) + allreduce_s(rest, ranks, link)


def buckets(grads: list[dict], cap: float = BUCKET_CAP, first: float = FIRST_BUCKET,
            solo: float | None = SOLO) -> list[dict]:
    """mpidp's layout in ready order: [{bytes, ready_s, shapes}] (solo: reduced in place)."""
    out, open_ = [], None
    for grad in grads:
        if solo is not None and grad["bytes"] >= solo:
            out.append(dict(bytes=grad["bytes"], ready_s=grad["ready_s"], shapes=[grad["shape"]]))
            continue
        limit = first if not out and open_ is None else cap
        if open_ is not None and open_["bytes"] + grad["bytes"] > limit:
            out.append(open_)
            open_ = None
        if open_ is None:
            open_ = dict(bytes=0, ready_s=0.0, shapes=[])
        open_["bytes"] += grad["bytes"]
        open_["ready_s"] = max(open_["ready_s"], grad["ready_s"])
        open_["shapes"].append(grad["shape"])
    if open_ is not None:
        out.append(open_)
    return sorted(out, key=lambda b: b["ready_s"])


def bucket_comm_s(bucket: dict, ranks: int, link: Link, mode: str, work: dict,
                  chunk: float = CHUNK) -> float:
    """Seconds to reduce one bucket under ``mode`` (exact, fp16/bf16, psgdR)."""
    size = bucket["bytes"]
    if mode == "exact":
        return chunked_s(size, ranks, link, chunk)
    if mode in ("fp16", "bf16"):
        half = size / 2
        share = (ranks - 1) / ranks
        wire = 2 * ((ranks - 1) * link.alpha + share * half * link.beta)
        return wire + work["bf16"] * size
    rank = int(mode[4:])
    p_bytes = q_bytes = exact = 0
    for shape in bucket["shapes"]:
        n = shape[0] if shape else 1
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, rank)
        if (n + m) * r * 2 < n * m:
            p_bytes += 4 * n * r
            q_bytes += 4 * m * r
        else:
            exact += 4 * n * m
    comm = sum(allreduce_s(b, ranks, link) for b in (p_bytes, q_bytes, exact))
    return comm + work["psgd4"] * size


def step_s(profile: dict, ranks: int, link: Link, *, mode: str = "exact", overlap: bool = False,
           work: dict, cap: float = BUCKET_CAP, solo: float | None = SOLO,
           chunk: float = CHUNK, compute: float | None = None) -> float:
    """Predicted step: compute plus the communication the backward does not hide."""
    local = profile["forward_s"] + profile["backward_s"] + profile["optimizer_s"]
    scale = 1.0 if compute is None else compute / local  # the same phases, another machine's speed
    overhead = work["ddp"] * sum(g["bytes"] for g in profile["grads"])
    layout = buckets(profile["grads"], cap=cap, first=min(FIRST_BUCKET, cap), solo=solo)
    costs = [bucket_comm_s(b, ranks, link, mode, work, chunk) for b in layout]
    if not overlap:
        return local * scale + overhead + sum(costs)
    end = 0.0
    for bucket, cost in zip(layout, costs):
        end = max(bucket["ready_s"] * scale, end) + cost
    return local * scale + overhead + max(0.0, end - profile["backward_s"] * scale)


def hierarchy_s(nbytes: float, nodes: int, per_node: int, link: Link) -> dict:
    """One allreduce of ``nbytes`` on ``nodes`` x ``per_node`` ranks, three ways."""
    ranks = nodes * per_node
    share = (nodes - 1) / nodes
    flat = (2 * math.ceil(math.log2(ranks)) * link.alpha
            + 2 * per_node * share * nbytes * link.beta + (ranks - 1) / ranks * nbytes * link.gamma)
    ring = allreduce_s(nbytes, ranks, link, "ring")
    intra = 2 * per_node * nbytes / NODE_MEMORY_BYTES_S
    inter = (2 * math.ceil(math.log2(nodes)) * link.alpha + 2 * share * nbytes * link.beta
             + share * nbytes / per_node * link.gamma)
    return dict(flat=flat, ring=ring, hierarchical=intra + inter)


# -- calibration and the report ------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def fit_link(probe: dict, gamma: float) -> Link:
    """alpha: the 8 B allreduce's best round; beta: from the 1 to 64 MiB ones.

    At 2 ranks an allreduce of S bytes takes 2 alpha + S beta + S/2 gamma;
    beta is the median of what each size's median round gives (one size
    disturbed by the neighbours' load then moves it less than a fit would).
    """
    rows = sorted(probe["rows"], key=lambda r: r["bytes"])
    alpha = rows[0]["min_s"]
    betas = [(r["median_s"] - 2 * alpha) / r["bytes"] - gamma / 2 for r in rows
             if r["bytes"] >= MiB]
    return Link(alpha, statistics.median(betas), gamma)


def hook_work(records: list[dict], size: float) -> dict:
    """Seconds per gradient byte of local work: the DDP itself, bf16's and PowerSGD's conversions.

    From one launch's ``local`` and ``self-*`` modes (the DDP and its hooks on
    MPI.COMM_SELF), their median steps, as the steps they predict.
    """
    runs = {r["mode"]: r["median_ms"] / 1e3 for r in records}
    return dict(ddp=max(0.0, runs["self-exact"] - runs["local"]) / size,
                bf16=max(0.0, runs["self-bf16"] - runs["self-exact"]) / size,
                psgd4=max(0.0, runs["self-psgd4"] - runs["self-exact"]) / size)


def report(args) -> str:
    prof = json.loads((args.out / "profile.json").read_text())
    gamma = prof["gamma_s_per_byte"]
    checks = read_jsonl(args.out / "check.jsonl")
    probes = {(r["nodes"], r["rate"]): r for r in checks if r["kind"] == "probe"}
    links = {rate: fit_link(p, gamma) for (nodes, rate), p in probes.items() if nodes == 2}
    lines = ["# Scale model: calibration, check, projection", "",
             "Written by `python bench/cluster/scale_model.py report` from `profile.json` and "
             "`check.jsonl` (same folder).", "",
             "## Calibration (2 nodes x 1 rank)", "",
             f"gamma (sum, one core): {1 / gamma / 1e9:.2f} GB/s of float32 summed.", "",
             "| tbf rate | alpha (8 B allreduce, best) | beta as a rate (1-64 MiB, median) |",
             "|---|---|---|"]
    order = sorted(links, key=lambda rate: float(rate[:-4]))
    for rate in order:
        lines.append(f"| {rate} | {links[rate].alpha * 1e6:.1f} µs | "
                     f"{8 / links[rate].beta / 1e9:.2f} Gbit/s |")
    lines += ["", "The allreduce itself at 4 nodes x 1 rank (medians), against the model with "
              "the 2-node alpha and beta:", "",
              "| tbf rate | bytes | measured (ms) | model (ms) | model / measured |",
              "|---|---|---|---|---|"]
    for rate in order:
        for row in probes.get((4, rate), {}).get("rows", []):
            if row["bytes"] >= MiB:
                model = allreduce_s(row["bytes"], 4, links[rate])
                lines.append(f"| {rate} | {row['bytes'] // MiB} MiB | "
                             f"{row['median_s'] * 1e3:.1f} | "
                             f"{model * 1e3:.1f} | {model / row['median_s']:.2f} |")
    lines += ["", "## Predicted vs measured step (inline, the CPU default)", "",
              "Compute is the `local` step of the same launch (4 nodes: 4 ranks on 2 cores, "
              "so it is the oversubscribed compute), and so is the local work of the DDP and "
              "its hooks per byte (the `self-*` modes' median steps); communication is the "
              "model's, with the 2-node alpha and beta of the rate.",
              "", "| nodes | link | model | mode | measured (ms) | predicted (ms) | error | "
              "measured comm (ms) | predicted comm (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    trains = {(r["nodes"], r["rate"], r["model"], r["mode"]): r for r in checks
              if r["kind"] == "train"}
    errors = []
    for (nodes, rate, model, mode), r in sorted(trains.items()):
        if mode == "local" or mode.startswith("self-") or rate not in links:
            continue
        local = trains[(nodes, rate, model, "local")]["median_ms"] / 1e3
        p = prof["models"][model]
        launch = [v for k, v in trains.items() if k[:3] == (nodes, rate, model)]
        work = hook_work(launch, sum(g["bytes"] for g in p["grads"]))
        predicted = step_s(p, nodes, links[rate], mode=mode, work=work, compute=local)
        measured = r["median_ms"] / 1e3
        errors.append((predicted / measured - 1, nodes, rate, model, mode))
        lines.append(f"| {nodes} | {rate} | {model} | {mode} | {measured * 1e3:.0f} | "
                     f"{predicted * 1e3:.0f} | {predicted / measured - 1:+.0%} | "
                     f"{(measured - local) * 1e3:.0f} | {(predicted - local) * 1e3:.0f} |")
    if errors:
        worst = max(errors, key=lambda e: abs(e[0]))
        lines += ["", f"Largest step error: {worst[0]:+.0%} ({worst[1]} nodes, {worst[2]}, "
                  f"{worst[3]}, {worst[4]}); median absolute step error "
                  f"{statistics.median(abs(e[0]) for e in errors):.0%}."]
    lines += projection(prof, links, args.out)
    text = "\n".join(lines) + "\n"
    (args.out / "report.md").write_text(text)
    return text


def nominal(rate_gbit: float, measured: dict[str, Link], gamma: float) -> Link:
    """A link at its nominal rate, with the latency measured on the harness."""
    alpha = statistics.median(link.alpha for link in measured.values()) if measured else 20e-6
    return Link(alpha, 8 / (rate_gbit * 1e9), gamma)


def projection(prof: dict, measured: dict, out: Path) -> list[str]:
    gamma = prof["gamma_s_per_byte"]
    lines = ["", "## Projection: 8 -> 256 nodes x 1 rank", "",
             "Efficiency = local step / predicted step. Compute and per-byte local work are this "
             "machine's (one core per rank); links at their nominal rate with the latency "
             "measured between 2 nodes here. `inline`: exact, mpidp's CPU default; `overlap`: "
             "exact, reductions beside the backward, default buckets; `best bucket`: the cap "
             f"(MiB, every gradient bucketed, one allreduce per bucket) of {BUCKET_SWEEP_MIB} "
             "that gives the fastest overlapped step, and its efficiency; bf16 and PowerSGD "
             "rank 4 overlapped.", "",
             "| model | Gbit/s | nodes | inline | overlap | best bucket | bf16 | psgd4 |",
             "|---|---|---|---|---|---|---|---|"]
    curves = {}
    for model in MODELS:
        p = prof["models"][model]
        known = model if any(r["model"] == model for r in prof["hook_runs"]) else "mlp"
        runs = [r for r in prof["hook_runs"] if r["model"] == known]
        work = hook_work(runs, sum(g["bytes"] for g in prof["models"][known]["grads"]))
        # the hooks ran in another launch: their work in proportion to that launch's compute
        ratio = sum(prof["models"][known][f"{k}_s"] for k in ("forward", "backward", "optimizer")) \
            / next(r["median_ms"] / 1e3 for r in runs if r["mode"] == "local")
        work = {key: value * ratio for key, value in work.items()}
        local = p["forward_s"] + p["backward_s"] + p["optimizer_s"]
        for rate in PROJECT_RATES:
            link = nominal(rate, measured, gamma)
            for nodes in PROJECT_NODES:
                eff = {}
                eff["inline"] = local / step_s(p, nodes, link, work=work)
                eff["overlap"] = local / step_s(p, nodes, link, work=work, overlap=True)
                sweep = {cap: step_s(p, nodes, link, work=work, overlap=True, cap=cap * MiB,
                                     solo=None, chunk=cap * MiB) for cap in BUCKET_SWEEP_MIB}
                best = min(sweep, key=sweep.get)
                eff["bf16"] = local / step_s(p, nodes, link, work=work, mode="bf16", overlap=True)
                eff["psgd4"] = local / step_s(p, nodes, link, work=work, mode="psgd4", overlap=True)
                for key, value in eff.items():
                    curves.setdefault((model, rate, key), []).append(value)
                if nodes in (8, 64, 256):
                    lines.append(f"| {model} | {rate} | {nodes} | {eff['inline']:.2f} | "
                                 f"{eff['overlap']:.2f} | {best} ({local / sweep[best]:.2f}) | "
                                 f"{eff['bf16']:.2f} | {eff['psgd4']:.2f} |")
    lines += ["", "## Several ranks per node: one allreduce of the model's gradients", "",
              "8 ranks per node; milliseconds for `flat` Rabenseifner over all ranks (each "
              "node's link carries 8 ranks' inter-node halvings), a `ring` ordered by node, and "
              "`hierarchical` (shared memory within the node at "
              f"{NODE_MEMORY_BYTES_S / 1e9:.1f} GB/s, then 1/8 of the buffer per local rank "
              "across nodes).", "",
              "| model | Gbit/s | nodes | flat | ring | hierarchical |",
              "|---|---|---|---|---|---|"]
    for model in ("mlp", "wide"):
        size = sum(g["bytes"] for g in prof["models"][model]["grads"])
        for rate in PROJECT_RATES:
            link = nominal(rate, measured, gamma)
            for nodes in (8, 64, 256):
                t = hierarchy_s(size, nodes, 8, link)
                lines.append(f"| {model} | {rate} | {nodes} | {t['flat'] * 1e3:.0f} | "
                             f"{t['ring'] * 1e3:.0f} | {t['hierarchical'] * 1e3:.0f} |")
    plot(curves, out / "projection.png")
    lines += ["", "![projection](projection.png)"]
    return lines


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PROJECT_RATES), figsize=(14, 4.2), sharey=True)
    styles = {"overlap": "-", "inline": ":", "bf16": "--", "psgd4": "-."}
    colors = dict(zip(MODELS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for ax, rate in zip(axes, PROJECT_RATES):
        for model in MODELS:
            for key, style in styles.items():
                ax.plot(PROJECT_NODES, curves[(model, rate, key)], style, color=colors[model],
                        label=f"{model} {key}" if rate == PROJECT_RATES[0] else None)
        ax.set_xscale("log", base=2)
        ax.set_xticks(PROJECT_NODES, [str(n) for n in PROJECT_NODES])
        ax.set_title(f"{rate} Gbit/s links")
        ax.set_xlabel("nodes (1 rank each)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (local step / step)")
    fig.legend(loc="center right", fontsize=7)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="all",
                        choices=["all", "profile", "check", "report"])
    parser.add_argument("--models", nargs="+", default=["mlp", "wide"],
                        help="models of the check runs and the hooks' local work")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prefix", default="mpidpz")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.command in ("all", "profile"):
        profile(args)
    if args.command in ("all", "check"):
        check(args)
    if args.command in ("all", "report"):
        print(report(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
