"""mpidp.Healer where nothing is lost, and what it refuses; run on every rank (2 and 3 ranks).

The heals themselves need ULFM (Open MPI under ``mpirun --with-ft ulfm``) and
real kills: tests/test_healing.py. Here, under the suite's MPI: the refusals
come on every rank alike, a Healer without ULFM is the plain loop (the same
batches, errors passing through), a lost-rank error is told from others
along its chain, and a DDP's communicators rebuilt over the world train on
as before.
"""

import shutil
import tempfile

import pytest
import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpidp
from mpidp import communicators, errors

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
LAST = SIZE - 1


@pytest.fixture
def directory():
    path = COMM.bcast(tempfile.mkdtemp(prefix="mpidp-heal-") if RANK == 0 else None)
    yield path
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _data(samples: int = 30):
    inputs = torch.randn(samples, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return TensorDataset(inputs, inputs.sum(1, keepdim=True).tanh())


def _parts(directory, batch_size=2, **options):
    dataset = _data()
    sampler = mpidp.DistributedSampler(dataset, seed=3, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    ddp = mpidp.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    checkpointer = mpidp.Checkpointer(directory, model=ddp, optimizer=optimizer, sampler=sampler,
                                      batch_size=batch_size, signals=(), **options)
    return loader, ddp, optimizer, checkpointer


def test_without_ulfm_the_healer_is_the_plain_loop(directory):
    loader, ddp, optimizer, checkpointer = _parts(directory)
    healer = mpidp.Healer(checkpointer)
    assert not healer.active  # the suite's MPICH has no ULFM
    seen = []
    for x, y in healer.batches(loader, steps=9):  # 30 // (2 x SIZE) steps per epoch: 2 epochs+
        with healer.guard():
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            seen.append(x)
            checkpointer.step()
    plain, sampler = [], loader.sampler
    for epoch in range(3):
        sampler.set_epoch(epoch)
        plain += [x for x, _ in loader]
    assert checkpointer.steps == 9 and len(seen) == 9
    assert all(torch.equal(a, b) for a, b in zip(seen, plain))
    with pytest.raises(errors.RankLostError, match="passes"):
        with healer.guard():
            raise errors.RankLostError("passes through where nothing can heal")
    checkpointer.close()
    ddp.close()


def test_a_lost_rank_is_told_from_other_errors_along_the_chain():
    lost = errors.RankLostError("gone")
    try:
        try:
            raise lost
        except errors.RankLostError:
            raise RuntimeError("the backward failed")  # noqa: B904 (its context is the point)
    except RuntimeError as outer:
        assert errors.lost_rank(outer)
    assert not errors.lost_rank(errors.CommunicationError("counts differ"))
    assert not errors.lost_rank(MPI.Exception(MPI.ERR_UNKNOWN))
    assert errors.mpi_failure("x", MPI.Exception(MPI.ERR_COUNT)).__class__ is errors.CommunicationError


def test_a_loader_that_is_not_the_checkpointers_is_an_error_on_every_rank(directory):
    loader, ddp, _, checkpointer = _parts(directory)
    healer = mpidp.Healer(checkpointer)
    other = DataLoader(loader.dataset, batch_size=3 if RANK == LAST else 2, sampler=loader.sampler)
    with pytest.raises(ValueError, match="batch_size=2"):
        next(iter(healer.batches(other, steps=1)))
    checkpointer.close()
    ddp.close()


def test_a_ddp_rebuilt_over_the_world_trains_on_as_before(directory):
    """What a heal asks of each owner, over the same world: nothing changes but the communicators."""
    loader, ddp, optimizer, checkpointer = _parts(directory)
    twin = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    twin.load_state_dict(ddp.module.state_dict())
    twin_ddp = mpidp.DistributedDataParallel(twin)
    twin_optimizer = torch.optim.SGD(twin_ddp.parameters(), lr=0.1)
    before = [id(c) for c in ddp._communicators()]
    ddp._rebuild(COMM)
    checkpointer._rebuild(COMM)
    assert not {id(c) for c in ddp._communicators()} & set(before)
    assert len(communicators.listing()) >= 4
    for x, y in loader:
        for model, opt in ((ddp, optimizer), (twin_ddp, twin_optimizer)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ddp.parameters(), twin_ddp.parameters()))
    checkpointer.save()  # its rebuilt communicator works
    checkpointer.close()
    twin_ddp.close()
    ddp.close()


@pytest.mark.parametrize("what, message", [
    ("plain module", "heals mpidp.DistributedDataParallel, torch's"),
    ("own communicator", "communicator of its own"),
    ("no sampler", "needs the Checkpointer's sampler"),  # even where nothing can heal
    ("second ddp", "cannot follow a heal"),
    ("pool", "cannot follow a heal"),
    ("zero stage 2", "must be stage=1 over the world"),
    ("second zero", "cannot follow a heal"),
])
def test_what_cannot_heal_is_an_error_on_every_rank(directory, what, message, monkeypatch):
    """The refusals of a job that could heal: ULFM's presence is forced (nothing is lost here)."""
    if what != "no sampler":
        monkeypatch.setattr(mpidp.healing, "ulfm", lambda: True)
    dup = COMM.Dup()
    torch.manual_seed(0)
    closing = []
    if what == "own communicator":
        model = mpidp.DistributedDataParallel(_model(), comm=dup)
    elif what == "plain module":
        model = _model()
    else:
        model = mpidp.DistributedDataParallel(_model())
    zeros = []
    if what in ("zero stage 2", "second zero"):
        zeros = [mpidp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1,
                                               stage=2 if what == "zero stage 2" else 1)]
        if what == "second zero":
            zeros.append(mpidp.ZeroRedundancyOptimizer(_model().parameters(), torch.optim.SGD,
                                                       lr=0.1))
    optimizer = zeros[0] if zeros else torch.optim.SGD(model.parameters(), lr=0.1)
    if what == "second ddp":
        closing.append(mpidp.DistributedDataParallel(_model()))
    if what == "pool":
        pool = mpidp.comm.Pool(None, 1)
    dataset = _data()
    sampler = None if what == "no sampler" else mpidp.DistributedSampler(dataset)
    checkpointer = mpidp.Checkpointer(directory, model=model, optimizer=optimizer, sampler=sampler,
                                      batch_size=None if sampler is None else 2, signals=())
    with pytest.raises((TypeError, ValueError), match=message):
        mpidp.Healer(checkpointer)
    checkpointer.close()
    for ddp in [model, *closing]:
        if isinstance(ddp, mpidp.DistributedDataParallel):
            ddp.close()
    if what == "pool":
        pool.free()
    for zero in zeros:
        mpidp.communicators.free(zero._comm)
    dup.Free()


