"""mpidp.comm misuse: the same clear error on every rank that made it, and nobody hangs afterwards.

Argument errors are raised before anything collective happens, so a rank that
catches one stays in step with the others; in debug mode, ranks that make
different collective calls all raise the same error; messages to oneself are
refused at every size; a forked child does not reuse the default pool. Each
test ends with correct collectives whose results are checked, which would hang
if the ranks' pools had fallen out of step.
"""

import os

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp import comm

RANK, SIZE = mpidp.rank(), mpidp.size()
ODD = SIZE - 1  # the rank that misbehaves (rank 0 when it runs alone)
OTHERS = "rank 0" if SIZE == 2 else f"ranks 0-{SIZE - 2}"  # the well-behaved ranks, as errors name them

needs_two = pytest.mark.skipif(SIZE < 2, reason="a cross-rank mismatch needs two ranks")


def agree_on_every_rank(message: str) -> None:
    """Every rank saw the same message (and reached this collective: nobody hung)."""
    messages = MPI.COMM_WORLD.allgather(message)
    assert messages == [messages[0]] * SIZE, messages


def sums_agree(target=None) -> None:
    """Two correct allreduces on ``target`` give the right sums on every rank.

    A rank one pool member ahead of the others would run each of them on
    another communicator than they do, and hang.
    """
    for step in range(2):
        tensor = torch.full((5,), float(RANK + step))
        comm.allreduce(tensor, comm=target)
        assert torch.equal(tensor, torch.full((5,), SIZE * (SIZE - 1) / 2 + SIZE * step))


@pytest.fixture(params=["default pool", "Pool(size=3)", "COMM_WORLD.Dup()"])
def target(request):
    """The ``comm`` argument: None, a pool of its own, or a plain mpi4py communicator."""
    if request.param == "default pool":
        yield None
    elif request.param.startswith("Pool"):
        pool = comm.Pool(size=3)
        yield pool
        pool.free()
    else:
        dup = MPI.COMM_WORLD.Dup()
        yield dup
        dup.Free()


@pytest.fixture
def debug(monkeypatch):
    monkeypatch.setattr(comm.checks, "_DEBUG", True)


# name -> (call on ``comm``, the error it raises, what its message says)
BAD_CALLS = {
    "broadcast root=size": (lambda c: comm.broadcast(torch.ones(4), SIZE, comm=c), ValueError,
                            rf"invalid root {SIZE}, root should be in the interval \[0, {SIZE - 1}\]"),
    "ibroadcast root=-1": (lambda c: comm.ibroadcast(torch.ones(4), -1, comm=c), ValueError,
                           r"invalid root -1, root should be in the interval"),
    "allgather output 1 too long": (
        lambda c: comm.allgather(torch.empty(SIZE * 4 + 1), torch.ones(4), comm=c), ValueError,
        rf"output must have world size \({SIZE}\) x tensor.numel\(\) = {SIZE * 4} elements, "
        rf"got {SIZE * 4 + 1}"),
    "iallgather output of another dtype": (
        lambda c: comm.iallgather(torch.empty(SIZE * 4, dtype=torch.float64), torch.ones(4), comm=c),
        TypeError, "output and tensor must have the same dtype, got torch.float64 and torch.float32"),
    "reduce_scatter output 1 too short": (
        lambda c: comm.reduce_scatter(torch.empty(3), torch.ones(SIZE * 4), comm=c), ValueError,
        rf"tensor must have world size \({SIZE}\) x output.numel\(\) = {SIZE * 3} elements, "
        rf"got {SIZE * 4}"),
    "ireduce_scatter output 1 too long": (
        lambda c: comm.ireduce_scatter(torch.empty(5), torch.ones(SIZE * 4), "max", comm=c),
        ValueError, rf"tensor must have world size \({SIZE}\) x output.numel\(\)"),
    "send dest=size": (lambda c: comm.send(torch.ones(4), SIZE, comm=c), ValueError,
                       rf"invalid dest {SIZE}, dest should be in the interval"),
    "irecv source=-1": (lambda c: comm.irecv(torch.ones(4), -1, comm=c), ValueError,
                        r"invalid source -1, source should be in the interval"),
}


@pytest.mark.parametrize("debug_mode", [False, True], ids=["debug off", "debug on"])
@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_a_rank_that_catches_an_argument_error_stays_in_step(name, target, debug_mode, monkeypatch):
    monkeypatch.setattr(comm.checks, "_DEBUG", debug_mode)
    call, error, message = BAD_CALLS[name]
    if RANK == ODD:
        with pytest.raises(error, match=message):
            call(target)
    sums_agree(target)
    sums_agree()


