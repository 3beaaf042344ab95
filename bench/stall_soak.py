"""The stall watchdog's evidence, many times, on each MPI library, on one host and across nodes.

    python bench/stall_soak.py --where host|cluster --mpi mpich|openmpi|impi --runs 10 \\
        [--scenarios asleep differ killed late limit] --out DIR

Issue 29's soak. Each run is a fresh job of ``tests/mpi/stall.py`` on 4 ranks
(``--where cluster``: 2 nodes of bench/cluster/harness.py, 2 ranks each, so
rank 3 is on the node without rank 0; ``host``: 4 ranks here), in which rank
3 misbehaves at DDP step 3 or at the first collective:

- ``asleep``: rank 3 sleeps in user code while the others wait in a bucket
  (``stall.py sleep 3 inline``, ``MPIDP_TIMEOUT=5``);
- ``differ``: rank 3 enters a broadcast where the others enter an allreduce
  on the same communicator (``stall.py differ 3``, ``MPIDP_TIMEOUT=5``);
- ``killed``: rank 3 is killed by SIGKILL (``stall.py kill 3 inline``);
- ``late``: rank 3 sleeps 200 ms before each of 16 backward passes
  (``stall.py late 3``): DDP names it a straggler;
- ``limit``: as ``asleep`` with ``MPIDP_TIMEOUT=600``; 2 s after every rank
  stalled, SIGTERM to the launcher, as a scheduler's time limit does
  (SIGKILL 30 s later if it has not ended).

Each run's output, its ranks' files (``MPIDP_TRACE_DIR``) and ``python -m mpidp
trace`` on them are judged by explicit checks (``judge_*``); a run passes when
every check does. Writes DIR/results-WHERE-MPI.jsonl (a line per run, with the
load average before it), DIR/table-WHERE-MPI.md (runs, passed, each failed
check with the first line of evidence that differs) and keeps a failed run's
output and files in DIR/failed/WHERE-MPI-SCENARIO-N/; a passed run's files
are removed. ``--mpi openmpi|impi`` runs the soak again under that library's
environment (bench/cluster/mpi_venv.sh). Every job, node, process and
temporary directory it made is gone when it ends, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench" / "cluster"))
import harness  # noqa: E402
import launch  # noqa: E402

STALL = "tests/mpi/stall.py"
SOURCE = (ROOT / STALL).read_text().splitlines()
SIZE, ODD, OTHERS = 4, 3, "ranks 0-2"  # rank 3 misbehaves; ranks 0-2 as the summary folds them
TIMEOUT = 5  # MPIDP_TIMEOUT of the stall scenarios
JOB_LIMIT = 180  # seconds: a job still running then is a hang
ENDS_WITHIN = TIMEOUT + 30  # seconds from the stall to the job's end
SCENARIOS = ["asleep", "differ", "killed", "late", "limit"]


def _line(text: str, after: str = "") -> int:
    """The number of the first line of stall.py holding ``text`` (after the line holding ``after``)."""
    start = next(n for n, line in enumerate(SOURCE) if after in line) if after else 0
    return next(n for n, line in enumerate(SOURCE[start:], start + 1) if text in line)


SLEEP = _line("time.sleep(TIMEOUT + 3")
BACKWARD = _line("loss.backward()", after="def train(")
KILL = _line("signal.SIGKILL")
BROADCAST = _line("mpidp.comm.broadcast(torch.ones(4), 0)")
ALLREDUCE = _line("mpidp.comm.allreduce(torch.ones(4))", after="mpidp.comm.broadcast(torch.ones(4), 0)")


class Judge:
    """The checks of one run: each failure keeps what was expected and the evidence that differs."""

    def __init__(self):
        self.failures: list[str] = []

    def check(self, ok: bool, what: str, evidence: str = "") -> bool:
        if not ok:
            first = (evidence.strip().splitlines() or ["(nothing)"])[0][:400]
            self.failures.append(f"{what}; got: {first}")
        return ok


# -- evidence ------------------------------------------------------------------------------

def summary(output: str) -> tuple[list[str], dict]:
    """Rank 0's summary lines, and what the first says of each rank: {0: "waiting in ...", ...,
    "end": "aborting ..."} (across nodes, DDP's staged reduction puts ranks in different calls)."""
    lines = re.findall(rf"\[mpidp rank 0/{SIZE}\] stall summary: (.*)", output)
    if not lines:
        return lines, {}
    *groups, end = lines[0].split("; ")
    said: dict = {"end": end}
    for group in groups:
        who, _, what = group.partition(": ")
        for rank in _ranks(who.split(" ", 1)[-1]) if re.fullmatch(r"ranks? [0-9, -]+", who) else []:
            said[rank] = what
    return lines, said


def stacks(output: str) -> dict[int, list[str]]:
    """Each rank's main-thread stack in rank 0's summary: {rank: ["file:line in function", ...]}."""
    found: dict[int, list[str]] = {}
    current: list[int] = []
    for line in output.splitlines():
        header = re.match(rf"\[mpidp rank 0/{SIZE}\] stack of ranks? ([0-9, -]+), thread (\S+)",
                          line)
        frame = re.match(rf"\[mpidp rank 0/{SIZE}\]     (\S+:\d+ in \S+)", line)
        if header:
            current = _ranks(header[1]) if header[2] == "MainThread" else []
            for rank in current:
                found.setdefault(rank, [])
        elif frame and current:
            for rank in current:
                found[rank].append(frame[1])
        else:
            current = []
    return found


def _ranks(folded: str) -> list[int]:
    ranks = []
    for part in folded.split(", "):
        low, _, high = part.partition("-")
        ranks += range(int(low), int(high or low) + 1)
    return ranks


def trace(folder: Path) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "mpidp", "trace", str(folder)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def first_finding(text: str) -> str:
    """The trace's first numbered finding with its indented lines."""
    found = re.search(r"^1\. .*(?:\n    .*)*", text, re.M)
    return found[0] if found else ""


# -- the judges: one per scenario ------------------------------------------------------------

def judge_summary(judge: Judge, output: str, others: str, where: str, odd: str,
                  stack_line: str) -> None:
    """Rank 0's summary: ranks 0-2 and rank 3 named with what they do, rank 3's stack."""
    lines, groups = summary(output)
    judge.check(len(lines) == 1, f"one stall summary from rank 0, found {len(lines)}",
                "\n".join(lines) or output[-2000:])
    if not lines:
        return
    judge.check("no report" not in lines[0], "every live rank answered (no 'no report')", lines[0])
    judge.check(all(groups.get(r, "").startswith(others) and where in groups[r] for r in range(ODD)),
                f"{OTHERS}: '{others}... {where}'", lines[0])
    judge.check(groups.get(ODD, "").startswith(odd), f"rank {ODD}: '{odd}...'", lines[0])
    judge.check(groups.get("end") == "aborting the job (MPIDP_TIMEOUT_ACTION=abort)",
                "the summary ends the job", lines[0])
    found = stacks(output)
    judge.check(sorted(found) == list(range(SIZE)), "a main-thread stack of every rank",
                f"stacks of ranks {sorted(found)}")
    judge.check(stack_line in found.get(ODD, []), f"rank {ODD}'s stack holds '{stack_line}'",
                " | ".join(found.get(ODD, [])) or "(no stack)")


def judge_never_arrived(judge: Judge, text: str) -> None:
    """The trace's first finding: ranks 0-2 started step 3's first bucket, rank 3 never did."""
    first = first_finding(text)
    starters = re.search(r", started [0-9.]+ s after start-up by ranks? ([0-9, -]+): ", first)
    judge.check(first.startswith("1. never arrived on ") and starters is not None
                and ODD not in _ranks(starters[1]) and "(DDP step 3 bucket 1/" in first.splitlines()[0],
                f"trace: first finding is DDP step 3 bucket 1, started without rank {ODD}",
                first or text)
    judge.check(f"\n    rank {ODD} never started it" in first,
                f"trace: rank {ODD} never started it", first or text)


def judge_asleep(judge: Judge, run: dict, folder: Path) -> None:
    output = run["output"]
    judge.check(run["returncode"] not in (0, None), "the job failed (the watchdog's abort)",
                f"exit status {run['returncode']}")
    judge_summary(judge, output, "waiting in DDP step 3 bucket 1/", f" at {STALL}:{BACKWARD} (",
                  f"not in an mpidp collective, main thread at {STALL}:{SLEEP}",
                  f"{STALL}:{SLEEP} in train")
    status, text = trace(folder)
    run["trace"] = text
    judge.check(status == 1, "trace: exit status 1 (the ranks disagree)", f"{status}: {text}")
    judge.check(f"flight records of ranks 0-{SIZE - 1} of {SIZE}" in text,
                "trace: every rank's flight record", text)
    judge_never_arrived(judge, text)


def judge_differ(judge: Judge, run: dict, folder: Path) -> None:
    output = run["output"]
    judge.check(run["returncode"] not in (0, None), "the job failed (the watchdog's abort)",
                f"exit status {run['returncode']}")
    judge_summary(judge, output, "waiting in allreduce op=sum dtype=float32 count=4 ",
                  f" at {STALL}:{ALLREDUCE} (",
                  f"waiting in broadcast root=0 dtype=float32 count=4 at {STALL}:{BROADCAST} (",
                  f"{STALL}:{BROADCAST} in differ")
    status, text = trace(folder)
    run["trace"] = text
    judge.check(status == 1, "trace: exit status 1 (the ranks disagree)", f"{status}: {text}")
    first = first_finding(text)
    judge.check(first.startswith(f"1. first divergence on ranks 0-{SIZE - 1} #")
                and ", collective #1, " in first.splitlines()[0],
                "trace: first divergence on the pool's communicator, collective #1", first or text)
    judge.check(f"\n    {OTHERS}: allreduce op=sum count=4 dtype=float32" in first
                and f"\n    rank {ODD}: broadcast root=0 count=4 dtype=float32" in first,
                f"trace: {OTHERS} allreduce, rank {ODD} broadcast", first or text)


def judge_killed(judge: Judge, run: dict, folder: Path) -> None:
    """Rank 3 named as killed: by mpidp's summary, the launcher's rank, its pid in a pid file, or
    the trace (of the files the survivors wrote and of the black boxes of the ranks that were
    SIGKILLed before they could write: hydra kills them all at once)."""
    output = run["output"]
    judge.check(run["returncode"] not in (0, None), "the job failed", f"exit {run['returncode']}")
    lines, groups = summary(output)
    named = []
    if lines:  # the others lived to MPIDP_TIMEOUT: the watchdog accounts for rank 3
        if groups.get(ODD, "").startswith("no report (not reachable: dead"):
            named.append("mpidp's summary")
        judge.check(all(groups.get(r, "").startswith("waiting in DDP step 3 bucket 1/")
                        for r in range(ODD)),
                    f"{OTHERS} waiting in DDP step 3 bucket 1", lines[0])
    launcher = re.search(rf"process\s+rank\s+{ODD}\s+with\s+PID\s+\d+\s+on\s+node\s+\S+\s+"
                         rf"exited\s+on\s+signal\s+9", output)  # Open MPI wraps its lines
    if launcher:  # Open MPI names the rank
        named.append("the launcher (rank)")
    # hydra (MPICH, Intel MPI) names each process that ended badly by pid and host (Intel MPI
    # with its rank too); mpidp's pid files name the rank of a pid. It must be rank 3 alone.
    blocks = re.findall(r"^=\s+(?:RANK (\d+) )?PID (\d+) RUNNING AT (\S+)\s*\n"
                        r"=\s+(?:EXIT CODE: 9|KILLED BY SIGNAL: 9)", output, re.M)
    heads = {path.read_text(errors="replace").strip(): path.name
             for path in folder.glob("rank-*.pid")}
    owners = set()
    for rank, pid, host in blocks:
        owners |= {rank} if rank else {name[5:10].lstrip("0") or "0" for head, name in heads.items()
                                         if re.fullmatch(rf"mpidp rank \d+/{SIZE}, pid {pid} on "
                                                         rf"{re.escape(host)}", head)}
    if owners == {str(ODD)}:
        named.append("the launcher (" + ("rank" if blocks[0][0] else "pid, and the pid file")
                     + ")")
    if list(folder.glob("rank-*.json")) or list(folder.glob("rank-*.box")):
        # the survivors' records (SIGTERM before SIGKILL), else the black boxes of ranks that
        # were SIGKILLed before they could write (hydra): the trace must name rank 3
        status, text = trace(folder)
        run["trace"] = text
        absent = re.search(r"^no file from ranks? ([0-9, -]+) ", text, re.M)
        first = first_finding(text)
        by_trace = (absent is not None and ODD in _ranks(absent[1])) or (
            first.startswith("1. never arrived on ") and f"\n    rank {ODD} never started it" in first)
        judge.check(by_trace, f"trace: rank {ODD} left no record or never arrived first", text)
        if by_trace:
            named.append("the trace")
    pid = re.search(r"^=\s+(?:RANK \d+ )?PID \d+ RUNNING AT .*", output, re.M)
    judge.check(bool(named), f"rank {ODD} named as killed (mpidp's summary, the launcher's rank, "
                             f"the launcher's pid in a pid file, or the trace)",
                (lines[0] if lines else "") or
                (f"{pid[0].strip('= ')} (rank {', '.join(sorted(owners)) or '?'} by the pid "
                 f"files)" if pid else output[-1500:]))
    run["named_by"] = named
    run["launcher_named"] = sorted(owners)  # the ranks of the processes hydra reported


def judge_late(judge: Judge, run: dict, folder: Path) -> None:
    output = run["output"]
    judge.check(run["returncode"] == 0, "the job ends normally", f"exit {run['returncode']}")
    named = re.findall(r"mpidp: rank (\d+) is a straggler: .* reached their end (\d+) ms after",
                       output)
    judge.check(len(named) == 1, "one straggler warning from rank 0", str(named) or output[-2000:])
    if named:
        rank, ms = int(named[0][0]), int(named[0][1])
        judge.check(rank == ODD, f"rank {ODD} named", f"rank {rank}")
        judge.check(150 <= ms <= 300, "its lateness 150-300 ms (it sleeps 200)", f"{ms} ms")
    records = dict(re.findall(r"rank (\d+) stragglers (\{[^}]*\})", output))
    judge.check(sorted(map(int, records)) == list(range(SIZE)) and
                all(list(ast.literal_eval(r)) == [ODD] for r in records.values()),
                f"ddp.stragglers() is {{{ODD}: ...}} on every rank", str(records))
    judge.check("] stall" not in output, "no stall report", output)


def judge_limit(judge: Judge, run: dict, folder: Path) -> None:
    output = run["output"]
    judge.check(run.get("term_to_end") is not None and run["term_to_end"] < 30,
                "the launcher ended the job within 30 s of SIGTERM", str(run.get("term_to_end")))
    judge.check("stall summary" not in output, "no stall summary (MPIDP_TIMEOUT=600)", output)
    for rank in range(SIZE):
        path = folder / f"rank-{rank:05d}.stacks.txt"
        text = path.read_text(errors="replace") if path.exists() else ""
        line = SLEEP if rank == ODD else BACKWARD
        judge.check(f'{STALL}", line {line} in train' in text,
                    f"rank {rank}'s stacks file holds stall.py:{line} in train",
                    text[-600:] or f"({path.name} missing or empty)")
        judge.check((folder / f"rank-{rank:05d}.json").exists(), f"rank {rank}'s flight record",
                    " ".join(sorted(p.name for p in folder.iterdir())))
    status, text = trace(folder)
    run["trace"] = text
    judge.check(f"flight records of ranks 0-{SIZE - 1} of {SIZE}" in text,
                "trace: every rank's flight record", text)
    judge_never_arrived(judge, text)


# -- jobs --------------------------------------------------------------------------------

class Host:
    """One host: the jobs' processes are the launcher's group (harness.Job kills it)."""

    def launch(self, argv: list[str], env: dict) -> harness.Job:
        launcher = launch.mpiexec()
        line = [launcher, *launch._oversubscribe_flags(launcher), "-n", str(SIZE), *argv]
        full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                    MPIR_CVAR_ENABLE_HEAVY_YIELD="1",  # more ranks than cores (tests/launch.py)
                    OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    FI_PROVIDER="tcp", **env)
        return harness.Job(self, line, full, echo=False)

    def sweep(self) -> int:
        return 0

    def close(self) -> None:
        pass


