"""Two of everything at once: the concurrency rules of docs/concurrency.md under load.

Run on every rank under mpiexec (tests/test_mpi.py, 2 and 3 ranks). Schedules are
randomized with seeds fixed per test (the same on every rank where the order
must agree, per rank where it may differ), so a failure can be run again.
"""

import copy
import datetime
import os
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

import mpidp
import races
from mpidp.process_group import work as _work

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def _differs(match: str):
    """What a call that differs across ranks raises: the backend's call check, or under
    MPIDP_DEBUG the debug check that runs before it and names each rank's call."""
    if mpidp.comm.checks._DEBUG:
        return pytest.raises(ValueError, match=r"collective calls differ across ranks: ranks? 0\b")
    return pytest.raises(_work.CallMismatch, match=match)


@pytest.fixture(scope="module", autouse=True)
def backend():
    mpidp.init_process_group()
    yield
    dist.destroy_process_group()


def _gan():
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    d = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    return g, d


@pytest.mark.parametrize("shared_memory", [True, False])
@pytest.mark.parametrize("overlap", ["inline", "thread", "nonblocking"])
def test_two_ddps_in_one_backward_equal_one_process(overlap, shared_memory):
    """A GAN step, loss = D(G(z)): two DDPs reduce in the same backward (issue 17, item 1)."""
    if shared_memory and SIZE == 1:
        pytest.skip("shared memory needs two ranks")
    g, d = _gan()
    g0, d0 = copy.deepcopy(g), copy.deepcopy(d)
    z = torch.randn(4 * SIZE, 16, generator=torch.Generator().manual_seed(1))
    d0(g0(z)).mean().backward()
    expected = [p.grad for p in [*g0.parameters(), *d0.parameters()]]
    options = dict(overlap=overlap, bucket_cap_mb=0.002, shared_memory=shared_memory)
    with mpidp.DistributedDataParallel(g, **options) as dg, \
            mpidp.DistributedDataParallel(d, **options) as dd:
        for _ in range(12):
            for p in [*g.parameters(), *d.parameters()]:
                p.grad = None
            dd(dg(z[RANK * 4:(RANK + 1) * 4])).mean().backward()
            for p, want in zip([*g.parameters(), *d.parameters()], expected):
                torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def groups():
    made = races.make_groups()
    yield made
    for group in made[1:]:
        dist.destroy_process_group(group)


RACE_SEEDS = os.environ.get("RACE_SEEDS", ",".join(map(str, range(1, 21))))


@pytest.mark.parametrize("seed", [int(seed) for seed in RACE_SEEDS.split(",")])
def test_schedule(seed, groups):
    """A randomized schedule (tests/mpi/races.py): DDPs, ZeRO and backend groups at once."""
    print(races.run(seed, groups))


def test_async_chunked_allreduces_on_two_groups_in_any_wait_order():
    """Two groups over the same ranks, large async all_reduces, waits in a per-rank random
    order (issue 17, item 2: one rank's progress thread blocked in one group's chunks while
    it owed a peer the other's)."""
    other = dist.new_group(list(range(SIZE)))
    rng = random.Random(100 + RANK)  # per rank: the order of waits may differ
    numel = (4 << 20) // 4 + 1000  # above the default 4 MiB chunk: chunked
    for round_ in range(12):
        tensors = [torch.full((numel,), float(RANK + k)) for k in range(3)]
        works = [dist.all_reduce(t, group=[None, other][k % 2], async_op=True)
                 for k, t in enumerate(tensors)]
        rng.shuffle(works)
        for w in works:
            w.wait()
        for k, t in enumerate(tensors):
            assert t[0].item() == t[-1].item() == sum(r + k for r in range(SIZE)), round_
    dist.destroy_process_group(other)


def test_chunked_allreduce_takes_one_path_whatever_the_layout():
    """A non-contiguous tensor on some ranks only: the size alone picks the chunked path."""
    numel = (4 << 20) // 4 + 64
    base = torch.full((2, numel), float(RANK + 1))
    tensor = base[0] if RANK % 2 == 0 else base.t().contiguous().t()[0]
    assert tensor.is_contiguous() == (RANK % 2 == 0)
    dist.all_reduce(tensor)
    assert torch.all(tensor == SIZE * (SIZE + 1) / 2)


@pytest.mark.skipif(mpidp.comm.checks._DEBUG, reason="MPIDP_DEBUG checks a call across ranks "
                    "before it starts, waiting for every rank to make it "
                    "(docs/mismatched-calls.md)")
