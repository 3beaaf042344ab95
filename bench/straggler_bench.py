"""What naming stragglers (mpidp.ddp.stragglers) costs a DDP step: run under mpiexec.

    mpiexec -n 2 python bench/straggler_bench.py [--out r.jsonl] [--models mlp wide]

"on" is mpidp as shipped (``MPIDP_STRAGGLER_MS`` > 0): each rank carries its last
wait in one int64 slot per rank of the step's bookkeeping allreduce, and every
rank reads the sums and judges the ranks. "off" is what ``MPIDP_STRAGGLER_MS=0``
builds: no slots, no record. The toggle swaps the reducer's record and its
bookkeeping tensor between rounds, on every rank alike. Rounds alternate on and
off within one run (``watchdog_bench.compare``), so machine noise hits both
alike; a time is the slowest rank's, the figure the median of per-round ratios.
A first row times the record's own work per step in one process (``fill``,
``read`` of the sums, the statistics' list, ``waited``) for a world of 2 and
of 1024 ranks, no rank late.
"""

import argparse
import json
import timeit

import torch
from mpi4py import MPI

import mpidp
from mpidp.ddp.stragglers import Stragglers
from watchdog_bench import COMM, ddp_step_row


def record_cost(world: int) -> dict:
    """ns per step of the record's own work (one process), for a world of ``world`` ranks."""
    record = Stragglers(0, world, 100.0, 5, 0.1)
    extra = Stragglers.SLOTS_BEYOND_RANKS
    slots = torch.zeros(world + extra, dtype=torch.int64).numpy()
    summed = torch.arange(1000, 1000 + world + extra, dtype=torch.int64)  # no rank late
    record.waited(1, 0.001)

    def step():
        record.fill(slots)
        _, lateness = record.read(summed.numpy().copy())  # as the reducer reads the sum
        lateness.tolist()  # its statistics entry
        record.waited(2, 0.001)

    best = min(timeit.repeat(step, number=2000, repeat=5)) / 2000
    return dict(kind="record", world=world, ns=best * 1e9)


def bind(ddp):
    """The toggle of ``ddp``'s straggler record: on as built, off as ``MPIDP_STRAGGLER_MS=0``."""
    reducer = ddp.reducer
    record = reducer.stragglers
    if record is None:
        raise SystemExit("the straggler record is off: unset MPIDP_STRAGGLER_MS")
    n = len(reducer.params)

    def toggle(on: bool, _parts=()) -> None:
        reducer.stragglers = record if on else None
        extra = reducer.world + Stragglers.SLOTS_BEYOND_RANKS if on else 0
        reducer._used = torch.zeros(n + 5 + extra, dtype=torch.int64)
        reducer._used_flags = reducer._used.numpy()

    return toggle


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=["mlp", "wide"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    mpidp.comm.allreduce(torch.ones(2))
    costs = [record_cost(world) for world in (2, 1024)]
    rows = [ddp_step_row(name, args.rounds, parts=("stragglers",), bind=bind)
            for name in args.models]
    if COMM.rank == 0:
        for cost in costs:
            print(f"  the record's work, {cost['world']} ranks: {cost['ns'] / 1e3:.1f} us per step")
        print(f"straggler record cost, {COMM.size} ranks, {MPI.Get_library_version().splitlines()[0]}")
        for row in rows:
            print(f"  DDP step, {row['model']} ({row['buckets']} buckets): on {row['us_on']:.1f} us, "
                  f"off {row['us_off']:.1f} us, ratio {row['ratio']:.4f} ({row['us_extra']:+.1f} us)")
        if args.out:
            with open(args.out, "a") as out:
                for row in costs + rows:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
