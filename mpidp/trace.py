"""``python -m mpidp trace DIR``: line up the ranks' flight records and say where they part.

Each rank's ``rank-NNNNN.json`` (``mpidp.recorder``) lists its last collectives,
each with its communicator's key and its sequence number there. MPI matches the
collectives of a communicator by their order, so the n-th collective of a
communicator must be the same call on each of its ranks. For every
communicator this module walks the sequence numbers that all its ranks' rings
still hold and finds:

- the first collective where the ranks' calls differ (operation, element count,
  dtype, reduction op or root), naming each group of ranks and its call;
- the first collective that some of its ranks started and others never did,
  naming those that never arrived and the last one each of them did start there.

The findings of all communicators are sorted by when they started (wall clock,
from each file's anchor), so the first line is where the job went wrong, with
one exception: a collective that some ranks never started because each of them
was waiting in another one (started, not completed) is a consequence, and comes
after those whose missing ranks were elsewhere. Across nodes, where DDP's
reduction runs in stages (the node's ranks, then across nodes), a rank late
on one node leaves its node's ranks in the first stage and the other node's
in the second, which the others enter first: by time alone the first finding
named a rank that was only waiting. Then what each rank's ring shows as
started and never completed. A rank without a file of its own is named by
what another rank heard as it finished, or by its stacks and pid files
(``stacks.absent``). Reads files only: no MPI.
"""

from __future__ import annotations

import glob
import json
import os
import re

from .communicators import fold
from .recorder import read_box
from .stacks import absent

__all__ = ["load", "members", "analyse", "report", "main"]

_FORMAT = 1


def load(folder: str) -> dict[int, dict]:
    """Every ``rank-NNNNN.json`` of ``folder``, by rank; for a rank without one, its black box
    (``rank-NNNNN.box``: the process was killed before it could write, ``mpidp.recorder``).

    Raises:
        FileNotFoundError: ``folder`` holds no such file.
        ValueError: a file of another layout.
    """
    found = {}
    for name in sorted(glob.glob(os.path.join(folder, "rank-*.json"))):
        with open(name) as source:
            data = json.load(source)
        if data.get("format") != _FORMAT:
            raise ValueError(f"{name}: layout {data.get('format')!r}, this mpidp reads {_FORMAT}")
        found[data["rank"]] = data
    for name in sorted(glob.glob(os.path.join(folder, "rank-*.box"))):
        data = read_box(name)
        if data is not None and data["rank"] not in found:
            found[data["rank"]] = data
    if not found:
        raise FileNotFoundError(f"no rank-NNNNN.json or .box in {folder} (set MPIDP_TRACE_DIR, "
                                f"or look for mpidp-trace-<job> in the job's working directory)")
    return found


def members(key: str, size: int) -> list[int]:
    """The world ranks a communicator's key names ("ranks 0-2, 5 #1", "COMM_WORLD")."""
    if key == "COMM_WORLD":
        return list(range(size))
    match = re.match(r"ranks ([0-9, -]+?) (\(not made by mpidp\) )?#", key)
    if match is None:
        return []
    ranks = []
    for part in match.group(1).split(", "):
        low, _, high = part.partition("-")
        ranks += range(int(low), int(high or low) + 1)
    return ranks


def _call(entry: dict) -> str:
    words = [entry["op"]]
    extra = entry["extra"] or []  # None: not known (a black box keeps no extras)
    words += [f"{k}={v}" for k, v in zip(extra[::2], extra[1::2])]
    if entry["count"] >= 0:
        words.append(f"count={entry['count']}")
    if entry["dtype"]:
        words.append(f"dtype={entry['dtype']}")
    return " ".join(words)


def _signature(entry: dict, extras: bool = True) -> tuple:
    """What must be alike on every rank; ``extras`` False where some rank's are not known."""
    return entry["op"], tuple(entry["extra"]) if extras else (), entry["count"], entry["dtype"]


def _wall(data: dict, monotonic: float) -> float:
    anchor = data["anchor"]
    return anchor["wall"] + monotonic - anchor["monotonic"]


def _when(seconds: float, ranks: dict[int, dict]) -> str:
    """Seconds since the first rank's import (its recorder's anchor), by the wall clock."""
    return f"{seconds - min(d['anchor']['wall'] for d in ranks.values()):.3f} s after start-up"


def _described(entry: dict) -> str:
    what = f" ({entry['what']})" if entry.get("what") else ""
    return f"{_call(entry)}{what}"


def analyse(ranks: dict[int, dict]) -> list[dict]:
    """The findings, earliest first (those whose missing ranks all waited elsewhere last): dicts
    with ``when``, ``kind`` ("differ"/"missing"), ``lines`` and ``blocked``."""
    size = max(data["size"] for data in ranks.values())
    by_comm: dict[str, dict[int, dict[int, dict]]] = {}
    for rank, data in ranks.items():
        for entry in data["entries"]:
            by_comm.setdefault(entry["comm"], {}).setdefault(rank, {})[entry["seq"]] = entry
    findings = []
    for key, held in by_comm.items():
        group = [r for r in members(key, size) if r in ranks] or sorted(held)
        owner = next((d["communicators"][key]["owner"] for d in ranks.values()
                      if key in d["communicators"]), "?")
        found = _first_problem(key, owner, group, held, ranks)
        if found is not None:
            findings.append(found)
    open_ = {rank: [e for e in data["entries"] if e["end"] is None] for rank, data in ranks.items()}
    for finding in findings:
        waiting = [r for r in finding.get("absent", []) if open_.get(r)]
        for rank in waiting:
            entry = open_[rank][-1]
            finding["lines"].append(f"    rank {rank} was waiting in {_described(entry)} on "
                                    f"{entry['comm']}, collective #{entry['seq']}")
        finding["blocked"] = bool(waiting) and len(waiting) == len(finding["absent"])
    return sorted(findings, key=lambda f: (f.get("blocked", False), f["when"]))


