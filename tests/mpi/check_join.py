"""DistributedDataParallel.join(): uneven inputs give what torch's DDP over gloo gives with join()."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import mpidp
from _models import RANK, SIZE, ConvBN, loss_of, max_rel_diff, mlp

pytestmark = [pytest.mark.usefixtures("gloo"),
              pytest.mark.skipif(SIZE < 2, reason="uneven inputs need two ranks")]

MODELS = {"mlp": (mlp, (10,), 5), "convbn": (ConvBN, (3, 8, 8), 5)}
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
              "adam": lambda p: torch.optim.Adam(p, lr=1e-3)}


def batches(model_name, count, rank=RANK):
    """Rank ``rank``'s ``count`` batches of 4 (different on every rank)."""
    _, shape, out = MODELS[model_name]
    gen = torch.Generator().manual_seed(100 * rank + 7)
    return [(torch.randn(4, *shape, generator=gen), torch.randn(4, out, generator=gen))
            for _ in range(count)]


def seeded(model_name, rank=RANK):
    torch.manual_seed(rank)  # different on every rank: the construction broadcast must win
    model = MODELS[model_name][0]()
    if model_name == "convbn":
        # A conv bias followed by BatchNorm has a gradient that is exactly zero in exact
        # arithmetic; in float32 it is summation noise (1e-9 to 1e-11) that differs between
        # MPICH and gloo, and Adam scales noise to full lr steps. Compare what carries signal.
        for layer in (model.features[0], model.features[3]):
            layer.bias.requires_grad_(False)
    return model


def train(model, optimizer, data, model_name, micro=1, **join):
    with model.join(**join):
        for k in range(0, len(data), micro):
            optimizer.zero_grad()
            group = data[k:k + micro]
            for i, (x, y) in enumerate(group):
                if i < len(group) - 1:
                    with model.no_sync():
                        loss_of(model_name, model(x), y).backward()
                else:
                    loss_of(model_name, model(x), y).backward()
            optimizer.step()


def counts(kind, rank=RANK):
    if kind == "5-4-3":
        return 5 - rank % 3
    return 0 if rank == SIZE - 1 else 3  # "zero": the last rank has no batch at all


@pytest.mark.parametrize("kind", ["5-4-3", "zero"])
@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("model_name", ["mlp", "convbn"])
def test_uneven_inputs_match_torch_ddp_join(model_name, optimizer, divide_by_initial_world_size,
                                           kind):
    data = batches(model_name, counts(kind))
    mine = mpidp.DistributedDataParallel(seeded(model_name), bucket_cap_mb=0.001)
    theirs = TorchDDP(seeded(model_name), bucket_cap_mb=0.001)
    for model in (mine, theirs):
        train(model, OPTIMIZERS[optimizer](model.parameters()), data, model_name,
              divide_by_initial_world_size=divide_by_initial_world_size)
    diff = max_rel_diff(mine.module, theirs.module)  # parameters and BatchNorm buffers
    print(f"JOIN size={SIZE} {model_name}-{optimizer}-{kind}-"
          f"{'initial' if divide_by_initial_world_size else 'active'} max_rel_diff={diff:.3e}")
    assert diff < 1e-5
    flat = torch.cat([p.detach().reshape(-1) for p in mine.module.parameters()])
    high, low = flat.clone(), flat.clone()
    mpidp.comm.allreduce(high, "max")
    mpidp.comm.allreduce(low, "min")
    assert torch.equal(high, low)  # the final model is the same everywhere
    mine.close()


def test_no_sync_inside_join_matches_torch():
    data = batches("mlp", 6 - 2 * (RANK % 2))  # 6 or 4 batches, 2 micro-batches a step
    mine = mpidp.DistributedDataParallel(seeded("mlp"))
    theirs = TorchDDP(seeded("mlp"))
    for model in (mine, theirs):
        train(model, OPTIMIZERS["sgd"](model.parameters()), data, "mlp", micro=2)
    diff = max_rel_diff(mine.module, theirs.module)
    print(f"JOIN size={SIZE} no_sync max_rel_diff={diff:.3e}")
    assert diff < 1e-5


def test_throw_on_early_termination_raises_on_every_rank_at_the_same_step():
    data = batches("mlp", 4 - (RANK == 1))  # rank 1 runs out one step early
    mine = mpidp.DistributedDataParallel(seeded("mlp"))
    optimizer = OPTIMIZERS["sgd"](mine.parameters())
    steps = 0
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] ran out of inputs and "
                                           r"throw_on_early_termination=True") as info:
        with mine.join(throw_on_early_termination=True):
            for x, y in data:
                optimizer.zero_grad()
                loss_of("mlp", mine(x), y).backward()
                optimizer.step()
                steps += 1
    assert steps == 3  # every rank stopped at the step after rank 1 ran out
    from mpi4py import MPI
    messages = MPI.COMM_WORLD.allgather(str(info.value))
    assert messages == [messages[0]] * SIZE
    # the wrapper is usable afterwards
    x, y = data[0]
    loss_of("mlp", mine(x), y).backward()


def test_join_with_equal_inputs_and_disabled_changes_nothing():
    data = batches("mlp", 3)
    plain = mpidp.DistributedDataParallel(seeded("mlp"))
    joined = mpidp.DistributedDataParallel(seeded("mlp"))
    disabled = mpidp.DistributedDataParallel(seeded("mlp"))
    for model, join in ((plain, None), (joined, {}), (disabled, {"enable": False})):
        optimizer = OPTIMIZERS["sgd"](model.parameters())
        if join is None:
            for x, y in data:
                optimizer.zero_grad()
                loss_of("mlp", model(x), y).backward()
                optimizer.step()
        else:
            train(model, optimizer, data, "mlp", **join)
    assert max_rel_diff(joined.module, plain.module) == 0.0
    assert max_rel_diff(disabled.module, plain.module) == 0.0
    with pytest.raises(TypeError, match="throw_on_early_termination must be a bool, got 1"):
        with plain.join(throw_on_early_termination=1):
            pass


@pytest.mark.parametrize("kind", ["5-4-3", "zero"])
@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
def test_sync_batchnorm_with_uneven_inputs_matches_one_process(divide_by_initial_world_size, kind):
    """Each step equals BatchNorm on the concatenated batches of the ranks still active."""
    model = mpidp.SyncBatchNorm.convert_sync_batchnorm(seeded("convbn"))
    ddp = mpidp.DistributedDataParallel(model)
    reference = seeded("convbn", rank=0)  # rank 0's model, which DDP broadcast, with BatchNorm
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    train(ddp, optimizer, batches("convbn", counts(kind)), "convbn",
          divide_by_initial_world_size=divide_by_initial_world_size)
    data = {rank: batches("convbn", counts(kind, rank), rank) for rank in range(SIZE)}
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(max(len(d) for d in data.values())):
        active = [rank for rank in range(SIZE) if len(data[rank]) > step]
        out = reference(torch.cat([data[rank][step][0] for rank in active]))
        losses = [loss_of("convbn", part, data[rank][step][1])
                  for rank, part in zip(active, out.split(4))]
        reference_optimizer.zero_grad()
        (sum(losses) / (SIZE if divide_by_initial_world_size else len(active))).backward()
        reference_optimizer.step()
    diff = max_rel_diff(ddp.module, reference)  # parameters and running statistics
    print(f"JOIN size={SIZE} syncbn-{kind}-{'initial' if divide_by_initial_world_size else 'active'}"
          f" max_rel_diff={diff:.3e}")
    assert diff < 1e-5
