"""One synced step of the reducer: its state, and the searches that arm it.

``Reducer.prepare`` opens a ``Step`` after each synced forward; the step holds
everything of that one reduction, from the forward to the end of its backward
pass, so nothing of one step can leak into the next (``mpidp.ddp.reducer`` tells
its life). The two searches are torch DDP's: the tensors of a model output
(whose hooks find the end of the backward), and the parameters that the
output's autograd graph reaches (``find_unused_parameters``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from .buckets import LaunchOrder

__all__ = ["ARMED", "RUNNING", "DONE", "Step", "find_tensors", "reachable_parameters"]

# armed: forward done, no parameter gradient yet; running: the backward has
# reached a parameter; done: every bucket reduced and the outcome agreed on.
ARMED, RUNNING, DONE = "armed", "running", "done"


class Step:
    """The reduction of one synced forward, from ``prepare`` to the end of its backward."""

    __slots__ = ("state", "ready", "order", "task", "unused", "fired", "counted", "copies")

    def __init__(self, count: int, layout: list[list[int]], unused: list[int]):
        self.state = ARMED
        self.ready = bytearray(count)
        self.order = LaunchOrder(layout)  # which buckets are full, and the next to hand over
        # The graph task whose end-of-backward callback is queued and has not run
        # yet (-1: none). If it never runs, that backward raised.
        self.task = -1
        self.unused = unused  # marked ready as soon as the step starts
        self.fired = [0] * count  # post-accumulate-grad hook calls (static_graph)
        self.counted = False  # whether this step has its number (see Reducer._count)
        # per bucket, (position, gradient) of the gradients its one batched copy takes
        # (mpidp.ddp.packing), held until the bucket's last one arrives
        self.copies: list[list] = [[] for _ in layout]


def find_tensors(obj) -> list[torch.Tensor]:
    """Return the tensors in a model output, searched as torch's DDP does.

    Tensors, and lists, tuples (named or not), dicts and dataclasses of them,
    nested to any depth.
    """
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return list(itertools.chain.from_iterable(map(find_tensors, obj)))
    if isinstance(obj, dict):
        return list(itertools.chain.from_iterable(map(find_tensors, obj.values())))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return list(itertools.chain.from_iterable(
            find_tensors(getattr(obj, field.name)) for field in dataclasses.fields(obj)))
    return []


def reachable_parameters(outputs: Sequence[torch.Tensor]) -> set[int]:
    """Return the ids of the leaf tensors that the autograd graph of ``outputs`` reaches."""
    found, seen = set(), set()
    stack = []
    for tensor in outputs:
        if tensor.grad_fn is None:
            found.add(id(tensor))
        else:
            stack.append(tensor.grad_fn)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return found