def test_group_timeout_fails_wait_and_future_with_torch_error():
    """One rank is late past the group's timeout (issue 17, item 4): wait() raises
    DistBackendError after the timeout, not never; the late call then matches."""
    group = dist.new_group(list(range(SIZE)), timeout=datetime.timedelta(seconds=1))
    tensor = torch.ones(8)
    if RANK == 0 and SIZE > 1:
        work = dist.all_reduce(tensor, group=group, async_op=True)
        start = time.monotonic()
        with pytest.raises(dist.DistBackendError, match="timeout of 1 s"):
            work.wait()
        assert 0.7 < time.monotonic() - start < 3
        with pytest.raises(dist.DistBackendError):
            work.get_future().wait()
        with pytest.raises(dist.DistBackendError, match="timeout of 1 s"):
            dist.all_reduce(torch.ones(8), group=group)  # blocking form
    else:
        time.sleep(3.5 if SIZE > 1 else 0)  # past rank 0's two timeouts, with 1.5 s to spare
        dist.all_reduce(tensor, group=group)  # matches rank 0's abandoned call
        if SIZE > 1:
            dist.all_reduce(torch.ones(8), group=group)  # and its blocking one
    MPI.COMM_WORLD.Barrier()



@pytest.mark.skipif(mpidp.comm.checks._DEBUG, reason="MPIDP_DEBUG checks a call across ranks "
                    "before it starts, waiting for every rank to make it")
