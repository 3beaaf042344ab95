"""mpidp's flight records in torch's flight-recorder format, for torch's own analyzer.

``python -m mpidp trace DIR --torch-fr OUT`` writes one file per rank into OUT,
laid out as torch's ProcessGroupNCCL dumps its flight recorder (a pickle with
``version``, ``pg_config``, ``pg_status`` and ``entries``; what
``TORCH_FR_DUMP_TEMP_FILE`` names), so that ``torchfrtrace OUT`` (torch's
``torch.distributed.flight_recorder``) reads the records of an mpidp job as it
reads an NCCL job's. It converts what ``mpidp.trace`` reads (the ranks'
``rank-NNNNN.json``, or a killed rank's black box) and takes nothing from
elsewhere:

- a communicator is a process group named by its key ("ranks 0-1 #1", alike on
  its ranks), described by its owner as the lowest rank that knows it names it
  (torch refuses descriptions that differ across ranks), its ``pg_id`` its place
  among the keys in sorted order; a collective's sequence number there is its
  ``collective_seq_id``;
- an operation is named ``gloo:<torch's name>`` ("all_reduce", "broadcast"...):
  torch's analyzer takes only its own backends' names, and Gloo is its CPU one.
  It compares the type, sizes, dtypes and state of a collective across ranks and
  nothing else, so each entry's dtypes also list what else ``mpidp.trace``
  compares: the reduction op or root (where every rank's are known: a black box
  keeps none) and the mpidp call itself ("call=iallreduce");
- only the sequence numbers that every rank of a communicator still holds are
  written (record ids from 0 on each rank), as ``mpidp.trace`` looks at no others:
  torch aligns the ranks by record id, which MPI ranks do not share;
- a collective that every rank of its communicator started and one completed is
  written as completed on each: MPI completes it on a rank once that rank waits
  for it, and a rank notes the end only when it does, so a rank that had not
  waited yet is no sign of a divergence (NCCL's states say the same of the GPU).

Torch's analyzer walks the ranks in the order it finds their files and takes the
first rank's calls as the expected ones ("Culprit rank" is a rank that differs
from it). So that it names what ``python -m mpidp trace`` names first, the file of
a rank that made that collective (of the largest group, if the ranks differ) is
OUT's only file, and the others' are in ``OUT/other-ranks``; torch's reader walks
into it.

Reads and writes files only: no MPI, no torch.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import NamedTuple

from . import trace

__all__ = ["export", "main", "PREFIX", "VERSION"]

VERSION = "2.10"  # the layout torch 2.13's ProcessGroupNCCL writes (FlightRecorder.hpp)
PREFIX = "fr_trace_rank_"  # then the rank: torch's reader takes it from the name's end
_OTHERS = "other-ranks"
_BACKEND = "gloo"

# mpidp's call (its first word that names an MPI collective) -> torch's operation
_KINDS = {"allreduce": "all_reduce", "bcast": "broadcast", "broadcast": "broadcast",
          "allgather": "all_gather", "allgatherv": "all_gather", "reduce": "reduce",
          "reduce_scatter": "reduce_scatter", "reduce_scatter_block": "reduce_scatter",
          "gather": "gather", "gatherv": "gather", "scatter": "scatter", "scatterv": "scatter",
          "alltoall": "all_to_all", "alltoallv": "all_to_all", "barrier": "barrier",
          # mpidp's own agreements, both an Allreduce of int64 words
          "call check": "all_reduce", "hvd control": "all_reduce"}
_FRAME = re.compile(r'File "(.*)", line (\d+), in (.*)')


def _kind(op: str) -> str:
    """Torch's name of mpidp's call ``op`` ("shared-memory allreduce", "iallreduce", "Bcast")."""
    name = op.lower()
    if name in _KINDS:
        return _KINDS[name]
    for word in name.split():
        for stem in (word, word[1:] if word.startswith("i") else None):
            if stem in _KINDS:
                return _KINDS[stem]
    return "all_reduce"  # not an MPI collective's name: the dtypes still name the call


def _sizes(kind: str, count: int, size: int) -> tuple[list, list]:
    """Input and output sizes of a collective of ``count`` elements (-1: not known; mpidp
    counts an allgather's input and a reduce_scatter's input) over ``size`` ranks."""
    if kind == "all_gather":
        return [[count]], [[count * size]]
    if kind == "reduce_scatter":
        return [[count]], [[count // size]]
    return [[count]], [[count]]


def _frames(stack: str) -> list[dict]:
    """A thread's stack text (``traceback.format_stack``) as torch's frames, innermost first."""
    return [dict(name=name, filename=filename, line=line)
            for filename, line, name in reversed(_FRAME.findall(stack))]


class _Group(NamedTuple):
    """A communicator as torch's process group: its id, name, description and ranks."""

    index: int
    key: str
    owner: str
    ranks: list[int]


