"""mpidp's DDP under compiled autograd: each gradient summed inside the compiled backward.

Compiled autograd (``torch._dynamo.compiled_autograd._enable``, or
``torch._dynamo.config.compiled_autograd`` under ``torch.compile``) traces the backward pass,
the parameters' post-accumulate-grad hooks with it, into one graph, and allows no
end-of-backward callback outside that graph: the reducer's buckets, overlap strategies and
end-of-step bookkeeping cannot run there. So ``grad_hook``, each parameter's hook, asks
whether dynamo is tracing it. If so it calls the custom op ``mpidp::ddp_allreduce_``, which
the compiler keeps as one opaque call; the compiled backward then runs these calls in the
graph's order. Every rank builds the same graph from the same model, so every rank runs
them in the same order. At run time the op divides the gradient by the world size and sums
it across the ranks on the reducer's control communicator (with ZeRO stage 2, this rank's
pieces of it then go to the optimizer's shards, and ``.grad`` is dropped, as a reduce-scatter
would leave it; the last parameter's call closes the step). The call blocks, on the thread
that runs the backward (the program's thread, which issues on that communicator in eager
steps too). Inside ``no_sync`` the op does nothing, as an eager step would. Otherwise the
hook is the reducer's eager one.

Limits, checked by the op before its first collective, alike on every rank, since they are
the DDP's own settings: every rank must give a gradient to the same parameters, so
``find_unused_parameters=True`` is refused, and a parameter without a gradient is the
user's to avoid (a rank that skips one leaves the others waiting; the stall watchdog names
it); no comm hook. There is no bucketing and no overlap with the
backward pass: one blocking allreduce per parameter. The cost is measured in
docs/performance-ddp.md. A step under compiled autograd does no bookkeeping sum, so a
Checkpointer agrees on a stop with an allreduce of its own (``mpidp.preemption.agreed_by``).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from .. import comm as _comm
from ..comm import chunking as _chunking

__all__ = ["grad_hook", "register"]

_reducers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> Reducer
_keys = itertools.count()


def register(reducer) -> int:
    """The key by which the compiled graph's calls find ``reducer``."""
    key = next(_keys)
    _reducers[key] = reducer
    return key


def grad_hook(on_grad, key: int, index: int, param: torch.Tensor) -> None:
    """A parameter's post-accumulate-grad hook: the reducer's ``on_grad(index, param)``, or,
    traced by compiled autograd, a call of ``mpidp::ddp_allreduce_`` on its gradient."""
    if torch.compiler.is_compiling():
        torch.ops.mpidp.ddp_allreduce_(param.grad, key, index)
        return
    on_grad(index, param)


@torch.library.custom_op("mpidp::ddp_allreduce_", mutates_args=("grad",))
def _allreduce_(grad: torch.Tensor, key: int, index: int) -> None:
    reducer = _reducers[key]
    if reducer._step is None:
        return  # inside no_sync: the gradient accumulates locally
    problem = _refusal(reducer, grad)
    if problem is not None:
        raise RuntimeError(f"mpidp.DistributedDataParallel under compiled autograd: {problem} "
                           f"(docs/ddp.md, \"Compiled autograd\")")
    _chunking.divide(grad, reducer._divisor)
    _comm.allreduce(grad, "sum", comm=reducer.control)
    sink = getattr(reducer, "sink", None)
    if sink is not None:  # ZeRO stage 2: this rank's pieces to its shards, no whole gradient
        sink.take_whole(index, grad)
        reducer.params[index].grad = None
        step = reducer._step
        step.fired[index] += 1
        if all(step.fired):  # every gradient is in: the step's shards are whole
            sink.reduced([True] * len(step.fired))
            step.fired = [0] * len(step.fired)


def _refusal(reducer, grad: torch.Tensor) -> str | None:
    """What this DDP does that a compiled backward cannot (the same on every rank), or None."""
    if reducer.find_unused:
        return ("find_unused_parameters=True needs the end-of-step bookkeeping, which a "
                "compiled backward cannot run; every rank must give a gradient to the same "
                "parameters")
    if reducer.launcher.comm_hook is not None:
        return "a comm hook needs the buckets, which a compiled backward does not fill"
    if grad.is_sparse:
        return "sparse gradients are gathered at the end of a step, which it has not"
    return None


@_allreduce_.register_fake
def _(grad: torch.Tensor, key: int, index: int) -> None:
    return None
