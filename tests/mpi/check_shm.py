"""Shared-memory reduction (mpidp.comm.shm): against its definition, and DDP through it.

Run on every rank under mpiexec, at 2 and 4 ranks, and at 4 ranks with
MPIDP_SHM_NODE_SIZE=2 (two "nodes" of two ranks: the node sums, then MPI
between the nodes). The window's allreduce must give every rank the same bits,
equal to the float64 sum of every rank's input rounded as the dtype rounds
one sum per element (float32/float64), or within one rounding of the float32
sum (float16/bfloat16, summed in float32). DDP through the window must train
as one process on the whole batch does, under every overlap strategy, with
and without gradients as bucket views, with no_sync and unused parameters,
and after the buckets are laid out anew.
"""

import gc
import glob
import os

import pytest
import torch
from mpi4py import MPI

import mpidp
from _models import (OPTIMIZERS, RANK, SIZE, Branches, inputs, loss_of, max_rel_diff,
                     reference_copy, shard, fresh)
from mpidp.comm import shm

COMM = MPI.COMM_WORLD
NODE_SIZE = int(os.environ.get("MPIDP_SHM_NODE_SIZE", "0")) or None
pytestmark = pytest.mark.skipif(SIZE < 2, reason="shared memory needs two ranks")


@pytest.fixture(scope="module")
def node():
    node = shm.Node(COMM)
    assert node.usable, node.reason
    assert node.local_size == (NODE_SIZE or SIZE)
    assert node.cross.Get_size() == SIZE // node.local_size
    yield node
    node.free()


def agree(value) -> bool:
    """Whether every rank holds the same ``value`` (compared by its bytes)."""
    values = COMM.allgather(value)
    return all(v == values[0] for v in values)


