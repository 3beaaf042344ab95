"""FSDP2, the distributed checkpoint and DTensor over "mpidp" as torch's default group.

``mpidp.init_process_group()`` once per process (no gloo, no MASTER_ADDR), then
unmodified torch programs: ``fully_shard`` training equals one process training
on the whole batch, a sharded checkpoint saved with ``torch.distributed.checkpoint``
loads back, and DTensor on a 2-D device mesh (4 ranks) computes what the full
tensors give. Saving at 4 ranks and loading at 2 is tests/mpi/dcp_reshard.py.
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mpi4py import MPI
from torch import nn
from torch.distributed._state_dict_utils import _broadcast_state_dict
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn import functional as F

import mpidp
from _models import RANK, SIZE

STEPS = 3
TIGHT = 1e-12  # float64
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
              "adam": lambda params: torch.optim.Adam(params, lr=1e-2)}
four_ranks = pytest.mark.skipif(SIZE != 4, reason="a (2, 2) device mesh needs 4 ranks")


@pytest.fixture(scope="module", autouse=True)
def default_group():
    mpidp.init_process_group()
    assert dist.get_backend() == "mpidp" and dist.get_world_size() == SIZE
    yield
    dist.destroy_process_group()


@pytest.fixture
def shared_dir(tmp_path_factory):
    """A directory every rank sees: rank 0's, its path broadcast."""
    path = str(tmp_path_factory.mktemp("dcp")) if RANK == 0 else None
    return MPI.COMM_WORLD.bcast(path, root=0)


def mlp():
    # 33 rows: the shards of dim 0 are uneven at 2 and 4 ranks, so FSDP2 pads
    return nn.Sequential(nn.Linear(10, 33), nn.Tanh(), nn.Linear(33, 32), nn.Tanh(),
                         nn.Linear(32, 5))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        layer = nn.TransformerEncoderLayer(32, nhead=4, dim_feedforward=64, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))


MODELS = {"mlp": (mlp, (10,), 5), "transformer": (Transformer, (6, 8), 5)}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]().double()


def shard_model(model: nn.Module, mesh=None, **options) -> nn.Module:
    """fully_shard every layer (each its own all-gather), then the root."""
    layers = model.encoder.layers if hasattr(model, "encoder") else \
        [m for m in model if isinstance(m, nn.Linear)]
    for layer in layers:
        fully_shard(layer, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def batch(name: str, step: int):
    _, shape, out = MODELS[name]
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(24, *shape, generator=gen, dtype=torch.float64)  # 2 micro-batches of 12
    return x, torch.randn(x.shape[:-1] + (out,), generator=gen, dtype=torch.float64)


def train(model, optimizer, name, steps, shards, index):
    for step in range(steps):
        train_step(model, optimizer, name, step, shards, index)


def train_step(model, optimizer, name, step, shards=SIZE, index=RANK):
    x, y = batch(name, step)
    optimizer.zero_grad()
    F.mse_loss(model(x.chunk(shards)[index]), y.chunk(shards)[index]).backward()
    optimizer.step()


def max_rel_diff(sharded: nn.Module, local: nn.Module) -> float:
    worst = 0.0
    for (name, p), (local_name, q) in zip(sharded.named_parameters(), local.named_parameters()):
        assert name == local_name
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        worst = max(worst, ((full.detach() - q.detach()).abs().max() / q.abs().max()).item())
    return worst


def report(name, value):
    print(f"EQUIVALENCE-backend-fsdp size={SIZE} {name} vs_single={value:.3e}")


@pytest.mark.parametrize("name,optimizer,reshard", [("mlp", "sgd", True), ("mlp", "adam", False),
                                                    ("transformer", "sgd", True),
                                                    ("transformer", "adam", False)])
def test_fully_shard_matches_single_process(name, optimizer, reshard):
    model = shard_model(build(name), reshard_after_forward=reshard)
    local = build(name)
    first = next(model.parameters())
    assert type(first).__name__ == "DTensor" and first.device_mesh.size() == SIZE
    train(model, OPTIMIZERS[optimizer](model.parameters()), name, STEPS, SIZE, RANK)
    train(local, OPTIMIZERS[optimizer](local.parameters()), name, STEPS, 1, 0)
    diff = max_rel_diff(model, local)
    report(f"fully_shard-{name}-{optimizer}-reshard{reshard}", diff)
    # Attention's softmax ignores the key bias: its gradient is rounding noise (1e-17),
    # different in any other summation order, and Adam scales noise up to lr-sized steps
    assert diff < (1e-9 if name == "transformer" and optimizer == "adam" else TIGHT)


def test_gradient_accumulation_without_sync_matches_single_process():
    model = shard_model(build("mlp"))
    local = build("mlp")
    opt, local_opt = OPTIMIZERS["sgd"](model.parameters()), OPTIMIZERS["sgd"](local.parameters())
    for step in range(STEPS):
        x, y = batch("mlp", step)
        opt.zero_grad()
        local_opt.zero_grad()
        for micro, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):  # two micro-batches
            model.set_requires_gradient_sync(micro == 1)  # reduce-scatter once, at the last
            F.mse_loss(model(xs.chunk(SIZE)[RANK]), ys.chunk(SIZE)[RANK]).backward()
            F.mse_loss(local(xs), ys).backward()
        opt.step()
        local_opt.step()
    diff = max_rel_diff(model, local)
    report("fully_shard-mlp-accumulate-no-sync", diff)
    assert diff < TIGHT


