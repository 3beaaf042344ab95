"""The end of a synced step: averaged gradients back in ``.grad``, or the same error everywhere.

Once the bookkeeping allreduce of a step has told every rank the same sums
(``mpidp.ddp.reducer``), each rank turns them into the step's outcome here: the
reduced buckets are copied back into ``param.grad`` (or ``.grad`` is left a
view of its bucket), and a step that failed somewhere, that the ranks reached
at different step numbers, or that missed a gradient on some rank, becomes
the same error on every rank. Apart from ``disagreement`` (one allgather on
the reducer's control communicator) nothing here communicates.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from ..comm.agreement import judged
from .buckets import Bucket
from ..kernels import unpack

__all__ = ["copy_back", "disagreement", "missing_error"]


def copy_back(params: list[torch.Tensor], buckets: list[Bucket], layout: list[list[int]],
              counts: list[int], *, known_unused: bool, as_view: bool) -> None:
    """Leave each bucketed parameter's averaged gradient in ``.grad``.

    Args:
        params: the reducer's parameters, indexed as ``layout`` and ``counts``.
        buckets: the reduced buckets, one per entry of ``layout``.
        layout: the parameter indices of each bucket.
        counts: per parameter, how many ranks produced its gradient.
        known_unused: a count of 0 means unused on every rank (find_unused_parameters
            or static_graph): such a ``.grad`` stays as the user left it.
        as_view: make ``.grad`` the bucket's view instead of copying into it.
    """
    for bucket, members in zip(buckets, layout):
        if bucket.solo:
            _copy_back_solo(bucket, params[members[0]], known_unused and counts[members[0]] == 0)
            continue
        targets = []
        for index, view in zip(members, bucket.views):
            param = params[index]
            if known_unused and counts[index] == 0:
                targets.append(None)  # unused on every rank: .grad stays as the user left it
            elif as_view:
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    param.grad = view
                targets.append(None)
            else:
                if param.grad is None:
                    param.grad = torch.empty_like(view)
                targets.append(param.grad)
        if all(t is not None for t in targets):
            unpack(bucket.buffer, targets)
        else:
            for target, view in zip(targets, bucket.views):
                if target is not None:
                    unpack(view.reshape(-1), [target])


def _copy_back_solo(bucket: Bucket, param: torch.Tensor, unused: bool) -> None:
    # Drop the reference to this step's spare use, so the next step starts clean.
    buffer, bucket.buffer = bucket.buffer, None
    if buffer is not bucket.spare or unused:
        return  # reduced in place, or unused everywhere
    if param.grad is None:
        param.grad = bucket.spare.view(param.shape).clone()
    else:
        unpack(bucket.spare, [param.grad])


def missing_error(names: list[str], counts: list[int], active: int) -> RuntimeError | None:
    """The error for parameters that fewer than ``active`` ranks produced a gradient for, or None."""
    missing = [f"{names[i]} (missing on {active - c} of {active} ranks)"
               for i, c in enumerate(counts[:len(names)]) if c < active]
    if not missing:
        return None
    return RuntimeError(
        f"DistributedDataParallel: {len(missing)} parameter(s) received no gradient in the "
        f"last backward pass: {', '.join(missing)}. Pass find_unused_parameters=True to "
        f"DistributedDataParallel if parts of the model may not take part in the loss, or "
        f"set requires_grad=False on parameters that never do. This step reduced them "
        f"as zeros (or their earlier .grad) so that no rank hangs.")


def disagreement(control: MPI.Intracomm, failed: bool,
                 steps: int) -> tuple[int, RuntimeError | None]:
    """A rank's backward failed, or the ranks are at different steps: agree on what to say.

    Every rank saw the same sums, so every rank takes part in this allgather.

    Args:
        control: the reducer's communicator for its small collectives.
        failed: whether this rank's own backward failed (it raised already).
        steps: this rank's step number.

    Returns:
        The highest step number (to line the ranks up for the next step), and
        the error this rank raises (None: its own backward's exception is raised).
    """
    reports, error = judged(control, (failed, steps), _step_verdict,
                            f"DDP step {steps}: the report of a failed or misaligned step")
    aligned = len({number for _, number in reports}) == 1
    # a rank whose own backward failed raised its own exception already
    return max(number for _, number in reports), None if failed and aligned else error


def _step_verdict(reports: list[tuple[bool, int]]) -> RuntimeError:
    """What every rank says of a step that some rank failed or reached at another number."""
    numbers = {rank: number for rank, (_, number) in enumerate(reports)}
    if len(set(numbers.values())) > 1:
        return RuntimeError(
            f"DistributedDataParallel: the ranks are not at the same synced backward pass "
            f"(steps by rank: {numbers}): a rank skipped a step (its forward, or its "
            f"backward before reaching this module, raised and the exception was caught), "
            f"or ran a grad-enabled forward in training mode alone (evaluate on one rank "
            f"under torch.no_grad() or in eval mode). The gradients of this step mix "
            f"different steps and must not be used. The step numbers are lined up again, "
            f"but the ranks' loops are not: end the epoch on every rank, or restart.")
    bad = [rank for rank, (did_fail, _) in enumerate(reports) if did_fail]
    return RuntimeError(
        f"DistributedDataParallel: the backward pass raised on rank(s) {bad} before their "
        f"gradients were reduced, so the gradients of this step are not averaged over "
        f"all ranks and must not be used: call optimizer.zero_grad() and go on with the "
        f"next step on every rank (catch this error where those ranks catch theirs).")
