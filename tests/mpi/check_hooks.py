"""Communication hooks (mpidp.hooks, DistributedDataParallel.register_comm_hook) and ddp.stats().

Run on every rank under mpiexec. Each shipped hook is checked against its
definition on the same buckets: ``allreduce_hook`` gives the bits of the DDP
without a hook; ``compressed_allreduce`` and the fp16/bf16 hooks give
round(float32 sum, in rank order, of round(x_r / N)) computed here from every
rank's input; ``powerSGD_hook`` gives what torch's ``powerSGD_hook`` gives over
a process group of the "mpidp" backend. Then torch's own default hooks on
mpidp's DDP, the hooks with no_sync, unused parameters, sparse gradients and
in-place buckets, the errors (raised on every rank, after which the ranks
still communicate), the profiler's bucket events, one profile of every rank
(``python -m mpidp profile``) and ``ddp.stats()``.

The models are float32 and small (a few buckets of ~0.5 KiB), so the file stays fast.
"""

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

import mpidp
import _models
from _models import BATCH, RANK, SIZE
from mpidp import __main__ as cli
from mpidp import hooks
from mpidp.comm import chunking

pytestmark = pytest.mark.filterwarnings("ignore:mpidp. ranks .* share cores")

DDP = mpidp.DistributedDataParallel
F16, BF16 = torch.float16, torch.bfloat16
# 3 buckets of net(), reduced through MPI's allreduce as the hooks do: with shared memory the
# sum's order is rank order, and an MPI library may add in another (Open MPI at 3 ranks: one
# float32 rounding apart), so bit-for-bit comparisons take MPI on both sides
SMALL = dict(bucket_cap_mb=0.0005, first_bucket_mb=0.0005, shared_memory=False)
STEPS = 3
POOL = "the DDP's pool"  # a state placeholder: ddp.pool, known once the DDP is built


@pytest.fixture(scope="module")
def group():
    """torch.distributed over the "mpidp" backend, for torch's hooks (once, for this file)."""
    assert not dist.is_initialized()
    mpidp.init_process_group()
    assert dist.get_backend() == "mpidp"
    yield dist.group.WORLD
    dist.destroy_process_group()


# -- models, data, training -----------------------------------------------------------


def net(seed_rank: int = RANK) -> nn.Module:
    """A float32 MLP; each rank seeds its own, so the DDP's broadcast of rank 0's must win."""
    torch.manual_seed(seed_rank)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 5))


class Branches(_models.Branches):
    """Branch ``a`` on even ranks, ``b`` on odd ones; ``never`` is unused everywhere."""

    def forward(self, x):
        return super().forward(x, bool(RANK % 2))


class SparseNet(nn.Module):
    """An embedding with sparse gradients feeding a dense layer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8, sparse=True)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def seeded(factory):
    def build():
        torch.manual_seed(RANK)
        return factory()
    return build


def batch(step: int, tokens: bool = False):
    """The global batch of ``step``, the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = (torch.randint(0, 20, (BATCH, 6), generator=gen) if tokens
         else torch.randn(BATCH, 10, generator=gen))
    return x, torch.randn(BATCH, 5, generator=gen)


def shard(tensor):
    return tensor.chunk(SIZE)[RANK]


def loss_on(model, step: int, tokens: bool = False):
    x, y = batch(step, tokens)
    return F.mse_loss(model(shard(x)), shard(y))


def plain_step(ddp, step, tokens=False):
    loss_on(ddp, step, tokens).backward()


def train(hook=None, state=None, steps=STEPS, factory=net, step_fn=plain_step, options=None,
          tokens=False, check=None):
    """SGD on this rank's shards under a DDP (``hook``: registered first).

    Returns (the gradients after the first step, a snapshot of the parameters
    after every step); ``check(ddp)`` runs before the DDP is closed.
    """
    ddp = DDP(factory(), **(SMALL if options is None else options))
    if hook is not None:
        ddp.register_comm_hook(ddp.pool if state is POOL else state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    first, history = None, []
    for step in range(steps):
        opt.zero_grad()
        step_fn(ddp, step, tokens)
        if first is None:
            first = [None if p.grad is None else p.grad.clone() for p in ddp.parameters()]
        opt.step()
        history.append([p.detach().clone() for p in ddp.parameters()])
    if check is not None:
        check(ddp)
    ddp.close()
    return first, history


_REFERENCES = {}


def reference(key, **kwargs):
    """``train(**kwargs)`` without a hook, once per ``key`` (every rank asks at the same tests)."""
    if key not in _REFERENCES:
        _REFERENCES[key] = train(**kwargs)
    return _REFERENCES[key]


def dense(tensor):
    return tensor.to_dense() if tensor is not None and tensor.is_sparse else tensor


def assert_bit_equal(got, expected):
    assert len(got) == len(expected)
    for k, (a, b) in enumerate(zip(got, expected)):
        a, b = dense(a), dense(b)
        assert (a is None) == (b is None), k
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), (k, (a - b).abs().max().item())