def _groups(ranks: dict[int, dict], held: dict) -> dict[str, _Group]:
    size = max(data["size"] for data in ranks.values())
    found = {}
    for index, key in enumerate(sorted(held)):
        owner = next((ranks[r]["communicators"][key]["owner"] for r in sorted(ranks)
                      if key in ranks[r]["communicators"]), "?")
        found[key] = _Group(index, key, owner, trace.members(key, size) or sorted(held[key]))
    return found


def _entry(record_id: int, entry: dict, group: _Group, data: dict, known: bool,
           completed: bool) -> dict:
    kind = _kind(entry["op"])
    inputs, outputs = _sizes(kind, entry["count"], len(group.ranks))
    extra = entry["extra"] or []
    dtypes = [entry["dtype"]] if entry["dtype"] else []
    if known:
        dtypes += [f"{k}={v}" for k, v in zip(extra[::2], extra[1::2])]
    dtypes.append(f"call={entry['op']}")
    anchor = data["anchor"]
    started = int((anchor["wall"] + entry["start"] - anchor["monotonic"]) * 1e9)
    ended = 0 if entry["end"] is None else \
        int((anchor["wall"] + entry["end"] - anchor["monotonic"]) * 1e9)
    thread = data.get("threads", {}).get(str(entry["thread"]), {})
    written = dict(
        record_id=record_id, pg_id=group.index, process_group=(group.key, group.owner),
        collective_seq_id=entry["seq"], p2p_seq_id=0, op_id=entry["seq"], is_p2p=False,
        profiling_name=f"{_BACKEND}:{kind}", time_created_ns=started,
        input_sizes=inputs, input_dtypes=dtypes, output_sizes=outputs,
        output_dtypes=list(dtypes), state="completed" if completed else "started",
        time_discovered_started_ns=started, time_discovered_completed_ns=ended,
        retired=completed, timeout_ms=0, thread_id=str(entry["thread"]),
        thread_name=thread.get("name", "?"), frames=[])
    if entry["end"] is not None:
        written["duration_ms"] = (entry["end"] - entry["start"]) * 1e3
    return written