def test_a_work_one_thread_waits_is_not_expired_under_it_by_another():
    """Rule 9: a Work that one thread claimed (its wait's own timeout longer than the group's)
    is not failed under it by a second thread's wait that reached the group's deadline (it was:
    the first raised 'pop from empty list' when the late peer came), nor by a future's callback
    that waits on it on the progress thread; all three get the sum."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    group = dist.new_group(list(range(SIZE)), timeout=datetime.timedelta(seconds=0.2))
    tensor = torch.ones(8)
    if RANK == 0:
        work = dist.all_reduce(tensor, group=group, async_op=True)
        outcomes = {}

        def wait(name, timeout):
            try:
                work.wait(timeout)
                outcomes[name] = tensor.tolist()
            except Exception as error:
                outcomes[name] = f"{type(error).__name__}: {error}"

        claimant = threading.Thread(target=wait, args=("claimant", datetime.timedelta(seconds=60)))
        claimant.start()
        while work._state == "pending" and claimant.is_alive():
            time.sleep(1e-4)
        # the peers' match comes later: the callback runs on the progress thread
        chained = dist.all_reduce(torch.ones(1), async_op=True).get_future().then(
            lambda future: wait("callback", datetime.timedelta(0)))
        wait("second", datetime.timedelta(0))  # until the group's deadline
        claimant.join()
        chained.wait()
        assert outcomes == {name: [float(SIZE)] * 8 for name in ("claimant", "second", "callback")}
    else:
        time.sleep(0.1)
        dist.all_reduce(torch.ones(1))  # ends rank 0's chained all_reduce
        time.sleep(0.5)  # past rank 0's group deadline
        dist.all_reduce(tensor, group=group)
    MPI.COMM_WORLD.Barrier()
    dist.destroy_process_group(group)

def test_abort_fails_pending_and_later_operations():
    group = dist.new_group(list(range(SIZE)))
    backend = group  # torch hands out the ProcessGroupMPIDP itself
    assert isinstance(backend, mpidp.process_group.ProcessGroupMPIDP)
    if SIZE > 1 and RANK == 0:
        work = dist.all_reduce(torch.ones(4), group=group, async_op=True)
        backend.abort()
        with pytest.raises(dist.DistBackendError, match="aborted"):
            work.wait()
        with pytest.raises(dist.DistBackendError, match="aborted"):
            dist.all_reduce(torch.ones(4), group=group)
    elif SIZE > 1:
        dist.all_reduce(torch.ones(4), group=group)  # matches rank 0's aborted call
    MPI.COMM_WORLD.Barrier()


def test_blocking_results_stay_per_thread():
    """The reused completed Work of blocking calls is one per thread."""
    import threading
    seen = {}

    def call(name):
        seen[name] = _work.blocking([name])

    threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen[0].result() == [0] and seen[1].result() == [1]


def test_mpi_failure_names_the_call_and_the_way_on():
    error = mpidp.errors.mpi_failure("allreduce op=sum dtype=float32 count=10",
                                     MPI.Exception(MPI.ERR_TRUNCATE))
    text = str(error)
    assert "allreduce op=sum dtype=float32 count=10" in text and "MPIDP_DEBUG=1" in text
    assert isinstance(error, RuntimeError)


@pytest.fixture
def fresh_group():
    """Groups for calls that differ across ranks on purpose, destroyed after the test: a call
    that started in MPI before every rank knew it differs spoils its group
    (docs/mismatched-calls.md)."""
    made = []

    def new():
        made.append(dist.new_group(list(range(SIZE))))
        return made[-1]

    yield new
    for group in made:
        dist.destroy_process_group(group)


def _goes_on_or_was_aborted(group, started: bool) -> None:
    """After a call that differed: a group whose call had started in MPI is aborted on every
    rank (its next call raises at once, naming why); one whose call had not (a chunked
    all_reduce waits for its check; MPIDP_DEBUG checks first) goes on, right."""
    tensor = torch.full((5,), float(RANK))
    if started and not mpidp.comm.checks._DEBUG:
        with pytest.raises(dist.DistBackendError, match="a call differed across ranks after it "
                                                        "had started in MPI .*destroy the group"):
            dist.all_reduce(tensor, group=group)
        assert MPI.COMM_WORLD.allreduce(1) == SIZE  # every rank got here: nothing waits
        return
    dist.all_reduce(tensor, group=group)
    assert torch.all(tensor == sum(range(SIZE)))


@pytest.mark.parametrize("numel", [10, (4 << 20) // 4 + 5])  # whole, and in chunks
@pytest.mark.parametrize("async_op", [False, True])
def test_a_call_that_differs_raises_on_every_rank_and_spoils_only_a_group_it_reached(
        numel, async_op, fresh_group):
    """The backend's call check (issue 17, item 5): an all_reduce whose element count differs
    across ranks raises the same error on every rank, where MPICH's nonblocking form returned a
    truncated sum. Where the operation had started beside its check, the group is aborted alike
    on every rank, with an operation issued after it and still pending; a new group works."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    group = fresh_group()
    tensor = torch.ones(numel + 7 * (RANK % 2))
    later = None
    with _differs(r"element count from \d+ to \d+") as caught:
        work = dist.all_reduce(tensor, group=group, async_op=async_op)
        if async_op:
            try:
                later = dist.all_reduce(torch.ones(3), group=group, async_op=True)
            except dist.DistBackendError as error:  # this rank's progress thread already
                later = error  # found the mismatch and aborted the group (seen under load)
        work.wait()
    texts = MPI.COMM_WORLD.allgather(str(caught.value))
    assert texts.count(texts[0]) == SIZE, texts
    chunked = numel > 1000
    if later is not None:  # issued before the mismatch was known: fails, or completes, alike
        try:
            if isinstance(later, BaseException):
                raise later
            later.wait()
            outcome = "done"
        except dist.DistBackendError as error:
            outcome = "aborted" if "a call differed across ranks" in str(error) else str(error)
        assert MPI.COMM_WORLD.allgather(outcome) == [outcome] * SIZE
        assert outcome == ("done" if chunked or mpidp.comm.checks._DEBUG else "aborted")
    _goes_on_or_was_aborted(group, started=not chunked)
    _goes_on_or_was_aborted(fresh_group(), started=False)


def test_a_work_issued_before_a_differing_call_was_known_fails_alike_when_waited(
        fresh_group, monkeypatch):
    """The later Work of the test above, waited by the program's thread before the progress
    thread looked (a CI run saw it: 'done' on rank 0, where MPI ended it on the undefined
    communicators, 'aborted' on rank 1): it fails on every rank, whoever claims it."""
    if SIZE == 1 or mpidp.comm.checks._DEBUG:
        pytest.skip("needs two ranks, and the call check (MPIDP_DEBUG checks first)")
    group = fresh_group()
    dist.barrier(group=group)  # the progress thread has nothing of this group's queued
    monkeypatch.setattr(_work.progress, "_test", lambda: [])  # it completes nothing now
    work = dist.all_reduce(torch.ones(10 + 7 * (RANK % 2)), group=group, async_op=True)
    later = dist.all_reduce(torch.ones(3), group=group, async_op=True)
    with _differs(r"element count from \d+ to \d+"):
        work.wait()
    with pytest.raises(dist.DistBackendError, match="a call differed across ranks after it"):
        later.wait()
    assert not later.is_success() and MPI.COMM_WORLD.allreduce(1) == SIZE
    monkeypatch.undo()
    with pytest.raises(dist.DistBackendError, match="a call differed across ranks after it"):
        later.get_future().wait()