def rel_diff(got, expected) -> float:
    """Largest, over tensors, of max|got - expected| / max|expected|."""
    worst = 0.0
    for a, b in zip(got, expected):
        a, b = dense(a).double(), dense(b).double()
        worst = max(worst, (a - b).abs().max().item() / (b.abs().max().item() or 1.0))
    return worst


def report(name, value):
    if RANK == 0:  # the same on every rank
        print(f"HOOKS size={SIZE} {name} {value:.3e}", flush=True)


def assert_alive():
    """A collective on every rank: nobody was left behind by an error."""
    probe = torch.full((2,), float(RANK + 1))
    mpidp.comm.allreduce(probe, "sum")
    assert probe.tolist() == [SIZE * (SIZE + 1) / 2] * 2


def compressed_reference(inputs, dtype):
    """The definition: round(sum in float32, in rank order, of round(x_r / N)), as float32."""
    terms = [(x / SIZE).to(dtype).to(torch.float32) for x in inputs]
    total = terms[0].clone()  # not 0 + ...: -0 + -0 is -0, but 0 + -0 is 0
    for term in terms[1:]:  # rank order
        total += term
    return total.to(dtype).to(torch.float32)


def spread(numel: int, salt: int) -> torch.Tensor:
    """Random float32 values over several orders of magnitude, different on every rank."""
    gen = torch.Generator().manual_seed(10_000 * salt + 100 * numel + RANK)
    scale = 10.0 ** (torch.rand(numel, generator=gen) * 5 - 3)  # 1e-3 .. 1e2
    return torch.randn(numel, generator=gen) * scale


# -- 1. each mpidp hook against its definition -------------------------------------------


@pytest.mark.parametrize("state", [None, POOL], ids=["state_None", "state_pool"])
def test_allreduce_hook_gives_the_bits_of_the_ddp_without_a_hook(state):
    expected_grads, expected = reference("mlp")
    grads, history = train(hooks.allreduce_hook, state)
    assert_bit_equal(grads, expected_grads)
    for got, want in zip(history, expected):
        assert_bit_equal(got, want)
    assert rel_diff(expected[-1], expected[0]) > 1e-3  # the steps did move the parameters
    # the DDP's default, shared memory within the node: the same sums, in rank order
    shm_grads, _ = reference("mlp-shm", options=dict(SMALL, shared_memory=True))
    assert rel_diff(grads, shm_grads) < 1e-6


@pytest.mark.parametrize("form", ["tensor", "list"])
def test_a_hook_whose_future_holds_a_new_tensor(form):
    """The DDP copies the future's value into the bucket (torch accepts a list of one too)."""
    def averaged_elsewhere(state, bucket):
        average = bucket.buffer() / SIZE  # a new tensor; the bucket keeps the local sum
        mpidp.comm.allreduce(average, "sum")
        future = torch.futures.Future()
        future.set_result(average if form == "tensor" else [average])
        return future

    expected_grads, expected = reference("mlp")
    grads, history = train(averaged_elsewhere)
    assert_bit_equal(grads, expected_grads)
    assert_bit_equal(history[-1], expected[-1])


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("numel,chunk_mb", [(1, None), (7, None), (1001, None), (1001, 0.001),
                                            (4099, 0.001), (1 << 16, 0.01)])
def test_compressed_allreduce_equals_its_definition(dtype, numel, chunk_mb, monkeypatch):
    """In one chunk, and pipelined over many (4 to 26 chunks, the last one short)."""
    if chunk_mb is not None:
        monkeypatch.setattr(chunking, "CHUNK_MB", chunk_mb)
    x = spread(numel, salt=1)
    everyone = mpidp.allgather_object(x)
    buffer = x.clone()
    out = hooks.compressed_allreduce(buffer, dtype)
    assert out is buffer and out.dtype == torch.float32 and out.shape == (numel,)
    expected = compressed_reference(everyone, dtype)
    assert torch.equal(buffer, expected), (buffer - expected).abs().max().item()
    # the same bits on every rank
    assert all(torch.equal(other, buffer) for other in mpidp.allgather_object(buffer))


