"""What the stall watchdog costs on the hot path: run under mpiexec.

    mpiexec -n 2 python bench/watchdog_bench.py [--out r.jsonl] [--models small mlp]

"on" is mpidp as shipped: every blocking MPI call stores its label and a
``time.monotonic()`` in the thread's slot, DDP opens a ``Scope`` per bucket,
every ``Handle`` notes its scope, the watchdog thread wakes every second and
rank 0 keeps its receive posted. "off" replaces ``watchdog.begin``,
``watchdog.context`` and ``watchdog.Scope`` with no-ops, stops the thread and
cancels the receive. Within one run, rounds alternate on and off, so machine
noise hits both alike; a time is the slowest rank's, the figure the median.

1. ``record``: one ``begin()`` plus the store that clears it, against an empty
   function call (one process; the stub "off" still pays such a call, so
   this is the part of the cost that rows 2 and 3 cannot see);
2. ``allreduce``: ``mpidp.comm.allreduce`` of 8 bytes (2 float32), per call;
3. ``ddp-step``: a DDP training step (forward, backward, SGD) of each model:
   ``small`` (132k parameters in 0.05 MB buckets: a collective per layer, the
   watchdog's worst case) and the bench's models (``mlp``, ``cnn``, ...).

Each row is the median of per-round on/off ratios (rounds alternate on-off
and off-on) and the median times. Rank 0 prints them and appends one JSON
object per row to ``--out``.
"""

import argparse
import contextlib
import json
import statistics
import time
import timeit

import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp import watchdog
from models import build

COMM = MPI.COMM_WORLD
_REAL = dict(begin=watchdog.begin, context=watchdog.context, Scope=watchdog.Scope)


class _NullSlot:
    __slots__ = ("current",)


_NULL_SLOT = _NullSlot()


def _null_begin(label, context=None, waiting=False):
    return _NULL_SLOT


def _null_context():
    return None


def _null_scope(*args, **kwargs):
    return contextlib.nullcontext()


_on = {"record": True, "thread": True}


def switch(on: bool, parts=("record", "thread")) -> None:
    """Turn parts of the watchdog on or off on this rank (between collectives, on every rank).

    "record": the hot path (begin, context, Scope); "thread": the watchdog
    thread and rank 0's posted receive.
    """
    if "record" in parts and on != _on["record"]:
        _on["record"] = on
        fakes = (_null_begin, _null_context, _null_scope)
        watchdog.begin, watchdog.context, watchdog.Scope = _REAL.values() if on else fakes
    if "thread" not in parts or on == _on["thread"]:
        return
    _on["thread"] = on
    channel = watchdog._channel
    if on:
        if channel is not None:
            channel.request = channel._post()
        watchdog._stopping.clear()
        watchdog._thread = None
        watchdog._ensure_thread()
        return
    watchdog._stopping.set()
    watchdog._wake.set()
    if watchdog._thread is not None:
        watchdog._thread.join()
    if channel is not None:
        channel.request.Cancel()
        channel.request.Wait()


def record_cost() -> dict:
    """ns per begin() + clear, and per empty call, in this process (no MPI)."""
    label = ("allreduce", None, "op", "sum")

    def recorded():
        slot = watchdog.begin(label)
        slot.current = None

    def stub():
        slot = _null_begin(label)
        slot.current = None

    best = {name: min(timeit.repeat(fn, number=100_000, repeat=7)) / 100_000 * 1e9
            for name, fn in (("recorded", recorded), ("stub", stub))}
    return dict(kind="record", ns_recorded=best["recorded"], ns_stub=best["stub"],
                ns_extra=best["recorded"] - best["stub"])


def timed(call, repeats: int) -> float:
    COMM.Barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return COMM.allreduce(time.perf_counter() - start, op=MPI.MAX) / repeats


