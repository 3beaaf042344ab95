"""Training-step benchmark worker: run under mpiexec; bench/run.py drives it.

    mpiexec -n 2 python bench/train_bench.py --model mlp --out r.jsonl --modes local naive mpidp:pool=1

Every mode trains its own copy of the same model on the same per-rank batches,
one thread per rank; rounds alternate the modes so machine noise hits all
alike. A step's time is the slowest rank's. Modes:

- ``local``: no communication, the compute floor;
- ``naive``: one blocking mpi4py allreduce per gradient after backward;
- ``flat``: flatten every gradient, one allreduce, unflatten;
- ``ddp-gloo``: torch's DistributedDataParallel over gloo (loopback TCP);
- ``ddp-mpidp``: torch's DistributedDataParallel over the "mpidp" torch.distributed
  backend (mpidp.process_group: MPI through mpidp.comm, a progress thread);
- ``mpidp``: mpidp.DistributedDataParallel at its defaults; ``mpidp:key=value,...``
  changes settings: ``bucket`` and ``chunk`` (MiB), ``pool``, ``view`` (0/1),
  ``predict`` (0/1), ``poll`` (0/1: the hooks' progress polling), ``overlap``
  (0 = "nonblocking", 1 = "thread", 2 = "inline"), ``inplace`` (MiB; 0 = off),
  ``buffers`` (0/1: broadcast_buffers), ``stats`` (0/1: ``record_stats``, the
  step statistics and profiler ranges), ``shm`` (0/1: ``shared_memory``; by
  default on for CPU models, every rank on one node), ``pack`` (how the buckets are
  filled, ``mpidp.ddp.packing``: 0 = each gradient copied and divided at its hook,
  1 = one ``_foreach_copy_`` per bucket, 2 = one CuPy kernel launch per bucket where
  it applies, ``_foreach_copy_`` elsewhere: on a GPU, 2 against 1 is with and without
  CuPy in the hot path; left out: the rule, which packs CPU buckets as 0, CUDA ones as 1).
- ``mpidp+HOOK``, ``ddp-gloo+HOOK``: with a comm hook, HOOK one of fp16, bf16,
  powersgd (rank 4, compressing from the third step): mpidp's own hooks on
  mpidp, torch's on torch's DDP.

With ``--memory`` a single mode runs and the peak resident memory is reported.
With ``--device cuda`` every rank trains on the GPU of its local rank (2 ranks
may share one GPU: mpidp then stages through host memory unless MPI is
CUDA-aware; torch DDP runs over gloo, as NCCL refuses two ranks on one GPU).
Rank 0 appends one JSON object per mode to ``--out``.
"""

import argparse
import json
import resource
import socket
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.ddp import packing
from models import build

COMM = MPI.COMM_WORLD
PACKINGS = (packing.EACH, packing.FOREACH, packing.KERNEL)  # the ``pack`` setting's values
GROUPS = {}  # "ddp-gloo"/"ddp-mpidp" -> the process group torch's DDP runs over


def init_gloo():
    port = None
    if COMM.rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{COMM.bcast(port)}",
                            rank=COMM.rank, world_size=COMM.size)


# "+hook" after a DDP mode registers that comm hook: mpidp's (mpidp.hooks) on
# "mpidp", torch's (torch.distributed.algorithms.ddp_comm_hooks) on "ddp-gloo".
HOOKS = ("fp16", "bf16", "powersgd")
POWERSGD = dict(matrix_approximation_rank=4, start_powerSGD_iter=2)  # compressing after warm-up


def comm_hook(name: str, hook: str, group):
    """(state, hook) of ``hook`` for DDP mode ``name`` (torch's hooks get the gloo group)."""
    if name == "mpidp":
        from mpidp import hooks

        if hook == "powersgd":
            return hooks.PowerSGDState(None, **POWERSGD), hooks.powerSGD_hook
        return None, getattr(hooks, f"{hook}_compress_hook")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "powersgd":
        return powerSGD_hook.PowerSGDState(group, **POWERSGD), powerSGD_hook.powerSGD_hook
    if hook == "bf16":
        # torch's DDP refuses its bf16 hooks (by name) without NCCL; the same steps, renamed:
        wrapped = default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)

        def bf16_over_gloo(state, bucket):
            return wrapped(state, bucket)

        return group, bf16_over_gloo
    return group, getattr(default_hooks, f"{hook}_compress_hook")