@pytest.mark.parametrize("numel,chunk_mb", [(5, None), (1001, None), (4099, 0.001)])
def test_compressed_allreduce_sends_no_more_than_its_share(numel, chunk_mb, monkeypatch):
    """The alltoalls together send the bucket rounded up to N equal blocks, never a whole
    chunk of padding (a small bucket once went out at the chunk's size: right sums, 2x bytes)."""
    if chunk_mb is not None:
        monkeypatch.setattr(chunking, "CHUNK_MB", chunk_mb)
    sent = []
    real = hooks._comm.ialltoall

    def counting(output, tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return real(output, tensor, *args, **kwargs)

    monkeypatch.setattr(hooks._comm, "ialltoall", counting)
    hooks.compressed_allreduce(spread(numel, salt=2), BF16)
    assert all(count % SIZE == 0 for count in sent), sent
    assert sum(sent) == -(-numel // SIZE) * SIZE, sent
    chunk = chunking.chunk_bytes() // 4 // SIZE * SIZE
    assert len(sent) == -(-numel // chunk), sent


@pytest.mark.parametrize("differs", ["numel", "dtype", "wire", "chunk"])
def test_compressed_allreduce_names_what_differs_across_ranks(differs, monkeypatch):
    """One rank's buffer size, dtype, 16-bit format or chunk size differs: the same error on
    every rank, naming each rank's, never a hang (the chunks would no longer match)."""
    last = RANK == SIZE - 1
    numel = 1000 + (7 if last and differs == "numel" else 0)
    dtype = torch.float64 if last and differs == "dtype" else torch.float32
    wire = F16 if last and differs == "wire" else BF16
    if last and differs == "chunk":
        monkeypatch.setattr(chunking, "CHUNK_MB", 0.001)
    with pytest.raises(ValueError, match="every rank must pass a usable buffer of the same size") as error:
        hooks.compressed_allreduce(torch.ones(numel, dtype=dtype), wire)
    text = str(error.value)
    assert f"rank {SIZE - 1}: " in text and "1000 elements of float32 sent as bfloat16" in text
    # every rank is ready for the next call
    assert torch.equal(hooks.compressed_allreduce(torch.ones(10), BF16), torch.ones(10))


def _unusable(kind: str) -> torch.Tensor:
    if kind == "strided":
        return torch.arange(2000.0)[::2]
    if kind == "expanded":
        return torch.ones(1).expand(1000)
    if kind == "requires_grad":
        return torch.ones(1000, requires_grad=True) * 2
    if kind == "inference":
        with torch.inference_mode():
            return torch.ones(1000)
    if kind == "int32":
        return torch.ones(1000, dtype=torch.int32)
    return torch.ones(1000).numpy()


@pytest.mark.parametrize("kind", ["strided", "expanded", "requires_grad", "inference", "int32",
                                  "numpy"])
def test_an_unusable_buffer_on_one_rank_is_the_same_error_on_every_rank(kind):
    """Found by review: a rank that raised before the check left the others to pair their
    collectives with its next call (wrong sums), or waiting in the alltoall for good."""
    buffer = _unusable(kind) if RANK == SIZE - 1 else torch.ones(1000)
    with pytest.raises(ValueError, match=f"rank {SIZE - 1}: (buffer|dtype)") as error:
        hooks.compressed_allreduce(buffer, BF16)
    if SIZE > 1:
        assert "1000 elements of float32 sent as bfloat16" in str(error.value)
    x = torch.full((1000,), float(RANK + 1))
    hooks.compressed_allreduce(x, BF16)  # every rank goes on, in step
    assert torch.equal(x, torch.full((1000,), (SIZE + 1) / 2))


def test_compressed_allreduce_work_buffers_survive_inference_mode_and_many_sizes():
    """A first call inside inference_mode once made buffers that later calls could not write;
    one set per size grew without bound (100 sizes of ~4 MiB: +600 MiB)."""
    with torch.inference_mode():
        x = torch.full((4097,), 2.0)
        hooks.compressed_allreduce(x, BF16)
    for numel in (4097, 4096, 10, 5000, 1, 0):
        x = torch.full((numel,), 2.0)
        hooks.compressed_allreduce(x, BF16)
        assert torch.equal(x, torch.full((numel,), 2.0))
    kept = [key for key in hooks._THREAD.workspaces if key[1] == BF16]
    assert len(kept) == 1, kept  # one set for this world size, grown to the largest


def test_powersgd_leaves_the_global_random_state_alone():
    """Its first Qs come from a generator of its own (torch's hook reseeds the process's,
    which two threads' hooks raced on: 2 to 10 of 600 results wrong)."""
    model = nn.Linear(32, 16)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    views = [flat[:512].view(16, 32), flat[512:].view(16)]
    state = hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                warm_start=False, use_error_feedback=False)
    state.iter = 2
    before = torch.get_rng_state()
    hooks.powerSGD_hook(state, hooks.GradBucket(0, flat, views, [None, None], True)).wait()
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("differs", ["shapes", "order", "rank", "start"])
def test_powersgd_names_a_bucket_or_setting_that_differs_across_ranks(differs):
    """The factors' allreduces would pair unlike matrices (silently wrong) or unlike sizes."""
    last = RANK == SIZE - 1
    shapes = [(16, 32), (32, 16), (16,)]
    if last and differs == "shapes":
        shapes = [(32, 16), (32, 16), (16,)]
    if last and differs == "order":
        shapes = [(32, 16), (16, 32), (16,)]
    state = hooks.PowerSGDState(None, matrix_approximation_rank=3 if last and differs == "rank"
                                else 2, start_powerSGD_iter=3 if last and differs == "start"
                                else 2)
    with pytest.raises(ValueError, match="every rank must reduce the same bucket") as error:
        for step in range(4):
            flat = torch.randn(sum(torch.Size(shape).numel() for shape in shapes))
            views, at = [], 0
            for shape in shapes:
                views.append(flat[at:at + torch.Size(shape).numel()].view(shape))
                at += views[-1].numel()
            hooks.powerSGD_hook(state, hooks.GradBucket(0, flat, views, [None] * 3, True))
    assert f"rank {SIZE - 1}: bucket 0" in str(error.value)
    assert step == (2 if differs == "start" else 0)
    assert_alive()


def test_compressed_allreduce_from_two_threads_on_two_communicators(monkeypatch):
    """Two threads, each on a communicator of its own, compress buckets of one size at once
    (two DDPs stepping in two threads): each thread must get work buffers of its own."""
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        pytest.skip("two threads in MPI need MPI_THREAD_MULTIPLE")
    monkeypatch.setattr(chunking, "CHUNK_MB", 0.001)  # 17 chunks: long windows to interleave
    numel, rounds = 4099, 20
    inputs = [spread(numel, salt=20 + t) for t in range(2)]
    expected = [compressed_reference(mpidp.allgather_object(x), BF16) for x in inputs]
    comms = [MPI.COMM_WORLD.Dup() for _ in range(2)]
    wrong: list = []
    failed: list = []

    def work(t: int) -> None:
        try:
            for r in range(rounds):
                got = hooks.compressed_allreduce(inputs[t].clone(), BF16, comms[t])
                if not torch.equal(got, expected[t]):
                    wrong.append((t, r, (got - expected[t]).abs().max().item()))
        except BaseException as error:  # reported below, on this rank
            failed.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for comm in comms:
        comm.Free()
    assert not failed, failed
    assert not wrong, wrong[:5]


@pytest.mark.skipif(SIZE < 3, reason="two summands commute: no order to check")
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_compressed_allreduce_sums_in_rank_order(dtype):
    """Inputs whose float32 sum depends on the order: big, tiny and -big on three ranks.

    tiny is 1.5 half-ulps of big in float32: big + tiny rounds up to the next
    float32, -big + tiny is a tie, rounded to even; the order shows in the result, which
    ``dtype`` holds exactly. One element per placement of the three on the
    ranks (the others hold 0). Random inputs cannot tell orders apart: sums of
    three values of 8 or 11 significant bits are exact in float32.
    """
    big = 1.0 if dtype == BF16 else 1024.0  # tiny stays a normal number of dtype
    tiny = 1.5 * 2.0 ** -24 * big
    placements = [(i, j, k) for i in range(SIZE) for j in range(SIZE) for k in range(SIZE)
                  if len({i, j, k}) == 3]
    x = torch.zeros(len(placements))
    for e, (i, j, k) in enumerate(placements):
        x[e] = {i: big, j: tiny, k: -big}.get(RANK, 0.0) * SIZE  # / SIZE is exact
    everyone = mpidp.allgather_object(x)
    out = hooks.compressed_allreduce(x.clone(), dtype)
    expected = compressed_reference(everyone, dtype)
    assert torch.equal(out, expected), (out, expected)
    assert len(set(expected.tolist())) > 1  # the orders do give different sums here


@pytest.mark.parametrize("comm", ["COMM_WORLD", "Pool"])
def test_compressed_allreduce_over_a_given_communicator(comm):
    base = MPI.COMM_WORLD.Dup()
    given = base if comm == "COMM_WORLD" else mpidp.comm.Pool(base, 2)
    try:
        x = spread(33, salt=2)
        everyone = mpidp.allgather_object(x)
        out = hooks.compressed_allreduce(x.clone(), BF16, comm=given)
        assert torch.equal(out, compressed_reference(everyone, BF16))
    finally:
        if isinstance(given, mpidp.comm.Pool):
            given.free()
        base.Free()


def test_relative_error_of_one_compressed_reduction():
    gen = torch.Generator().manual_seed(7 + RANK)
    x = torch.randn(4096, generator=gen)
    exact = torch.stack(mpidp.allgather_object(x)).double().sum(0) / SIZE
    for dtype, unit in ((F16, 2.0 ** -11), (BF16, 2.0 ** -8)):
        got = hooks.compressed_allreduce(x.clone(), dtype).double()
        error = (got - exact).abs().max().item() / exact.abs().max().item()
        norm = ((got - exact).norm() / exact.norm()).item()
        name = "fp16" if dtype == F16 else "bf16"
        report(f"{name} one compressed reduction: relative error (max-norm)", error)
        report(f"{name} one compressed reduction: relative error (2-norm)", norm)
        assert 0 < error < 8 * unit  # compressed, and by no more than a few roundings
        assert 0 < norm < 4 * unit


@pytest.mark.parametrize("hook,dtype", [(hooks.fp16_compress_hook, F16),
                                        (hooks.bf16_compress_hook, BF16)], ids=["fp16", "bf16"])
def test_compress_hooks_in_ddp_equal_their_definition_on_local_gradients(hook, dtype):
    ddp = DDP(net(), **SMALL)
    ddp.register_comm_hook(None, hook)
    loss_on(ddp, 0).backward()
    plain = net(0)  # rank 0's initial model, which the DDP broadcast
    loss_on(plain, 0).backward()
    local = [p.grad for p in plain.parameters()]
    everyone = mpidp.allgather_object(local)
    exact_differs = False
    for param, grads in zip(ddp.parameters(), zip(*everyone)):
        expected = compressed_reference(list(grads), dtype)
        assert torch.equal(param.grad, expected), (param.grad - expected).abs().max().item()
        exact = torch.stack(grads).sum(0) / SIZE
        exact_differs |= not torch.equal(param.grad, exact)
    assert exact_differs
    ddp.close()


def psgd_net() -> nn.Module:
    """Matrices of shapes (16, 32), (32, 16), (16, 32) in a row: torch batches Ps and Qs by shape."""
    torch.manual_seed(RANK)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 5))


