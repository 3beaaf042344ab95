"""Horovod's matching by name: which named operations every rank of a set has submitted.

Horovod's controller starts an operation once every rank of its process set has
submitted one under its name, whatever else each rank submitted in between.
``mpidp.horovod`` starts each collective on the calling thread after a control
message that every rank of the set sends alike (``requests``); where the ranks'
calls differ there, a call that has a name is *deferred*: its rank keeps it in its
queue of the set and goes on, and the control messages that follow carry each
rank's queue, until every rank has one of that name. This module is the judge of
such an exchange: a pure function of what every rank sent, so every rank reaches
the same verdict and starts the same operations in the same order (rule 2 of
docs/concurrency.md: one order, decided from facts all ranks share).

A rank that waits for an operation no other rank submitted, while every other rank
waits too or is in a call that cannot go on, would wait forever (Horovod stalls
there); here no rank can make progress in such an exchange, and every waiting or
calling rank raises ``HorovodInternalError`` that names each rank's call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..comm.agreement import by_rank


@dataclass(frozen=True)
class Record:
    """What one rank sends in an exchange (picklable)."""

    call: str | None  # the call this rank makes now (None: joined, or waiting)
    name: str | None  # its name: a named call may be deferred
    waiting: str | None  # the deferred operation this rank waits for (synchronize)
    joined: bool
    pending: tuple  # (name, description) of this rank's deferred operations, in order


@dataclass
class Verdict:
    """What every rank does after an exchange: the same on every rank."""

    agreed: bool  # the ranks' calls agree: the call goes on after the matched ones
    deferred: set = field(default_factory=set)  # ranks whose call is queued instead
    matched: list = field(default_factory=list)  # ((name, occurrence), error or None), in order
    stuck: str | None = None  # no rank can go on: every rank with a call raises this


def keyed(pending) -> dict:
    """``{(name, occurrence): description}``: the k-th operation of a name matches the k-th."""
    seen: dict = {}
    keys = {}
    for name, description in pending:
        occurrence = seen.get(name, 0)
        seen[name] = occurrence + 1
        keys[(name, occurrence)] = description
    return keys


def judge(records: list[Record], agreed: bool, kind_name: str) -> Verdict:
    """The verdict of an exchange, from every rank's ``Record`` alone.

    Args:
        agreed: the control message found every calling rank's call alike and no rank waiting.
        kind_name: this rank's kind of call, for the message (the rest is the same everywhere).
    """
    verdict = Verdict(agreed)
    if not agreed:
        verdict.deferred = {r for r, rec in enumerate(records)
                            if rec.call is not None and rec.name is not None}
    queues = [keyed(list(rec.pending) + ([(rec.name, rec.call)] if r in verdict.deferred else []))
              for r, rec in enumerate(records)]
    for key in queues[0]:  # in the order of the set's first rank
        if all(key in queue for queue in queues[1:]):
            descriptions = [queue[key] for queue in queues]
            error = None
            if len(set(descriptions)) > 1:
                error = (f"hvd: the operations named {key[0]!r} differ between the ranks of the "
                         f"process set (every rank must submit an operation of a name with the "
                         f"same dtype, shape, op and root_rank), got {by_rank(descriptions)}")
            verdict.matched.append((key, error))
    if not (agreed or verdict.deferred or verdict.matched):
        states = [rec.call if rec.call is not None else
                  f"{rec.waiting} (synchronize; not submitted on every rank)"
                  if rec.waiting is not None else None for rec in records]
        verdict.stuck = differ_message(kind_name, states)
        if any(rec.pending for rec in records):
            names = [", ".join(repr(n) for n, _ in rec.pending) or "none" for rec in records]
            verdict.stuck += f"; deferred by name: {by_rank(names)}"
    return verdict


def differ_message(kind_name: str, what: list) -> str:
    """The error of calls that differ between the ranks of a set, ``what`` each rank called."""
    return (f"hvd.{kind_name}: every rank of the process set must make the same call (dtype, "
            f"shape, op, root_rank, name) with valid arguments, in the same order (from one "
            f"thread, or threads taking turns in a fixed order), or submit each named operation "
            f"on every rank, got {by_rank(what)}")
