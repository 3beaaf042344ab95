"""torch's own distributed programs over the "mpidp" backend equal single-process training and gloo.

Every test runs one unmodified torch program (torch's DistributedDataParallel,
its comm hooks, ZeroRedundancyOptimizer) on two process groups of the same
ranks, one of backend "mpidp" and gloo's default group, in float64 on shards of
a batch, and compares the parameters with (a) one process training on the
whole batch and (b) the same program over gloo.
"""

import gc
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import mpidp  # noqa: F401  registers the backend "mpidp"
from _models import RANK, SIZE, inputs, max_rel_diff, shard

pytestmark = pytest.mark.usefixtures("gloo")

STEPS = 4
TIGHT = 1e-12  # float64: only the order of the sums differs
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
              "adam": lambda params: torch.optim.Adam(params, lr=1e-2)}


@pytest.fixture(scope="module")
def groups(gloo):
    """{"mpidp": a group of backend mpidp, "gloo": the default group}, both of every rank."""
    mine = dist.new_group(backend="mpidp")
    assert dist.get_backend(mine) == "mpidp" and dist.get_backend() == "gloo"
    yield {"mpidp": mine, "gloo": dist.group.WORLD}
    dist.destroy_process_group(mine)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(10, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x, use_b: bool):
        hidden = torch.tanh(self.trunk(x))
        return self.head(torch.tanh(self.b(hidden) if use_b else self.a(hidden)))


def net(rank: int = RANK, kind: str = "mlp") -> nn.Module:
    """A float64 model; each rank seeds its own, so DDP's broadcast of rank 0's must win."""
    torch.manual_seed(rank)
    if kind == "branchy":
        return Branchy().double()
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 5)).double()


def batch(step: int):
    x, y = inputs("mlp", step)
    return x.double(), y.double()


def ddp_train(group, steps=STEPS, optimizer="sgd", setup=None, accumulate=False, **kwargs):
    """DDP(process_group=group) on this rank's shard of every step's batch; its module."""
    ddp = DDP(net(), process_group=group, **kwargs)
    if setup is not None:
        setup(ddp, group)
    opt = OPTIMIZERS[optimizer](ddp.parameters())
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        if accumulate:
            with ddp.no_sync():  # this micro-batch's gradient stays local
                F.mse_loss(ddp(shard(x)), shard(y)).backward()
            x, y = batch(100 + step)
        F.mse_loss(ddp(shard(x)), shard(y)).backward()
        opt.step()
    ddp.buckets = len(ddp.reducer._get_zeros_like_grad_buckets())  # as rebuilt after step 1
    return ddp


def single(steps=STEPS, optimizer="sgd", accumulate=False):
    """One process, the whole batch: rank 0's initial model."""
    model = net(0)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        if accumulate:
            F.mse_loss(model(x), y).backward()
            x, y = batch(100 + step)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model


def report(name, vs_single=None, vs_gloo=None):
    parts = [f"EQUIVALENCE-backend size={SIZE} {name}"]
    if vs_single is not None:
        parts.append(f"vs_single={vs_single:.3e}")
    if vs_gloo is not None:
        parts.append(f"vs_gloo={vs_gloo:.3e}")
    print(" ".join(parts))


DDP_OPTIONS = {
    "defaults": {},
    "bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "small_buckets": {"bucket_cap_mb": 0.001},
    "small_buckets_view_static": {"bucket_cap_mb": 0.001, "gradient_as_bucket_view": True,
                                  "static_graph": True},
}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("options", sorted(DDP_OPTIONS))
def test_torch_ddp_matches_single_process_and_gloo(groups, options, optimizer):
    runs = {name: ddp_train(group, optimizer=optimizer, **DDP_OPTIONS[options])
            for name, group in groups.items()}
    if "bucket_cap_mb" in DDP_OPTIONS[options]:
        assert runs["mpidp"].buckets >= 3, runs["mpidp"].buckets
    reference = single(optimizer=optimizer)
    vs_single = max_rel_diff(runs["mpidp"].module, reference)
    vs_gloo = max_rel_diff(runs["mpidp"].module, runs["gloo"].module)
    report(f"ddp-{options}-{optimizer}", vs_single, vs_gloo)
    assert vs_single < TIGHT and vs_gloo < TIGHT