PSGD_CASES = [(1, True, True), (4, True, True), (1, False, False), (4, False, False),
              (4, True, False)]
LAYOUTS = {"small": SMALL, "one_bucket": dict(bucket_cap_mb=1, shared_memory=False)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rank,feedback,warm", PSGD_CASES,
                         ids=[f"r{r}-{'ef' if f else 'noef'}-{'warm' if w else 'cold'}"
                              for r, f, w in PSGD_CASES])
def test_powersgd_hook_equals_torchs_over_the_mpidp_group(group, rank, feedback, warm, layout):
    options = dict(matrix_approximation_rank=rank, start_powerSGD_iter=3,
                   use_error_feedback=feedback, warm_start=warm)
    mine = hooks.PowerSGDState(None, **options)
    theirs = torch_powersgd.PowerSGDState(group, **options)
    run = dict(steps=6, factory=psgd_net, options=LAYOUTS[layout])
    _, got = train(hooks.powerSGD_hook, mine, **run)
    _, expected = train(torch_powersgd.powerSGD_hook, theirs, **run)
    diff = rel_diff(got[-1], expected[-1])
    report(f"powerSGD rank {rank} feedback {feedback} warm {warm} {layout} vs torch's: "
           f"rel diff", diff)
    # The same operations on the same buckets, one product summed in another order
    # (mpidp forms Q = M^T P as (P^T M)^T): equal within float32 summation noise.
    assert diff < 1e-5
    assert mine.iter == theirs.iter == 6
    assert mine.compression_stats() == theirs.compression_stats()
    assert mine.compression_stats()[0] > 1
    # exact for the first start_powerSGD_iter steps, then not
    _, exact = reference(f"psgd-{layout}", **run)
    for step in range(3):
        assert_bit_equal(got[step], exact[step])
    assert rel_diff(got[-1], exact[-1]) > 1e-5


