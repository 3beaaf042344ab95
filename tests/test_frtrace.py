"""mpidp's flight records in torch's format (mpidp.frtrace), read by torch's own analyzer.

Torch's analyzer (``torch.distributed.flight_recorder``, ``torchfrtrace``) runs here in this
process on real records (tests/data) and on made ones; tests/test_mpi.py runs it as a user
does, on the records of a job that hangs.
"""

import ast
import json
import logging
import re
from pathlib import Path

import pytest

from mpidp import frtrace, trace

ROOT = Path(__file__).resolve().parent.parent
KEY, OTHER = "ranks 0-1 #0", "ranks 0-1 #1"


def torch_findings(text: str) -> list[dict]:
    """What torch's analyzer printed about each collective it found wrong, in its order: the
    sequence number, the group (mpidp's key), the missing ranks and the "culprit" ranks."""
    found: list[dict] = []
    for line in text.splitlines():
        start = re.match(r"(Not all ranks joining collective, sequence number|Collective "
                         r"sequence number): (\d+)", line)
        if start:
            found.append(dict(seq=int(start[2]), missing=set(), culprits=set()))
        elif found and line.startswith("group info: "):
            found[-1]["group"] = line.removeprefix("group info: ").split(":", 1)
        elif found and line.startswith("missing ranks: "):
            found[-1]["missing"] = set(ast.literal_eval(line.removeprefix("missing ranks: ")))
        elif found and line.startswith("error msg: "):
            found[-1]["culprits"] = {int(r) for r in re.findall(r"Culprit rank (\d+);", line)}
            found[-1]["error"] = line
    return found


def _torch_reads(out, caplog) -> list[dict]:
    from torch.distributed.flight_recorder.fr_trace import main
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="Flight Recorder"):
        main([str(out)])
    return torch_findings("\n".join(caplog.messages))


def agree(finding: dict, torch_first: dict) -> None:
    """Torch's first finding is trace's first: the same collective, the same rank(s)."""
    assert torch_first["group"][0] == finding["comm"], (torch_first, finding["lines"])
    assert torch_first["seq"] == finding["seq"], (torch_first, finding["lines"])
    if finding["kind"] == "missing":
        assert torch_first["missing"] == set(finding["absent"]), (torch_first, finding["lines"])
    else:
        groups = sorted(finding["ranks"].values(), key=lambda group: (-len(group), min(group)))
        others = {rank for group in groups[1:] for rank in group}
        assert torch_first["culprits"] == others, (torch_first, finding["lines"])


@pytest.mark.parametrize("data", ["trace-two-nodes", "trace-killed-box"])
def test_torch_analyzer_names_the_collective_and_rank_trace_names_first(data, tmp_path, caplog):
    """Real records of 4 ranks on two nodes where rank 3 never came (slept; killed, its black box
    without extras): torch's analyzer names the same collective and rank as trace, though by
    time alone another came first (two-nodes), and takes no missing extras for a divergence."""
    folder = ROOT / "tests" / "data" / data
    paths = frtrace.export(str(folder), str(tmp_path / "fr"))
    assert [Path(p).parent.name for p in paths] == ["fr"] + ["other-ranks"] * 3, paths
    found = _torch_reads(tmp_path / "fr", caplog)
    first = trace.analyse(trace.load(str(folder)))[0]
    assert found and first["kind"] == "missing", caplog.text
    agree(first, found[0])
    assert found[1]["missing"] == {3} and not any("error" in f for f in found), found


def _record(rank: int, calls: list[tuple]) -> dict:
    """A rank's file as mpidp.recorder writes it, of ``calls``: (key, op, count, dtype, extra,
    done) on communicators of ranks 0-1."""
    entries, seqs = [], {}
    for n, (key, op, count, dtype, extra, done) in enumerate(calls):
        seqs[key] = seqs.get(key, 0) + 1
        entries.append(dict(ticket=n, comm=key, seq=seqs[key], op=op, count=count, dtype=dtype,
                            extra=extra, what=f"call {n}", thread=7, start=10.0 + n,
                            end=10.5 + n if done else None))
    return dict(format=1, rank=rank, size=2, host="h", pid=100 + rank, reason="test",
                written=1000.0, anchor=dict(wall=900.0, monotonic=10.0), capacity=64, waits=[],
                communicators={key: dict(owner=f"owner seen by rank {rank}", issuer="t", size=2)
                               for key in (KEY, OTHER)},
                entries=entries,
                threads={"7": dict(name="MainThread",
                                   stack=f'  File "train.py", line {40 + rank}, in step\n')})