def inputs_of(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + salt)
    return (torch.randn(numel, generator=gen, dtype=torch.float64) * (rank + 1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
@pytest.mark.parametrize("numel", [1, 7, 17, 1001, 300_001])  # 300,001: several blocks per slice
def test_allreduce_equals_the_sum_of_every_rank_on_every_rank(node, dtype, numel):
    # two regions, the second not at the window's start: offsets are honoured
    first = (numel * 8 + 63) // 64 * 64
    window = node.allocate(first + numel * 8)
    mine = window.tensor(first, numel, dtype)
    mine.copy_(inputs_of(RANK, numel, dtype))
    other = window.tensor(0, numel, dtype)
    other.fill_(RANK)
    window.allreduce(mine)
    exact = sum(inputs_of(rank, numel, dtype).double() for rank in range(SIZE))
    if dtype in (torch.float32, torch.float64) and SIZE == 2:
        assert torch.equal(mine, exact.to(dtype))  # one rounding: a + b
    else:
        scale = exact.abs().max().item()
        tol = {torch.float32: 1e-6, torch.float64: 1e-14}.get(dtype, 2 ** -7)
        assert (mine.double() - exact).abs().max().item() <= tol * scale
    assert agree(mine.view(torch.uint8 if dtype.itemsize == 1 else
                           {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]).tolist())
    assert torch.all(other == RANK)  # the other region untouched


def test_a_divisor_divides_each_rank_first(node):
    window = node.allocate(4096)
    mine = window.tensor(64, 100, torch.float64)
    mine.copy_(inputs_of(RANK, 100, torch.float64))
    window.allreduce(mine, divisor=SIZE)
    exact = sum(inputs_of(rank, 100, torch.float64) / SIZE for rank in range(SIZE))
    torch.testing.assert_close(mine, exact, rtol=1e-14, atol=0)


def test_the_name_in_dev_shm_is_gone_once_mapped_and_the_memory_outlives_the_window(node):
    before = set(glob.glob("/dev/shm/mpidp-*"))
    window = node.allocate(1 << 16)
    tensor = window.tensor(0, 10, torch.float32)
    tensor.fill_(RANK)
    COMM.Barrier()
    assert set(glob.glob("/dev/shm/mpidp-*")) <= before  # unlinked: nothing left behind
    del window
    gc.collect()
    assert torch.all(tensor == RANK)  # the mapping lives while a tensor does


def test_the_file_is_the_owners_alone_and_no_other_file_is_taken_for_it(tmp_path):
    """Review for issue 31: the name was mpidp-<pid>-<n>, and a file another user of the node made
    under that name first was opened by every rank (the creation failed, the opens did not)."""
    name, identity, mapping = shm._create(4096)
    try:
        assert os.path.basename(name).startswith("mpidp-") and len(os.path.basename(name)) == 38
        found = os.stat(name)
        assert found.st_mode & 0o777 == 0o600 and found.st_uid == os.getuid()
        assert shm._open(name, 4096, identity) is not None  # the file rank 0 made
        decoy = tmp_path / "decoy"
        decoy.write_bytes(bytes(4096))
        decoy.chmod(0o666)
        assert shm._open(str(decoy), 4096, identity) is None  # another file under the name
        link = tmp_path / "link"
        link.symlink_to(name)
        assert shm._open(str(link), 4096, identity) is None  # never through a link
    finally:
        os.unlink(name)
        mapping.close()


# -- DDP through shared memory -----------------------------------------------------------


def train_pair(model_name="mlp", optimizer="adam", steps=4, step=None, **ddp_kwargs):
    ddp = mpidp.DistributedDataParallel(fresh(model_name), **ddp_kwargs)
    local = reference_copy(ddp.module, model_name=model_name)
    ddp_opt = OPTIMIZERS[optimizer](ddp.parameters())
    local_opt = OPTIMIZERS[optimizer](local.parameters())
    for k in range(steps):
        x, y = inputs(model_name, k)
        ddp_opt.zero_grad()
        (step or plain_step)(ddp, model_name, x, y)
        ddp_opt.step()
        local_opt.zero_grad()
        loss_of(model_name, local(x), y).backward()
        local_opt.step()
    return ddp, local


def plain_step(ddp, model_name, x, y):
    loss_of(model_name, ddp(shard(x)), shard(y)).backward()


def no_sync_step(ddp, model_name, x, y):
    xs, ys = shard(x), shard(y)
    halves = list(zip(xs.chunk(2), ys.chunk(2)))  # uneven at 4 ranks (3 rows): weigh by rows
    with ddp.no_sync():
        (loss_of(model_name, ddp(halves[0][0]), halves[0][1]) * len(halves[0][0]) / len(xs)).backward()
    (loss_of(model_name, ddp(halves[1][0]), halves[1][1]) * len(halves[1][0]) / len(xs)).backward()


def in_window(ddp) -> bool:
    window = ddp.reducer.layout.window
    return window is not None and all(window.holds(b.buffer) for b in ddp.reducer.layout.buckets)


def report(name, value):
    print(f"EQUIVALENCE-shm size={SIZE} node={NODE_SIZE or SIZE} {name} max_rel_diff={value:.3e}")


@pytest.mark.parametrize("overlap", ["inline", "thread", "nonblocking"])
@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
def test_ddp_through_shared_memory_matches_one_process(overlap, view):
    ddp, local = train_pair(overlap=overlap, gradient_as_bucket_view=view,
                            bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    assert in_window(ddp) and len(ddp.reducer.layout.buckets) > 2
    if view:  # gradients are the window's bucket views
        assert all(ddp.reducer.layout.window.holds(p.grad) for p in ddp.module.parameters())
    diff = max_rel_diff(ddp.module, local)
    report(f"ddp-{overlap}-{'view' if view else 'copy'}", diff)
    assert diff < 1e-5
    assert agree(torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]).tolist())
    ddp.close()


@pytest.mark.parametrize("overlap", ["inline", "thread", "nonblocking"])
def test_large_gradients_through_mpi_beside_buckets_in_shared_memory(overlap):
    """The default ("auto") without bucket views: big gradients reduced in place by MPI,
    in bucket order among the shared-memory buckets."""
    ddp, local = train_pair(overlap=overlap, bucket_cap_mb=0.001, inplace_threshold_mb=0.001)
    solo = [b for b in ddp.reducer.layout.buckets if b.solo]
    shared = [b for b in ddp.reducer.layout.buckets if not b.solo]
    assert solo and shared and all(ddp.reducer.layout.window.holds(b.buffer) for b in shared)
    diff = max_rel_diff(ddp.module, local)
    report(f"ddp-{overlap}-inplace-beside-shared", diff)
    assert diff < 1e-5
    ddp.close()


def test_auto_puts_every_gradient_in_shared_buckets_with_bucket_views():
    def model():  # a 1 MiB weight: in place by MPI under "auto" unless buckets are views
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 5))

    with mpidp.DistributedDataParallel(model()) as copies:
        assert [b.solo for b in copies.reducer.layout.buckets].count(True) == 1
    with mpidp.DistributedDataParallel(model(), gradient_as_bucket_view=True) as views:
        assert not any(b.solo for b in views.reducer.layout.buckets) and in_window(views)
    with mpidp.DistributedDataParallel(model(), gradient_as_bucket_view=True, shared_memory=False) as mpi:
        assert [b.solo for b in mpi.reducer.layout.buckets].count(True) == 1