def compare(name: str, call, repeats: int, rounds: int, parts=("record", "thread"),
            toggle=None, **fields) -> dict:
    """Rounds of ``call`` with ``toggle(on, parts)`` (default: ``switch``) on and off."""
    toggle = toggle or switch
    samples = {True: [], False: []}
    ratios = []
    for index in range(rounds):
        # on-off, then off-on: a drift of the machine's speed cancels within two rounds
        for on in (True, False) if index % 2 == 0 else (False, True):
            toggle(on, parts)
            samples[on].append(timed(call, repeats))
        ratios.append(samples[True][-1] / samples[False][-1])
    toggle(True, parts)
    on, off = statistics.median(samples[True]), statistics.median(samples[False])
    ratio = statistics.median(ratios)
    return dict(kind=name, switched="+".join(parts), ranks=COMM.size, us_on=on * 1e6,
                us_off=off * 1e6, ratio=ratio, us_extra=(ratio - 1) * off * 1e6, **fields)


def small_model():
    """8 x Linear(128, 128), 132k parameters: with 0.05 MB buckets, a collective per layer."""
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(128, 128), nn.ReLU())][:-1]
    gen = torch.Generator().manual_seed(100 + COMM.rank)
    batches = [(torch.randn(32, 128, generator=gen), torch.randn(32, 128, generator=gen))]
    return nn.Sequential(*layers), batches, nn.functional.mse_loss


def ddp_step_row(model_name: str, rounds: int, toggle=None, parts=("record", "thread"),
                 bind=None) -> dict:
    """One DDP step of ``model_name``, on and off (``bind(ddp)``, if given, returns the toggle)."""
    if model_name == "small":
        model, batches, loss_fn = small_model()
        ddp = mpidp.DistributedDataParallel(model, bucket_cap_mb=0.05, first_bucket_mb=0.05,
                                            inplace_threshold_mb=None)
    else:
        model, batches, loss_fn = build(model_name, COMM.rank)
        ddp = mpidp.DistributedDataParallel(model)
    if bind is not None:
        toggle = bind(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = batches[0]

    def step():
        optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()
        optimizer.step()

    for _ in range(3):
        step()
    start = time.perf_counter()
    step()
    once = COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)
    repeats = max(2, min(100, int(0.2 / once)))  # about 0.2 s per sample
    buckets = len(ddp.reducer.layout.buckets)
    row = compare("ddp-step", step, repeats, rounds, parts, toggle, model=model_name,
                  buckets=buckets)
    ddp.close()
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=["small", "mlp"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensor = torch.ones(2)  # 8 bytes
    mpidp.comm.allreduce(tensor)  # the default pool, and the watchdog, start here
    if watchdog._thread is None:
        raise SystemExit("the watchdog did not start: is MPIDP_TIMEOUT=0 or the world size 1?")
    allreduce = lambda: mpidp.comm.allreduce(tensor)  # noqa: E731
    rows = [record_cost()] + [compare("allreduce", allreduce, 1000, args.rounds, parts, bytes=8)
                              for parts in (("record", "thread"), ("record",), ("thread",))]
    rows += [ddp_step_row(name, args.rounds) for name in args.models]
    if COMM.rank == 0:
        print(f"watchdog cost, {COMM.size} ranks, timeout {watchdog.get_timeout()[0]:g} s")
        for row in rows:
            if row["kind"] == "record":
                print(f"  begin() + clear: {row['ns_recorded']:.0f} ns, an empty call "
                      f"{row['ns_stub']:.0f} ns: {row['ns_extra']:.0f} ns per call that an "
                      f"on/off comparison cannot see")
            else:
                what = (f"8-byte allreduce ({row['switched']} switched)"
                        if row["kind"] == "allreduce" else
                        f"DDP step, {row['model']} ({row['buckets']} buckets)")
                print(f"  {what}: on {row['us_on']:.2f} us, off {row['us_off']:.2f} us, "
                      f"ratio {row['ratio']:.4f} ({row['us_extra']:+.2f} us)")
        if args.out:
            with open(args.out, "a") as out:
                for row in rows:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