def test_no_sync_accumulation_matches_single_process_and_gloo(groups):
    runs = {name: ddp_train(group, accumulate=True) for name, group in groups.items()}
    vs_single = max_rel_diff(runs["mpidp"].module, single(accumulate=True))
    vs_gloo = max_rel_diff(runs["mpidp"].module, runs["gloo"].module)
    report("ddp-no_sync", vs_single, vs_gloo)
    assert vs_single < TIGHT and vs_gloo < TIGHT


USES_B = {"by_step": lambda rank, step: step % 2 == 1,  # a branch unused by every rank
          "by_rank": lambda rank, step: (rank + step) % 2 == 1}  # used by some ranks only


@pytest.mark.parametrize("pattern", sorted(USES_B))
def test_find_unused_parameters_matches_single_process_and_gloo(groups, pattern):
    uses_b = USES_B[pattern]
    runs = {}
    for name, group in groups.items():
        ddp = DDP(net(kind="branchy"), process_group=group, find_unused_parameters=True)
        opt = OPTIMIZERS["sgd"](ddp.parameters())
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(step)
            F.mse_loss(ddp(shard(x), uses_b(RANK, step)), shard(y)).backward()
            opt.step()
        runs[name] = ddp.module
    model = net(0, kind="branchy")
    opt = OPTIMIZERS["sgd"](model.parameters())
    for step in range(STEPS):  # the average of the shards' losses, each with its rank's branch
        opt.zero_grad()
        x, y = batch(step)
        sum(F.mse_loss(model(xs, uses_b(r, step)), ys)
            for r, (xs, ys) in enumerate(zip(x.chunk(SIZE), y.chunk(SIZE)))).div(SIZE).backward()
        opt.step()
    vs_single = max_rel_diff(runs["mpidp"], model)
    vs_gloo = max_rel_diff(runs["mpidp"], runs["gloo"])
    report(f"ddp-find_unused-{pattern}", vs_single, vs_gloo)
    assert vs_single < TIGHT and vs_gloo < TIGHT


def test_one_collective_may_be_blocking_on_some_ranks_and_async_on_others(groups):
    """As torch's Join and DDP's join hooks do; MPI never matches the two forms itself."""
    for name, group in groups.items():
        blocking = RANK % 2 == 0
        t = torch.full((3,), float(RANK + 1))
        work = dist.all_reduce(t, group=group, async_op=not blocking)
        b = torch.full((2,), float(RANK))
        later = dist.broadcast(b, src=SIZE - 1, group=group, async_op=blocking)
        barrier = dist.barrier(group=group, async_op=not blocking)
        for pending in (work, later, barrier):
            if pending is not None:
                pending.wait()
        assert torch.equal(t, torch.full((3,), SIZE * (SIZE + 1) / 2)), name
        assert torch.equal(b, torch.full((2,), float(SIZE - 1))), name


def test_join_with_uneven_inputs_matches_gloo(groups):
    gen = torch.Generator().manual_seed(RANK)
    data = [(torch.randn(4, 10, generator=gen, dtype=torch.float64),
             torch.randn(4, 5, generator=gen, dtype=torch.float64)) for _ in range(2 + 2 * RANK)]
    runs = {}
    for name, group in groups.items():
        ddp = DDP(net(), process_group=group, bucket_cap_mb=0.001)
        opt = OPTIMIZERS["sgd"](ddp.parameters())
        with ddp.join():
            for x, y in data:
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                opt.step()
        runs[name] = ddp.module
    vs_gloo = max_rel_diff(runs["mpidp"], runs["gloo"])
    report("ddp-join-uneven", vs_gloo=vs_gloo)
    assert vs_gloo < TIGHT
    everyone = [None] * SIZE  # and every rank ends with the same model
    dist.all_gather_object(everyone, [p.detach() for p in runs["mpidp"].parameters()],
                           group=groups["mpidp"])
    for theirs in everyone:
        for a, b in zip(theirs, runs["mpidp"].parameters()):
            assert torch.equal(a, b.detach())