def raises_the_same_everywhere(call, expected: str) -> None:
    """``call`` raises on every rank the same ValueError, which names each rank's call."""
    with pytest.raises(ValueError, match="collective calls differ across ranks") as info:
        call()
    message = str(info.value)
    assert message == (f"collective calls differ across ranks: {expected}; every rank must make "
                       f"the same collective calls, with the same op, root, dtype and element "
                       f"count, in the same order")
    agree_on_every_rank(message)
    sums_agree()


@needs_two
def test_debug_allreduce_against_reduce_scatter_of_the_same_count(debug):
    count = 4 * SIZE
    if RANK == ODD:
        call = lambda: comm.reduce_scatter(torch.empty(4), torch.ones(count))  # noqa: E731
    else:
        call = lambda: comm.allreduce(torch.ones(count))  # noqa: E731
    raises_the_same_everywhere(call, f"{OTHERS} called allreduce(op='sum', dtype=float32, "
                                     f"numel={count}); rank {ODD} called reduce_scatter(op='sum', "
                                     f"dtype=float32, numel={count})")


@needs_two
def test_debug_sum_against_max(debug):
    op = "max" if RANK == ODD else "sum"
    raises_the_same_everywhere(lambda: comm.allreduce(torch.ones(6), op),
                               f"{OTHERS} called allreduce(op='sum', dtype=float32, numel=6); "
                               f"rank {ODD} called allreduce(op='max', dtype=float32, numel=6)")


@needs_two
def test_debug_different_dtype(debug):
    dtype = torch.float64 if RANK == ODD else torch.float32
    raises_the_same_everywhere(lambda: comm.allreduce(torch.ones(6, dtype=dtype), "min"),
                               f"{OTHERS} called allreduce(op='min', dtype=float32, numel=6); "
                               f"rank {ODD} called allreduce(op='min', dtype=float64, numel=6)")


@needs_two
def test_debug_different_count(debug):
    count = 7 if RANK == ODD else 6
    raises_the_same_everywhere(lambda: comm.iallreduce(torch.ones(count, dtype=torch.int64)).wait(),
                               f"{OTHERS} called iallreduce(op='sum', dtype=int64, numel=6); "
                               f"rank {ODD} called iallreduce(op='sum', dtype=int64, numel=7)")


@needs_two
def test_debug_broadcast_from_different_roots(debug):
    expected = "; ".join(f"rank {rank} called broadcast(root={rank}, dtype=uint8, numel=3)"
                         for rank in range(SIZE))
    raises_the_same_everywhere(lambda: comm.broadcast(torch.ones(3, dtype=torch.uint8), RANK),
                               expected)


@needs_two
def test_debug_blocking_against_nonblocking_and_barrier_against_allgather(debug):
    # MPI never matches a blocking collective with a nonblocking one.
    if RANK == ODD:
        call = lambda: comm.iallgather(torch.empty(2 * SIZE), torch.ones(2)).wait()  # noqa: E731
    else:
        call = lambda: comm.allgather(torch.empty(2 * SIZE), torch.ones(2))  # noqa: E731
    raises_the_same_everywhere(call, f"{OTHERS} called allgather(dtype=float32, numel=2); "
                                     f"rank {ODD} called iallgather(dtype=float32, numel=2)")
    call = comm.barrier if RANK == 0 else lambda: comm.allgather(torch.empty(SIZE), torch.ones(1))
    others = "rank 1" if SIZE == 2 else f"ranks 1-{SIZE - 1}"
    raises_the_same_everywhere(call, f"rank 0 called barrier(); {others} called "
                                     f"allgather(dtype=float32, numel=1)")


def test_debug_matched_calls_give_the_right_results(debug, target):
    tensor = torch.full((4,), float(RANK))
    comm.iallreduce(tensor, "max", comm=target).wait()
    assert torch.equal(tensor, torch.full((4,), float(SIZE - 1)))
    tensor = torch.full((3,), float(RANK))
    comm.broadcast(tensor, ODD, comm=target)
    assert torch.equal(tensor, torch.full((3,), float(ODD)))
    gathered = comm.allgather(torch.empty(SIZE, 2), torch.full((2,), float(RANK)), comm=target)
    assert torch.equal(gathered, torch.arange(SIZE).repeat_interleave(2).reshape(SIZE, 2).float())
    block = comm.ireduce_scatter(torch.empty(2), torch.arange(2.0 * SIZE), comm=target).wait()
    assert torch.equal(block, torch.tensor([2.0 * RANK, 2.0 * RANK + 1]) * SIZE)
    comm.barrier(comm=target)
    comm.ibarrier(comm=target).wait()
    sums_agree(target)


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("TRUE", True),
                                            ("yes", True), ("On", True), ("0", False),
                                            ("false", False), ("off", False), ("", False)])
