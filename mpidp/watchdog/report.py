"""Stall reports: what a rank says when an mpidp call waits too long, and rank 0's summary.

``mpidp.watchdog`` records the calls and decides when one has waited too
long; this module turns a recorded call into words, carries the words
between ranks and ends the job. A rank's line names what it waits in and the
call site, the first frame of the waiting thread outside mpidp, torch and
the standard library, read with ``sys._current_frames()`` while that thread
sits in C (the thread strategy's communication thread reports the call site
of the thread that handed it the bucket)::

    [mpidp rank 1/3] stall: waiting 5.4 s (timeout 5 s from MPIDP_TIMEOUT) in DDP step 3 bucket 2/2 (0.1 MB): allreduce op=sum dtype=float32 count=25605 at train.py:42

**Rank 0's summary.** Over the watchdogs' own communicator (a duplicate of
``MPI.COMM_WORLD`` made by ``watchdog.start()``, so their messages can never
match the program's) go point-to-point messages only (``Channel``), so
nothing the watchdog does can hang on a missing rank: rank 0's watchdog keeps a
receive posted for each other rank (not ``ANY_SOURCE``, which missed messages
from another node with MPICH over UCX: remote ranks read "no report"), and
every other rank's keeps one posted for rank 0's questions. A stalled rank sends its line to rank 0. At the first
such line, or its own stall, rank 0 asks every other rank for its state,
collects answers for up to ``_COLLECT_SECONDS`` (less once all have
answered), prints one summary line, and aborts the job::

    [mpidp rank 0/3] stall summary: ranks 0, 2: waiting in DDP step 3 bucket 2/2 (0.1 MB): allreduce op=sum dtype=float32 count=25605 at train.py:42 (5.4 s); rank 1: not in an mpidp collective, main thread at train.py:40; aborting the job (MPIDP_TIMEOUT_ACTION=abort)

A rank answers from its watchdog thread, so rank 0 hears even from a rank
whose main thread is busy in user code, and rank 0 summarises while its own
main thread is. A rank that does not answer is dead or cannot run Python
(a call that holds the GIL): "no report". The abort status is
``ABORT_STATUS`` (124, as GNU ``timeout``).

Each state carries the stack of the thread it names; rank 0 prints them after the
summary, ranks with the same stack folded, and names the directory of the
ranks' flight records (``mpidp.recorder``).

Imports nothing from mpidp but ``exits``, ``communicators`` and ``stacks.site``: the
watchdog hands in what it knows.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

from mpi4py import MPI

from .. import communicators, exits
from ..stacks import site

__all__ = ["ABORT_STATUS", "Channel", "abort", "describe", "label_text", "ranks_text", "say",
           "set_rank", "site", "summary"]

ABORT_STATUS = 124
_TAG_LINE = 1  # a rank's state, to rank 0
_TAG_QUERY = 2  # rank 0 asks for it
_MESSAGE_BYTES = 8192  # a longer state is cut to fit
_COLLECT_SECONDS = 3.0  # a few wake-ups of every rank's watchdog
_clock = time.monotonic


# -- describing what a rank does ------------------------------------------------------------

def label_text(label) -> str:
    """The words for a recorded label: a string, a callable, or ``(name, tensor, key, value, ...)``."""
    if label is None:
        return "an MPI call"
    if isinstance(label, str):
        return label
    if callable(label):
        return label()
    name, tensor, *pairs = label
    words = [name] + [f"{key}={value}" for key, value in zip(pairs[::2], pairs[1::2])]
    if tensor is not None:
        words.append(f"dtype={str(tensor.dtype).removeprefix('torch.')} count={tensor.numel()}")
    return " ".join(words)


def describe(slot, record, frames: dict) -> str:
    """What the call ``record`` of a watchdog slot waits in, and its call site.

    Args:
        slot: the slot of the thread in the call (its ``thread`` and ``site``).
        record: ``(label, since, scope, waiting)``, as ``watchdog.begin`` stores it.
        frames: ``sys._current_frames()``.
    """
    label, _, scope, waiting = record
    text = label_text(label)
    if waiting:  # a tensor collective's name in its nonblocking form; a text as it is
        text = f"{'i' if isinstance(label, tuple) else ''}{text} (Handle.wait)"
    if scope is not None:
        text = f"{scope}: {text}"
    # A helper thread (the thread strategy's, autograd's device threads) has no user
    # frame; the thread that handed it the work, or the main thread, has.
    threads = (slot.site or slot.thread, slot.thread, threading.main_thread().ident)
    return f"{text} at {site(*(frames.get(t) for t in threads))}"


def ranks_text(ranks) -> str:
    """Name ranks as mpidp.comm's messages do, folding runs: 'rank 3', 'ranks 0-2, 5'."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {communicators.fold(ranks)}"


_NO_REPORT = ("not reachable: dead, or no Python thread can run there, as in a call that "
              "holds the GIL")