def test_torch_ddp_over_the_default_group_and_horovod_are_accepted_a_group_of_its_own_is_not(
        directory, monkeypatch):
    """Where the job can heal (ULFM forced here): torch's DDP over the default group of
    "mpidp" follows a heal (mpidp/process_group/healing.py), one over a group made with
    new_group does not (refused on every rank, naming the rule); a module stepped by
    hvd.DistributedOptimizer over hvd.init()'s whole world follows (mpidp/horovod/healing.py)."""
    import torch.distributed as dist
    import mpidp.horovod as hvd

    monkeypatch.setattr(mpidp.healing, "ulfm", lambda: True)
    mpidp.init_process_group("mpidp", store="local")
    try:
        for group in (dist.new_group(list(range(SIZE))), None):
            model = torch.nn.parallel.DistributedDataParallel(_model(), process_group=group)
            dataset = _data()
            checkpointer = mpidp.Checkpointer(
                directory, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                sampler=mpidp.DistributedSampler(dataset), batch_size=2, signals=())
            if group is not None:
                with pytest.raises(ValueError, match="over the default group of .mpidp. only"):
                    mpidp.Healer(checkpointer)
            else:
                assert mpidp.Healer(checkpointer).active
            checkpointer.close()
    finally:
        dist.destroy_process_group()
    hvd.init()
    try:
        model = _model()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters())
        dataset = _data()
        checkpointer = mpidp.Checkpointer(directory, model=model, optimizer=optimizer,
                                          sampler=mpidp.DistributedSampler(dataset),
                                          batch_size=2, signals=())
        assert mpidp.Healer(checkpointer).active
        checkpointer.close()
    finally:
        hvd.shutdown()


