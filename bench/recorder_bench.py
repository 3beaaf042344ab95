"""What the flight recorder (mpidp.recorder) costs: run under mpiexec.

    mpiexec -n 2 python bench/recorder_bench.py [--out r.jsonl] [--models mlp wide]

"on" is mpidp as shipped (``MPIDP_TRACE_ENTRIES`` entries); "off" sets the ring's
size to 0, so ``recorder.started`` returns at its first test, as with
``MPIDP_TRACE_ENTRIES=0``. Rounds alternate on and off within one run
(``watchdog_bench.compare``), so machine noise hits both alike.

1. ``record``: one ``started`` + ``ended`` pair with a torch tensor's count and dtype,
   as ``mpidp.comm`` makes it, against the same pair switched off (one process);
2. ``allreduce``: ``mpidp.comm.allreduce`` of 8 bytes, per call;
3. ``ddp-step``: a DDP training step of each model (``mlp``, ``wide``, ``small``...).
"""

import argparse
import json
import timeit

import torch
from mpi4py import MPI

import mpidp
from mpidp import recorder
from mpidp.comm import handle
from watchdog_bench import COMM, compare, ddp_step_row

_SIZE = recorder._size


def toggle(on: bool, _parts=()) -> None:
    """The recorder on or off on this rank (between collectives, on every rank)."""
    recorder._size = _SIZE if on else 0


def record_cost() -> dict:
    """ns per recorded collective (the ring's part of ``mpidp.comm``'s start), on and off."""
    tensor, comm = torch.ones(2), MPI.COMM_WORLD
    label = ("allreduce", tensor, "op", "sum")

    def recorded():
        recorder.ended(handle._record(comm, "Allreduce", label, None, False))

    best = {}
    for on in (True, False):
        toggle(on)
        best[on] = min(timeit.repeat(recorded, number=100_000, repeat=7)) / 100_000 * 1e9
    toggle(True)
    return dict(kind="record", ns_on=best[True], ns_off=best[False],
                ns_extra=best[True] - best[False])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=["mlp", "wide"])
    args = parser.parse_args()
    if not _SIZE:
        raise SystemExit("the recorder is off: unset MPIDP_TRACE_ENTRIES")
    torch.set_num_threads(1)
    tensor = torch.ones(2)
    mpidp.comm.allreduce(tensor)
    rows = [record_cost(),
            compare("allreduce", lambda: mpidp.comm.allreduce(tensor), 1000, args.rounds, (),
                    toggle, bytes=8)]
    rows += [ddp_step_row(name, args.rounds, toggle, ()) for name in args.models]
    if COMM.rank == 0:
        print(f"flight recorder cost, {COMM.size} ranks, {_SIZE} entries")
        for row in rows:
            if row["kind"] == "record":
                print(f"  started() + ended(): on {row['ns_on']:.0f} ns, off {row['ns_off']:.0f} ns: "
                      f"{row['ns_extra']:.0f} ns per collective")
            else:
                what = ("8-byte allreduce" if row["kind"] == "allreduce" else
                        f"DDP step, {row['model']} ({row['buckets']} buckets)")
                print(f"  {what}: on {row['us_on']:.2f} us, off {row['us_off']:.2f} us, "
                      f"ratio {row['ratio']:.4f} ({row['us_extra']:+.2f} us)")
        if args.out:
            with open(args.out, "a") as out:
                for row in rows:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