# -- 2. torch's default hooks on mpidp's DDP -------------------------------------------


@pytest.mark.parametrize("name", ["allreduce", "fp16", "bf16"])
def test_torchs_default_hooks_on_mpidp_ddp(group, name):
    theirs = {"allreduce": default_hooks.allreduce_hook,
              "fp16": default_hooks.fp16_compress_hook,
              "bf16": default_hooks.bf16_compress_hook}[name]
    grads, got = train(theirs, group)
    if name == "allreduce":
        # torch's hook goes through the backend's nonblocking allreduce, the DDP through the
        # blocking one: the same bits on MPICH, one rounding apart where the library picks
        # another algorithm for each (Open MPI at 3 ranks)
        expected_grads, expected = reference("mlp")
        assert rel_diff(grads, expected_grads) < 1e-6
        assert rel_diff(got[-1], expected[-1]) < 1e-6
        return
    mine = hooks.fp16_compress_hook if name == "fp16" else hooks.bf16_compress_hook
    _, expected = train(mine)
    diff = rel_diff(got[-1], expected[-1])
    report(f"torch's {name} hook vs mpidp's after {STEPS} steps: rel diff", diff)
    if SIZE == 2 and name == "bf16":  # x / 2 is exact and one rounding of a + b either way
        assert_bit_equal(got[-1], expected[-1])
    elif SIZE == 2:  # the same, but for fp16's subnormals: torch rounds x before halving it
        assert diff < 1e-6
    else:
        assert diff < (2e-3 if name == "fp16" else 1e-2)
    _, exact = reference("mlp")
    assert rel_diff(got[-1], exact[-1]) > 0  # compressed indeed