def test_a_message_pending_when_its_group_is_spoilt_fails_on_the_progress_thread(fresh_group):
    """A receive pending when a differing call spoils its group fails when the progress thread
    looks at it, as when a thread claims it in wait() (it stayed pending for good, is_completed()
    False: only a claim checked the group)."""
    if SIZE == 1 or mpidp.comm.checks._DEBUG:
        pytest.skip("needs two ranks, and the call check (MPIDP_DEBUG checks first)")
    group = fresh_group()
    message = dist.irecv(torch.empty(2), src=(RANK + 1) % SIZE, group=group, tag=7)  # never sent
    with _differs(r"element count from \d+ to \d+"):
        dist.all_reduce(torch.ones(10 + 7 * (RANK % 2)), group=group)
    until = time.monotonic() + 30
    while not message.is_completed() and time.monotonic() < until:
        time.sleep(1e-3)
    assert "a call differed across ranks after it" in str(message.exception())


def test_broadcast_reduce_and_reduce_scatter_calls_that_differ_raise_on_every_rank(fresh_group):
    if SIZE == 1:
        pytest.skip("needs two ranks")
    group = fresh_group()
    with _differs("root from 0 to 1"):
        dist.broadcast(torch.ones(4), src=RANK % 2, group=group)
    _goes_on_or_was_aborted(group, started=True)
    group = fresh_group()
    with _differs("dtype from float"):
        dist.reduce(torch.ones(4, dtype=[torch.float32, torch.float64][RANK % 2]), dst=0,
                    group=group)
    group = fresh_group()
    with _differs("op from sum to max"):
        dist.all_reduce(torch.ones(4), op=[dist.ReduceOp.SUM, dist.ReduceOp.MAX][RANK % 2],
                        group=group)
    group = fresh_group()
    out = torch.empty(3 + RANK % 2)
    with _differs("element count"):
        dist.reduce_scatter_tensor(out, torch.ones(out.numel() * SIZE), group=group)
    _goes_on_or_was_aborted(group, started=True)


def test_every_communicator_is_registered_with_its_owner_and_freed_with_it():
    """mpidp.communicators lists what each part made, and forgets it when that part frees it."""
    from mpidp import communicators
    before = communicators.listing()
    ddp = mpidp.DistributedDataParallel(nn.Linear(4, 4))
    group = dist.new_group(list(range(SIZE)))
    dist.all_reduce(torch.ones(2), group=group)
    optimizer = mpidp.ZeroRedundancyOptimizer(nn.Linear(4, 4).parameters(), torch.optim.SGD, lr=1)
    owners = [record.owner for record in communicators.listing()]
    assert any(owner.startswith(f"DDP {id(ddp):#x}") for owner in owners), owners
    assert any(owner.startswith(f"ZeroRedundancyOptimizer {id(optimizer):#x}") for owner in owners)
    assert any(owner.endswith(": chunks") for owner in owners), owners
    assert all(record.size == SIZE for record in communicators.listing()
               if record.owner.startswith("DDP"))
    issuers = {record.issuer for record in communicators.listing()}
    assert "the progress thread" in issuers
    ddp.close()
    dist.destroy_process_group(group)
    after = [record.owner for record in communicators.listing()]
    assert not any(owner.startswith(f"DDP {id(ddp):#x}") for owner in after), after
    assert len(after) < len(owners)
    assert [r for r in before if r.owner.startswith("DDP")] == \
        [r for r in communicators.listing() if r.owner.startswith("DDP")]  # only its own went