def parse_mode(spec: str) -> tuple[str, dict]:
    name, _, options = spec.partition(":")
    name, _, hook = name.partition("+")
    if hook and hook not in HOOKS:
        raise ValueError(f"unknown hook {hook!r} in mode {spec!r}, expected one of {HOOKS}")
    settings = {"hook": hook} if hook else {}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        settings[key] = float(value)
    return name, settings


class Runner:
    """One mode: a model copy, its optimizer, and a step that reports its phases."""

    def __init__(self, spec, model_name, device):
        self.spec = spec
        self.name, self.settings = parse_mode(spec)
        self.device = device
        if device.type == "cuda" and self.name in ("naive", "flat"):
            raise ValueError(f"mode {self.name!r} reduces numpy views of CPU gradients; on CUDA "
                             f"compare local, ddp-gloo and mpidp")
        model, batches, self.loss = build(model_name, COMM.rank)
        model = model.to(device)
        self.batches = [(x.to(device), y.to(device)) for x, y in batches]
        self.wait = 0.0
        self.first_launch = None
        pack = self.settings.get("pack")
        self.packing = None if pack is None else PACKINGS[int(pack)]
        packing.FORCE = self.packing  # its layouts are chosen now and at the rebuild in step()
        self.model = self.wrap(model)
        self.module = getattr(self.model, "module", self.model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.step_index = 0

    def wrap(self, model):
        if self.name in ("local", "naive", "flat"):
            return model
        if self.name in ("ddp-gloo", "ddp-mpidp"):
            wrapped = nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device] if self.device.type == "cuda" else None,
                process_group=GROUPS[self.name])
            if "hook" in self.settings:
                wrapped.register_comm_hook(*comm_hook(self.name, self.settings["hook"],
                                                      GROUPS[self.name]))
            return wrapped
        if self.name != "mpidp":
            raise ValueError(f"unknown mode {self.spec!r}")
        options = dict(gradient_as_bucket_view=bool(self.settings.get("view", 0)),
                       broadcast_buffers=bool(self.settings.get("buffers", 1)),
                       predict_gradient_order=bool(self.settings.get("predict", 1)))
        if "bucket" in self.settings:
            options["bucket_cap_mb"] = self.settings["bucket"]
        if "pool" in self.settings:
            options["pool_size"] = int(self.settings["pool"])
        if "inplace" in self.settings:
            options["inplace_threshold_mb"] = self.settings["inplace"] or None
        if "chunk" in self.settings:
            options["chunk_mb"] = self.settings["chunk"]
        if "overlap" in self.settings:
            options["overlap"] = ("nonblocking", "thread", "inline")[int(self.settings["overlap"])]
        if "shm" in self.settings:
            options["shared_memory"] = bool(self.settings["shm"])
        wrapped = mpidp.DistributedDataParallel(model, **options)
        if "hook" in self.settings:
            wrapped.register_comm_hook(*comm_hook("mpidp", self.settings["hook"], None))
        wrapped.record_stats = bool(self.settings.get("stats", 1))
        if not self.settings.get("poll", 1):
            wrapped.reducer.strategy.poll = lambda: None
        finish = wrapped.reducer._finish

        def timed_finish(*args, **kwargs):
            start = time.perf_counter()
            finish(*args, **kwargs)
            self.wait = time.perf_counter() - start

        wrapped.reducer._finish = timed_finish
        start = wrapped.reducer.strategy.start

        def timed_start(*args):
            if self.first_launch is None:
                self.first_launch = time.perf_counter()
            start(*args)

        wrapped.reducer.strategy.start = timed_start
        return wrapped

    def allreduce_grads(self):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.name == "naive":
            for grad in grads:
                COMM.Allreduce(MPI.IN_PLACE, grad.numpy())
                grad.div_(COMM.size)
        elif self.name == "flat":
            flat = torch.cat([g.reshape(-1) for g in grads])
            COMM.Allreduce(MPI.IN_PLACE, flat.numpy())
            flat.div_(COMM.size)
            for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(part.view_as(grad))

    def step(self) -> dict:
        x, y = self.batches[self.step_index % len(self.batches)]
        self.step_index += 1
        packing.FORCE = self.packing
        marks = [time.perf_counter()]
        self.optimizer.zero_grad()
        output = self.model(x)
        marks.append(time.perf_counter())
        self.first_launch = None
        self.loss(output, y).backward()
        marks.append(time.perf_counter())
        # How far into the backward pass the first allreduce started (0 = at once).
        first = (float("nan") if self.first_launch is None else
                 (self.first_launch - marks[1]) / (marks[2] - marks[1]))
        self.allreduce_grads()
        marks.append(time.perf_counter())
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        marks.append(time.perf_counter())
        forward, backward, comm, optimizer = (b - a for a, b in zip(marks, marks[1:]))
        if self.name == "mpidp":  # the end-of-backward wait is inside backward()
            backward, comm = backward - self.wait, self.wait
        elif self.name.startswith("ddp-"):
            comm = float("nan")  # torch DDP's wait cannot be separated from its backward
        return dict(forward=forward, backward=backward, wait=comm, optimizer=optimizer,
                    total=marks[-1] - marks[0], first_launch=first)


