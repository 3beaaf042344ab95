"""One training step as a timeline: the backward's operators and each bucket's reduction, per rank.

    mpiexec -n 2 python bench/timeline_bench.py --out bench/reports/hooks/timeline.png

For the mlp and wide models of bench/models.py, exact and with
``mpidp.hooks.bf16_compress_hook``: three warm-up steps, then one step under
``torch.profiler``. Each rank's autograd operators ("... Backward ...") and
mpidp's bucket ranges ("mpidp.DDP bucket ...", recorded by the reducer) are
gathered on rank 0 and drawn on one time axis, which starts at the forward of
the step. Like the DDP paper's overlap figures, it shows when communication
runs beside the backward computation.
"""

import argparse
import json

import torch
from mpi4py import MPI
from torch.profiler import ProfilerActivity, profile

import mpidp
from models import build

COMM = MPI.COMM_WORLD


def one_step(model_name: str, hook) -> list[tuple[str, str, float, float]]:
    model, batches, loss_fn = build(model_name, COMM.rank)
    ddp = mpidp.DistributedDataParallel(model)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = batches[0]
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()
        optimizer.step()
    optimizer.zero_grad()
    COMM.Barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("step"):
            loss_fn(ddp(x), y).backward()
    events = []
    for event in prof.events():
        name = event.name
        if name == "step":
            kind = "step"
        elif name.startswith("mpidp.DDP bucket"):
            kind = "comm"
        elif "Backward" in name and name.startswith("autograd::engine::evaluate_function"):
            kind = "compute"
        else:
            continue
        events.append((kind, name, event.time_range.start / 1e3, event.time_range.end / 1e3))
    start = min(begin for kind, _, begin, _ in events if kind == "step")
    ddp.close()
    return [(kind, name, begin - start, end - start) for kind, name, begin, end in events]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="the PNG to write (and a .json beside it)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    panels = []
    for model_name in ("mlp", "wide"):
        for label, hook in (("exact", None), ("bf16", mpidp.hooks.bf16_compress_hook)):
            gathered = COMM.gather(one_step(model_name, hook))
            panels.append((f"{model_name}, {label}", gathered))
    if COMM.rank:
        return
    with open(args.out.rsplit(".", 1)[0] + ".json", "w") as out:
        json.dump(panels, out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 2.2 * len(panels)))
    for ax, (title, ranks) in zip(axes, panels):
        rows = []
        for rank, events in enumerate(ranks):
            for row, kind, color in ((2 * rank, "compute", "C0"), (2 * rank + 1, "comm", "C3")):
                spans = [(begin, end - begin) for k, _, begin, end in events if k == kind]
                ax.broken_barh(spans, (row - 0.4, 0.8), color=color)
                rows.append(f"rank {rank} {'backward' if kind == 'compute' else 'reduction'}")
        step_end = max(end for events in ranks for k, _, _, end in events if k == "step")
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_xlim(0, step_end)
        ax.set_title(f"{title}: forward + backward {step_end:.0f} ms", fontsize=9)
    axes[-1].set_xlabel("ms from the start of the forward")
    figure.tight_layout()
    figure.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
