"""GPU path under mpiexec: comm on CUDA tensors and DDP on a CUDA model vs a CPU reference.

Skips without a GPU; fails instead when MPIDP_TEST_GPU=1. Each route to MPI (blocking,
nonblocking, DDP under every overlap strategy, the backend's progress thread) is checked to
take the path the decision gives (``mpidp.cuda.paths()``); MPIDP_TEST_PATH=pointer (or staged)
also says which path that must be for every device collective, so that a silent fall back to
staging fails (bench/gpu_validate.sh sets it for a library that reads device memory in every
collective, and checks that the tests fail under MPIDP_CUDA_AWARE=0).
"""

import contextlib
import os

import pytest
import torch

import mpidp
from _models import RANK, SIZE, inputs, loss_of, max_rel_diff, mlp, shard

if not torch.cuda.is_available():
    if os.environ.get("MPIDP_TEST_GPU") == "1":
        raise RuntimeError("MPIDP_TEST_GPU=1 but torch sees no GPU")
    pytest.skip("no GPU", allow_module_level=True)

DEVICE = mpidp.cuda.local_device()
PATH = os.environ.get("MPIDP_TEST_PATH")  # "pointer" or "staged": what every device call must take


def path_of(nonblocking: bool) -> str:
    """The path the decision gives a device collective of this kind, and MPIDP_TEST_PATH's if set."""
    path = "pointer" if mpidp.cuda.takes_device_memory(nonblocking) else "staged"
    if PATH is not None and path != PATH:
        raise AssertionError(f"device memory goes {path} ({mpidp.cuda.decision().reason}) where "
                             f"MPIDP_TEST_PATH={PATH}")
    return path


@contextlib.contextmanager
def paths_taken():
    """The paths (``mpidp.cuda.paths()``) that device memory took within the block."""
    taken: set[str] = set()
    before = mpidp.cuda.paths()
    yield taken
    after = mpidp.cuda.paths()
    taken.update(path for path in after if after[path] > before[path])