def timed(runner, steps):
    records = []
    for _ in range(steps):
        COMM.Barrier()
        records.append(runner.step())
    return records


def summarize(spec, model_name, records, runner):
    totals = [max(ranks) for ranks in zip(*COMM.allgather([r["total"] for r in records]))]
    ms = sorted(t * 1e3 for t in totals)
    phases = {key: statistics.median(r[key] for r in records) * 1e3
              for key in ("forward", "backward", "wait", "optimizer")}
    phases = {k: statistics.fmean(v) for k, v in
              zip(phases, zip(*COMM.allgather(list(phases.values()))))}
    first = [r["first_launch"] for r in records if r["first_launch"] == r["first_launch"]]
    return dict(kind="train", model=model_name, mode=spec, ranks=COMM.size, steps=len(ms),
                median_ms=statistics.median(ms), p90_ms=ms[int(0.9 * (len(ms) - 1))],
                breakdown_ms=phases,
                first_allreduce_at=statistics.median(first) if first else None,
                params=sum(p.numel() for p in runner.module.parameters()))


def final_parameters(runner):
    return torch.cat([p.detach().reshape(-1) for p in runner.module.parameters()]).cpu()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", nargs="+", default=["local", "naive", "flat", "ddp-gloo", "mpidp"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = mpidp.cuda.local_device() if args.device == "cuda" else torch.device("cpu")
    specs = args.modes
    names = {parse_mode(s)[0] for s in specs}
    if names & {"ddp-gloo", "ddp-mpidp"}:
        init_gloo()
        GROUPS["ddp-gloo"] = dist.group.WORLD
    if "ddp-mpidp" in names:
        GROUPS["ddp-mpidp"] = dist.new_group(backend="mpidp")
    if args.memory:
        (spec,) = specs
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        runner = Runner(spec, args.model, device)
        timed(runner, args.warmup + args.steps)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peaks = COMM.gather((baseline / 1024, peak / 1024))
        if COMM.rank == 0:
            record = dict(kind="memory", model=args.model, mode=spec, ranks=COMM.size,
                          peak_mib=max(p for _, p in peaks),
                          peak_over_start_mib=max(p - b for b, p in peaks))
            with open(args.out, "a") as out:
                out.write(json.dumps(record) + "\n")
        return
    runners = [Runner(spec, args.model, device) for spec in specs]
    records = {spec: [] for spec in specs}
    for runner in runners:
        timed(runner, args.warmup)
    # Modes take turns step by step: slow drifts of the machine (frequency,
    # memory layout, neighbours) then hit every mode alike.
    for _ in range(args.steps):
        for runner in runners:
            records[runner.spec] += timed(runner, 1)
    results = [summarize(r.spec, args.model, records[r.spec], r) for r in runners]
    # At 2 ranks every correct averaging scheme gives bit-identical parameters.
    reference = next((r for r in runners if r.name == "mpidp"), None)
    for result, runner in zip(results, runners):
        if runner.name != "local" and reference is not None:
            same = torch.equal(final_parameters(runner), final_parameters(reference))
            diff = (final_parameters(runner) - final_parameters(reference)).abs().max().item()
            result.update(identical_to_mpidp=same, max_abs_diff_to_mpidp=diff)
    if COMM.rank == 0:
        with open(args.out, "a") as out:
            for result in results:
                out.write(json.dumps(result) + "\n")
        for result in results:
            print(f"{args.model:12s} {result['mode']:28s} median {result['median_ms']:8.1f} ms "
                  f"p90 {result['p90_ms']:8.1f} ms  identical={result.get('identical_to_mpidp', '-')}",
                  flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
