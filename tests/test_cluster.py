"""Two real nodes on this machine (bench/cluster/harness.py): checks across them, a cut link.

Each test brings up its own cluster of 2 nodes (namespaces with their own
hostname, address, /dev/shm and boot id, joined by 1 Gbit/s veths through a
bridge), runs MPICH's hydra inside n0 across both, and asserts that nothing of
the cluster is left afterwards. Needs root; skipped with the reason otherwise.
The prefix carries this process's id, so runs of the suite side by side keep
apart; clusters of runs that were killed before their teardown are removed
at the start.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "cluster"))
import harness  # noqa: E402

WHY = harness.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no cluster: {WHY}")
PREFIX = f"mpidpt{os.getpid() % 100_000}"
if WHY is None:
    harness.down_orphans("mpidpt")  # clusters of earlier runs killed before their teardown
PPN = 2
MB = 2**20
# n0's decoy: n1 (198.18.0.2/24) has no route to it, yet its /15 holds n1's address too
DECOY, DECOY_PREFIX = "198.19.0.1", 15


def cluster():
    return harness.Cluster(2, rate="1gbit", prefix=PREFIX)


@pytest.fixture
def traces():
    """MPIDP_TRACE_DIR for a job that ends by the watchdog: without it the ranks left
    mpidp-trace-<job>/ in the checkout. Not under /tmp, which each node has of its own."""
    with tempfile.TemporaryDirectory(prefix="mpidp-trace-", dir="/var/tmp") as folder:
        yield folder


def assert_all_gone(made: harness.Cluster) -> None:
    assert made.inodes, "the cluster never came up"
    assert harness.leftovers(PREFIX, made.inodes) == []


def test_mpidp_across_two_nodes_sees_both_and_trains_as_one_process():
    made = cluster()
    with made:
        before = made.counters()
        result = made.run([sys.executable, "-m", "pytest", "-q", "-s", "-x", "-p",
                           "no:cacheprovider", str(ROOT / "tests" / "mpi" / "check_cluster.py")],
                          ppn=PPN, timeout=240, env={"CLUSTER_NODES": "2"}).check()
        after = made.counters()
    assert_all_gone(made)
    figures = re.findall(r"^CLUSTER (\S+) .*max_rel_diff=(\S+)", result.output, re.M)
    print("\n".join(f"{name}: max relative difference {diff}" for name, diff in figures))
    assert {name for name, _ in figures} >= {"ddp-shm-sgd", "ddp-shm-adam", "zero-stage1",
                                              "zero-stage2", "syncbn", "backend-torch-ddp"}
    for name in after:  # the 16 MB allreduce alone puts >= 16 MB on each link
        sent, received = (after[name][key] - before[name][key] for key in ("tx", "rx"))
        print(f"{name}: sent {sent / MB:.1f} MB, received {received / MB:.1f} MB on eth0")
        assert sent > 16 * MB and received > 16 * MB


def add_decoy(made: harness.Cluster) -> None:
    """Give n0 an interface ``decoy0`` holding DECOY, ahead of eth0: ``hostname -I`` lists it first.

    A namespace numbers its interfaces in creation order, so eth0 steps out to
    the bridge's namespace while decoy0 (a bridge without ports: the dummy
    driver may be missing) takes its number, then comes back after it and gets
    its address again (not its tc shaping, which this test does not need).
    """
    bridge, n0 = made.pids["bridge"], made.pids["n0"]
    script = (f"set -e; index=$(cat /sys/class/net/eth0/ifindex); "
              f"ip link set eth0 netns {bridge}; ip link add decoy0 index $index type bridge; "
              f"ip addr add {DECOY}/{DECOY_PREFIX} dev decoy0; ip link set decoy0 up; "
              f"nsenter -t {bridge} -n -- ip link set eth0 netns {n0}; "
              f"ip addr add {made.address('n0')}/24 dev eth0; ip link set eth0 up")
    done = made.exec("n0", ["bash", "-c", script])
    assert done.returncode == 0, done.stderr


def test_the_store_address_passes_over_a_decoy_and_an_unreachable_one_is_named():
    made = cluster()
    check = [sys.executable, str(ROOT / "tests" / "mpi" / "check_cluster_rendezvous.py")]
    cases = {"choice": {}, "iface": {"MPIDP_RDZV_IFACE": "eth0"},
             "decoy": {"MPIDP_RDZV_ADDR": DECOY, "MPIDP_RDZV_TIMEOUT": "2", "MPIDP_STORE": "tcp"}}
    with made:
        add_decoy(made)
        runs = {case: made.run(check, ppn=1, timeout=90, env={"CLUSTER_DECOY": DECOY, **env})
                for case, env in cases.items()}
    assert_all_gone(made)
    n0 = made.address("n0")
    for case, why in (("choice", f"interface eth0, on the link to n1 ({made.address('n1')})"),
                      ("iface", "MPIDP_RDZV_IFACE=eth0")):
        output = runs[case].check().output
        assert f"RDZV hostname-I {DECOY} {n0}" in output  # the naive choice is the decoy
        found = re.search(r"^RDZV address MASTER_ADDR=(\S+) MASTER_PORT=\d+ why=(.*)$", output,
                          re.M)
        print(f"{case}: {found[0]}")
        assert found.groups() == (n0, why)
        for backend in ("gloo", "mpidp"):
            assert f"RDZV backend {backend} all_reduce=3 monitored_barrier=passed" in output
        assert "RDZV outsider accepted none; mpidp ports none" in output
        print(f"{case}: {re.search(r'^RDZV outsider on n1 .*$', output, re.M)[0]}")
        assert "hostname of the client socket cannot be retrieved" not in output  # no TCPStore
        assert "RDZV done" in output
    failed = runs["decoy"]
    errors = re.findall(r"^RDZV error rank (\d+): (\w+): (.*)$", failed.output, re.M)
    print(f"decoy: exit status {failed.returncode} after {failed.seconds:.1f} s; "
          f"{errors[0][2] if errors else failed.output[-4000:]}")
    assert not failed.timed_out and failed.returncode == 1  # mpidp's abort: the job ended
    assert sorted(rank for rank, _, _ in errors) == ["0", "1"]  # every rank raised...
    assert {(kind, text) for _, kind, text in errors} == {("DistNetworkError", errors[0][2])}
    text = errors[0][2]  # ...the same error, naming the rank, the address, port and variables
    assert re.search(rf"rank 1: could not connect to the rendezvous store at {DECOY}:\d+ "
                     rf"\(rank 0's address, chosen from MPIDP_RDZV_ADDR\) within 2 s", text)
    assert "MPIDP_RDZV_IFACE" in text and "MPIDP_RDZV_TIMEOUT" in text


def test_a_cut_link_ends_the_job_with_the_watchdogs_report(traces):
    made = cluster()
    with made:
        train = ROOT / "bench" / "cluster" / "train_until_cut.py"
        job = made.launch([sys.executable, str(train)], ppn=PPN,
                          env={"MPIDP_TIMEOUT": "3", "MPIDP_TRACE_DIR": traces})
        try:
            assert job.wait_for("step 3 rank 2", 120), f"n1 never trained:\n{job.output[-4000:]}"
            made.set_link("n1", up=False)
            result = job.wait(60)
        finally:
            job.kill()
    assert_all_gone(made)
    print(result.output[-3000:])
    assert not result.timed_out, "the job did not end by itself within 60 s of the cut"
    assert result.returncode == 124  # the watchdog's MPI_Abort
    summary = re.search(r"stall summary: .*", result.output)
    assert summary, result.output[-4000:]
    assert "ranks 2-3: no report" in summary[0]  # the ranks behind the cut link
    assert result.swept > 0  # n1's processes, which the launcher left, killed by the harness


def test_the_watchdog_accounts_for_every_rank_across_nodes(traces):
    """Issue 29: rank 3 (on n1) sleeps in user code at DDP step 3 while the others wait in a
    bucket; rank 0's summary must name rank 3's line, not "no report" (its watchdog answered
    over a receive posted for it: ANY_SOURCE missed messages from the other node)."""
    made = cluster()
    with made:
        result = made.run([sys.executable, str(ROOT / "tests" / "mpi" / "stall.py"), "sleep", "3",
                           "inline"], ppn=PPN, timeout=180,
                          env={"MPIDP_TIMEOUT": "3", "MPIDP_TRACE_DIR": traces})
    assert_all_gone(made)
    summary = re.search(r"stall summary: .*", result.output)
    assert summary, result.output[-4000:]
    print(summary[0])
    assert result.returncode == 124, result.output[-4000:]
    assert "no report" not in summary[0], summary[0]
    for rank in (0, 1, 2):
        assert re.search(rf"\brank {rank}: waiting in DDP step 3 bucket", summary[0]), summary[0]
    assert "rank 3: not in an mpidp collective, main thread at tests/mpi/stall.py:" in summary[0]


def test_the_command_line_kills_a_job_at_its_limit_and_down_removes_everything():
    script = [sys.executable, str(ROOT / "bench" / "cluster" / "harness.py"), "--prefix", PREFIX]
    inodes = set()
    try:
        subprocess.run([*script, "up", "--nodes", "2", "--rate", "100mbit", "--owner",
                        str(os.getpid())], check=True, timeout=60, capture_output=True)
        inodes = harness.Cluster.attach(PREFIX).inodes
        run = subprocess.run([*script, "run", "--ppn", "1", "--timeout", "3", "--", "sleep", "60"],
                             timeout=60, capture_output=True, text=True)
        assert run.returncode == 124, run.stdout + run.stderr
        assert "killed at the 3.0 s limit" in run.stdout
        assert harness.Cluster.attach(PREFIX).inodes == inodes  # the nodes outlive the job
    finally:
        down = subprocess.run([*script, "down"], timeout=60, capture_output=True, text=True)
    assert "removed" in down.stdout
    assert inodes and harness.leftovers(PREFIX, inodes) == []


def test_a_cluster_whose_owner_was_killed_is_removed_by_the_next_run():
    prefix = f"{PREFIX}o"
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT / 'bench' / 'cluster')!r}); "
            f"import harness; harness.Cluster(2, prefix={prefix!r}).up(); print('up', flush=True); "
            f"time.sleep(120)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    inodes = set()
    try:
        assert owner.stdout.readline().strip() == "up"
        inodes = harness.Cluster.attach(prefix).inodes
        assert not any(prefix in item for item in harness.down_orphans("mpidpt"))  # alive
        owner.kill()
        owner.wait()
        assert harness.holders(prefix)  # the nodes outlive their owner...
        assert any(prefix in item for item in harness.down_orphans("mpidpt"))  # ...until this
    finally:
        owner.kill()
        owner.wait()
        harness.down(prefix)
    assert inodes and harness.leftovers(prefix, inodes) == []