@pytest.mark.parametrize("hook", ["fp16_compress_hook", "bf16_compress_hook"])
def test_compression_hooks_match_gloo(groups, hook):
    def setup(ddp, group):
        if hook == "bf16_compress_hook":
            # torch refuses this hook by its name without CUDA and NCCL (or XPU), whatever
            # the group; the same function under another name runs on CPU
            with pytest.raises(TypeError, match="BF16 all reduce communication hook required"):
                ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
            ddp.register_comm_hook(group, lambda state, bucket:
                                   default_hooks.bf16_compress_hook(state, bucket))
        else:
            ddp.register_comm_hook(group, getattr(default_hooks, hook))
    runs = {name: ddp_train(group, setup=setup, bucket_cap_mb=0.001)
            for name, group in groups.items()}
    vs_single = max_rel_diff(runs["mpidp"].module, single())
    vs_gloo = max_rel_diff(runs["mpidp"].module, runs["gloo"].module)
    report(f"ddp-{hook}", vs_single, vs_gloo)
    # at 2 ranks both sum a + b in half precision (exact order); beyond, only the order differs
    assert vs_gloo == 0.0 if SIZE == 2 else vs_gloo < (1e-3 if "fp16" in hook else 1e-2)
    assert vs_single < (1e-2 if "fp16" in hook else 5e-2)