# -- 3. hooks with no_sync, unused parameters, sparse gradients, in-place buckets ----------


def test_no_sync_calls_the_hook_once_per_bucket_of_each_synced_step():
    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        return hooks.allreduce_hook(state, bucket)

    def accumulate(ddp, step, tokens):
        calls.clear()
        with ddp.no_sync():
            loss_on(ddp, 100 + step).backward()
        if ddp.reducer.launcher.comm_hook is not None:
            assert calls == []
        loss_on(ddp, step).backward()
        if ddp.reducer.launcher.comm_hook is not None:
            assert calls == list(range(len(ddp.reducer.layout.buckets)))

    grads, got = train(counting, None, step_fn=accumulate)
    assert calls  # the checks above ran
    expected_grads, expected = reference("mlp-no-sync", step_fn=accumulate)
    assert_bit_equal(grads, expected_grads)
    assert_bit_equal(got[-1], expected[-1])


def test_unused_parameters_with_a_hook():
    options = dict(SMALL, find_unused_parameters=True)

    def check(ddp):
        assert ddp.module.never.weight.grad is None and ddp.module.never.bias.grad is None

    grads, got = train(hooks.allreduce_hook, None, factory=seeded(Branches), options=options,
                       check=check)
    expected_grads, expected = reference("branches", factory=seeded(Branches), options=options)
    assert_bit_equal(grads, expected_grads)
    assert_bit_equal(got[-1], expected[-1])
    assert grads[2] is not None  # a.weight: used on even ranks only, reduced everywhere


def test_sparse_gradients_bypass_the_hook():
    seen = []

    def recording(state, bucket):
        seen.extend(id(p) for p in bucket.parameters())
        return hooks.allreduce_hook(state, bucket)

    embed_id = []

    def check(ddp):
        embed_id.append(id(ddp.module.embed.weight))
        dense_ids = {id(p) for p in ddp.module.head.parameters()}
        assert dense_ids <= set(seen)

    grads, got = train(recording, None, factory=seeded(SparseNet), tokens=True, check=check)
    assert embed_id[0] not in seen
    assert grads[0].is_sparse
    expected_grads, expected = reference("sparse", factory=seeded(SparseNet), tokens=True)
    assert_bit_equal(grads, expected_grads)
    assert_bit_equal(got[-1], expected[-1])


def test_in_place_buckets_with_a_hook():
    options = dict(SMALL, inplace_threshold_mb=0.001)  # the 32x10 and 32x32 weights
    views = []

    def checking(state, bucket):
        # gradients(): views of buffer(), shaped as the parameters, in their order
        buffer, at = bucket.buffer(), 0
        for grad, param in zip(bucket.gradients(), bucket.parameters(), strict=True):
            assert grad.shape == param.shape
            assert grad.data_ptr() == buffer[at:].data_ptr()
            at += grad.numel()
        assert at == buffer.numel()
        views.append(len(bucket.parameters()))
        return hooks.allreduce_hook(state, bucket)

    def check(ddp):
        assert sum(bucket.solo for bucket in ddp.reducer.layout.buckets) == 2

    grads, got = train(checking, None, options=options, check=check)
    assert views.count(1) >= 2 * STEPS  # the two in-place buckets, at every step
    expected_grads, expected = reference("mlp-solo", options=options)
    assert_bit_equal(grads, expected_grads)
    assert_bit_equal(got[-1], expected[-1])


# -- 4. errors: raised on every rank, and the ranks still communicate ----------------------


def test_registering_twice_raises_everywhere():
    with DDP(net(), **SMALL) as ddp:
        ddp.register_comm_hook(None, hooks.allreduce_hook)
        with pytest.raises(RuntimeError, match="only be called once"):
            ddp.register_comm_hook(None, hooks.allreduce_hook)
        loss_on(ddp, 0).backward()  # the first one stays
        assert ddp.reducer.launcher.comm_hook[1] is hooks.allreduce_hook
    assert_alive()


def test_registering_after_the_first_backward_raises_everywhere():
    with DDP(net(), **SMALL) as ddp:
        loss_on(ddp, 0).backward()
        with pytest.raises(RuntimeError, match="before the first backward"):
            ddp.register_comm_hook(None, hooks.allreduce_hook)
        assert ddp.reducer.launcher.comm_hook is None
        loss_on(ddp, 1).backward()
    assert_alive()


def test_a_different_hook_on_rank_1_raises_everywhere():
    hook = hooks.fp16_compress_hook if RANK == 1 else hooks.allreduce_hook
    with DDP(net(), **SMALL) as ddp:
        with pytest.raises(ValueError, match="different hooks"):
            ddp.register_comm_hook(None, hook)
        assert ddp.reducer.launcher.comm_hook is None
        loss_on(ddp, 0).backward()
    assert_alive()