def _dumps(ranks: dict[int, dict]) -> dict[int, dict]:
    """Each rank's file as torch's pickle holds it, by rank."""
    held: dict[str, dict[int, dict[int, dict]]] = {}  # key -> rank -> seq -> entry
    for rank, data in ranks.items():
        for entry in data["entries"]:
            held.setdefault(entry["comm"], {}).setdefault(rank, {})[entry["seq"]] = entry
    groups = _groups(ranks, held)
    # the first sequence number each communicator's ranks all still hold, where mpidp.trace starts
    first = {key: max(min(seqs) for seqs in by_rank.values()) for key, by_rank in held.items()}
    dumps = {}
    for rank, data in sorted(ranks.items()):
        latest = {}  # thread -> its latest collective: where its stack stands, if not completed
        entries = []
        for entry in data["entries"]:
            key, seq = entry["comm"], entry["seq"]
            if seq < first[key]:
                continue
            present = [held[key][r][seq] for r in groups[key].ranks
                       if seq in held[key].get(r, {})]
            everyone = len(present) == len(groups[key].ranks)
            completed = entry["end"] is not None or \
                (everyone and any(e["end"] is not None for e in present))
            known = all(e["extra"] is not None for e in present)
            entries.append(_entry(len(entries), entry, groups[key], data, known, completed))
            latest[entry["thread"]] = entries[-1]
        for thread, written in latest.items():
            if written["state"] != "completed":
                written["frames"] = _frames(data.get("threads", {}).get(str(thread), {})
                                            .get("stack", ""))
        mine = [g for g in groups.values() if rank in g.ranks or rank in held[g.key]]
        status = {}
        for group in mine:
            seqs = held[group.key].get(rank, {})
            done = [s for s, e in seqs.items() if e["end"] is not None]
            status[str(group.index)] = dict(last_enqueued_collective=max(seqs, default=-1),
                                            last_started_collective=max(seqs, default=-1),
                                            last_completed_collective=max(done, default=-1))
        dumps[rank] = dict(
            version=VERSION, comm_lib_version="mpidp (MPI)", entries=entries,
            pg_config={g.key: dict(name=g.key, desc=g.owner, ranks=str(g.ranks)) for g in mine},
            pg_status=status)
    return dumps


def _leader(ranks: dict[int, dict]) -> int:
    """The rank whose calls torch's analyzer should take as the expected ones: one that made
    the collective ``mpidp.trace`` names first, of the largest group if the calls differ."""
    findings = trace.analyse(ranks)
    if not findings:
        return min(ranks)
    first = findings[0]
    if first["kind"] == "differ":
        return min(max(first["ranks"].values(), key=lambda group: (len(group), -min(group))))
    return min(r for r, data in ranks.items()
               if any(e["comm"] == first["comm"] and e["seq"] == first["seq"]
                      for e in data["entries"]))


def _clear(out: str) -> None:
    """Remove an earlier export from ``out``; refuse a folder that holds anything else."""
    ours = re.compile(rf"{PREFIX}\d+$")
    for root, folders, files in os.walk(out):
        strange = [name for name in files if not ours.match(name)] + \
            [name for name in folders if root != out or name != _OTHERS]
        if strange:
            raise ValueError(f"{out} must be empty or hold only an earlier export "
                             f"(torch's analyzer reads every file under it), found "
                             f"{os.path.join(root, strange[0])}")
    for root, _, files in os.walk(out):
        for name in files:
            os.unlink(os.path.join(root, name))


def export(folder: str, out: str) -> list[str]:
    """Write the flight records of ``folder`` (``mpidp.trace.load``) into ``out`` in torch's
    flight-recorder format; returns the files' paths, the first one torch's analyzer reads
    first.

    Raises:
        FileNotFoundError: ``folder`` holds no flight record.
        ValueError: a record of another layout, or ``out`` holds files of its own.
    """
    ranks = trace.load(folder)
    dumps = _dumps(ranks)
    leader = _leader(ranks)
    _clear(out)
    os.makedirs(os.path.join(out, _OTHERS), exist_ok=True)
    paths = []
    for rank in [leader] + [r for r in sorted(dumps) if r != leader]:
        where = out if rank == leader else os.path.join(out, _OTHERS)
        path = os.path.join(where, f"{PREFIX}{rank}")
        with open(path, "wb") as target:
            pickle.dump(dumps[rank], target)
        paths.append(path)
    return paths


def main(folder: str, out: str) -> int:
    """Export and say where (``python -m mpidp trace DIR --torch-fr OUT``); 0, or 2 on an error."""
    try:
        paths = export(folder, out)
    except (FileNotFoundError, ValueError, OSError) as error:
        print(f"python -m mpidp trace --torch-fr: {error}")
        return 2
    print(f"torch's flight-recorder files of {len(paths)} rank(s) in {out}: read them with "
          f"'torchfrtrace {out}'")
    return 0