def test_no_sync_accumulation_through_shared_memory():
    ddp, local = train_pair(step=no_sync_step, bucket_cap_mb=0.001)
    assert in_window(ddp)
    assert max_rel_diff(ddp.module, local) < 1e-5


def test_unused_parameters_through_shared_memory():
    torch.manual_seed(0)
    model = Branches()
    ddp = mpidp.DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.001)
    assert in_window(ddp)
    for step in range(3):
        x, y = inputs("mlp", step)
        ddp.zero_grad()
        loss_of("mlp", ddp(shard(x), RANK % 2 == 1), shard(y)).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters() if p.grad is not None])
        assert agree(grads.tolist())
    assert ddp.module.never.weight.grad is None  # unused everywhere: left alone, as torch does
    ddp.close()


def test_the_new_layout_after_the_first_step_gets_a_window_of_its_own():
    ddp = mpidp.DistributedDataParallel(fresh("mlp"), bucket_cap_mb=0.001, gradient_as_bucket_view=True)
    first = ddp.reducer.layout.window
    layout = ddp.reducer.layout.members
    x, y = inputs("mlp", 0)
    loss_of("mlp", ddp(shard(x)), shard(y)).backward()
    if ddp.reducer.layout.members != layout:  # rebuilt in arrival order: a new mapping
        assert ddp.reducer.layout.window is not first
    assert in_window(ddp)
    grads = [p.grad.clone() for p in ddp.module.parameters()]
    assert all(ddp.reducer.layout.window.holds(p.grad) for p in ddp.module.parameters())
    ddp.close()  # the gradients keep their memory after close
    gc.collect()
    assert all(torch.equal(p.grad, g) for p, g in zip(ddp.module.parameters(), grads))


def test_shared_memory_false_and_the_environment_switch(monkeypatch):
    ddp = mpidp.DistributedDataParallel(fresh("mlp"), shared_memory=False)
    assert ddp.reducer.layout.window is None
    ddp.close()
    monkeypatch.setenv("MPIDP_SHARED_MEMORY", "0")
    ddp = mpidp.DistributedDataParallel(fresh("mlp"))
    assert ddp.reducer.layout.window is None
    ddp.close()


def test_shared_memory_true_on_uneven_nodes_raises_on_every_rank(monkeypatch):
    """Runs in the 4-rank launch (tests/test_mpi.py's, two "nodes" of two), regrouped here."""
    if SIZE != 4:
        pytest.skip("needs 4 ranks grouped by the test (3 + 1)")
    monkeypatch.setenv("MPIDP_SHM_NODE_SIZE", "3")
    with pytest.raises(ValueError, match=r"shared_memory=True needs every node to hold the same "
                                         r"number \(> 1\) of the communicator's ranks, but nodes "
                                         r"hold different numbers of ranks \(\[1, 3\]\)"):
        mpidp.DistributedDataParallel(fresh("mlp"), shared_memory=True)
    ddp = mpidp.DistributedDataParallel(fresh("mlp"))  # None: MPI, silently
    assert ddp.reducer.layout.window is None
    ddp.close()
    COMM.Barrier()


def test_a_rank_that_cannot_map_the_memory_sends_every_rank_to_mpi(monkeypatch):
    real_open = os.open

    def failing_open(path, *args, **kwargs):
        if str(path).startswith("/dev/shm/mpidp-"):
            raise OSError(28, "No space left on device")
        return real_open(path, *args, **kwargs)

    if RANK == SIZE - 1:
        monkeypatch.setattr(shm.os, "open", failing_open)
    with pytest.warns(RuntimeWarning, match="no shared-memory window of .* bytes could be allocated"):
        ddp, local = train_pair(steps=2)
    assert ddp.reducer.layout.window is None
    assert max_rel_diff(ddp.module, local) < 1e-5
    ddp.close()


@pytest.mark.may_skip("needs a GPU, which CI's machine has not (tests/test_cuda.py)")
def test_shared_memory_and_a_cuda_module_is_a_clear_error():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    with pytest.raises(ValueError, match="shared_memory=True reduces CPU gradients"):
        mpidp.DistributedDataParallel(fresh("mlp").cuda(), shared_memory=True)