def test_a_hook_that_is_not_callable():
    with DDP(net(), **SMALL) as ddp:
        with pytest.raises(TypeError, match="callable"):
            ddp.register_comm_hook(None, "allreduce")
    assert_alive()


def test_join_refuses_a_hook():
    with DDP(net(), **SMALL) as ddp:
        ddp.register_comm_hook(None, hooks.allreduce_hook)
        with pytest.raises(RuntimeError, match="comm hook"):
            with ddp.join():
                pass
    assert_alive()


def test_a_hook_returning_no_future_raises_from_backward_everywhere():
    def no_future(state, bucket):
        return hooks.allreduce_hook(state, bucket).wait()  # the tensor itself

    ddp = DDP(net(), **SMALL)
    ddp.register_comm_hook(None, no_future)
    with pytest.raises(TypeError, match="must return a torch.futures.Future"):
        loss_on(ddp, 0).backward()
    # close() finishes the abandoned step, which calls the hook for the
    # buckets left, and it raises the same again (on every rank alike)
    with contextlib.suppress(TypeError):
        ddp.close()
    assert ddp.pool is None
    assert_alive()


def test_powersgd_state_arguments():
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        hooks.PowerSGDState(start_powerSGD_iter=1)
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        hooks.PowerSGDState(matrix_approximation_rank=0)
    hooks.PowerSGDState(start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)
    with pytest.raises(TypeError, match="state must be None"):
        hooks.PowerSGDState(comm="world")


def test_a_hook_and_a_stage_2_zero_optimizer_exclude_each_other():
    with DDP(net(), **SMALL) as ddp:
        mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, stage=2, lr=0.1)
        with pytest.raises(RuntimeError, match="stage-2"):
            ddp.register_comm_hook(None, hooks.allreduce_hook)
    with DDP(net(), **SMALL) as ddp:
        ddp.register_comm_hook(None, hooks.allreduce_hook)
        with pytest.raises(ValueError, match="comm hook"):
            mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, stage=2, lr=0.1)
    assert_alive()


# -- 5. the profiler -----------------------------------------------------------------


@pytest.mark.parametrize("hook", [None, hooks.allreduce_hook, hooks.fp16_compress_hook],
                         ids=["no_hook", "allreduce_hook", "fp16_compress_hook"])
def test_profiler_records_every_bucket(hook):
    with DDP(net(), **SMALL) as ddp:
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        loss_on(ddp, 0).backward()  # the buckets are rebuilt in arrival order after it
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss_on(ddp, 1).backward()
        buckets = ddp.reducer.layout.buckets
        assert len(buckets) >= 3
        names = sorted(event.name for event in prof.events()
                       if event.name.startswith("mpidp.DDP bucket "))
        suffix = "allreduce" if hook is None else hook.__name__
        expected = sorted(f"mpidp.DDP bucket {k} "
                          f"{bucket.buffer.numel() * bucket.buffer.element_size() / 2**20:.2f} "
                          f"MiB {suffix}" for k, bucket in enumerate(buckets))
        assert names == expected


PROFILED = """
import torch
from torch import nn
import mpidp

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))
# inline: each bucket's range holds its blocking allreduce, which no rank can leave before
# every rank has entered it
ddp = mpidp.DistributedDataParallel(model, bucket_cap_mb=0.0005, first_bucket_mb=0.0005,
                                    shared_memory=False, overlap="inline")
for step in range(2):
    ddp(torch.randn(4, 10)).sum().backward()
print(f"buckets {len(ddp.reducer.layout.buckets)}")
"""


def check_trace(path: str, size: int, buckets: int, steps: int) -> None:
    """The merged trace: JSON that Perfetto reads, one process per rank, every rank's bucket
    ranges, and times on one axis (each step's bucket range ends, on every rank, after it
    began on every rank)."""
    with open(path) as file:
        trace = json.load(file)
    events = trace["traceEvents"]
    assert events and all({"ph", "ts", "pid", "tid", "name"} <= set(e) for e in events), \
        [e for e in events if not {"ph", "ts", "pid", "tid", "name"} <= set(e)][:3]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {rank: f"rank {rank}" for rank in range(size)}
    assert {e["pid"] for e in events} == set(range(size))
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert min(e["ts"] for e in spans) < 1e6  # µs from the earliest event (the profiler's start)
    ranges = {rank: sorted((e["ts"], e["ts"] + e["dur"]) for e in spans
                           if e["pid"] == rank and e["name"].startswith("mpidp.DDP bucket "))
              for rank in range(size)}
    assert all(len(found) == buckets * steps for found in ranges.values()), ranges
    for k in range(buckets * steps):
        latest_start = max(found[k][0] for found in ranges.values())
        assert all(found[k][1] >= latest_start for found in ranges.values()), (k, ranges)


