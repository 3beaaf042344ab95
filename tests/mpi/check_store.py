"""The store over MPI (mpidp.store) against torch's Store contract, and the ports a job opens.

Runs under mpiexec at 2 and 3 ranks. Every operation from every rank, the
timeouts, a missing key, a large value, many threads at once, gloo's start-up,
``monitored_barrier`` and ``new_group`` over it; then, from a process outside
the job, every TCP port the job's processes listen on.
"""

import os
import threading

import _idle
from _ports import listening, outsider

# The MPI library's own listeners (the launcher's PMI port, the fabric's), before mpidp runs:
# conftest has initialised MPI; nothing of mpidp's has run yet.
LIBRARY = listening(os.getpid())

import datetime  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpidp  # noqa: E402
from mpidp import rendezvous  # noqa: E402
from mpidp.store import MPIStore  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
_count = [0]


@pytest.fixture
def store():
    """The MPI store under a prefix of this test's own (every rank takes the same)."""
    _count[0] += 1
    shared = MPIStore(datetime.timedelta(seconds=30))
    yield dist.PrefixStore(f"check_store/{_count[0]}", shared)
    WORLD.Barrier()  # no rank leaves while another still asks rank 0


def test_mpidp_hands_torch_the_mpi_store_by_default():
    assert rendezvous.store_kind() == "mpi"
    assert not rendezvous._state.listened_at_import  # import started no TCP server
    mpidp.init_process_group("mpidp")
    try:
        inner = dist.distributed_c10d._get_default_store()
        while isinstance(inner, dist.PrefixStore):
            inner = inner.underlying_store
        assert isinstance(inner, MPIStore)
    finally:
        dist.destroy_process_group()


def test_every_operation_from_every_rank(store):
    store.set(f"key/{RANK}", f"value {RANK}")
    for peer in range(SIZE):
        assert store.get(f"key/{peer}") == f"value {peer}".encode()  # waits for the peer's set
    assert store.add("counter", RANK + 1) >= RANK + 1
    store.wait([f"key/{peer}" for peer in range(SIZE)])
    store.wait([f"key/{peer}" for peer in range(SIZE)], datetime.timedelta(seconds=5))
    assert store.check([f"key/{peer}" for peer in range(SIZE)])
    WORLD.Barrier()
    assert store.get("counter") == str(SIZE * (SIZE + 1) // 2).encode()
    assert store.add("counter", 0) == SIZE * (SIZE + 1) // 2
    store.append(f"log/{RANK}", "a")
    store.append(f"log/{RANK}", b"b")
    assert store.get(f"log/{RANK}") == b"ab"
    store.multi_set([f"m/{RANK}/x", f"m/{RANK}/y"], [b"1", "2"])
    assert store.multi_get([f"m/{RANK}/y", f"m/{RANK}/x"]) == [b"2", b"1"]
    WORLD.Barrier()
    inner = store.underlying_store
    before = inner.num_keys()
    assert before >= 1 + 4 * SIZE  # this test's keys at least (the prefix shares the store)
    WORLD.Barrier()
    assert store.delete_key(f"key/{RANK}") is True
    assert store.delete_key(f"key/{RANK}") is False
    WORLD.Barrier()
    assert inner.num_keys() == before - SIZE
    assert not store.check([f"key/{RANK}"])


def test_compare_set_follows_tcpstore(store):
    key = f"cas/{RANK}"
    assert store.compare_set(key, "expected", "new") == b"expected"  # missing, expected given
    assert not store.check([key])
    assert store.compare_set(key, "", "first") == b"first"  # missing, expected empty: set
    assert store.compare_set(key, "wrong", "second") == b"first"  # no match: the value
    assert store.compare_set(key, "first", "second") == b"second"  # match: swapped
    # one winner across ranks
    won = store.compare_set("race", "", f"rank {RANK}")
    assert WORLD.allgather(won) == [won] * SIZE


def test_get_and_wait_time_out_with_a_clear_error(store):
    store.set_timeout(datetime.timedelta(seconds=0.3))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"wait timeout after 0.3 s .*never/1"):
        store.get("never/1")
    assert 0.29 <= time.monotonic() - started < 10
    with pytest.raises(dist.DistStoreError, match=r"after 0.2 s .*never/2"):
        store.wait(["never/2"], datetime.timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match=r"never/3"):
        store.multi_get([f"key/{RANK}", "never/3"])
    store.set_timeout(datetime.timedelta(seconds=30))
    store.set(f"late/{RANK}", "1")  # the store still serves
    assert store.get(f"late/{(RANK + 1) % SIZE}") == b"1"


def test_a_missing_key(store):
    assert store.check(["missing"]) is False
    assert store.delete_key("missing") is False
    with pytest.raises(dist.DistStoreError):
        store.wait(["missing"], datetime.timedelta(seconds=0.05))
    with pytest.raises(dist.DistStoreError, match="not an integer"):
        store.set(f"text/{RANK}", "abc")
        store.add(f"text/{RANK}", 1)


def test_a_large_value(store):
    big = os.urandom(5 << 20) if RANK == SIZE - 1 else None
    big = WORLD.bcast(big, root=SIZE - 1)
    if RANK == SIZE - 1:
        store.set("big", big)
    assert store.get("big") == big  # rank 0 from its table, the others over MPI
    keys = [f"many/{i}" for i in range(300)]
    if RANK == 0:
        store.multi_set(keys, [str(i) * 200 for i in range(300)])  # > one inline message
    assert store.multi_get(keys) == [(str(i) * 200).encode() for i in range(300)]