def test_device_memory_goes_to_mpi_the_decided_way_blocking_and_nonblocking():
    tensor = torch.full((1 << 16,), float(RANK + 1), device=DEVICE)
    with paths_taken() as taken:
        mpidp.comm.allreduce(tensor)
    assert taken == {path_of(False)}
    with paths_taken() as taken:
        mpidp.comm.iallreduce(tensor).wait()
    assert taken == {path_of(True)}
    assert torch.all(tensor == SIZE * SIZE * (SIZE + 1) // 2).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.int64], ids=str)
def test_collectives_on_device_tensors(dtype):
    tensor = torch.full((1000,), RANK + 1, dtype=dtype, device=DEVICE)
    mpidp.comm.allreduce(tensor)
    assert torch.all(tensor == SIZE * (SIZE + 1) // 2).item()
    gathered = torch.empty(SIZE * 3, dtype=dtype, device=DEVICE)
    mpidp.comm.allgather(gathered, torch.full((3,), RANK, dtype=dtype, device=DEVICE))
    assert gathered.cpu().tolist() == [r for r in range(SIZE) for _ in range(3)]


@pytest.mark.parametrize("overlap", ["auto", "inline", "thread", "nonblocking"])
def test_ddp_on_the_gpu_matches_the_cpu(overlap):
    torch.manual_seed(RANK)
    model = mlp()
    cpu = mpidp.DistributedDataParallel(model)
    gpu = mpidp.DistributedDataParallel(mlp().to(DEVICE), overlap=overlap, bucket_cap_mb=0.001)
    gpu.module.load_state_dict(cpu.module.state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (cpu, gpu)]
    with paths_taken() as taken:
        for step in range(4):
            x, y = inputs("mlp", step)
            for model, optimizer, device in zip((cpu, gpu), optimizers, ("cpu", DEVICE)):
                optimizer.zero_grad()
                loss_of("mlp", model(shard(x).to(device)), shard(y).to(device)).backward()
                optimizer.step()
    # the buckets' path: nonblocking collectives under "nonblocking", blocking ones otherwise
    assert path_of(overlap == "nonblocking") in taken and taken <= {path_of(False), path_of(True)}
    assert max_rel_diff(gpu.module.cpu(), cpu.module) < 1e-5


def test_device_ids_of_the_local_gpu_move_cpu_inputs_and_moving_the_wrapper_rebuilds():
    torch.manual_seed(RANK)
    cpu = mpidp.DistributedDataParallel(mlp())
    gpu = mpidp.DistributedDataParallel(mlp().to(DEVICE), device_ids=[DEVICE.index],
                                        output_device=DEVICE.index)
    gpu.module.load_state_dict(cpu.module.state_dict())
    x, y = inputs("mlp", 0)
    loss_of("mlp", gpu(shard(x)), shard(y).to(DEVICE)).backward()  # CPU input moved by DDP
    loss_of("mlp", cpu(shard(x)), shard(y)).backward()
    for p, q in zip(gpu.module.parameters(), cpu.module.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="device_ids\\[0\\] must be the module's device"):
        mpidp.DistributedDataParallel(mlp().to(DEVICE), device_ids=[DEVICE.index + 1])
    moved = mpidp.DistributedDataParallel(mlp()).to(DEVICE)  # the wrapper follows its module
    assert {b.buffer.device for b in moved.reducer.layout.buckets if b.buffer is not None} == {DEVICE}
    loss_of("mlp", moved(shard(x).to(DEVICE)), shard(y).to(DEVICE)).backward()


# -- every other path on the GPU, each against the same run on the CPU ------------------
# Two ranks may share one GPU: each then drives cuda:0, and MPI reads device memory
# directly or through host staging (mpidp.cuda.decision()).

F64 = torch.float64


def on(device, module: torch.nn.Module) -> torch.nn.Module:
    return module.to(device)


def twin(factory, seed=0):
    """The same freshly built model on the CPU and on this rank's GPU."""
    torch.manual_seed(seed)
    cpu = factory()
    gpu = factory().to(DEVICE)
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu


def batches(step, dtype=torch.float32, features=10, out=5):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(12, features, generator=gen, dtype=dtype)
    return shard(x), shard(torch.randn(12, out, generator=gen, dtype=dtype))


def rel(gpu_module, cpu_module) -> float:
    return max_rel_diff(gpu_module.to("cpu"), cpu_module)


def report(name, value):
    print(f"EQUIVALENCE-gpu size={SIZE} {name} gpu_vs_cpu={value:.3e}")


def mlp64():
    return mlp().double()


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stages_on_the_gpu_match_the_cpu(stage):
    models = twin(mlp64)
    for model, device in zip(models, ("cpu", DEVICE)):
        ddp = mpidp.DistributedDataParallel(model, bucket_cap_mb=0.001)
        opt = mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-2, stage=stage,
                                            bucket_cap_mb=0.001, chunk_mb=0.001)
        for step in range(4):
            x, y = batches(step, F64)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device)).backward()
            opt.step()
        if stage == 2:  # the flat buffers live where the parameters do
            assert all(b.buffer.device == torch.device(device) for b in ddp.reducer.layout.buckets
                       if b.buffer is not None)
    diff = rel(models[1], models[0])
    report(f"zero-stage{stage}", diff)
    assert diff < 1e-10


