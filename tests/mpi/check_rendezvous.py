"""Every torch.distributed backend started from MPI: the variables, the shared store, its errors.

Runs under mpiexec at 2 and 3 ranks with none of MASTER_ADDR, MASTER_PORT,
RANK or WORLD_SIZE set by the launcher: mpidp exports them at import; the
store travels over MPI (mpidp.store), or is torch's TCPStore when asked
(mpidp.rendezvous). The store's own tests: tests/mpi/check_store.py. The two-host cases (a decoy
address the other host cannot reach) need the network-namespace cluster
harness: tests/mpi/check_cluster_rendezvous.py, run by tests/test_cluster.py.
"""

import datetime
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import _idle
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidp
from mpidp import address, rendezvous, watchdog

RANK, SIZE = mpidp.rank(), mpidp.size()
WORLD = MPI.COMM_WORLD
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env_var():
    """Set variables for one test, restored after it."""
    saved = {}

    def set_var(name, value):
        saved.setdefault(name, os.environ.get(name))
        os.environ[name] = value
    yield set_var
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _sum_of_ranks(group=None) -> float:
    tensor = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(tensor, group=group)
    return tensor.item()


def test_the_usual_variables_come_from_mpi():
    env = os.environ
    assert (env["RANK"], env["WORLD_SIZE"]) == (str(RANK), str(SIZE))
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(mpidp.local_rank()),
                                                            str(mpidp.local_size()))
    assert env["GROUP_RANK"] == env["NODE_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
    assert env["MASTER_ADDR"] == "127.0.0.1"  # every rank on one host
    host, port, why = rendezvous.master_address()
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (host, str(port)) and "host" in why
    assert WORLD.allgather(env["MASTER_PORT"]) == [env["MASTER_PORT"]] * SIZE
    # no server started by import (a test of this launch may have asked for a TCP one since)
    assert rendezvous.store_kind() == "mpi" and not rendezvous._state.listened_at_import


@pytest.mark.parametrize("backend,store", [("gloo", None), ("mpidp", None), (None, None),
                                           ("cpu:gloo,cuda:gloo", None), ("gloo", "tcp")])
def test_backends_start_with_a_shared_store_and_init_barrier(backend, store, env_var):
    env_var("TORCH_DIST_INIT_BARRIER", "1")  # torch's store-based barrier after the start
    mpidp.init_process_group(backend, store=store, timeout=datetime.timedelta(seconds=60))
    try:
        expected = SIZE * (SIZE + 1) / 2
        assert _sum_of_ranks() == expected
        if backend is None:
            assert dist.get_backend() == rendezvous.default_backend() == "mpidp"  # no CUDA here
        store = dist.distributed_c10d._get_default_store()
        store.set(f"from-{RANK}", str(RANK))  # a store every rank shares
        assert [store.get(f"from-{peer}").decode() for peer in range(SIZE)] == \
            [str(peer) for peer in range(SIZE)]
        pair = dist.new_group([0, 1], backend="gloo")  # gloo subgroups use the same store
        if RANK < 2:
            assert _sum_of_ranks(pair) == 3
        mpidp.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    finally:
        dist.destroy_process_group()


def test_gloo_waits_the_watchdogs_timeout_unless_told_otherwise():
    """A gloo group's timeout is the stall watchdog's: its stalls end the job as mpidp's do."""
    seconds, action = watchdog.get_timeout()
    cpu = torch.device("cpu")
    try:
        watchdog.set_timeout(5)
        for kwargs, expected in (({}, 5), ({"timeout": datetime.timedelta(seconds=7)}, 7)):
            mpidp.init_process_group("gloo", **kwargs)
            try:
                group = dist.distributed_c10d._get_default_group()
                assert group._get_backend(cpu).options._timeout.total_seconds() == expected
            finally:
                dist.destroy_process_group()
        assert rendezvous.with_group_timeout("mpidp", {}) == {}  # the watchdog sees its stalls
        watchdog.set_timeout(5, action="report")  # the job goes on after a stall: torch's default
        assert rendezvous.with_group_timeout("gloo", {}) == {}
        watchdog.set_timeout(0, action="abort")  # off
        assert rendezvous.with_group_timeout("cpu:gloo,cuda:nccl", {}) == {}
    finally:
        watchdog.set_timeout(None, action=action)
    assert watchdog.get_timeout() == (seconds, action)


def test_a_user_env_init_after_import_uses_mpidp_store():
    """torchrun-style code: dist.init_process_group("gloo") with env:// reads mpidp's variables
    and connects to its store (no second server on MASTER_PORT), twice in a row."""
    for _ in range(2):
        dist.init_process_group("gloo")
        try:
            assert _sum_of_ranks() == SIZE * (SIZE + 1) / 2
        finally:
            dist.destroy_process_group()


def test_monitored_barrier_over_mpidp_names_the_rank_that_did_not_arrive():
    mpidp.init_process_group("mpidp")
    try:
        timeout = datetime.timedelta(seconds=1.5)
        mpidp.monitored_barrier(timeout=timeout, wait_all_ranks=True)  # all arrive
        if RANK == 0:
            with pytest.raises(RuntimeError, match="Rank 1 failed to pass monitoredBarrier"):
                mpidp.monitored_barrier(timeout=timeout)
        elif RANK > 1:
            with pytest.raises(RuntimeError, match=f"Rank {RANK} successfully reached "
                                                   f"monitoredBarrier, but received errors"):
                mpidp.monitored_barrier(timeout=timeout)
        WORLD.Barrier()
    finally:
        dist.destroy_process_group()


def test_a_device_map_mixing_mpidp_with_another_backend_is_refused():
    with pytest.raises(ValueError, match="drops the other backends"):
        mpidp.init_process_group("cpu:mpidp,cuda:nccl")


def test_rank_and_size_are_checked_against_mpi():
    with pytest.raises(ValueError, match=f"world_size={SIZE + 1} disagrees with MPI"):
        mpidp.init_process_group("gloo", world_size=SIZE + 1, rank=RANK)
    assert not dist.is_initialized()


def test_the_local_store_is_for_mpidp_alone():
    with pytest.raises(ValueError, match="store='local' works for the 'mpidp' backend alone"):
        mpidp.init_process_group("gloo", store="local")
    mpidp.init_process_group("mpidp", store="local")
    try:
        assert _sum_of_ranks() == SIZE * (SIZE + 1) / 2
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        assert isinstance(store, dist.HashStore)
        with pytest.raises(RuntimeError, match="monitored_barrier needs a store shared"):
            mpidp.monitored_barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fresh_state(monkeypatch):
    """rendezvous' module state, restored after the test (the server keeps running)."""
    for name in ("server", "listener", "address", "master", "problem", "client"):
        monkeypatch.setattr(rendezvous._state, name, getattr(rendezvous._state, name))


def test_a_rank_that_cannot_connect_raises_on_every_rank(fresh_state, env_var):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed = WORLD.bcast(probe.getsockname()[1], root=0)
    env_var("MPIDP_RDZV_TIMEOUT", "0.5")
    rendezvous._state.client = None
    rendezvous._state.address = ("127.0.0.1", closed, "a test")
    if SIZE == 1:
        pytest.skip("rank 0 alone never connects")
    with pytest.raises(dist.DistNetworkError) as raised:
        rendezvous._shared_store()
    text = str(raised.value)
    assert f"could not connect to the rendezvous store at 127.0.0.1:{closed}" in text
    assert "MPIDP_RDZV_ADDR" in text and "MPIDP_RDZV_IFACE" in text
    assert ("rank 1:" if SIZE == 2 else f"ranks 1-{SIZE - 1}:") in text  # the failing ranks


def test_the_address_variables_override_the_choice(fresh_state, env_var):
    env_var("MPIDP_RDZV_ADDR", "127.0.0.1")
    rendezvous._start_server(WORLD)
    assert rendezvous._state.address[0] == "127.0.0.1" and rendezvous._state.problem is None
    assert rendezvous._state.address[2] == "MPIDP_RDZV_ADDR"
    env_var("MPIDP_RDZV_ADDR", "")
    env_var("MPIDP_RDZV_IFACE", "lo")
    rendezvous._start_server(WORLD)
    assert rendezvous._state.address[:1] == ("127.0.0.1",)
    env_var("MPIDP_RDZV_IFACE", "no-such-interface0")
    rendezvous._start_server(WORLD)
    assert "MPIDP_RDZV_IFACE='no-such-interface0'" in rendezvous._state.problem
    assert "its interfaces: " in rendezvous._state.problem


def test_the_address_is_the_interface_on_the_link_to_the_other_node():
    own = {"lo": ("127.0.0.1", "255.0.0.0"), "docker0": ("172.17.0.1", "255.255.0.0"),
           "eth0": ("10.1.0.5", "255.255.255.0"), "ib0": ("192.168.7.5", "255.255.255.0")}
    peers = [("node2", ["172.18.0.1", "192.168.7.6"])]  # its decoy bridge first, then IPoIB
    chosen, why = address.choose(own, peers)
    assert chosen == "192.168.7.5" and "ib0" in why
    # two subnets hold the peer: the narrowest is the link (the kernel's longest prefix)
    wider = {"br1": ("10.200.0.1", "255.0.0.0"), "eth0": ("10.1.0.5", "255.255.255.0")}
    assert address.choose(wider, [("node2", ["10.1.0.6"])])[0] == "10.1.0.5"
    # no shared subnet: the kernel's route toward the peer decides (here: this host's own)
    here = address.interfaces()
    reachable = [a for a, _ in here.values() if not a.startswith("127.")]
    if reachable:
        assert address.choose({}, [("peer", reachable)])[0] == address.route_source(reachable[0])


@pytest.mark.parametrize("differs", ["backend", "store", "rank"])
def test_init_arguments_that_differ_on_one_rank_are_the_same_error_on_every_rank(differs):
    """Found by review: they left the other ranks in the rendezvous until the watchdog,
    or ended in MPI's "Message truncated"."""
    last = RANK == SIZE - 1
    kwargs = {"backend": "gloo" if last and differs == "backend" else "mpidp"}
    if differs == "store":
        kwargs["store"] = "local" if last else "tcp"
    if differs == "rank":
        kwargs["rank"] = 0 if last else RANK
    expected = {"backend": "every rank must pass the same backend, store and init_method",
                "store": "every rank must pass the same backend, store and init_method",
                "rank": f"rank {SIZE - 1}: rank=0 disagrees with MPI"}[differs]
    with pytest.raises(ValueError, match=expected):
        mpidp.init_process_group(**kwargs)
    assert not dist.is_initialized()
    mpidp.init_process_group("mpidp")  # every rank goes on, in step
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == SIZE
    dist.destroy_process_group()


def test_a_given_store_address_must_resolve_to_rank_0s_host():
    """It used to reach the server's start-up: ~2.7 x MPIDP_RDZV_TIMEOUT, then an error
    naming neither the variable nor the rule."""
    with pytest.raises(ValueError, match=r"MPIDP_RDZV_ADDR='not_an::addr' does not resolve"):
        address.given_address("not_an::addr")
    with pytest.raises(ValueError, match=r"MPIDP_RDZV_ADDR='10\.255\.255\.1' \(10\.255\.255\.1\) "
                                         r"is no address of rank 0's host .*its interfaces: "):
        address.given_address("10.255.255.1")
    assert address.given_address("127.0.0.1") == "127.0.0.1"
    assert address.given_address("::1") == "::1"


def _launch(nprocs: int, args: list[str], **extra: str) -> subprocess.CompletedProcess:
    """A nested job from rank 0: this job's PMI and MPI variables removed, mpidp's too."""
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith(("PMI_", "HYDRA", "MPIR", "MPICH", "OMPI", "PMIX", "PRTE"))
               or k.startswith("OMPI_ALLOW_RUN_AS_ROOT"))  # the user's, not the job's
           and k not in rendezvous.exported()}
    env.update(extra)
    beside = Path(sys.executable).parent / "mpiexec"  # the wheel's, else the one on PATH
    launcher = str(beside) if beside.exists() else shutil.which("mpiexec")
    command = [launcher, "-n", str(nprocs), sys.executable,
               "-m", "mpidp", "run", *args]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_healer_refuses_the_tcp_store_on_every_rank(monkeypatch):
    """Where the job can heal (ULFM forced here): torch.distributed over torch's TCPStore is
    refused as the MPI store is (check_healing.py): a heal makes torch's groups again over a
    process-local store, so keys shared through the TCP store would be each rank's alone."""
    import tempfile

    monkeypatch.setattr(mpidp.healing, "ulfm", lambda: True)
    directory = WORLD.bcast(tempfile.mkdtemp(prefix="mpidp-heal-") if RANK == 0 else None)
    mpidp.init_process_group("mpidp", store="tcp")
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        data = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1))
        checkpointer = mpidp.Checkpointer(
            directory, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            sampler=mpidp.DistributedSampler(data), batch_size=1, signals=())
        try:
            with pytest.raises(ValueError, match=r"store is shared \(TCPStore\).*store=\"local\""):
                mpidp.Healer(checkpointer)
        finally:
            checkpointer.close()
    finally:
        dist.destroy_process_group()
        WORLD.Barrier()
        if RANK == 0:
            shutil.rmtree(directory, ignore_errors=True)