def test_zero_stage_1_over_the_world_is_accepted_and_gets_a_partner_copy(directory, monkeypatch):
    """Where the job can heal (ULFM forced here), a ZeRO optimizer of stage 1 over the world
    heals from partner copies (mpidp/zero/partner.py): the Healer starts them."""
    monkeypatch.setattr(mpidp.healing, "ulfm", lambda: True)
    torch.manual_seed(0)
    model = mpidp.DistributedDataParallel(_model())
    optimizer = mpidp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1,
                                              momentum=0.9)
    dataset = _data()
    sampler = mpidp.DistributedSampler(dataset)
    checkpointer = mpidp.Checkpointer(directory, model=model, optimizer=optimizer,
                                      sampler=sampler, batch_size=2, signals=())
    healer = mpidp.Healer(checkpointer)
    assert healer.active and optimizer._healing.partner is not None
    assert optimizer._healing.partner.of == (COMM.Get_rank() - 1) % COMM.Get_size()
    checkpointer.close()
    model.close()
    mpidp.communicators.free(optimizer._comm)


@pytest.mark.parametrize("store", ["mpi", "local"])
def test_a_shared_store_is_refused_on_every_rank_and_says_why(directory, monkeypatch, store):
    """Where the job can heal (ULFM forced here): torch.distributed over a shared store (the
    MPI store, the default; TCP: check_rendezvous.py, whose launch may keep its listener) is
    refused on every rank, saying why and what to give: a heal makes torch's groups again
    over a process-local store, and the shared store's keys live on rank 0 alone.
    ``store="local"`` is accepted."""
    import torch.distributed as dist

    monkeypatch.setattr(mpidp.healing, "ulfm", lambda: True)
    mpidp.init_process_group("mpidp", store=store)
    try:
        model = torch.nn.parallel.DistributedDataParallel(_model())
        checkpointer = mpidp.Checkpointer(
            directory, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            sampler=mpidp.DistributedSampler(_data()), batch_size=2, signals=())
        try:
            if store == "local":
                assert mpidp.Healer(checkpointer).active
            else:
                with pytest.raises(ValueError, match=r"store is shared \(MPIStore\).*keys live on "
                                                     r"rank 0 alone.*store=\"local\""):
                    mpidp.Healer(checkpointer)
        finally:
            checkpointer.close()
    finally:
        dist.destroy_process_group()
        if store == "mpi" and SIZE > 1:  # its first use took the store's rebuild for good:
            # give it back, as in a process whose store was never used (the next tests heal)
            communicators.set_rebuild(mpidp.store._shared.comm, mpidp.store._rebuild)


@pytest.mark.parametrize("spares, message", [
    (SIZE, f"spares must be an int from 0 to {SIZE - 1}"),
    (-1, "got -1"),
    ("1", "got '1'"),
    (RANK % 2, r"spares differs between ranks: \[0, 1"),
], ids=["as-many-as-ranks", "negative", "a-string", "differs-between-ranks"])
def test_stand_by_refuses_bad_spares_on_every_rank_and_leaves_the_world(spares, message):
    with pytest.raises(ValueError, match=message):
        mpidp.stand_by(spares=spares)
    assert mpidp.runtime.world() is MPI.COMM_WORLD and not mpidp.spares.launched()


def test_stand_by_comes_before_any_communicator_over_the_world():
    ddp = mpidp.DistributedDataParallel(_model())
    with pytest.raises(ValueError, match=r"by \[.*'DistributedDataParallel'.*\]: call stand_by"):
        mpidp.stand_by(spares=1)
    assert mpidp.runtime.world() is MPI.COMM_WORLD
    ddp.close()