def summary(states: dict[int, dict], size: int,
            absent: Callable[[int], str | None] | None = None) -> str:
    """One line: the ranks grouped by what they do, the longest waits first, then those that
    finished, then those that sent nothing (``absent(rank)``: what their files say, if anything)."""
    groups: dict[tuple, list[int]] = {}
    for rank, state in states.items():
        groups.setdefault((state["kind"], state["text"]), []).append(rank)
    for rank in sorted(set(range(size)) - set(states)):
        text = absent(rank) if absent is not None else None
        groups.setdefault(("missing", f"no report ({text or _NO_REPORT})"), []).append(rank)
    order = {"stalled": 0, "waiting": 1, "idle": 2, "finished": 3, "missing": 4}
    parts = []
    for (kind, text), ranks in sorted(groups.items(), key=lambda g: (order[g[0][0]], min(g[1]))):
        if kind in ("stalled", "waiting"):
            seconds = max(states[r]["seconds"] for r in ranks)
            under = ", under the timeout" if kind == "waiting" else ""
            text = f"waiting in {text} ({seconds:.1f} s{under})"
        parts.append(f"{ranks_text(ranks)}: {text}")
    return "; ".join(parts)


def stack_report(states: dict[int, dict], size: int, folder: str) -> list[str]:
    """The stacks the ranks sent with their states, ranks with the same stack folded,
    and where each rank's files are (``mpidp.recorder``, ``mpidp.stacks``)."""
    groups: dict[tuple, list[int]] = {}
    for rank, state in states.items():
        if state["kind"] != "finished":
            groups.setdefault((state.get("thread", "?"), tuple(state.get("stack", ()))),
                              []).append(rank)
    lines = []
    for (thread, stack), ranks in sorted(groups.items(), key=lambda g: min(g[1])):
        lines.append(f"stack of {ranks_text(ranks)}, thread {thread} (innermost first):")
        lines += [f"    {frame}" for frame in stack] or ["    (none)"]
    missing = sorted(set(range(size)) - set(states))
    if missing:
        lines.append(f"{ranks_text(missing)} sent nothing: faulthandler writes the stacks of a "
                     f"rank whose GIL stays held to its rank-NNNNN.stacks.txt")
    lines.append(f"every rank's flight record and stacks: {folder} (python -m mpidp trace "
                 f"{folder})")
    return lines


# -- printing and ending the job ----------------------------------------------------------

_rank = _size = None  # read on a thread that may call MPI, before the watchdog starts


def set_rank(rank: int, size: int) -> None:
    """Name this rank in the lines ``say`` prints."""
    global _rank, _size
    _rank, _size = rank, size


def say(line: str) -> None:
    """Print ``line`` on stderr with this rank's prefix, in one write that nothing buffers."""
    data = f"[mpidp rank {_rank}/{_size}] {line}\n".encode(errors="replace")
    while data:
        try:
            data = data[os.write(2, data):]
        except InterruptedError:
            continue
        except OSError:
            return


def abort(line: str, multiple: bool) -> None:
    """End the job from the watchdog thread, the legal way for the thread level granted.

    Args:
        line: why, printed first.
        multiple: the thread level is ``MPI_THREAD_MULTIPLE`` (``MPI_Abort`` is allowed).
    """
    if multiple:
        exits._abort([line], ABORT_STATUS)  # prints, lets the launcher read it, MPI_Abort
        # MPICH 5.0's MPI_Abort, called from a thread other than the main one, was
        # seen to return (in 1 of 3 tries) once the launcher had the job in hand.
        os._exit(ABORT_STATUS)
    say(f"{line}, by os._exit({ABORT_STATUS}): MPI_Abort may not be called from this thread "
        f"below MPI_THREAD_MULTIPLE; the launcher ends the other ranks")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not stop the exit
            pass
    deadline = _clock() + 2.0
    while (exits._unread_bytes(1) or exits._unread_bytes(2)) and _clock() < deadline:
        time.sleep(0.01)
    os._exit(ABORT_STATUS)


# -- the channel to rank 0 --------------------------------------------------------------------