@pytest.mark.parametrize("stage", [None, 2])
def test_compiled_autograd_on_the_gpu_matches_eager_on_the_cpu(stage):
    """mpidp's DDP (and ZeRO stage 2) under compiled autograd on device tensors: each gradient's
    op in the compiled backward sums it (staged or CUDA-aware, as the library is)."""
    from torch._dynamo import compiled_autograd as ca
    torch._dynamo.reset()
    models = twin(mlp64)
    backend = torch.compile(backend="aot_eager")
    for model, device in zip(models, ("cpu", DEVICE)):
        ddp = mpidp.DistributedDataParallel(model)
        opt = (torch.optim.Adam(ddp.parameters(), lr=1e-2) if stage is None else
               mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-2,
                                             stage=stage))
        for step in range(3):
            x, y = batches(step, F64)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
            if device == "cpu":
                loss.backward()  # the reference: an eager step
            else:
                with ca._enable(backend):
                    loss.backward()
            opt.step()
    diff = rel(models[1], models[0])
    report(f"compiled-autograd-{stage or 'ddp'}", diff)
    assert diff < 1e-10


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_hooks_on_the_gpu_match_the_cpu(hook):
    from mpidp import hooks
    models = twin(mlp)
    for model, device in zip(models, ("cpu", DEVICE)):
        ddp = mpidp.DistributedDataParallel(model, bucket_cap_mb=0.0005, first_bucket_mb=0.0005)
        if hook == "powersgd":
            ddp.register_comm_hook(hooks.PowerSGDState(None, matrix_approximation_rank=2,
                                                       start_powerSGD_iter=2), hooks.powerSGD_hook)
        else:
            ddp.register_comm_hook(None, getattr(hooks, f"{hook}_compress_hook"))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(4):
            x, y = batches(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device)).backward()
            opt.step()
    diff = rel(models[1], models[0])
    report(f"hook-{hook}", diff)
    assert diff < 1e-3  # a 16-bit rounding may flip where the float32 gradients differ in the last bit


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compressed_allreduce_on_the_gpu_gives_the_bits_of_the_cpu(dtype):
    from mpidp import hooks
    gen = torch.Generator().manual_seed(RANK)
    values = torch.randn(1001, generator=gen)
    cpu = hooks.compressed_allreduce(values.clone(), dtype)
    gpu = hooks.compressed_allreduce(values.to(DEVICE), dtype)
    assert gpu.device == DEVICE and torch.equal(gpu.cpu(), cpu)