class Nodes:
    """Two nodes of bench/cluster/harness.py, 2 ranks each, up for the whole soak."""

    def __init__(self):
        harness.down_orphans("mpidps")  # what a killed soak left
        self.cluster = harness.Cluster(2, rate="1gbit", prefix=f"mpidps{os.getpid() % 100_000}")
        self.cluster.up()

    def launch(self, argv: list[str], env: dict) -> harness.Job:
        return self.cluster.launch(argv, ppn=SIZE // 2, env=env)

    def close(self) -> None:
        self.cluster.down()
        left = harness.leftovers(self.cluster.prefix, self.cluster.inodes)
        if left:
            print(f"stall_soak: left of the cluster: {left}", file=sys.stderr)


def run_one(place, scenario: str, folder: Path, extra: dict) -> dict:
    """One job of ``scenario``, its files in ``folder``, ``extra`` in its environment: its
    output, status, timings."""
    args = {"asleep": ["sleep", str(ODD), "inline"], "differ": ["differ", str(ODD)],
            "killed": ["kill", str(ODD), "inline"], "late": ["late", str(ODD)],
            "limit": ["sleep", str(ODD), "inline"]}[scenario]
    env = {"MPIDP_TRACE_DIR": str(folder),
           "MPIDP_TIMEOUT": "600" if scenario == "limit" else str(TIMEOUT), **extra}
    job = place.launch([sys.executable, STALL, *args], env)
    run: dict = {"scenario": scenario}
    try:
        if scenario == "limit":
            stalled = _wait_for_stalls(job, JOB_LIMIT)
            if stalled:
                time.sleep(2)  # every rank inside its stall
                os.kill(job.process.pid, signal.SIGTERM)
                termed = time.monotonic()
                try:
                    job.process.wait(30)
                    run["term_to_end"] = time.monotonic() - termed
                except subprocess.TimeoutExpired:
                    run["term_to_end"] = None
            result = job.wait(5)
        else:
            result = job.wait(JOB_LIMIT)
    finally:
        job.kill()
    starts = [float(s) for s in re.findall(r" stalls at (\d+\.\d{3})", result.output)]
    run.update(returncode=result.returncode, output=result.output, seconds=result.seconds,
               timed_out=result.timed_out, swept=result.swept,
               stall_to_end=time.time() - min(starts) if starts else None)
    return run


def _wait_for_stalls(job: harness.Job, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and job.process.poll() is None:
        if job.output.count(" stalls at ") >= SIZE:
            return True
        time.sleep(0.1)
    return False


JUDGES = {"asleep": judge_asleep, "differ": judge_differ, "killed": judge_killed,
          "late": judge_late, "limit": judge_limit}


def judge(run: dict, folder: Path) -> list[str]:
    verdict = Judge()
    verdict.check(not run["timed_out"], f"the job ended within {JOB_LIMIT} s (no hang)",
                  run["output"][-2000:])
    if run["scenario"] in ("asleep", "differ", "killed"):
        verdict.check(run["stall_to_end"] is not None and run["stall_to_end"] < ENDS_WITHIN,
                      f"the job ended within {ENDS_WITHIN} s of the stall",
                      f"{run['stall_to_end']} s")
    JUDGES[run["scenario"]](verdict, run, folder)
    return verdict.failures


# -- the soak ----------------------------------------------------------------------------

def library() -> str:
    from mpi4py import MPI
    return MPI.Get_library_version().splitlines()[0].strip().strip("\0")


def reexec_under(mpi: str) -> None:
    """Run this soak again with the python of ``mpi``'s environment, unless it is this one."""
    python = subprocess.run(["bash", str(ROOT / "bench" / "cluster" / "mpi_venv.sh"), mpi],
                            capture_output=True, text=True, check=True).stdout.strip()
    if Path(python).parent != Path(sys.executable).parent:
        os.execv(python, [python, *sys.argv])


def table(rows: list[dict], where: str, mpi: str, lib: str, env: list[str]) -> str:
    lines = [f"{where}, {mpi} ({lib}), {SIZE} ranks{', ' + ' '.join(env) if env else ''}:", "",
             "| scenario | runs | passed | failures (run: check; first differing evidence) |",
             "|---|---|---|---|"]
    for scenario in SCENARIOS:
        mine = [r for r in rows if r["scenario"] == scenario]
        if not mine:
            continue
        failed = "<br>".join(f"run {r['run']}: {f}".replace("|", "\\|")
                             for r in mine for f in r["failures"][:2]) or "-"
        lines.append(f"| {scenario} | {len(mine)} | {sum(not r['failures'] for r in mine)} | "
                     f"{failed} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--where", choices=["host", "cluster"], required=True)
    parser.add_argument("--mpi", choices=["mpich", "openmpi", "impi"], default="mpich")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=SCENARIOS)
    parser.add_argument("--out", required=True)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in every job (I_MPI_JOB_ABORT_SIGNAL=15: Intel MPI's hydra "
                             "then ends the other ranks with SIGTERM, not SIGKILL)")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.env)
    reexec_under(args.mpi)
    os.chdir(ROOT)  # stall.py's lines are named relative to the working directory
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.where}-{args.mpi}" + "".join(f"-{k}={v}" for k, v in extra.items())
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up on SIGTERM too
    base = Path(tempfile.mkdtemp(prefix="mpidp-stall-soak-", dir="/var/tmp"))  # seen by every node
    rows: list[dict] = []
    place = None
    try:
        place = Nodes() if args.where == "cluster" else Host()
        lib = library()
        print(f"{tag}: {lib}; {' '.join(args.env) or 'no extra environment'}", flush=True)
        with open(out / f"results-{tag}.jsonl", "a") as results:
            for number in range(1, args.runs + 1):
                for scenario in args.scenarios:
                    folder = base / f"{scenario}-{number}"
                    load = os.getloadavg()
                    run = run_one(place, scenario, folder, extra)
                    failures = judge(run, folder)
                    row = dict(where=args.where, mpi=args.mpi, scenario=scenario, run=number,
                               failures=failures, returncode=run["returncode"],
                               seconds=round(run["seconds"], 1), load=[round(x, 2) for x in load],
                               named_by=run.get("named_by"),
                               launcher_named=run.get("launcher_named"), term_to_end=run.get("term_to_end"))
                    rows.append(row)
                    results.write(json.dumps(row) + "\n")
                    results.flush()
                    print(f"{tag} {scenario} run {number}: "
                          f"{'passed' if not failures else 'FAILED: ' + failures[0]} "
                          f"({run['seconds']:.1f} s, exit {run['returncode']}, load {load[0]:.1f})",
                          flush=True)
                    if failures:
                        kept = out / "failed" / f"{tag}-{scenario}-{number}"
                        shutil.rmtree(kept, ignore_errors=True)
                        shutil.copytree(folder, kept) if folder.exists() else kept.mkdir(parents=True)
                        (kept / "output.txt").write_text(run["output"])
                        (kept / "trace.txt").write_text(run.get("trace", "(not run)"))
                        (kept / "failures.txt").write_text("\n".join(failures) + "\n")
                    shutil.rmtree(folder, ignore_errors=True)
    finally:
        if place is not None:
            place.close()
        shutil.rmtree(base, ignore_errors=True)
        if rows:  # also when stopped early: the runs so far
            (out / f"table-{tag}.md").write_text(table(rows, args.where, args.mpi, lib, args.env))
            print(table(rows, args.where, args.mpi, lib, args.env))
    return 1 if any(r["failures"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