def test_many_threads_at_once(store):
    threads, adds = 8, 25
    errors = []

    def work(index: int) -> None:
        try:
            store.set(f"t/{RANK}/{index}", f"{RANK}.{index}")
            for _ in range(adds):
                store.add("total", 1)
            peer = (RANK + 1) % SIZE  # a key another rank's thread sets, maybe later
            assert store.get(f"t/{peer}/{index}") == f"{peer}.{index}".encode()
            store.wait([f"t/{r}/{index}" for r in range(SIZE)])
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    running = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join(60)
    assert not errors, errors
    WORLD.Barrier()
    assert int(store.get("total")) == SIZE * threads * adds


def test_two_stores_on_two_threads_with_collectives_in_flight(store):
    """The store thread never waits on a collective: store calls while MPI collectives run."""
    other = dist.PrefixStore("second", store.underlying_store.clone())
    result = []

    def collectives() -> None:
        comm = WORLD.Dup()
        total = 0
        for step in range(50):
            total += comm.allreduce(RANK + step)
        comm.Free()
        result.append(total)

    thread = threading.Thread(target=collectives)
    thread.start()
    for step in range(20):
        (store if step % 2 else other).set(f"s/{RANK}/{step}", str(step))
        peer = (RANK + step) % SIZE
        assert (store if step % 2 else other).get(f"s/{peer}/{step}") == str(step).encode()
    thread.join(60)
    assert result == [sum(SIZE * (SIZE - 1) // 2 + SIZE * step for step in range(50))]


def _slack_of(native_id: int) -> int:
    with open(f"/proc/{native_id}/timerslack_ns") as f:
        return int(f.read())


@pytest.mark.skipif(not os.path.exists(f"/proc/{threading.get_native_id()}/timerslack_ns"),
                    reason="Linux's per-thread timer slack")
def test_polling_threads_take_a_fine_timer_slack_and_a_caller_gets_its_own_back(store):
    """mpidp/store/server.py, "Timer slack": the store thread polls with 1 us for its life; a
    caller's thread only while it waits for an answer that did not come at once."""
    own = 77_000  # ns: this test's own value for the calling thread
    before = _slack_of(threading.get_native_id())
    with open(f"/proc/{threading.get_native_id()}/timerslack_ns", "w") as f:
        f.write(str(own))
    try:
        if RANK == 1:
            store.get("late")  # rank 0 sets it 50 ms later: this caller polls meanwhile
        elif RANK == 0:
            time.sleep(0.05)
            store.set("late", "now")
            from mpidp.store import _shared
            assert _slack_of(_shared.service.thread.native_id) == 1000
        WORLD.Barrier()
        assert _slack_of(threading.get_native_id()) == own
    finally:
        with open(f"/proc/{threading.get_native_id()}/timerslack_ns", "w") as f:
            f.write(str(before))


@pytest.mark.parametrize("barrier", ["0", "1"])
def test_gloo_monitored_barrier_and_new_group_over_the_mpi_store(barrier, monkeypatch):
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", barrier)
    mpidp.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        tensor = torch.tensor([float(RANK + 1)])
        dist.all_reduce(tensor)
        assert tensor.item() == SIZE * (SIZE + 1) / 2
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
        pair = dist.new_group([0, 1])
        if RANK < 2:
            tensor = torch.ones(1)
            dist.all_reduce(tensor, group=pair)
            assert tensor.item() == 2
        mpidp.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    finally:
        dist.destroy_process_group()


def test_no_port_of_mpidps_and_an_outsider_changes_nothing():
    """From a process outside the job: every port the ranks listen on, except the MPI library's."""
    mpidp.init_process_group("mpidp")
    store = dist.distributed_c10d._get_default_store()
    store.set(f"in/{RANK}", "1")
    mine = listening(os.getpid()) - LIBRARY
    everything = WORLD.gather((LIBRARY, mine), root=0)
    assert mine == set(), f"rank {RANK}: mpidp listens on {sorted(mine)}"  # none of its own
    dist.destroy_process_group()
    mpidp.init_process_group("gloo")
    gloo = listening(os.getpid()) - LIBRARY
    assert all(host not in ("0.0.0.0", "::") for host, _ in gloo), gloo  # gloo's own pair ports
    ports = WORLD.gather(sorted(gloo), root=0)
    if RANK == 0 and SIZE == 2:  # the outsider once (at 2 ranks): it takes seconds
        library = sorted(set().union(*(lib for lib, _ in everything)))
        print(f"\nthe MPI library's (not probed): {library}")
        tried = outsider([f"{host}:{port}" for each in ports for host, port in each])
        print(tried)
        assert "accepted" not in tried, tried
    _idle.barrier(WORLD)  # the others sleep while rank 0's outsider runs
    try:
        tensor = torch.tensor([float(RANK + 1)])
        dist.all_reduce(tensor)  # the job goes on, unchanged
        assert tensor.item() == SIZE * (SIZE + 1) / 2
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        assert WORLD.allreduce(RANK) == SIZE * (SIZE - 1) // 2
    finally:
        dist.destroy_process_group()


def test_a_tcp_store_when_asked_listens_on_the_one_address():
    """Last in this file: its server runs until the process ends."""
    mpidp.init_process_group("gloo", store="tcp")
    try:
        host, port, _ = rendezvous.store_address()
        assert host == "127.0.0.1"  # every rank on this host
        if RANK == 0:
            assert (host, port) in listening(os.getpid())  # that address alone, not *
            assert ("0.0.0.0", port) not in listening(os.getpid())
            assert ("::", port) not in listening(os.getpid())
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        assert tensor.item() == SIZE
    finally:
        dist.destroy_process_group()
