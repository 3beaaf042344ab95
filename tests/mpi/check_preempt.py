"""mpidp.Checkpointer and mpidp.preemption: one stop for all ranks, whole checkpoints, resume.

Run on every rank under mpiexec (2 and 3 ranks). The signals are real: one
rank sends itself SIGTERM or SIGUSR1 with ``os.kill``; the checkpointers run
with ``exit_on_stop=False`` so that the launch goes on to the next test
(tests/test_preemption.py launches the example and checks its exit status).
"""

import contextlib
import json
import os
import random
import shutil
import signal
import tempfile

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpidp
from mpidp import preemption, stacks
from mpidp.checkpoint import latest_checkpoint

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
LAST = SIZE - 1  # the rank that gets the signal


@pytest.fixture
def directory():
    path = COMM.bcast(tempfile.mkdtemp(prefix="mpidp-preempt-") if RANK == 0 else None)
    yield path
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def clean_flag():
    preemption.clear()
    yield
    preemption.disarm()
    preemption.clear()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _train_step(model, optimizer, step: int) -> None:
    data = torch.Generator().manual_seed(100 * step + RANK)
    x = torch.randn(6, 4, generator=data, dtype=torch.float64)
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def _run_until_stop(checkpointer, model, optimizer, signal_at: int, signum: int, steps: int = 12):
    """Train; rank LAST signals itself after step ``signal_at``; the step every rank stopped at."""
    for step in range(1, steps + 1):
        _train_step(model, optimizer, step)
        if RANK == LAST and step == signal_at:
            os.kill(os.getpid(), signum)
        if checkpointer.step():
            return step
    return None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_on_one_rank_stops_every_rank_at_the_next_ddp_step(directory, signum):
    ddp = mpidp.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    checkpointer = mpidp.Checkpointer(directory, model=ddp, optimizer=optimizer,
                                      exit_on_stop=False)
    stopped = _run_until_stop(checkpointer, ddp, optimizer, signal_at=3, signum=signum)
    # The signal came after step 3's bookkeeping: step 4's carries it to every rank.
    assert COMM.allgather(stopped) == [4] * SIZE
    path, manifest = latest_checkpoint(directory)
    assert (os.path.basename(path), manifest["step"], manifest["world"]) == ("step-000000004", 4, SIZE)
    assert sorted(manifest["files"]) == sorted(
        ["model.pt", "train.pt", *(f"rng-rank{r:05d}.pt" for r in range(SIZE))])
    saved = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    for name, value in ddp.module.state_dict().items():
        assert torch.equal(saved[name], value)
    assert preemption.received() == (signum if RANK == LAST else None)
    checkpointer.close()


def test_a_usr1_before_any_checkpointer_is_kept_and_the_first_step_stops(directory):
    """MPICH takes SIGUSR1 at MPI_Init and does nothing with it: a scheduler's warning that
    came before the Checkpointer was lost, and the run went on as if never warned (seen in
    tests/preempt_soak.py). mpidp keeps it from import on (preemption.keep_early)."""
    if RANK == LAST:
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered at the next bytecode, in this thread
    assert preemption.requested() == (RANK == LAST)
    ddp = mpidp.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    checkpointer = mpidp.Checkpointer(directory, model=ddp, optimizer=optimizer,
                                      exit_on_stop=False)
    stopped = _run_until_stop(checkpointer, ddp, optimizer, signal_at=0, signum=signal.SIGUSR1)
    assert COMM.allgather(stopped) == [1] * SIZE
    assert latest_checkpoint(directory)[1]["step"] == 1
    checkpointer.close()


def test_without_ddp_a_small_allreduce_agrees_at_the_same_step(directory):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = mpidp.Checkpointer(directory, model=model, optimizer=optimizer,
                                      exit_on_stop=False, signals=["USR2"])
    stopped = _run_until_stop(checkpointer, model, optimizer, signal_at=5, signum=signal.SIGUSR2)
    assert COMM.allgather(stopped) == [5] * SIZE
    assert latest_checkpoint(directory)[1]["step"] == 5
    checkpointer.close()