def test_powersgd_hook_matches_gloo(groups):
    states = {}

    def setup(ddp, group):
        states[group] = powerSGD_hook.PowerSGDState(process_group=group,
                                                    matrix_approximation_rank=1,
                                                    start_powerSGD_iter=2)
        ddp.register_comm_hook(states[group], powerSGD_hook.powerSGD_hook)
    runs = {name: ddp_train(group, steps=6, setup=setup) for name, group in groups.items()}
    assert runs["mpidp"].buckets == 1
    assert all(state.iter == 6 for state in states.values())  # 4 steps compressed
    vs_single = max_rel_diff(runs["mpidp"].module, single(steps=6))
    vs_gloo = max_rel_diff(runs["mpidp"].module, runs["gloo"].module)
    report("ddp-powerSGD-rank1", vs_single, vs_gloo)
    assert vs_gloo < 1e-10
    assert vs_single < 0.5  # a rank-1 approximation with error feedback: same ballpark only


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_zero_redundancy_optimizer_matches_single_process_and_gloo(groups, optimizer):
    runs, states = {}, {}
    options = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
               "adam": (torch.optim.Adam, {"lr": 1e-2})}[optimizer]
    for name, group in groups.items():
        ddp = DDP(net(), process_group=group, bucket_cap_mb=0.001)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=options[0],
                                      process_group=group, **options[1])
        if SIZE > 1:  # each rank steps only its own share of the parameters
            assert len(opt.optim.param_groups[0]["params"]) < len(list(ddp.parameters()))
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(step)
            F.mse_loss(ddp(shard(x)), shard(y)).backward()
            opt.step()
        opt.consolidate_state_dict(to=0)  # the whole optimizer state, gathered on rank 0
        states[name] = opt.state_dict() if RANK == 0 else None
        runs[name] = ddp.module
    reference = net(0)
    ref_opt = options[0](reference.parameters(), **options[1])
    for step in range(STEPS):
        ref_opt.zero_grad()
        x, y = batch(step)
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    vs_single = max_rel_diff(runs["mpidp"], reference)
    vs_gloo = max_rel_diff(runs["mpidp"], runs["gloo"])
    report(f"zero-redundancy-{optimizer}", vs_single, vs_gloo)
    assert vs_single < TIGHT and vs_gloo < TIGHT
    if RANK == 0:
        expected = ref_opt.state_dict()["state"]
        for name in ("mpidp", "gloo"):
            got = states[name]["state"]
            assert sorted(got) == sorted(expected)
            for index, state in expected.items():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        torch.testing.assert_close(got[index][key], value, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("compiler,compiled_autograd", [("aot_eager", False), ("inductor", False),
                                                        ("aot_eager", True)])
def test_torch_ddp_under_torch_compile_matches_one_process_and_gloo(groups, compiler,
                                                                    compiled_autograd):
    """torch.compile(DDP(model)) over "mpidp" (issue 30): dynamo runs the group's operations as
    they are, between graphs; the result equals one process and gloo, with no more graph breaks.
    Compiled autograd as torch 2.13 takes it for DDP: its Python reducer
    (``optimize_ddp="python_reducer"``, read when DDP is built) and the backward under
    ``compiled_autograd._enable``; the capture is counted, so the form cannot pass untried.
    That form runs in the 3-rank launch only (tests/test_mpi.py, with check_backend.py): in the
    2-rank one, something it compiles keeps the groups, and the TCP store under them, after they
    are destroyed, and check_store's port probe later in that launch found the listeners."""
    if compiled_autograd and SIZE == 2:
        pytest.skip("in the 3-rank launch: its groups outlive the test (see the docstring)")
    import torch._dynamo
    from torch._dynamo import compiled_autograd as ca
    from torch._dynamo.utils import counters
    modules, breaks, captures = {}, {}, {}
    mode = "python_reducer" if compiled_autograd else torch._dynamo.config.optimize_ddp
    for name, group in groups.items():
        torch._dynamo.reset()
        counters.clear()
        with torch._dynamo.config.patch(optimize_ddp=mode):
            ddp = DDP(net(), process_group=group)
            compiled = torch.compile(ddp, backend=compiler)
            opt = OPTIMIZERS["sgd"](ddp.parameters())
            for step in range(STEPS):
                opt.zero_grad()
                x, y = batch(step)
                loss = F.mse_loss(compiled(shard(x)), shard(y))
                if compiled_autograd:
                    with ca._enable(torch.compile(backend=compiler)):
                        loss.backward()
                else:
                    loss.backward()
                opt.step()
        modules[name] = ddp.module
        breaks[name] = sum(counters["graph_break"].values())
        captures[name] = counters["compiled_autograd"]["captures"]
    vs_single = max_rel_diff(modules["mpidp"], single())
    vs_gloo = max_rel_diff(modules["mpidp"], modules["gloo"])
    report(f"ddp-compile-{compiler}-ca{int(compiled_autograd)} graph_breaks={breaks} "
           f"captures={captures}", vs_single, vs_gloo)
    # the models' parameters carry DDP's hooks (the Python reducer's, under compiled autograd),
    # which hold the groups, as dynamo's and compiled autograd's caches do: all dropped here, or
    # the gloo group's sockets outlive its destruction and check_store's port test finds them
    modules.clear()
    del ddp, compiled, opt
    torch._dynamo.reset()
    ca.reset()
    gc.collect()
    assert vs_single < TIGHT and vs_gloo < TIGHT
    assert breaks["mpidp"] <= breaks["gloo"], breaks
    assert all(count > 0 for count in captures.values()) == compiled_autograd, captures


def test_functional_collectives_over_mpidp_eager_and_compiled(groups):
    """torch's functional collectives (what compiled code and DTensor issue) over "mpidp":
    eager and under torch.compile, the exact sums (issue 30). Not compared over gloo in this
    launch: dynamo's caches keep a group they compiled against alive, and with it gloo's
    listening sockets, which check_store.py later finds."""
    import torch._dynamo
    import torch.distributed._functional_collectives as funcol

    def step(x, group):
        summed = funcol.all_reduce(x * 2, "sum", group)
        gathered = funcol.all_gather_tensor(summed + 1, 0, group)
        return funcol.reduce_scatter_tensor(gathered, "sum", 0, group)

    x = torch.arange(4.0) + RANK
    torch._dynamo.reset()
    eager = step(x, groups["mpidp"])
    compiled = torch.compile(step, backend="aot_eager")(x, groups["mpidp"])
    torch._dynamo.reset()
    total = 2 * (torch.arange(4.0) * SIZE + sum(range(SIZE)))  # the all_reduce, every rank
    expected = SIZE * (total + 1).repeat(SIZE).chunk(SIZE)[RANK]  # gathered, then summed
    torch.testing.assert_close(eager, expected, rtol=0, atol=0)
    torch.testing.assert_close(compiled, expected, rtol=0, atol=0)