def test_distributed_checkpoint_round_trip(shared_dir):
    model = shard_model(build("transformer"))
    opt = OPTIMIZERS["adam"](model.parameters())
    train(model, opt, "transformer", 2, SIZE, RANK)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=shared_dir)

    fresh = shard_model(build("transformer", seed=1))  # other weights, no optimizer state yet
    fresh_opt = OPTIMIZERS["adam"](fresh.parameters())
    model_state, optim_state = get_state_dict(fresh, fresh_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=shared_dir)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            a, b = opt.state[p][key], fresh_opt.state[q][key]
            assert torch.equal(a.to_local() if hasattr(a, "to_local") else a,
                               b.to_local() if hasattr(b, "to_local") else b), key
    # and both go on identically
    train(model, opt, "transformer", 1, SIZE, RANK)
    train(fresh, fresh_opt, "transformer", 1, SIZE, RANK)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p.to_local(), q.to_local())


@pytest.fixture(scope="module")
def gloo(default_group):
    """A gloo group of every rank beside the default group of "mpidp"."""
    group = dist.new_group(backend="gloo")
    yield group
    dist.destroy_process_group(group)


def test_groups_declare_their_devices_as_gloo_does(gloo):
    """torch asks a group for its device types (broadcast_from_rank0, DCP's default device,
    the object collectives' device); the group of "mpidp" names gloo's, "cpu" preferred."""
    c10d = dist.distributed_c10d
    subgroup = dist.new_group(backend="mpidp")
    for group in (None, subgroup):
        assert sorted(c10d._device_capability(group)) == sorted(c10d._device_capability(gloo))
        assert c10d._get_object_coll_device(group) == c10d._get_object_coll_device(gloo) == "cpu"
        with pytest.warns(UserWarning, match="Multiple backends"):  # as gloo's: cpu and cuda
            assert c10d._get_pg_default_device(group) == torch.device("cpu")
    dist.destroy_process_group(subgroup)


def with_buffers(seed: int) -> nn.Module:
    # uneven shards of 33 rows, and a 0-dim buffer (num_batches_tracked) torch sends as an object
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 33), nn.BatchNorm1d(33), nn.Linear(33, 5)).double()
    model[1].num_batches_tracked += 7
    return model