def test_no_signal_no_stop_and_periodic_saves_keep_the_newest(directory):
    ddp = mpidp.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    checkpointer = mpidp.Checkpointer(directory, model=ddp, optimizer=optimizer, every=3, keep=2,
                                      exit_on_stop=False)
    assert _run_until_stop(checkpointer, ddp, optimizer, signal_at=-1, signum=0, steps=10) is None
    if RANK == 0:
        assert sorted(os.listdir(directory)) == ["step-000000006", "step-000000009"]
    checkpointer.close()


def test_resume_same_size_restores_everything_bit_for_bit(directory):
    ddp = mpidp.DistributedDataParallel(_model())
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    saver = mpidp.Checkpointer(directory, model=ddp, optimizer=optimizer, scheduler=scheduler,
                               exit_on_stop=False)
    for step in range(1, 4):
        _train_step(ddp, optimizer, step)
        scheduler.step()
        saver.step()
    random.seed(RANK), np.random.seed(RANK), torch.manual_seed(RANK)
    saver.save()
    expected_draws = (random.random(), np.random.rand(), torch.rand(1).item())
    for step in range(4, 7):
        _train_step(ddp, optimizer, step)
        scheduler.step()
    expected = [p.detach().clone() for p in ddp.parameters()]
    saver.close()

    ddp2 = mpidp.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(),
                                                       nn.Linear(8, 1)).double())
    optimizer2 = torch.optim.Adam(ddp2.parameters(), lr=0.01)
    scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=2, gamma=0.5)
    loader = mpidp.Checkpointer(directory, model=ddp2, optimizer=optimizer2, scheduler=scheduler2,
                                exit_on_stop=False)
    assert loader.resume() == 3 and loader.steps == 3
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected_draws
    assert scheduler2.last_epoch == 3
    for step in range(4, 7):
        _train_step(ddp2, optimizer2, step)
        scheduler2.step()
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    for got, want in zip(ddp2.parameters(), expected):
        assert torch.equal(got, want)
    loader.close()


def test_a_partial_or_damaged_checkpoint_is_never_loaded(directory):
    model = _model()
    checkpointer = mpidp.Checkpointer(directory, model=model, exit_on_stop=False, signals=())
    checkpointer.steps = 7
    checkpointer.save()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    if RANK == 0:
        # a kill during a later write leaves its temporary directory behind ...
        os.makedirs(os.path.join(directory, ".partial-step-000000009"))
        with open(os.path.join(directory, ".partial-step-000000009", "model.pt"), "wb") as f:
            f.write(b"\x00" * 10)
        # ... and a step directory whose file is shorter than its manifest says is not whole
        shutil.copytree(os.path.join(directory, "step-000000007"),
                        os.path.join(directory, "step-000000008"))
        manifest = os.path.join(directory, "step-000000008", "manifest.json")
        with open(manifest) as f:
            data = json.load(f)
        data["step"] = 8
        with open(manifest, "w") as f:
            json.dump(data, f)
        with open(os.path.join(directory, "step-000000008", "model.pt"), "r+b") as f:
            f.truncate(100)
    COMM.Barrier()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert checkpointer.resume() == 7
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name])
    checkpointer.close()


def test_zero_shards_are_saved_and_resumed(directory):
    ddp = mpidp.DistributedDataParallel(_model())
    optimizer = mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
    checkpointer = mpidp.Checkpointer(directory, model=ddp, optimizer=optimizer,
                                      exit_on_stop=False)
    for step in range(1, 3):
        _train_step(ddp, optimizer, step)
        checkpointer.step()
    checkpointer.save()
    for step in range(3, 5):
        _train_step(ddp, optimizer, step)
    expected = [p.detach().clone() for p in ddp.parameters()]
    checkpointer.close()
    assert any(name.startswith("zero-rank") for name in latest_checkpoint(directory)[1]["files"])

    ddp2 = mpidp.DistributedDataParallel(_model())
    optimizer2 = mpidp.ZeroRedundancyOptimizer(ddp2.parameters(), torch.optim.Adam, lr=0.01)
    with torch.no_grad():
        for p in ddp2.parameters():
            p.zero_()
    loader = mpidp.Checkpointer(directory, model=ddp2, optimizer=optimizer2, exit_on_stop=False)
    assert loader.resume() == 2
    for step in range(3, 5):
        _train_step(ddp2, optimizer2, step)
    for got, want in zip(ddp2.parameters(), expected):
        assert torch.equal(got, want)
    loader.close()


