"""The engine's own cost per operation, at one rank: what the completion claim (docs/concurrency.md,
rule 9) adds where MPI itself costs next to nothing.

    python bench/operation_cost.py [--calls 3000] [--repeats 5] [--tree PATH]

At one rank a nonblocking all_reduce of one float is complete when it starts, so the times are
mpidp's alone: ``start`` (``mpidp.comm.iallreduce``), ``wait`` (of an operation that is done),
``test_all`` (of two). Best of ``--repeats`` rounds of ``--calls`` each, in microseconds of
this thread's CPU time (``time.thread_time``), which a busy machine's preemptions leave out.
``--tree``: the checkout whose ``mpidp`` to time (another version: ``git worktree add``).
"""

import argparse
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--calls", type=int, default=3000)
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--tree", default=None)
args = parser.parse_args()
if args.tree is not None:
    sys.path.insert(0, args.tree)

import torch  # noqa: E402

import mpidp  # noqa: E402
from mpidp import comm  # noqa: E402

one = torch.ones(1)


def timed(body) -> float:
    start = time.thread_time()
    body()
    return (time.thread_time() - start) / args.calls * 1e6


def starts():
    for _ in range(args.calls):
        comm.iallreduce(one, "sum")


def waits(handles):
    for handle in handles:
        handle.wait()


def tests_of_pairs(pairs):
    for pair in pairs:
        while not comm.progress.test_all(pair):
            pass


best = {"start": float("inf"), "wait": float("inf"), "test_all": float("inf")}
for _ in range(args.repeats):
    best["start"] = min(best["start"], timed(starts))
    handles = [comm.iallreduce(one, "sum") for _ in range(args.calls)]
    best["wait"] = min(best["wait"], timed(lambda: waits(handles)))
    pairs = [[comm.iallreduce(one, "sum"), comm.iallreduce(one, "sum")] for _ in range(args.calls)]
    best["test_all"] = min(best["test_all"], timed(lambda: tests_of_pairs(pairs)))
print(f"{mpidp.__file__}: " + ", ".join(f"{name} {us:.2f} us" for name, us in best.items()))