def test_python_m_mpidp_run_starts_a_torchrun_style_script(tmp_path_factory):
    """No import of mpidp in the script: `python -m mpidp run` exports the variables,
    runs it as __main__, and ends the job when one rank raises."""
    if SIZE != 2:
        pytest.skip("launches its own 2-rank job: once is enough (at 2 ranks)")
    if RANK == 0:
        script = Path(os.environ.get("TMPDIR", "/tmp")) / f"torchrun_style_{os.getpid()}.py"
        script.write_text(
            "import os, sys, torch, torch.distributed as dist\n"
            "assert __name__ == '__main__'\n"
            "dist.init_process_group('gloo')\n"
            "t = torch.ones(1) * (int(os.environ['RANK']) + 1)\n"
            "dist.all_reduce(t)\n"
            # one write(2) per line: print() writes its parts one by one, and the
            # launcher interleaves two ranks' parts ("sumsum  33 ...", seen in CI)
            "os.write(1, f'sum {int(t.item())} args {sys.argv[1:]}\\n'.encode())\n"
            "if sys.argv[1:] == ['--fail'] and dist.get_rank() == 1:\n"
            "    raise RuntimeError('rank 1 gives up')\n"
            "if sys.argv[1:] == ['--exit'] and dist.get_rank() == 1:\n"
            "    sys.exit(3)\n"
            "dist.destroy_process_group()\n")
        try:
            done = _launch(2, [str(script), "--x"])
            assert done.returncode == 0, done.stderr[-3000:]
            assert done.stdout.count("sum 3 args ['--x']") == 2, done.stdout
            # asked for: torch's TCPStore, started at import on the one address, for env://
            tcp = _launch(2, [str(script), "--x"], MPIDP_STORE="tcp")
            assert tcp.returncode == 0, tcp.stderr[-3000:]
            assert tcp.stdout.count("sum 3 args ['--x']") == 2, tcp.stdout
            failed = _launch(2, [str(script), "--fail"])
            assert failed.returncode != 0
            assert "[mpidp rank 1/2] RuntimeError: rank 1 gives up" in failed.stderr, \
                failed.stderr[-3000:]
            # sys.exit(3) on one rank ends the job with its status (it once left the other
            # rank waiting: the script's frame did not exist when mpidp looked for __main__)
            exited = _launch(2, [str(script), "--exit"])
            assert exited.returncode == 3, exited.stderr[-3000:]
            assert "[mpidp rank 1/2] exiting with status 3" in exited.stderr
            # a store that cannot start: mpidp's reason, not torch's "MASTER_ADDR expected"
            nowhere = _launch(2, [str(script), "--x"], MPIDP_RDZV_IFACE="nosuch0")
            assert nowhere.returncode != 0
            assert "DistNetworkError: mpidp rendezvous: rank 0 could not choose the rendezvous " \
                "address: ValueError: MPIDP_RDZV_IFACE='nosuch0'" in nowhere.stderr, \
                nowhere.stderr[-3000:]
            # a setting that decides whether import mpidp starts the store, on one rank
            # only: the same error on every rank (it once hung in the store's start-up)
            python = [sys.executable, "-m", "mpidp", "run", str(script), "--x"]
            split = _launch(1, [*python[4:], ":", "-n", "1", "env", "MPIDP_STORE=local", *python])
            assert split.returncode != 0  # the first rank to abort ends the other
            assert "/2] ValueError: import mpidp: MPIDP_EXPORT_ENV, MPIDP_STORE, MASTER_ADDR and " \
                "MASTER_PORT must be set alike on every rank" in split.stderr, split.stderr[-3000:]
            assert "rank 0: MPIDP_EXPORT_ENV=1, MPIDP_STORE=mpi" in split.stderr
            assert "rank 1: MPIDP_EXPORT_ENV=1, MPIDP_STORE=local" in split.stderr
        finally:
            script.unlink()
    _idle.barrier(WORLD)  # rank 1 sleeps while rank 0's jobs run