# -- bad input: the same error on every rank, never a hang ----------------------------------

def test_an_unwritable_directory_is_an_error_on_every_rank(directory):
    blocker = os.path.join(directory, "a-file")
    if RANK == 0:
        with open(blocker, "w") as f:
            f.write("not a directory")
    COMM.Barrier()
    with pytest.raises(OSError, match="cannot write in"):
        mpidp.Checkpointer(os.path.join(blocker, "checkpoints"), model=_model(), signals=())


def test_a_directory_not_shared_by_the_ranks_is_an_error_on_every_rank(directory):
    if SIZE == 1:
        pytest.skip("needs two ranks")
    mine = os.path.join(directory, f"rank{RANK}")
    with pytest.raises(OSError, match="must be shared by every rank"):
        mpidp.Checkpointer(mine, model=_model(), signals=())


@pytest.mark.parametrize("bad, message", [
    (dict(deadline=0), "deadline must be a number > 0"),
    (dict(keep=0), "keep"),
    (dict(signals=["SIGKILL"]), "SIGKILL cannot be caught"),
    (dict(signals=["SIGNOPE"]), "unknown signal name"),
    (dict(sampler=mpidp.DistributedSampler(range(12))), "batch_size must be"),
])
def test_bad_arguments_on_one_rank_are_an_error_on_every_rank(directory, bad, message):
    arguments = bad if RANK == LAST else {}
    with pytest.raises(ValueError, match=message) as caught:
        mpidp.Checkpointer(directory, model=_model(), exit_on_stop=False, **arguments)
    if SIZE > 1:
        assert f"found on rank(s) [{LAST}]" in str(caught.value)


def test_a_save_over_the_deadline_is_discarded_on_every_rank(directory):
    model = _model()
    checkpointer = mpidp.Checkpointer(directory, model=model, exit_on_stop=False, signals=())
    checkpointer.steps = 1
    first = checkpointer.save()
    checkpointer.deadline = 1e-9
    checkpointer.steps = 2
    with pytest.raises(TimeoutError, match="over the deadline"):
        checkpointer.save()
    COMM.Barrier()
    assert latest_checkpoint(directory)[0] == first
    if RANK == 0:
        assert sorted(os.listdir(directory)) == ["step-000000001"]
    checkpointer.close()


def test_a_global_batch_the_new_size_cannot_keep_is_an_error_on_every_rank(directory):
    sampler = mpidp.DistributedSampler(range(60), shuffle=True, seed=3, drop_last=True)
    model = _model()
    saver = mpidp.Checkpointer(directory, model=model, sampler=sampler, batch_size=2,
                               exit_on_stop=False, signals=())
    saver.step()
    saver.save()
    saver.close()
    loader = mpidp.Checkpointer(directory, model=_model(), sampler=sampler, batch_size=3,
                                exit_on_stop=False, signals=())
    with pytest.raises(ValueError, match=f"global batch is {2 * SIZE} samples"):
        loader.resume()
    loader.close()


def test_torchs_ddp_stops_at_the_same_step_and_saves_the_unwrapped_module(directory, gloo):
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    checkpointer = mpidp.Checkpointer(directory, model=ddp, optimizer=optimizer,
                                      exit_on_stop=False)
    stopped = _run_until_stop(checkpointer, ddp, optimizer, signal_at=2, signum=signal.SIGTERM)
    assert COMM.allgather(stopped) == [2] * SIZE  # the 4-byte allreduce, at that very step
    saved = torch.load(os.path.join(latest_checkpoint(directory)[0], "model.pt"),
                       weights_only=True)
    assert saved.keys() == ddp.module.state_dict().keys()  # no "module." prefix
    for name, value in ddp.module.state_dict().items():
        assert torch.equal(saved[name], value)
    checkpointer.close()


# -- the loop runs again from its top after a resume: which loops go on exactly ------------
#
# Each run trains DDP over 48 samples, a global batch of 12 (4 steps an epoch, 3 epochs),
# with dropout drawn from torch's global generator and a DataLoader without a generator of
# its own (iter(loader) draws from that generator too), and an LR scheduler stepped at the
# end of each epoch: what the loop does on its way back to the checkpoint's position must
# leave no trace. Each step records its global batch's sample indices, its loss over the
# ranks and the learning rate; a run stopped by a signal and resumed must record what the
# uninterrupted one did and end with its parameters.