def full(tensor):
    """A DTensor's whole tensor (collective), a tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fsdp2"])
def test_broadcast_from_rank0_gives_every_rank_rank0s_state_as_gloo_does(gloo, sharded):
    """set_model_state_dict(broadcast_from_rank0=True) over "mpidp" loads rank 0's state into
    every rank (FSDP2: into each rank's shards), exactly; torch's broadcast under it gives the
    same over "mpidp" and over gloo."""
    expected = with_buffers(0).state_dict()

    def fresh():  # other values on every rank, rank 0 too
        model = with_buffers(RANK + 1)
        return shard_model(model) if sharded else model

    def rank0s():  # torch may keep rank 0's tensors: a copy each time
        return {key: value.clone() for key, value in expected.items()} if RANK == 0 else {}

    model = fresh()
    assert not torch.equal(full(model.state_dict()["0.weight"]), expected["0.weight"])
    set_model_state_dict(model, rank0s(), options=StateDictOptions(full_state_dict=True,
                                                                   broadcast_from_rank0=True))
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value) and got[key].dtype == value.dtype, key
    for name, group in (("mpidp", None), ("gloo", gloo)):
        states = fresh().state_dict()
        _broadcast_state_dict(rank0s(), states, torch.device("cpu"), pg=group)
        for key, value in expected.items():
            loaded = full(states[key])
            assert torch.equal(loaded, value) and loaded.dtype == value.dtype, (name, key)


def whole(model, optimizer) -> list:
    """The whole model and optimizer state on every rank, flattened: [(key, value)] (collective)."""
    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=StateDictOptions(full_state_dict=True))
    flat = []

    def walk(key, value):
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{key}/{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for k, v in enumerate(value):
                walk(f"{key}[{k}]", v)
        else:  # a copy: Adam's step is the optimizer's own tensor, which steps in place
            flat.append((key, value.clone() if torch.is_tensor(value) else value))
    walk("", {"model": model_state, "optim": optim_state})
    return flat


def differences(got: list, expected: list) -> list:
    """The keys where ``got`` and ``expected`` (``whole``'s) differ, bit for bit."""
    if [k for k, _ in got] != [k for k, _ in expected]:
        return [f"keys: {[k for k, _ in got]} != {[k for k, _ in expected]}"]
    return [key for (key, g), (_, e) in zip(got, expected)
            if not (torch.equal(g, e) and g.dtype == e.dtype if torch.is_tensor(e) else g == e)]


@pytest.mark.skipif(SIZE != 2, reason="2 ranks: tests/mpi/dcp_reshard.py saves at 4 (and "
                                       "resumes at 2)")
def test_checkpointer_saves_and_resumes_fsdp2_state_whole(shared_dir):
    """mpidp.Checkpointer with an FSDP2 model: the save is the whole state (not rank 0's
    shards), a resume into a fresh model gives every rank its own shards of it, bit for bit,
    and the next step equals the uninterrupted run's; a model of other shapes is refused on
    every rank. A parameter without optimizer state gets none. Another size:
    tests/mpi/dcp_reshard.py."""
    def make(seed, width=33):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(10, width), nn.Tanh(), nn.Linear(width, 5)).double()
        # unused by forward: no gradient, so no Adam state to save
        model.register_parameter("spare", nn.Parameter(torch.ones(4, 3, dtype=torch.float64)))
        model = shard_model(model)
        return model, OPTIMIZERS["adam"](model.parameters())

    model, opt = make(0)
    saver = mpidp.Checkpointer(shared_dir, model=model, optimizer=opt, signals=())
    for step in range(2):
        train_step(model, opt, "mlp", step)
        saver.step()
    saver.save()
    saver.close()
    saved = whole(model, opt)
    train_step(model, opt, "mlp", 2)

    fresh, fresh_opt = make(1)  # other weights, no optimizer state yet
    loader = mpidp.Checkpointer(shared_dir, model=fresh, optimizer=fresh_opt, signals=())
    assert loader.resume() == 2
    loader.close()
    assert differences(whole(fresh, fresh_opt), saved) == []
    assert fresh.spare not in fresh_opt.state
    train_step(fresh, fresh_opt, "mlp", 2)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p.to_local(), q.to_local())

    other, other_opt = make(1, width=34)
    loader = mpidp.Checkpointer(shared_dir, model=other, optimizer=other_opt, signals=())
    with pytest.raises(ValueError, match=r"does not fit the FSDP2 model.*0\.weight is \[33, 10\]"):
        loader.resume()
    loader.close()
    with pytest.raises(TypeError, match=r"FSDP2 \(DTensor parameters\) on every rank or on none"):
        mpidp.Checkpointer(shared_dir, model=fresh if RANK else build("mlp"), signals=())


@four_ranks
def test_dtensor_on_a_2d_mesh_matches_full_computation():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rows", "cols"))
    assert dist.get_backend(mesh.get_group("cols")) == "mpidp"
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    b = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    da = distribute_tensor(a, mesh, [Shard(0), Shard(1)])  # a 2 x 2 grid of blocks
    db = distribute_tensor(b, mesh, [Replicate(), Shard(0)])
    assert da.to_local().shape == (4, 3)
    torch.testing.assert_close(da.full_tensor(), a, rtol=0, atol=0)
    product = torch.matmul(da, db)  # partial sums along "cols", reduced on demand
    torch.testing.assert_close(product.full_tensor(), a @ b, rtol=1e-14, atol=1e-14)
    moved = da.redistribute(mesh, [Shard(1), Replicate()])  # all-to-all, then all-gather
    torch.testing.assert_close(moved.to_local(), a.chunk(2, dim=1)[mesh.get_coordinate()[0]],
                               rtol=0, atol=0)
    total = (da * 2).sum().full_tensor()
    torch.testing.assert_close(total, (a * 2).sum(), rtol=1e-14, atol=1e-14)


@four_ranks
def test_hybrid_sharding_on_a_2d_mesh_matches_single_process():
    """fully_shard over a (replicate, shard) mesh: HSDP, all-reduce across the replicas."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard_model(build("mlp"), mesh=mesh)
    local = build("mlp")
    assert next(model.parameters()).placements == (Replicate(), Shard(0))
    train(model, OPTIMIZERS["adam"](model.parameters()), "mlp", STEPS, SIZE, RANK)
    train(local, OPTIMIZERS["adam"](local.parameters()), "mlp", STEPS, 1, 0)
    diff = max_rel_diff(model, local)
    report("fully_shard-hsdp-2x2-mlp-adam", diff)
    assert diff < TIGHT


def test_fully_shard_under_torch_compile_matches_single_process():
    """FSDP2 over "mpidp" under torch.compile (issue 30): the group's operations run untraced,
    between graphs, and the result is one process's."""
    import torch._dynamo
    torch._dynamo.reset()
    model = shard_model(build("mlp"))
    local = build("mlp")
    compiled = torch.compile(model, backend="aot_eager")
    train(compiled, OPTIMIZERS["sgd"](model.parameters()), "mlp", STEPS, SIZE, RANK)
    train(local, OPTIMIZERS["sgd"](local.parameters()), "mlp", STEPS, 1, 0)
    diff = max_rel_diff(model, local)
    report("fully_shard-compiled-mlp-sgd", diff)
    assert diff < TIGHT