def test_exchanges_a_callback_issues_are_driven_on_the_progress_thread():
    """A future's callback runs on the progress thread, which never blocks (rule 3): the splits
    check of an alltoall, the shape exchange of a sparse all_reduce and, under MPIDP_DEBUG, the
    debug checks it issues there are driven, while another group's chunked all_reduce is in flight."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    other = dist.new_group(list(range(SIZE)))
    big = torch.full(((4 << 20) // 4 + 100,), float(RANK))
    seen, registering = {}, threading.Event()

    def callback(future):
        out = torch.empty(SIZE)
        dist.all_to_all_single(out, torch.full((SIZE,), float(RANK)), [1] * SIZE, [1] * SIZE)
        sparse = torch.sparse_coo_tensor([[RANK]], [1.0], (SIZE,))
        dist.all_reduce(sparse)
        # torch runs a callback inline, in then(), when the future is done by then
        seen.update(alltoall=out.tolist(), sparse=sparse.to_dense().tolist(),
                    thread=threading.current_thread().name, inline=registering.is_set())
        return future.value()

    for _ in range(3):
        registering.set()
        chained = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(callback)
        registering.clear()
        large = dist.all_reduce(big, group=other, async_op=True)
        chained.wait()
        large.wait()
        assert seen["thread"] == "mpidp-progress" or seen["inline"], seen
        assert seen["alltoall"] == [float(r) for r in range(SIZE)], seen
        assert seen["sparse"] == [1.0] * SIZE, seen
        big.fill_(float(RANK))
    dist.destroy_process_group(other)


def _in_two_threads(rounds: int, start, first, second) -> list:
    """Each round, ``start(k)`` on this thread (program order: alike on every rank), then
    ``first(k, started)`` and ``second(k, started)`` on two threads at once. Returns the
    problems they found (each returns a list of them)."""
    problems, started = [], [None]
    gate = threading.Barrier(3, timeout=60)  # broken, not hung, if a thread stops

    def run(body):
        for k in range(rounds):
            gate.wait()
            try:
                problems.extend(body(k, started[0]))
            except Exception as error:
                problems.append(f"round {k}: {type(error).__name__}: {error}")
            gate.wait()

    threads = [threading.Thread(target=run, args=(body,)) for body in (first, second)]
    for thread in threads:
        thread.start()
    for k in range(rounds):
        started[0] = start(k)
        gate.wait()  # both go
        gate.wait()  # both done
    for thread in threads:
        thread.join()
    return problems


def test_two_threads_complete_one_operation_once():
    """Rule 9: two threads test and wait the same engine operations at once (wait and wait,
    wait and is_completed, test_all and wait_all): each finish runs once, and a thread that
    finds an operation done finds it settled (its finish, a copy back that takes a while, has
    run) with the sum in it."""
    if mpidp.runtime.thread_level() < MPI.THREAD_MULTIPLE:
        pytest.skip("two threads in MPI need MPI_THREAD_MULTIPLE")
    engine = mpidp.comm.progress
    finished = {}
    total = float(SIZE * (SIZE + 1) // 2)

    def counted(handle, key):
        def finish():
            time.sleep(2e-4)  # a copy back that takes a while: what another thread could miss
            finished[key] = finished.get(key, 0) + 1
        handle._finish = finish
        return handle

    def start(k):
        tensors = [torch.full((5,), float(RANK + 1)) for _ in range(2)]
        return [counted(mpidp.comm.iallreduce(t, "sum"), (k, i)) for i, t in enumerate(tensors)]

    def settled(k, handles, order=(0, 1)) -> list:
        return [f"round {k}, operation {i}: finish ran {finished.get((k, i), 0)} times, "
                f"result {handles[i]._result.tolist()}" for i in order
                if finished.get((k, i)) != 1 or not torch.all(handles[i]._result == total)]

    def first(k, handles):
        if k % 3 == 2:
            while not engine.test_all(handles):
                pass
        else:
            engine.wait_all(handles)
        return settled(k, handles)

    def second(k, handles):
        if k % 3 == 0:
            engine.wait_all(handles[::-1])
        elif k % 3 == 1:
            while not (handles[0].is_completed() and handles[1].is_completed()):
                pass
        else:
            handles[1].wait()
            return settled(k, handles, (1,))
        return settled(k, handles)

    assert _in_two_threads(30, start, first, second) == []


def test_a_work_waited_from_two_threads_completes_once():
    """Rule 9 for the backend's Works: two threads wait one Work (AVG: its finish divides, so
    a second run of it would show) while the progress thread tests it; a failed Work raises
    the same error on both."""
    if mpidp.runtime.thread_level() < MPI.THREAD_MULTIPLE:
        pytest.skip("two threads in MPI need MPI_THREAD_MULTIPLE")
    mean = float(SIZE + 1) / 2

    def start(k):
        tensor = torch.full((6,), float(RANK + 1))
        return tensor, dist.all_reduce(tensor, op=dist.ReduceOp.AVG, async_op=True)

    def wait(k, started):
        tensor, work = started
        work.wait()
        return [] if torch.all(tensor == mean) and work.is_success() else [
            f"round {k}: {tensor.tolist()}, expected {mean}"]

    assert _in_two_threads(30, start, wait, wait) == []