EPOCHS, GLOBAL_BATCH, SAMPLES = 3, 12, 48
STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH


class _Run:
    """One training run over mpidp's world (runtime.world()), from scratch or resumed."""

    def __init__(self, directory: str, *, dropout: float = 0.25, stop_at: int | None = None,
                 signum: int = signal.SIGTERM):
        self.world = mpidp.runtime.world()
        data = torch.Generator().manual_seed(11)
        inputs = torch.randn(SAMPLES, 4, generator=data, dtype=torch.float64)
        dataset = TensorDataset(inputs, inputs.sum(1, keepdim=True).sin(), torch.arange(SAMPLES))
        self.sampler = mpidp.DistributedSampler(dataset, shuffle=True, seed=5, drop_last=True)
        batch_size = GLOBAL_BATCH // self.world.Get_size()
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler)
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(dropout),
                               nn.Linear(8, 1)).double()
        self.ddp = mpidp.DistributedDataParallel(module)
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=0.1, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.checkpointer = mpidp.Checkpointer(
            directory, model=self.ddp, optimizer=self.optimizer, scheduler=self.scheduler,
            sampler=self.sampler, batch_size=batch_size, exit_on_stop=False)
        self.checkpointer.resume()
        self.stop_at, self.signum, self.records = stop_at, signum, []

    def step(self, batch) -> bool:
        """One optimizer step; True if the ranks stopped at it (its checkpoint saved)."""
        x, y, index = batch
        step = self.checkpointer.steps + 1
        if step == self.stop_at and self.world.Get_rank() == self.world.Get_size() - 1:
            os.kill(os.getpid(), self.signum)  # before the backward: its bookkeeping carries it
        self.optimizer.zero_grad()
        loss = nn.functional.mse_loss(self.ddp(x), y)
        loss.backward()
        self.optimizer.step()
        shares = self.world.allgather((index.tolist(), loss.item()))
        self.records.append((step, sorted(sum((share for share, _ in shares), [])),
                             sum(loss for _, loss in shares) / len(shares),
                             self.optimizer.param_groups[0]["lr"]))
        return self.checkpointer.step()

    def parameters(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.ddp.parameters()]

    def close(self) -> None:
        self.checkpointer.close()
        preemption.clear()


def _readme_loop(run: _Run) -> bool:
    """The README's loop, a scheduler stepped per epoch; True if it stopped."""
    for epoch in range(EPOCHS):
        run.sampler.set_epoch(epoch)
        for batch in run.loader:
            if run.step(batch):
                return True
        run.scheduler.step()
    return False


def _while_loop(run: _Run) -> bool:
    """docs/preemption.md's loop: epochs from sampler.epoch, until the steps are done."""
    epoch = run.sampler.epoch
    while run.checkpointer.steps < STEPS:
        run.sampler.set_epoch(epoch)
        for batch in run.loader:
            if run.step(batch):
                return True
        run.scheduler.step()
        epoch += 1
    return False


def _no_set_epoch_loop(run: _Run) -> bool:
    """A loop that never calls set_epoch: every pass over epoch 0."""
    while run.checkpointer.steps < STEPS:
        for batch in run.loader:
            if run.step(batch):
                return True
        run.scheduler.step()
    return False


def _run(directory, loop, **options) -> _Run:
    run = _Run(directory, **options)
    stopped = loop(run)
    assert stopped == (options.get("stop_at") is not None)
    run.close()
    return run


@contextlib.contextmanager
def _world_of(size: int):
    """mpidp over the launch's first ``size`` ranks only, as after a heal; True on those."""
    sub = COMM.Split(0 if RANK < size else MPI.UNDEFINED, RANK)
    try:
        if sub != MPI.COMM_NULL:
            mpidp.runtime.set_world(sub)
        yield sub != MPI.COMM_NULL
    finally:
        if sub != MPI.COMM_NULL:
            mpidp.runtime._world.clear()  # back to MPI.COMM_WORLD
            sub.Free()
        COMM.Barrier()