def test_python_m_mpidp_profile_writes_one_trace_of_every_rank(capsys):
    """``python -m mpidp profile -o FILE script.py`` (its main(), in this launch)."""
    folder = mpidp.broadcast_object(tempfile.mkdtemp() if RANK == 0 else None)
    script, path = os.path.join(folder, "train.py"), os.path.join(folder, "job.json")
    if RANK == 0:
        with open(script, "w") as file:
            file.write(PROFILED)
    mpidp.barrier()
    argv, first = sys.argv[:], sys.path[0]
    try:
        assert cli.main(["profile", "-o", path, script]) == 0
    finally:
        sys.argv[:], sys.path[0] = argv, first
    buckets = int(capsys.readouterr().out.split("buckets ")[1].split()[0])
    try:
        if RANK == 0:
            check_trace(path, SIZE, buckets, steps=2)
    finally:
        mpidp.barrier()
        if RANK == 0:
            shutil.rmtree(folder)


def test_profile_refuses_a_missing_folder_on_every_rank():
    with pytest.raises(ValueError, match="mpidp.profile: rank 0: path .* does not exist"):
        with mpidp.profile("/nonexistent-mpidp-folder/job.json"):
            pass


# -- 6. ddp.stats() ------------------------------------------------------------------


def bucket_bytes(ddp) -> list[int]:
    """numel * element_size of each of ``ddp.reducer.layout.buckets`` (in-place ones hold no buffer)."""
    reducer = ddp.reducer
    assert len(reducer.layout.buckets) == len(reducer.layout.members)
    return [sum(shape.numel() for shape in bucket.shapes) * reducer.params[members[0]].element_size()
            for bucket, members in zip(reducer.layout.buckets, reducer.layout.members)]


@pytest.mark.parametrize("hook", [None, hooks.allreduce_hook], ids=["no_hook", "allreduce_hook"])
def test_stats_of_the_synced_steps(hook):
    options = dict(SMALL, chunk_mb=0.0002, inplace_threshold_mb=0.001)  # chunks, a solo bucket
    with DDP(net(), **options) as ddp:
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        assert ddp.stats() == []
        for step in range(4):
            with ddp.no_sync():
                loss_on(ddp, 100 + step).backward()
            loss_on(ddp, step).backward()
        stats = ddp.stats()
        assert len(stats) == 4
        assert [entry["step"] for entry in stats] == [1, 2, 3, 4]
        sizes = bucket_bytes(ddp)
        chunk = ddp.reducer.strategy.chunk_bytes
        assert any(size > chunk for size in sizes)
        for entry in stats:
            assert set(entry) == {"step", "bytes", "collectives", "reduction_s", "wait_s",
                                  "joined", "lateness_ms"}
            assert entry["bytes"] == sum(sizes)
            assert entry["collectives"] >= len(sizes) + 1
            if hook is None:  # chunks counted
                assert entry["collectives"] == sum(math.ceil(s / chunk) for s in sizes) + 1
            else:  # one per hook call
                assert entry["collectives"] == len(sizes) + 1
            assert entry["reduction_s"] >= 0 and entry["wait_s"] >= 0
            assert entry["joined"] is False
        # each step's lateness, per rank, once the next synced step carried it
        assert stats[-1]["lateness_ms"] is None
        for entry in stats[:-1]:
            late = entry["lateness_ms"]
            assert len(late) == SIZE and min(late) == 0 and all(v >= 0 for v in late), late
        assert sum(p.numel() * p.element_size() for p in ddp.parameters()) == sum(sizes)
        counted = mpidp.allgather_object([(e["bytes"], e["collectives"]) for e in stats])
        assert all(other == counted[0] for other in counted)
        stats[0]["bytes"] = -1  # a copy
        assert ddp.stats()[0]["bytes"] == sum(sizes)


def test_stats_keep_the_last_100_steps():
    torch.manual_seed(0)
    with DDP(nn.Linear(3, 2)) as ddp:
        x = torch.ones(2, 3)
        for _ in range(103):
            ddp(x).sum().backward()
        stats = ddp.stats()
    assert len(stats) == 100
    assert [entry["step"] for entry in stats] == list(range(4, 104))
    assert all(entry["bytes"] == 8 * 4 for entry in stats)


@pytest.mark.parametrize("hook", [None, hooks.allreduce_hook], ids=["no_hook", "allreduce_hook"])
def test_record_stats_off_records_nothing_and_changes_nothing(hook):
    expected_grads, _ = reference("mlp")
    with DDP(net(), **SMALL) as ddp:
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        ddp.record_stats = False
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss_on(ddp, 0).backward()
        assert ddp.stats() == []
        assert not [e for e in prof.events() if e.name.startswith("mpidp.DDP bucket ")]
        assert_bit_equal([p.grad for p in ddp.parameters()], expected_grads)
        ddp.record_stats = True
        loss_on(ddp, 1).backward()
        assert len(ddp.stats()) == 1
        with pytest.raises(TypeError, match="record_stats must be a bool"):
            ddp.record_stats = 0