class Channel:
    """Point-to-point on the watchdog's communicator: lines to rank 0, its questions back.

    Built on a thread that may call MPI; used by the watchdog thread only.

    A rank that finishes tells its peers (``finish``) before it leaves MPI: rank 0
    then names it in the summary as finished, and never asks it again; the others,
    told that rank 0 finished, know that no summary will come.

    Args:
        comm: the watchdogs' own communicator.
        state: ``state(now)`` is this rank's state (a dict with ``kind``, ``text``
            and, unless idle, ``seconds``), sent when rank 0 asks.
        folder: where the ranks write their flight records.
        absent: ``absent(rank)``: what the files of a rank that sent nothing say of it
            (dead, holding the GIL), or None.
        heard: ``heard(rank, text)`` runs when a peer says it finished.
    """

    def __init__(self, comm: MPI.Intracomm, state: Callable[[float], dict], folder: str = "",
                 *, absent: Callable[[int], str | None] | None = None,
                 heard: Callable[[int, str], None] | None = None):
        self.comm = comm
        self.folder = folder
        self.state = state
        self.absent, self.heard = absent, heard
        self.ended: dict[int, dict] = {}  # peers that finished: their last word
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.peers = list(range(1, self.size)) if self.rank == 0 else [0]
        self.inboxes = [bytearray(_MESSAGE_BYTES) for _ in self.peers]
        self.status = MPI.Status()
        self.sends: list = []  # (request, buffer) until complete
        self.states: dict[int, dict] | None = None  # rank 0, while it collects
        self.closes_at = 0.0
        self.requests = [self._post(index) for index in range(len(self.peers))]

    def _post(self, index: int) -> MPI.Request:
        """The receive from ``self.peers[index]``: one per peer, never ``ANY_SOURCE``."""
        tag = _TAG_LINE if self.rank == 0 else _TAG_QUERY
        return self.comm.Irecv([self.inboxes[index], MPI.BYTE], self.peers[index], tag)

    def _send(self, data: bytes, dest: int, tag: int) -> None:
        self.sends.append((self.comm.Isend([data, MPI.BYTE], dest, tag), data))

    def tell(self, state: dict, unasked: bool) -> None:
        """Send this rank's state to rank 0 (``unasked``: a stall of its own)."""
        text, stack = state["text"], list(state.get("stack", ()))
        while True:
            data = json.dumps(dict(state, text=text, stack=stack, unasked=unasked),
                              ensure_ascii=False)
            if len(data.encode()) <= _MESSAGE_BYTES:
                break
            if stack:
                stack.pop()  # the outermost frames go first
            else:
                text = text[:len(text) // 2] + "..."
        self._send(data.encode(), 0, _TAG_LINE)

    def poll(self, now: float) -> list[str] | None:
        """Handle what arrived; on rank 0, return the summary line and the stacks once a
        collection closes."""
        self.sends = [(r, d) for r, d in self.sends if not r.Test()]
        for index, request in enumerate(self.requests):
            if request is None or not request.Test(self.status):
                continue
            source = self.peers[index]
            data = bytes(self.inboxes[index][:self.status.Get_count(MPI.BYTE)])
            if self.rank == 0:
                try:
                    state = json.loads(data)
                except ValueError:  # cannot happen between mpidp watchdogs of one version
                    state = dict(kind="idle", text=f"unreadable report {data[:80]!r}", unasked=True)
                if state["kind"] == "finished":
                    self._finished(index, state)
                    continue
                self.requests[index] = self._post(index)
                self._heard(source, state, now)
            elif data:  # rank 0's last word: it finished, and asks nothing more
                self._finished(index, json.loads(data))
            else:
                self.requests[index] = self._post(index)
                self.tell(self.state(now), unasked=False)
        if self.states is not None and (now >= self.closes_at or len(self.states) == self.size):
            states, self.states = self.states, None
            return ([summary(states, self.size, self.absent)]
                    + stack_report(states, self.size, self.folder))
        return None

    def _finished(self, index: int, state: dict) -> None:
        """A peer finished: keep its word, post no receive from it again."""
        rank = self.peers[index]
        self.requests[index] = None
        self.ended[rank] = state
        if self.states is not None:
            self.states[rank] = state
        if self.heard is not None:
            self.heard(rank, state["text"])

    def finish(self, state: dict) -> None:
        """Tell the peers still here that this rank finishes (``state``: kind "finished", and
        ``text``), before it leaves MPI; ``close`` completes the sends."""
        data = json.dumps(dict(state, unasked=True), ensure_ascii=False).encode()
        tag = _TAG_QUERY if self.rank == 0 else _TAG_LINE
        for peer in self.peers:
            if peer not in self.ended:
                self._send(data[:_MESSAGE_BYTES], peer, tag)

    def _heard(self, source: int, state: dict, now: float) -> None:
        if self.states is None:
            if not state["unasked"]:
                return  # a late answer to a summary already printed
            self.open(now)
        self.states[source] = state

    def open(self, now: float) -> None:
        """Rank 0: start collecting every rank's state (a stall was reported or is ours)."""
        if self.states is not None:
            self.states[0] = self.state(now)  # rank 0's own stall, while it collects
            return
        self.states = {0: self.state(now), **self.ended}
        self.closes_at = now + _COLLECT_SECONDS
        for rank in range(1, self.size):
            if rank not in self.ended:
                self._send(b"", rank, _TAG_QUERY)

    def close(self) -> None:
        """Cancel the posted receive and finish the sends, before MPI_Finalize."""
        for request in self.requests:
            if request:  # not MPI.REQUEST_NULL: still posted
                request.Cancel()
                request.Wait()
        deadline = _clock() + 1.0
        while self.sends and _clock() < deadline:
            self.sends = [(r, d) for r, d in self.sends if not r.Test()]