# (stop at step, the loop that stops, the loop that resumes, the signal): mid-epoch, an
# epoch's last step and the next epoch's first, the first step and the last, at 2 ranks and
# at 3; a checkpoint is the same whatever loop wrote it
STOPS = {2: [(4, _readme_loop, _readme_loop, signal.SIGUSR1),
             (7, _readme_loop, _readme_loop, signal.SIGTERM),
             (9, _readme_loop, _while_loop, signal.SIGTERM),
             (5, _while_loop, _while_loop, signal.SIGUSR1),
             (7, _no_set_epoch_loop, _no_set_epoch_loop, signal.SIGTERM)],
         3: [(6, _readme_loop, _readme_loop, signal.SIGUSR1),
             (12, _readme_loop, _readme_loop, signal.SIGTERM),
             (1, _while_loop, _while_loop, signal.SIGTERM),
             (8, _while_loop, _while_loop, signal.SIGUSR1),
             (10, _while_loop, _readme_loop, signal.SIGUSR1)]}


def test_the_readme_loop_and_a_while_loop_resume_bit_for_bit(directory):
    references = {}
    for stop_at, loop, resume_loop, signum in STOPS.get(SIZE, STOPS[2]):
        shape = loop is _no_set_epoch_loop
        if shape not in references:
            reference = _run(directory, loop)
            references[shape] = reference.records, reference.parameters()
        records, parameters = references[shape]
        path = os.path.join(directory, f"{stop_at}-{loop.__name__}")
        first = _run(path, loop, stop_at=stop_at, signum=signum)
        assert [r[0] for r in first.records] == list(range(1, stop_at + 1))
        second = _run(path, resume_loop)
        what = (stop_at, loop.__name__, resume_loop.__name__)
        assert first.records + second.records == records, what
        assert all(torch.equal(got, want)
                   for got, want in zip(second.parameters(), parameters)), what


def test_both_loops_resume_at_another_rank_count(directory):
    """Saved at one rank fewer than the launch, resumed at the launch's count: the same global
    batches, the losses and parameters to float summation noise (no dropout: each rank's
    generator draws for its own samples). The README's loop at 2 ranks, the while loop at 3."""
    stop_at, loop = (8, _while_loop) if SIZE == 3 else (6, _readme_loop)
    reference = _run(os.path.join(directory, "reference"), loop, dropout=0.0)
    with _world_of(SIZE - 1) as member:
        if member:
            first = _run(directory, loop, dropout=0.0, stop_at=stop_at).records
    first = COMM.bcast(first if RANK == 0 else None)
    second = _run(directory, loop, dropout=0.0)
    records = first + second.records
    assert [r[:2] for r in records] == [r[:2] for r in reference.records]
    for (_, _, loss, lr), (_, _, want, want_lr) in zip(records, reference.records):
        assert lr == want_lr and abs(loss - want) <= 1e-12 * abs(want), (loss, want)
    for got, want in zip(second.parameters(), reference.parameters()):
        assert torch.allclose(got, want, rtol=1e-12, atol=0)


def test_a_loop_that_would_skip_or_replay_an_epoch_is_refused_on_every_rank(directory):
    _run(directory, _readme_loop, stop_at=6)  # saved in epoch 1
    run = _Run(directory)
    with pytest.raises(ValueError, match=r"set_epoch\(2\): .* resumed in epoch 1.*range\(epochs\)"):
        run.sampler.set_epoch(2)  # for epoch in range(sampler.epoch + 1, ...)
    run.close()
    run = _Run(directory)
    for batch in run.loader:  # the resumed epoch, begun without set_epoch ...
        run.step(batch)
    with pytest.raises(ValueError, match=r"set_epoch\(1\) after a pass over the resumed epoch 1"):
        run.sampler.set_epoch(1)  # ... then the loop's own count: epoch 1 again
    run.close()


def test_a_run_whose_epochs_went_back_is_not_resumed(directory):
    run = _Run(directory)
    for epoch in (0, 1, 0):  # set_epoch(epoch % 2)
        run.sampler.set_epoch(epoch)
        for batch in run.loader:
            run.step(batch)
    run.checkpointer.save()
    run.close()
    with pytest.raises(ValueError, match=r"set_epoch with an epoch below one it had trained"):
        _Run(directory)
