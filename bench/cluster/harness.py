"""A cluster of N nodes inside this machine, joined by shaped links, for MPI jobs.

Each node is a holder process (``sleep infinity`` renamed ``PREFIX-holder-nI``)
in network, UTS and mount namespaces of its own: hostname ``nI``, address
198.18.0.(I+1)/24 on ``eth0``, a veth to a bridge that lives in a namespace of
its own, so nothing is created in the host's namespace and its interfaces and
routes are never touched. Each node has its own ``/dev/shm``, ``/tmp``,
``/sys``, ``/etc/hosts``, boot id and machine id: MPI libraries decide "same
machine" from these and then move data through shared memory, so without them
two "nodes" put almost nothing on the veths (docs/cluster-harness.md). Each
node's link is shaped with ``tc ... tbf`` in both directions.

Jobs start with MPICH's hydra run inside n0, as on a batch job's first node:
``mpiexec -launcher ssh -launcher-exec SCRIPT -hosts n0,n1 -ppn K``, where
SCRIPT stands in for ssh and runs its command in the named node's namespaces
with ``nsenter``. Every job has a hard time limit; afterwards every process in
the nodes but the holders is killed (a launcher keeps waiting for a node whose
link was cut). Killing the holders ends the namespaces, and with them the
veths, the bridge and the nodes' mounts: ``down`` does that by name prefix, so
it also removes what a killed run left behind.

    python bench/cluster/harness.py up --nodes 2 --rate 1gbit
    python bench/cluster/harness.py run --ppn 2 -- python tests/mpi/check_cluster.py
    python bench/cluster/harness.py down

As a module (tests): ``with Cluster(2, rate="1gbit") as cluster: cluster.run([...], ppn=2)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

__all__ = ["Cluster", "Job", "JobResult", "PREFIX", "down", "down_orphans", "leftovers",
           "unavailable"]

PREFIX = "mpidpc"
RUN_DIR = Path("/run")
SUBNET = "198.18.0"  # 198.18.0.0/15 is reserved for benchmarking networks (RFC 2544)
TOOLS = ("ip", "tc", "unshare", "nsenter", "bash")
_THIS_PROCESS = -1  # Cluster's default owner
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def unavailable() -> str | None:
    """Why no cluster can be made here (not root, a tool missing, no namespaces), or None."""
    if os.geteuid() != 0:
        return "the cluster harness needs root (namespaces, veths, mounts)"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"the cluster harness needs {', '.join(absent)}"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True,
                           text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot create namespaces here: {probe.stderr.strip()}"
    return None


def _under_tmp() -> list[Path]:
    """The checkout and the Python environment, where they live under /tmp (outermost only)."""
    root = Path(__file__).resolve().parents[2]
    found = sorted({path for path in (root, Path(sys.prefix).resolve())
                    if path.is_relative_to("/tmp") and path != Path("/tmp")})
    return [path for path in found if not any(path != other and path.is_relative_to(other)
                                              for other in found)]


def _sh(*argv, timeout: float = 30, check: bool = True) -> str:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{shlex.join(map(str, argv))} exited with {result.returncode}: "
                           f"{result.stderr.strip()}")
    return result.stdout


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate such as ``10gbit`` or ``500mbit``."""
    match = re.fullmatch(r"([0-9.]+)\s*([kmgt]?bit)", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate must look like 1gbit, 500mbit or 10gbit, got {rate!r}")
    return float(match[1]) * _UNITS[match[2]] / 8


# -- processes and namespaces ------------------------------------------------------------


def _argv0(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _net_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:  # gone, or a zombie
        return None


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def holders(prefix: str = PREFIX) -> dict[str, int]:
    """The live holder processes of ``prefix``'s cluster: {"n0": pid, ..., "bridge": pid}."""
    mark = f"{prefix}-holder-"
    found = {}
    for pid in _pids():
        name = _argv0(pid)
        if name.startswith(mark):
            found[name[len(mark):]] = pid
    return found


def pids_in(inodes: set[int], *, spare: set[int] = frozenset()) -> list[int]:
    """Every live process in one of the network namespaces ``inodes``, but ``spare``."""
    return [pid for pid in _pids() if pid not in spare and _net_inode(pid) in inodes]


def _kill_all(inodes: set[int], *, spare: set[int] = frozenset(), wait: float = 10) -> int:
    """SIGKILL every process in those namespaces (but ``spare``) until none is left."""
    killed: set[int] = set()
    deadline = time.monotonic() + wait
    while True:
        victims = pids_in(inodes, spare=spare)
        if not victims:
            return len(killed)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {victims} survive SIGKILL")
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def down(prefix: str = PREFIX) -> list[str]:
    """Remove ``prefix``'s cluster, or what a killed run left of it: what was removed."""
    found = holders(prefix)
    inodes = {inode for inode in map(_net_inode, found.values()) if inode is not None}
    removed = []
    if found:
        count = _kill_all(inodes)
        removed.append(f"{count} processes in {len(inodes)} namespaces "
                       f"(holders {', '.join(sorted(found))})")
    state = RUN_DIR / prefix
    if state.exists():
        shutil.rmtree(state)
        removed.append(str(state))
    return removed


def down_orphans(family: str) -> list[str]:
    """``down`` every cluster whose prefix starts with ``family`` and whose owner has died.

    For clusters that live as long as a process (the tests'): one killed before
    its teardown leaves holders behind, which the next run removes. A cluster
    without an owner (``up`` from the command line) is left alone.
    """
    removed = []
    prefixes = {name.split("-holder-")[0] for name in map(_argv0, _pids())
                if name.startswith(family) and "-holder-" in name}
    for prefix in sorted(prefixes):
        try:
            owner = json.loads((RUN_DIR / prefix / "state.json").read_text())["owner"]
            if owner is not None:
                os.kill(owner, 0)
        except (OSError, ValueError, KeyError):  # no state, or its owner is gone
            removed += down(prefix)
    return removed


def leftovers(prefix: str = PREFIX, inodes: set[int] = frozenset()) -> list[str]:
    """What of ``prefix``'s cluster is still there (empty when it is all gone).

    Args:
        prefix: the cluster's name prefix.
        inodes: the network namespaces it had (``Cluster.inodes``), to find
            processes that were not holders.
    """
    found = []
    for name, pid in holders(prefix).items():
        found.append(f"holder process {pid} ({prefix}-holder-{name})")
    for pid in pids_in(set(inodes)):
        found.append(f"process {pid} ({_argv0(pid)}) in a cluster namespace")
    if (RUN_DIR / prefix).exists():
        found.append(f"state directory {RUN_DIR / prefix}")
    named = re.compile(rf"\b{prefix}\b")  # not mpidpt12 in mpidpt123
    netns = Path("/run/netns")
    if netns.is_dir():
        found += [f"named namespace {p}" for p in netns.iterdir() if named.search(p.name)]
    found += [f"mount {line}" for line in Path("/proc/self/mounts").read_text().splitlines()
              if named.search(line)]
    found += [f"host interface {line}" for line in _sh("ip", "-o", "link").splitlines()
              if named.search(line)]
    return found


# -- the launcher script -----------------------------------------------------------------

_LAUNCHER = """#!/bin/sh
# ssh stand-in for MPI launchers (hydra's -launcher-exec, Open MPI's plm_rsh_agent,
# I_MPI_HYDRA_BOOTSTRAP_EXEC): runs COMMAND inside node HOST's namespaces.
# Called as: {path} [ssh options] [user@]HOST COMMAND...
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;  # ssh options that take an argument
    -*) shift ;;
    *) break ;;
  esac
done
host=${{1#*@}}; shift
case "$host" in
{cases}
  *) echo "$0: no node named $host in cluster {prefix}" >&2; exit 255 ;;
esac
exec nsenter -t "$pid" -n -m -u -- /bin/sh -c "$*"
"""


def launcher_flavor(mpiexec: str) -> str:
    """Which launcher ``mpiexec`` is: "openmpi", "prrte" (a PRRTE of its own, e.g. built from
    its master branch, running Open MPI's ranks), "impi" (Intel MPI) or "hydra" (MPICH)."""
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30, env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                                                  OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    text = version.stdout + version.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "(PRRTE)" in text:
        return "prrte"
    return "impi" if "Intel(R) MPI" in text else "hydra"


# -- the cluster -------------------------------------------------------------------------


@dataclasses.dataclass
class JobResult:
    """How a job ended: exit status (None if killed at the limit), output, seconds."""

    returncode: int | None
    output: str
    seconds: float
    timed_out: bool
    swept: int  # processes left in the nodes after the launcher ended, killed by the harness

    def check(self) -> "JobResult":
        """Raise with the output's tail unless the job exited with status 0."""
        if self.returncode != 0:
            why = "ran past its time limit" if self.timed_out else f"exited with {self.returncode}"
            raise AssertionError(f"the job {why} after {self.seconds:.1f} s\n{self.output[-12000:]}")
        return self


class Job:
    """A running mpiexec (inside n0), its output gathered by a thread."""

    def __init__(self, cluster: "Cluster", argv: list[str], env: dict, echo: bool):
        self.cluster, self.argv, self.started = cluster, argv, time.monotonic()
        self._chunks: list[str] = []
        self._lock = threading.Lock()
        self.process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, errors="replace", start_new_session=True)
        self._reader = threading.Thread(target=self._read, args=(echo,), daemon=True)
        self._reader.start()

    def _read(self, echo: bool) -> None:
        for line in self.process.stdout:
            with self._lock:
                self._chunks.append(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()

    @property
    def output(self) -> str:
        with self._lock:
            return "".join(self._chunks)

    def wait_for(self, text: str, timeout: float) -> bool:
        """Wait until ``text`` appears in the output (True), or the job ends or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output:
                return True
            if self.process.poll() is not None:
                self._reader.join(1)
                return text in self.output
            time.sleep(0.1)
        return False

    def wait(self, timeout: float) -> JobResult:
        """Wait at most ``timeout`` more seconds, then kill the job; sweep the nodes."""
        timed_out = False
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        self.kill()
        swept = self.cluster.sweep()
        self._reader.join(5)
        return JobResult(None if timed_out else self.process.returncode, self.output,
                         time.monotonic() - self.started, timed_out, swept)

    def kill(self) -> None:
        """Kill the launcher's process group (the nodes' other processes: Cluster.sweep)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()


class Cluster:
    """N nodes in namespaces of their own, on a bridge, with shaped links.

    Args:
        nodes: how many nodes (hostnames n0 .. n{nodes-1}).
        rate: each node's link rate in tc's units (``1gbit``), both directions;
            None leaves the links unshaped.
        prefix: names the holder processes and the state directory
            ``/run/PREFIX``; two clusters need two prefixes.
        isolate: give each node its own /dev/shm, /tmp, /sys, boot id and
            machine id (False only to show what goes wrong without them).
        owner: the process whose death makes the cluster an orphan that
            ``down_orphans`` removes (default: this one; None: never).
    """

    def __init__(self, nodes: int = 2, *, rate: str | None = "1gbit", prefix: str = PREFIX,
                 isolate: bool = True, owner: int | None = _THIS_PROCESS):
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be in [1, 200], got {nodes}")
        if not re.fullmatch(r"[a-z][a-z0-9]{1,11}", prefix):
            raise ValueError(f"prefix must be 2-12 lowercase letters and digits, got {prefix!r}")
        if rate is not None:
            rate_bytes(rate)
        self.names = [f"n{index}" for index in range(nodes)]
        self.rate, self.prefix, self.isolate = rate, prefix, isolate
        self.owner = os.getpid() if owner == _THIS_PROCESS else owner
        self.dir = RUN_DIR / prefix
        self.launcher = self.dir / "launch.sh"
        self.pids: dict[str, int] = {}  # "n0" ... and "bridge" -> holder pid
        self.inodes: set[int] = set()  # the network namespaces, for sweeps and leftovers
        self._popens: list[subprocess.Popen] = []

    # -- life cycle

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "Cluster":
        """Create the bridge, the nodes and their links (removing any leftovers first)."""
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        down(self.prefix)
        try:
            self.dir.mkdir(parents=True)
            self._save()  # the owner first: down_orphans leaves a cluster being made alone
            self.pids["bridge"] = self._holder("bridge", "--net", setup=[
                "ip link set lo up", "ip link add br0 type bridge", "ip link set br0 up"])
            hosts = "".join(f"{self.address(name)} {name}\n" for name in self.names)
            for index, name in enumerate(self.names):
                self._make_node(index, name, hosts)
            self.inodes = {_net_inode(pid) for pid in self.pids.values()}
            self._write_launcher()
            self._save()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> list[str]:
        """Kill every process in the nodes, holders included; remove the state directory."""
        removed = down(self.prefix)
        for popen in self._popens:
            popen.wait()  # reap the holders this process started
        self._popens.clear()
        return removed

    @classmethod
    def attach(cls, prefix: str = PREFIX) -> "Cluster":
        """The cluster that ``up`` (another process) left running under ``prefix``."""
        state = RUN_DIR / prefix / "state.json"
        if not state.exists():
            raise RuntimeError(f"no cluster {prefix} is up ({state} missing): run 'up' first")
        saved = json.loads(state.read_text())
        cluster = cls(saved["nodes"], rate=saved["rate"], prefix=prefix, isolate=saved["isolate"],
                      owner=saved.get("owner"))
        live = holders(prefix)
        if live != saved["pids"]:
            raise RuntimeError(f"cluster {prefix} is broken: holders {saved['pids']} recorded, "
                               f"{live} alive; run 'down'")
        cluster.pids = live
        cluster.inodes = {_net_inode(pid) for pid in live.values()}
        return cluster

    def _save(self) -> None:
        state = dict(nodes=len(self.names), rate=self.rate, isolate=self.isolate, pids=self.pids,
                     owner=self.owner)
        (self.dir / "state.json").write_text(json.dumps(state, indent=1) + "\n")

    def _holder(self, name: str, *namespaces: str, setup: list[str]) -> int:
        """Start ``PREFIX-holder-NAME`` in new ``namespaces`` after ``setup``; its pid."""
        ready = self.dir / f"{name}.ready"
        log = self.dir / f"{name}.log"
        script = " && ".join([*setup, f"touch {ready}",
                              f"exec -a {self.prefix}-holder-{name} sleep infinity"])
        with open(log, "w") as out:
            popen = subprocess.Popen(["unshare", *namespaces, "--", "bash", "-c", script],
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                     start_new_session=True)
        self._popens.append(popen)
        deadline = time.monotonic() + 20
        while not ready.exists():
            if popen.poll() is not None or time.monotonic() > deadline:
                popen.kill()
                raise RuntimeError(f"node {name} did not come up: {log.read_text().strip()}")
            time.sleep(0.02)
        return popen.pid

    def _make_node(self, index: int, name: str, hosts: str) -> None:
        files = self.dir / name
        files.mkdir()
        (files / "hosts").write_text(f"127.0.0.1 localhost\n{hosts}")
        (files / "boot_id").write_text(f"{uuid.uuid4()}\n")
        (files / "machine-id").write_text(f"{uuid.uuid4().hex}\n")
        setup = [f"hostname {name}", "ip link set lo up",
                 f"mount --bind {files / 'hosts'} /etc/hosts"]
        if self.isolate:
            setup += ["mount -t tmpfs -o mode=1777 tmpfs /dev/shm"]
            # the node's own /tmp hides the host's: a checkout or Python under /tmp (a CI
            # clone in /tmp, say) is bound back at the same path, read through a handle on
            # the host's /tmp taken before the tmpfs covers it
            kept = _under_tmp()
            if kept:
                setup += [f"mkdir -p {files / 'host-tmp'}",
                          f"mount --bind /tmp {files / 'host-tmp'}"]
            setup += ["mount -t tmpfs -o mode=1777 tmpfs /tmp"]
            for path in kept:
                inside = files / "host-tmp" / path.relative_to("/tmp")
                setup += [f"mkdir -p {shlex.quote(str(path))}",
                          f"mount --bind {shlex.quote(str(inside))} {shlex.quote(str(path))}"]
            setup += ["mount -t sysfs sysfs /sys",  # this namespace's interfaces in /sys/class/net
                      f"mount --bind {files / 'boot_id'} /proc/sys/kernel/random/boot_id",
                      f"mount --bind {files / 'machine-id'} /etc/machine-id"]
            if Path("/var/lib/dbus/machine-id").exists():
                setup.append(f"mount --bind {files / 'machine-id'} /var/lib/dbus/machine-id")
        pid = self.pids[name] = self._holder(name, "--net", "--uts", "--mount",
                                             "--propagation", "private", setup=setup)
        bridge = ["nsenter", "-t", self.pids["bridge"], "-n", "--"]
        node = ["nsenter", "-t", pid, "-n", "--"]
        port = f"v{index}"
        _sh(*bridge, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", pid)
        _sh(*bridge, "ip", "link", "set", port, "master", "br0", "up")
        _sh(*node, "ip", "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
        _sh(*node, "ip", "link", "set", "eth0", "up")
        if self.rate is not None:
            # a burst of 10 ms at the rate, and at least 4 GSO packets: smaller buckets
            # cap the rate below the one asked for on a veth
            burst = int(max(rate_bytes(self.rate) / 100, 4 * 65536))
            for side, dev in ((bridge, port), (node, "eth0")):
                _sh(*side, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                    "burst", burst, "latency", "50ms")

    def _write_launcher(self) -> None:
        cases = "\n".join(f"  {name}|{self.address(name)}) pid={self.pids[name]} ;;"
                          for name in self.names)
        self.launcher.write_text(_LAUNCHER.format(path=self.launcher, cases=cases,
                                                  prefix=self.prefix))
        self.launcher.chmod(0o755)

    # -- nodes

    def address(self, name: str) -> str:
        """The node's address on the bridge."""
        return f"{SUBNET}.{self.names.index(name) + 1}"

    def nsenter(self, name: str, cwd: str | os.PathLike | None = None) -> list[str]:
        """The command prefix that runs a command inside node ``name``, in ``cwd`` (else here)."""
        return ["nsenter", "-t", str(self.pids[name]), "-n", "-m", "-u",
                f"--wd={cwd or os.getcwd()}", "--"]

    def exec(self, name: str, argv: list[str], *, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run ``argv`` inside node ``name`` and return its result (not checked)."""
        return subprocess.run([*self.nsenter(name), *map(str, argv)], capture_output=True,
                              text=True, timeout=timeout)

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes each node's eth0 has received and sent: {"n0": {"rx": .., "tx": ..}, ...}."""
        counts = {}
        for name in self.names:
            link = json.loads(_sh("nsenter", "-t", self.pids[name], "-n", "--",
                                  "ip", "-j", "-s", "link", "show", "dev", "eth0"))[0]
            counts[name] = {"rx": link["stats64"]["rx"]["bytes"],
                            "tx": link["stats64"]["tx"]["bytes"]}
        return counts

    def set_link(self, name: str, up: bool) -> None:
        """Set node ``name``'s port on the bridge up or down (a cable pulled at the switch)."""
        port = f"v{self.names.index(name)}"
        _sh("nsenter", "-t", self.pids["bridge"], "-n", "--", "ip", "link", "set", port,
            "up" if up else "down")

    def sweep(self) -> int:
        """Kill every process in the nodes but the holders; empty /dev/shm and /tmp. How many."""
        killed = _kill_all(self.inodes, spare=set(self.pids.values()))
        if self.isolate:
            for name in self.names:
                # -xdev: never into what is bound back from the host's /tmp (_under_tmp)
                self.exec(name, ["find", "/dev/shm", "/tmp", "-xdev", "-mindepth", "1",
                                 "-delete"])
        return killed

    # -- jobs

    def mpiexec(self, argv: list[str], *, ppn: int = 1, hosts: list[str] | None = None,
                mpiexec: str | None = None, env_names=(),
                options=()) -> tuple[list[str], dict]:
        """The command that runs ``argv`` on ``ppn`` ranks of each host, launched inside the first.

        Each library's own launcher, with the launcher script in place of ssh:
        MPICH's hydra (``-launcher-exec``), Open MPI's ``mpirun`` (``plm_rsh_agent``;
        ``-x`` for each of ``env_names``), Intel MPI's hydra (``I_MPI_HYDRA_BOOTSTRAP_EXEC``).
        ``options`` go to the launcher after the harness's own (``--with-ft ulfm``, say).

        Returns:
            (argv, environment variables the launcher needs).
        """
        hosts = hosts or self.names
        unknown = sorted(set(hosts) - set(self.names))
        if unknown:
            raise ValueError(f"hosts must be nodes of this cluster {self.names}, got {unknown}")
        launcher = mpiexec or str(Path(sys.executable).parent / "mpiexec")
        flavor, count = launcher_flavor(launcher), str(ppn * len(hosts))
        if flavor in ("openmpi", "prrte"):
            personality = ["--personality", "ompi"] if flavor == "prrte" else []
            line = [launcher, *personality, "--mca", "plm_rsh_agent", str(self.launcher),
                    "--host", ",".join(f"{host}:{ppn}" for host in hosts),
                    "--map-by", f"ppr:{ppn}:node:OVERSUBSCRIBE", "-n", count]
            for name in env_names:
                line += ["-x", name]
            env = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                       PRTE_ALLOW_RUN_AS_ROOT="1", PRTE_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        elif flavor == "impi":
            line = [launcher, "-hosts", ",".join(hosts), "-ppn", str(ppn), "-n", count]
            env = dict(I_MPI_HYDRA_BOOTSTRAP="ssh", I_MPI_HYDRA_BOOTSTRAP_EXEC=str(self.launcher),
                       I_MPI_FABRICS="shm:ofi", FI_PROVIDER="tcp")
        else:
            line = [launcher, "-launcher", "ssh", "-launcher-exec", str(self.launcher),
                    "-hosts", ",".join(hosts), "-ppn", str(ppn), "-n", count]
            env = {}
        return [*self.nsenter(hosts[0]), *line, *map(str, options), *map(str, argv)], env

    def launch(self, argv: list[str], *, ppn: int = 1, hosts: list[str] | None = None,
               env: dict | None = None, mpiexec: str | None = None, echo: bool = False,
               options=()) -> Job:
        """Start ``argv`` across the nodes (see ``mpiexec``); wait with ``Job.wait``."""
        env = dict(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        line, needed = self.mpiexec(argv, ppn=ppn, hosts=hosts, mpiexec=mpiexec, env_names=env,
                                    options=options)
        return Job(self, line, {**os.environ, **needed, **env}, echo)

    def run(self, argv: list[str], *, timeout: float, **options) -> JobResult:
        """Run a job to its end or to ``timeout`` seconds, whichever comes first; sweep after."""
        job = self.launch(argv, **options)
        try:
            return job.wait(timeout)
        finally:
            job.kill()


# -- command line ------------------------------------------------------------------------


def _print_counters(before: dict, after: dict) -> None:
    print(f"{'node':6}{'rx bytes':>16}{'tx bytes':>16}")
    for name in after:
        print(f"{name:6}{after[name]['rx'] - before[name]['rx']:>16,}"
              f"{after[name]['tx'] - before[name]['tx']:>16,}")


def _command(args) -> int:
    if args.command == "down":
        removed = down(args.prefix)
        print("\n".join(f"removed {item}" for item in removed) or "nothing to remove")
        return 0
    if args.command == "up":
        cluster = Cluster(args.nodes, rate=args.rate, prefix=args.prefix, isolate=args.isolate,
                          owner=args.owner).up()
        for name in cluster.names:
            print(f"{name}  {cluster.address(name):14} holder pid {cluster.pids[name]}")
        print(f"rate {args.rate}; launcher script {cluster.launcher}")
        return 0
    if args.command == "status":
        cluster = Cluster.attach(args.prefix)
        print(json.dumps(dict(pids=cluster.pids, counters=cluster.counters()), indent=1))
        return 0
    if args.command == "link":
        Cluster.attach(args.prefix).set_link(args.node, args.state == "up")
        return 0
    if args.command == "exec":
        return subprocess.call([*Cluster.attach(args.prefix).nsenter(args.node), *args.argv])
    # run: on the cluster that is up, or on one made for this job alone
    argv = [sys.executable if args.argv[:1] == ["python"] else args.argv[0], *args.argv[1:]]
    fresh = not (RUN_DIR / args.prefix / "state.json").exists()
    cluster = (Cluster(args.nodes, rate=args.rate, prefix=args.prefix, isolate=args.isolate).up()
               if fresh else Cluster.attach(args.prefix))
    try:
        before = cluster.counters()
        result = cluster.run(argv, ppn=args.ppn, timeout=args.timeout, echo=True,
                             hosts=args.hosts.split(",") if args.hosts else None)
        _print_counters(before, cluster.counters())
        print(f"exit status {result.returncode}, {result.seconds:.1f} s"
              + (f", killed at the {args.timeout} s limit" if result.timed_out else "")
              + (f", {result.swept} processes left in the nodes killed" if result.swept else ""))
        return 124 if result.timed_out else result.returncode
    finally:
        if fresh:
            cluster.down()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", default=PREFIX, help=f"names the cluster (default {PREFIX})")
    commands = parser.add_subparsers(dest="command", required=True)
    make = argparse.ArgumentParser(add_help=False)
    make.add_argument("--nodes", type=int, default=2, help="how many nodes (2)")
    make.add_argument("--rate", default="1gbit", help="each link's rate, tc units (1gbit)")
    make.add_argument("--no-isolate", dest="isolate", action="store_false",
                      help="share /dev/shm, /tmp, boot and machine id with the host (a demo)")
    up = commands.add_parser("up", parents=[make], help="create the nodes and leave them up")
    up.add_argument("--owner", type=int, help="a pid: once it has died, down_orphans removes "
                                              "the cluster (default: none, it stays)")
    commands.add_parser("down", help="remove the cluster and any leftovers of it")
    commands.add_parser("status", help="holder pids and byte counters")
    link = commands.add_parser("link", help="set a node's link up or down")
    link.add_argument("node")
    link.add_argument("state", choices=["up", "down"])
    run_exec = commands.add_parser("exec", help="run a command inside a node")
    run_exec.add_argument("node")
    run_exec.add_argument("argv", nargs=argparse.REMAINDER)
    run = commands.add_parser("run", parents=[make],
                              help="run an MPI job across the nodes (made for it if none is up); "
                                   "a first word 'python' becomes this Python")
    run.add_argument("--ppn", type=int, default=1, help="ranks per node")
    run.add_argument("--hosts", help="comma-separated nodes (default: all)")
    run.add_argument("--timeout", type=float, default=300, help="hard limit in seconds")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if getattr(args, "argv", None) and args.argv[0] == "--":
        args.argv = args.argv[1:]
    if args.command in ("run", "exec") and not args.argv:
        parser.error(f"{args.command} needs a command after --")
    try:
        return _command(args)
    except (RuntimeError, ValueError) as err:
        print(f"harness: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