def _write(folder: Path, records: list[dict]) -> Path:
    folder.mkdir()
    for record in records:
        (folder / f"rank-{record['rank']:05d}.json").write_text(json.dumps(record))
    return folder


def test_a_root_that_differs_is_a_divergence_for_torch_too(tmp_path, caplog):
    """Torch's analyzer compares a collective's type, sizes, dtypes and state only: the root of
    a broadcast that differs (rank 1's) reaches it through the dtypes. A nonblocking allreduce
    that rank 0 completed and rank 1 had not waited for yet is no divergence."""
    common = (KEY, "iallreduce", 4, "float32", ["op", "sum"])
    folder = _write(tmp_path / "records", [
        _record(0, [common + (True,), (KEY, "broadcast", 8, "float32", ["root", "0"], False)]),
        _record(1, [common + (False,), (KEY, "broadcast", 8, "float32", ["root", "1"], False)])])
    frtrace.export(str(folder), str(tmp_path / "fr"))
    found = _torch_reads(tmp_path / "fr", caplog)
    first = trace.analyse(trace.load(str(folder)))[0]
    assert first["kind"] == "differ" and first["seq"] == 2, first
    agree(first, found[0])
    assert "COLLECTIVE_DTYPE_MISMATCH" in found[0]["error"] and "root=1" in found[0]["error"]
    assert len(found) == 1, caplog.text  # the allreduce before it agrees
    assert found[0]["group"] == [KEY, "owner seen by rank 0"], found  # one description
    assert "step at train.py:40" in caplog.text, caplog.text  # the stack of the rank that waits


def test_the_rank_that_made_the_first_collective_leads_torchs_walk(tmp_path, caplog):
    """Rank 0 skipped an allreduce on one communicator and waits on another, where rank 1 never
    comes, as it waits for rank 0 in the first: trace names rank 0 missing in the first. Torch's
    walk takes the calls of the rank it reads first as expected, so rank 1's file is the one at
    the top: from rank 0's, torch would name rank 1 missing in the second first."""
    call = ("allreduce", 4, "float32", ["op", "sum"])
    folder = _write(tmp_path / "records", [
        _record(0, [(KEY, *call, True), (OTHER, *call, False)]),
        _record(1, [(KEY, *call, True), (KEY, *call, False)])])
    paths = frtrace.export(str(folder), str(tmp_path / "fr"))
    assert Path(paths[0]).name == f"{frtrace.PREFIX}1" and Path(paths[0]).parent.name == "fr"
    first = trace.analyse(trace.load(str(folder)))[0]
    assert first["comm"] == KEY and first["absent"] == [0], first
    agree(first, _torch_reads(tmp_path / "fr", caplog)[0])


def test_only_the_collectives_every_rank_still_holds_are_written(tmp_path, caplog):
    """Rank 1's ring no longer holds the first allreduce (it wrapped): trace starts at the second,
    where both wait, and finds nothing; so does torch's analyzer, which aligns the ranks by record
    id, not by what each communicator's ranks hold."""
    call = (KEY, "allreduce", 4, "float32", ["op", "sum"])
    late = _record(1, [call + (True,), call + (False,)])
    late["entries"].pop(0)
    folder = _write(tmp_path / "records", [_record(0, [call + (True,), call + (False,)]), late])
    assert trace.analyse(trace.load(str(folder))) == []
    frtrace.export(str(folder), str(tmp_path / "fr"))
    assert _torch_reads(tmp_path / "fr", caplog) == [], caplog.messages


def test_the_export_refuses_a_folder_of_other_files_and_replaces_its_own(tmp_path, capsys):
    from mpidp.__main__ import main
    folder = _write(tmp_path / "records", [_record(r, [(KEY, "barrier", 0, None, [], True)])
                                           for r in range(2)])
    out = tmp_path / "fr"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["trace", str(folder), "--torch-fr", str(out)]) == 2
    said = capsys.readouterr().out
    assert f"--torch-fr: {out} must be empty or hold only an earlier export" in said, said
    assert "notes.txt" in said, said
    (out / "notes.txt").unlink()
    for _ in range(2):  # a second export replaces the first
        assert main(["trace", str(folder), "--torch-fr", str(out)]) == 0
    assert f"read them with 'torchfrtrace {out}'" in capsys.readouterr().out
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == \
        [f"{frtrace.PREFIX}0", f"other-ranks/{frtrace.PREFIX}1"]