def _first_problem(key, owner, members, held, ranks) -> dict | None:
    # Only the sequence numbers every member's ring still holds (or never reached) count.
    first = max((min(held[r]) if held.get(r) else 0) for r in members)
    last = max(max(seqs) for seqs in held.values() if seqs)
    for seq in range(first, last + 1):
        present = {r: held[r][seq] for r in members if seq in held.get(r, {})}
        if not present:
            continue
        absent = [r for r in members if r not in present]
        signatures: dict[tuple, list[int]] = {}
        extras = all(entry["extra"] is not None for entry in present.values())
        for rank, entry in present.items():
            signatures.setdefault(_signature(entry, extras), []).append(rank)
        when = min(_wall(ranks[r], e["start"]) for r, e in present.items())
        where = f"{key} ({owner}), collective #{seq}"
        if len(signatures) > 1:
            lines = [f"first divergence on {where}, started {_when(when, ranks)}:"]
            for group in sorted(signatures.values(), key=min):
                lines.append(f"    {_rank_words(group)}: {_described(present[group[0]])}")
            return dict(when=when, kind="differ", ranks=signatures, lines=lines, comm=key, seq=seq)
        if absent:  # described by a rank that knows it best (a file over a black box)
            sample = max(present.values(), key=lambda entry: entry["extra"] is not None)
            lines = [f"never arrived on {where}, started {_when(when, ranks)} by "
                     f"{_rank_words(sorted(present))}: {_described(sample)}"]
            for rank in absent:
                mine = held.get(rank, {})
                before = mine.get(max(mine)) if mine else None
                last = f"#{before['seq']} {_described(before)}" if before else "none"
                lines.append(f"    {_rank_words([rank])} never started it; its last there: {last}")
            return dict(when=when, kind="missing", absent=absent, lines=lines, comm=key, seq=seq)
    return None


def _rank_words(ranks) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {fold(ranks)}"


def _in_flight(ranks: dict[int, dict]) -> list[str]:
    lines = []
    for rank, data in sorted(ranks.items()):
        open_ = [e for e in data["entries"] if e["end"] is None]
        names = {int(k): v["name"] for k, v in data.get("threads", {}).items()}
        for entry in open_[-3:]:
            age = data["written"] - _wall(data, entry["start"])
            lines.append(f"    rank {rank}: {_described(entry)} on {entry['comm']}, "
                         f"collective #{entry['seq']}, thread {names.get(entry['thread'], entry['thread'])}, "
                         f"started {age:.1f} s before its file was written")
    return lines


def _whereabouts(folder: str, ranks: dict[int, dict], size: int) -> list[str]:
    """What became of the ranks that wrote no file of their own: finished or stopped (as another
    rank heard from it), holding the GIL or dead (as their stacks and pid files say), or, with
    no file at all, a clean exit."""
    heard: dict[int, str] = {}
    for data in ranks.values():
        heard.update({int(rank): text for rank, text in data.get("ended", {}).items()})
    lines, unknown = [], []
    for rank in range(size):
        if rank in ranks and not ranks[rank].get("box"):
            continue  # it wrote its file: its reason says why
        said = heard.get(rank) or absent(rank, folder, live=False)
        if said:
            lines.append(f"rank {rank}: {said}")
        elif rank not in ranks:
            unknown.append(rank)
    if unknown:  # a killed rank leaves its pid file and black box: a clean exit removes them
        lines.append(f"no file from {_rank_words(unknown)}: it exited cleanly (finished or "
                     f"stopped), or wrote elsewhere (another node's working directory)")
    return lines


def report(folder: str) -> tuple[list[str], bool]:
    """The lines ``python -m mpidp trace`` prints, and whether the ranks agree."""
    ranks = load(folder)
    size = max(data["size"] for data in ranks.values())
    lines = [f"flight records of {_rank_words(sorted(ranks))} of {size} in {folder}"]
    lines += _whereabouts(folder, ranks, size)
    reasons: dict[str, list[int]] = {}
    for rank, data in ranks.items():
        reasons.setdefault(data["reason"], []).append(rank)
    for reason, group in reasons.items():
        lines.append(f"written by {_rank_words(group)}: {reason}")
    findings = analyse(ranks)
    if not findings:
        lines.append("every communicator's collectives agree across its ranks, as far as the "
                     "rings reach")
    for number, finding in enumerate(findings, 1):
        lines.append(f"{number}. {finding['lines'][0]}")
        lines += finding["lines"][1:]
    flight = _in_flight(ranks)
    if flight:
        lines.append("started and not completed when the files were written:")
        lines += flight
    return lines, not findings


def main(folder: str) -> int:
    """Print the report of ``folder``; 0 if the ranks agree, 1 if not, 2 without files."""
    try:
        lines, agree = report(folder)
    except (FileNotFoundError, ValueError) as error:
        print(f"python -m mpidp trace: {error}")
        return 2
    print("\n".join(lines))
    return 0 if agree else 1