def test_mpidp_debug_accepts_the_usual_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("MPIDP_DEBUG", value)
    assert comm._debug_from_env() is expected


def test_mpidp_debug_refuses_anything_else_naming_the_variable(monkeypatch):
    assert comm.checks._DEBUG is comm._debug_from_env()  # what import time read
    monkeypatch.setenv("MPIDP_DEBUG", "verbose")
    with pytest.raises(ValueError, match=r"MPIDP_DEBUG must be one of 1/true/yes/on or "
                                         r"0/false/no/off \(any case\), got 'verbose'"):
        comm._debug_from_env()


@pytest.mark.parametrize("nbytes", [16, 64 << 20], ids=["16 B", "64 MiB"])
@pytest.mark.parametrize("call", ["send", "isend", "recv", "irecv"])
def test_a_message_to_oneself_is_refused_before_it_starts(call, nbytes, target):
    name = "dest" if "send" in call else "source"
    in_flight = len(comm._in_flight)
    with pytest.raises(ValueError, match=rf"invalid {name} {RANK}, {name} should be another rank "
                                         rf"than this process's own: mpidp refuses messages to "
                                         rf"oneself"):
        getattr(comm, call)(torch.empty(nbytes // 4), RANK, comm=target)
    assert len(comm._in_flight) == in_flight  # nothing was started
    sums_agree(target)


@pytest.mark.skipif(SIZE > 1, reason="only a rank alone has nobody else to hear from")
@pytest.mark.parametrize("call", ["recv", "irecv"])
def test_a_rank_alone_cannot_receive_from_any_source(call):
    with pytest.raises(ValueError, match=r"recv from any source \(source=None\) needs another "
                                         r"rank, but comm has 1 rank"):
        getattr(comm, call)(torch.empty(4))


@needs_two
def test_messages_to_others_still_flow_after_refusals():
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    with pytest.raises(ValueError, match="invalid dest"):
        comm.isend(torch.ones(4), RANK, tag=3)
    receive = comm.irecv(incoming := torch.empty(4), left, tag=3)
    comm.isend(torch.full((4,), float(RANK)), right, tag=3).wait()
    assert receive.wait() is incoming
    assert torch.equal(incoming, torch.full((4,), float(left)))


def test_a_forked_child_does_not_reuse_the_default_pool():
    comm.allreduce(torch.ones(2))  # the default pool exists and is cached
    pid = os.fork()
    if pid == 0:  # the child never touches MPI; os._exit skips every hook
        try:
            comm.allreduce(torch.ones(2))
        except RuntimeError as err:
            os._exit(0 if "not available in a multiprocessing child" in str(err) else 2)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    sums_agree()


def test_the_watchdogs_settings_are_checked():
    """DistributedDataParallel(timeout=) and watchdog.set_timeout() refuse bad values by name;
    set_timeout(None) goes back to MPIDP_TIMEOUT."""
    before = mpidp.watchdog.get_timeout()
    with pytest.raises(ValueError) as error:
        mpidp.DistributedDataParallel(torch.nn.Linear(2, 2), timeout=-1)
    assert str(error.value) == ("timeout must be None or a number of seconds >= 0 (0 turns the "
                                "stall watchdog off), got -1")
    with pytest.raises(ValueError) as error:
        mpidp.watchdog.set_timeout("10")
    assert str(error.value) == ("seconds must be None or a number of seconds >= 0 (0 turns the "
                                "stall watchdog off), got '10'")
    with pytest.raises(ValueError) as error:
        mpidp.watchdog.set_timeout(10, action="ignore")
    assert str(error.value) == "action must be one of abort, report, got 'ignore'"
    assert mpidp.watchdog.get_timeout() == before  # a refused call changes nothing
    mpidp.watchdog.set_timeout(7.5, action="report")
    assert mpidp.watchdog.get_timeout() == (7.5, "report")
    mpidp.watchdog.set_timeout(None, action="abort")
    assert mpidp.watchdog.get_timeout() == (float(os.environ.get("MPIDP_TIMEOUT", 600)), "abort")
    sums_agree()