@pytest.mark.skipif(SIZE < 3, reason="the 3-rank launch's: a copy from the previous rank, not "
                                       "the next, needs 3 ranks (FSDP2's set-up costs seconds)")
def test_fsdp2_over_the_default_group_keeps_partner_copies_and_bad_input_is_refused_everywhere(
        directory, monkeypatch):
    """Where the job can heal (ULFM forced here): torch's FSDP2 needs ``rebuild=`` (given on
    one rank only: refused on every rank), over the default group of "mpidp" only, with an
    optimizer of its parameters; ``rebuild=`` with anything else is refused even where
    nothing heals. Accepted, ``guard()`` copies this rank's shards and receives the previous
    rank's, bit for bit, and the copies of all ranks make the whole state (mpidp/process_group/fsdp.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from mpidp.process_group import fsdp

    def sharded(mesh=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).double()
        fully_shard(model[0], mesh=mesh)  # 5 and 1 rows: uneven and empty shards
        return fully_shard(model, mesh=mesh)

    def healer(model, optimizer, **options):
        checkpointer = mpidp.Checkpointer(directory, model=model, optimizer=optimizer,
                                          sampler=mpidp.DistributedSampler(_data()),
                                          batch_size=2, signals=())
        try:
            return mpidp.Healer(checkpointer, **options), checkpointer
        except BaseException:
            checkpointer.close()
            raise

    with pytest.raises(TypeError, match="rebuild must be a callable, given with a model of "
                                        "torch's FSDP2 .fully_shard. only, got function"):
        healer(_model(), None, rebuild=_model)  # ULFM or not
    monkeypatch.setattr(mpidp.healing, "ulfm", lambda: True)
    mpidp.init_process_group("mpidp", store="local")
    try:
        make = lambda: None  # noqa: E731 (never called: nothing is lost here)
        model = sharded()
        # each rank over a group of its own (torch's DeviceMesh names the group of the first
        # mesh made over some ranks for every later mesh over them: not the whole world here)
        alone = [dist.new_group([rank]) for rank in range(SIZE)][RANK]
        other = sharded(DeviceMesh.from_group(alone, "cpu"))
        with pytest.raises(ValueError, match="FSDP2 follows a heal over the default group of "
                                             ".mpidp. only .fully_shard without mesh=., got"):
            healer(other, torch.optim.Adam(other.parameters()), rebuild=make)
        with pytest.raises(ValueError, match="FSDP2 needs rebuild=, a callable .*, got None"):
            healer(model, torch.optim.Adam(model.parameters()), rebuild=make if RANK else None)
        with pytest.raises(ValueError, match="the optimizer must step the FSDP2 model's"):
            healer(model, torch.optim.Adam(list(model.parameters())[1:]), rebuild=make)

        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        heal, checkpointer = healer(model, optimizer, rebuild=make)
        assert heal.active and heal._copies.fsdp is not None
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(RANK), dtype=torch.float64)
        for _ in range(3):  # the third step's start: Adam has state, the last copy is of it
            with heal.guard():
                optimizer.zero_grad()
                model(x).square().mean().backward()
                optimizer.step()
        with heal.guard():  # copies the state after the third step
            pass
        copy = heal._copies.kept[-1]["fsdp"]
        mines = mpidp.allgather_object(copy["mine"])
        assert torch.equal(copy["theirs"], mines[(RANK - 1) % SIZE])
        whole_model, whole_optimizer = fsdp.whole_state(copy, dict(enumerate(mines)))
        for name, param in model.named_parameters():
            assert torch.equal(whole_model[name], param.full_tensor().detach())
            for key, value in optimizer.state[param].items():
                value = value.full_tensor() if hasattr(value, "full_tensor") else value
                assert torch.equal(whole_optimizer["state"][name][key], value)
        assert [g["params"] for g in whole_optimizer["param_groups"]] == \
            [[name for name, _ in model.named_parameters()]]
        checkpointer.close()
    finally:
        dist.destroy_process_group()