def test_horovod_on_device_tensors_and_its_optimizer_match_the_cpu():
    import mpidp.horovod as hvd
    hvd.init()
    for dtype in (torch.float32, torch.float16, torch.int32):
        value = torch.full((6,), RANK + 1, dtype=dtype, device=DEVICE)
        summed = hvd.allreduce(value, op=hvd.Sum, name=f"gpu.sum.{dtype}")
        assert summed.device == DEVICE and torch.all(summed.cpu() == SIZE * (SIZE + 1) // 2)
        gathered = hvd.allgather(torch.full((RANK + 1, 2), RANK, dtype=dtype, device=DEVICE))
        assert gathered.device == DEVICE
        assert gathered[:, 0].cpu().tolist() == [r for r in range(SIZE) for _ in range(r + 1)]
        root = hvd.broadcast(torch.full((3,), RANK, dtype=dtype, device=DEVICE), root_rank=SIZE - 1)
        assert root.cpu().tolist() == [SIZE - 1] * 3
        sent = torch.arange(2 * SIZE, dtype=dtype, device=DEVICE) + 100 * RANK
        received = hvd.alltoall(sent)
        assert received.cpu().tolist() == [100 * r + 2 * RANK + i for r in range(SIZE) for i in range(2)]
    models = twin(mlp64)
    for model, device in zip(models, ("cpu", DEVICE)):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for step in range(3):
            x, y = batches(step, F64)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
    diff = rel(models[1], models[0])
    report("horovod-optimizer", diff)
    assert diff < 1e-10


def test_the_default_backend_is_nccl_only_where_each_rank_has_a_gpu_of_its_own():
    from mpi4py import MPI
    from mpidp import rendezvous
    uuids = MPI.COMM_WORLD.allgather(str(torch.cuda.get_device_properties(DEVICE).uuid))
    nccl = all(MPI.COMM_WORLD.allgather(torch.distributed.is_nccl_available()))
    own = len(set(uuids)) == SIZE  # each rank's GPU differs from every other rank's
    assert rendezvous.default_backend() == ("cpu:gloo,cuda:nccl" if own and nccl else "mpidp")
    assert mpidp.cuda.placements()[0] == tuple(f"GPU-{uuid}" for uuid in uuids)


class SparseBN(torch.nn.Module):
    """A sparse embedding bag, BatchNorm (a buffer to broadcast) and a layer used on rank 0 only."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(30, 10, mode="sum", sparse=True)
        self.norm = torch.nn.BatchNorm1d(10)
        self.head = torch.nn.Linear(10, 5)
        self.rank0 = torch.nn.Linear(10, 10)

    def forward(self, tokens):
        hidden = self.norm(self.embed(tokens))
        return self.head(self.rank0(hidden) if RANK == 0 else hidden)


@pytest.mark.parametrize("bucket_view", [False, True])
def test_sparse_gradients_buffers_unused_parameters_and_no_sync_on_the_gpu(bucket_view):
    models = twin(lambda: SparseBN().double())
    for model, device in zip(models, ("cpu", DEVICE)):
        ddp = mpidp.DistributedDataParallel(model, find_unused_parameters=True,
                                            gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.0005)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            tokens = shard(torch.randint(0, 30, (12, 4), generator=gen))
            _, y = batches(step, F64)
            opt.zero_grad()
            with ddp.no_sync():
                torch.nn.functional.mse_loss(ddp(tokens.to(device)), y.to(device)).backward()
            torch.nn.functional.mse_loss(ddp(tokens.to(device)), y.to(device)).backward()
            opt.step()
    diff = rel(models[1], models[0])
    report(f"sparse-bn-unused-no_sync-view{bucket_view}", diff)
    assert diff < 1e-10


@pytest.mark.parametrize("by_kernel", [True, False])
def test_bucket_copies_through_the_kernel_or_torch_give_the_cpu_gradients(by_kernel, monkeypatch):
    pytest.importorskip("cupy")
    from mpidp import kernels
    from mpidp.kernels import _cuda
    monkeypatch.setattr(kernels, "PLAIN_COPIES_BY_KERNEL", by_kernel)

    def launches():
        info = _cuda._function.cache_info()  # every launch looks its kernel up here
        return info.hits + info.misses

    cpu, gpu = twin(mlp)
    models = [mpidp.DistributedDataParallel(m, bucket_cap_mb=0.001) for m in (cpu, gpu)]
    before = launches()
    for model, device in zip(models, ("cpu", DEVICE)):
        x, y = batches(0)
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    copies = len([b for b in models[1].reducer.layout.buckets if not b.solo])
    assert launches() - before == (copies if by_kernel else 0)
    for p, q in zip(gpu.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["foreach", "kernel"])
def test_a_batched_bucket_copy_on_the_gpu_gives_the_bits_of_a_copy_per_gradient(how, monkeypatch):
    """mpidp.ddp.packing on CUDA (never run yet: docs/gpu.md, "Packing the buckets"): one
    _foreach_copy_, or one kernel launch, per bucket leaves the bits of a copy per gradient."""
    from mpidp.ddp import packing
    from mpidp.kernels import _cuda
    if how == packing.KERNEL:
        pytest.importorskip("cupy")
    grads, launched = {}, {}
    for name in (packing.EACH, how):
        monkeypatch.setattr(packing, "FORCE", name)
        _, gpu = twin(mlp)
        ddp = mpidp.DistributedDataParallel(gpu, device_ids=[DEVICE], bucket_cap_mb=0.001,
                                            predict_gradient_order=False)  # one layout
        before = _cuda._function.cache_info()  # every launch looks its kernel up here
        for step in range(2):
            gpu.zero_grad()
            x, y = batches(step)
            torch.nn.functional.mse_loss(ddp(x.to(DEVICE)), y.to(DEVICE)).backward()
        after = _cuda._function.cache_info()
        launched[name] = after.hits + after.misses - before.hits - before.misses
        grads[name] = [p.grad.clone() for p in gpu.parameters()]
        buckets = len([b for b in ddp.reducer.layout.buckets if not b.solo])
        ddp.close()
    assert all(torch.equal(a, b) for a, b in zip(grads[packing.EACH], grads[how]))
    if how == packing.KERNEL:  # a pack per bucket and step, beside the copies back
        assert launched[how] - launched[packing.EACH] == 2 * buckets


# -- torch.distributed over the "mpidp" backend, with CUDA tensors ------------------------


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist
    mpidp.init_process_group("mpidp")
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_the_backends_progress_thread_takes_the_decided_path(group):
    import torch.distributed as dist
    tensor = torch.full((1 << 16,), float(RANK + 1), device=DEVICE)
    with paths_taken() as taken:
        dist.all_reduce(tensor, async_op=True).wait()
    assert taken == {path_of(True)}
    assert torch.all(tensor == SIZE * (SIZE + 1) // 2).item()


def test_backend_collectives_on_device_tensors(group):
    import torch.distributed as dist
    tensor = torch.full((5,), float(RANK + 1), device=DEVICE)
    dist.all_reduce(tensor)
    assert tensor.cpu().tolist() == [SIZE * (SIZE + 1) / 2] * 5
    work = dist.all_reduce(tensor, async_op=True)  # async: the result is there after wait()
    work.wait()
    assert tensor.cpu().tolist() == [SIZE * SIZE * (SIZE + 1) / 2] * 5
    out = torch.empty(SIZE * 3, device=DEVICE)
    dist.all_gather_into_tensor(out, torch.full((3,), float(RANK), device=DEVICE))
    assert out.cpu().tolist() == [float(r) for r in range(SIZE) for _ in range(3)]
    part = torch.empty(2, device=DEVICE)
    dist.reduce_scatter_tensor(part, torch.arange(2.0 * SIZE, device=DEVICE))
    assert part.cpu().tolist() == [SIZE * (2.0 * RANK + i) for i in range(2)]
    root = torch.full((4,), float(RANK), device=DEVICE)
    dist.broadcast(root, src=SIZE - 1)
    assert root.cpu().tolist() == [float(SIZE - 1)] * 4


@pytest.mark.parametrize("numel", [1 << 18, 1 << 21], ids=["whole", "chunked"])
def test_async_result_waited_on_a_side_stream_is_the_sum(group, numel):
    """The progress thread copies a staged result back on its own stream; wait() under
    another stream must order that stream after the copy (torch's Work contract).

    The default stream is kept busy, so the progress thread's copy-back (on that stream)
    is still queued when wait() returns: a read on the side stream that does not wait
    for it sees the rank's own values instead of the sum (the old code did)."""
    import time

    import torch.distributed as dist
    tensor = torch.full((numel,), float(RANK + 1), device=DEVICE)
    torch.cuda.synchronize(DEVICE)
    side = torch.cuda.Stream(DEVICE)
    with torch.cuda.stream(side):
        work = dist.all_reduce(tensor, async_op=True)  # staged: copied to the host now
    torch.cuda._sleep(int(4e9))  # about two seconds of spinning queued on the default stream
    until = time.monotonic() + 1.0
    while not work.is_completed() and time.monotonic() < until:
        time.sleep(0.01)
    # the conditions of the race: done by the progress thread, its copy-back still queued
    assert work.is_completed() and not torch.cuda.default_stream(DEVICE).query()
    with torch.cuda.stream(side):
        work.wait()
        seen = tensor.clone()
    side.synchronize()
    torch.cuda.synchronize(DEVICE)
    assert torch.all(seen == SIZE * (SIZE + 1) / 2).item(), seen[:4].tolist()


def test_torch_ddp_on_the_gpu_over_mpidp_matches_mpidp_ddp_on_the_cpu(group):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    cpu, gpu = twin(mlp64)
    ours = mpidp.DistributedDataParallel(cpu)
    theirs = TorchDDP(gpu, device_ids=[DEVICE.index], process_group=group, bucket_cap_mb=0.001)
    for model, device in ((ours, "cpu"), (theirs, DEVICE)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(4):
            x, y = batches(step, F64)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
    diff = rel(gpu, cpu)
    report("torch-ddp-over-mpidp", diff)
    assert diff < 1e-10


def test_torchs_bf16_hook_on_the_gpu_over_mpidp(group):
    """torch accepts its bf16 hook only where CUDA and NCCL exist: here, on the mpidp group."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    cpu, gpu = twin(mlp)
    results = []
    for model, device in ((cpu, "cpu"), (gpu, DEVICE)):
        ddp = TorchDDP(model, device_ids=[DEVICE.index] if device != "cpu" else None, process_group=group)
        if device != "cpu":  # the exact CPU run is the reference
            ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
        x, y = batches(0)
        torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device)).backward()
        results.append([p.grad.cpu() for p in model.parameters()])
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-3)  # two bf16 roundings


def test_fully_shard_on_the_gpu_matches_one_process_on_the_cpu(group):
    from torch.distributed.fsdp import fully_shard
    cpu, gpu = twin(lambda: torch.nn.Sequential(torch.nn.Linear(10, 33), torch.nn.Tanh(),
                                                torch.nn.Linear(33, 32), torch.nn.Tanh(),
                                                torch.nn.Linear(32, 5)).double())
    for layer in gpu:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(gpu)
    assert next(gpu.parameters()).device == DEVICE
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (cpu, gpu)]
    for step in range(3):
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(12, 10, generator=gen, dtype=F64), torch.randn(12, 5, generator=gen, dtype=F64)
        for opt in opts:
            opt.zero_grad()
        torch.nn.functional.mse_loss(cpu(x), y).backward()
        torch.nn.functional.mse_loss(gpu(shard(x).to(DEVICE)), shard(y).to(DEVICE)).backward()
        for opt in opts:
            opt.step()
    worst = 0.0
    for p, q in zip(gpu.parameters(), cpu.parameters()):
        full = p.full_tensor().detach().cpu()
        worst = max(worst, ((full - q.detach()).abs().max() / q.abs().max()).item())
    report("fsdp2-adam", worst)
    assert worst < 1e-9


def test_checkpoint_on_the_gpu_resumes_bit_for_bit_with_cuda_generators_and_a_grad_scaler(tmp_path):
    """Issue 28 on a GPU: dropout draws from the CUDA generator and AMP's GradScaler changes its
    scale; a resume restores both with the model and the optimizer, and the next steps are the
    uninterrupted run's, bit for bit."""
    import shutil
    import tempfile

    from mpi4py import MPI
    directory = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="mpidp-gpu-ckpt-") if RANK == 0 else None)

    def make():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                  torch.nn.Linear(64, 4)).to(DEVICE)
        ddp = mpidp.DistributedDataParallel(net)
        optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        # a scale that overflows float16 at first: the scaler skips steps and halves it
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 24, growth_interval=2)
        return ddp, optimizer, scaler

    def train(ddp, optimizer, scaler, steps, saver=None):
        for step in steps:
            gen = torch.Generator().manual_seed(100 * step + RANK)
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(ddp(x.to(DEVICE)), y.to(DEVICE))
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if saver is not None:
                saver.step()

    try:
        ddp, optimizer, scaler = make()
        saver = mpidp.Checkpointer(directory, model=ddp, optimizer=optimizer, scaler=scaler,
                                   exit_on_stop=False)
        train(ddp, optimizer, scaler, range(1, 4), saver)
        torch.cuda.manual_seed(1234 + RANK)  # each rank's own CUDA stream of draws
        saver.save()
        scale_at_save = scaler.get_scale()
        train(ddp, optimizer, scaler, range(4, 8))
        expected = [p.detach().clone() for p in ddp.parameters()]
        expected_scale = scaler.get_scale()
        saver.close()

        ddp2, optimizer2, scaler2 = make()
        torch.cuda.manual_seed(99)  # a different CUDA generator state, which resume replaces
        loader = mpidp.Checkpointer(directory, model=ddp2, optimizer=optimizer2, scaler=scaler2,
                                    exit_on_stop=False)
        assert loader.resume() == 3
        assert scaler2.get_scale() == scale_at_save < 2.0 ** 24
        train(ddp2, optimizer2, scaler2, range(4, 8))
        assert scaler2.get_scale() == expected_scale
        for got, want in zip(ddp2.parameters(), expected):
            assert got.device == DEVICE and torch.equal(got, want)
        loader.close()
    finally:
        MPI.COMM_WORLD.Barrier()
        if RANK == 0:
            shutil.rmtree(directory, ignore_errors=True)
