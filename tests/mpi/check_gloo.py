"""mpidp.DistributedDataParallel equals torch's DDP over gloo on the same seeds and shards."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import mpidp
from mpidp.ddp import packing
from _models import RANK, SIZE, Branches, inputs, loss_of, max_rel_diff, shard, fresh

TOLERANCE = 1e-5


pytestmark = pytest.mark.usefixtures("gloo")


def report(name, value):
    print(f"EQUIVALENCE-vs-torch-DDP size={SIZE} {name} max_rel_diff={value:.3e}")


@pytest.mark.parametrize("batched", [False, True], ids=["each", "batched"])
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_conv_batchnorm_with_buffers_matches_torch_ddp(as_view, batched, monkeypatch):
    """Batched: mpidp's one copy per bucket (mpidp.ddp.packing.FOREACH, the CUDA buckets' way,
    here on the CPU), torch's batched_grad_copy; else a copy per gradient, both."""
    monkeypatch.setattr(packing, "FORCE", packing.FOREACH if batched else packing.EACH)
    mine = mpidp.DistributedDataParallel(fresh("convbn"), bucket_cap_mb=0.001,
                                         gradient_as_bucket_view=as_view)
    theirs = TorchDDP(fresh("convbn"), bucket_cap_mb=0.001, gradient_as_bucket_view=as_view,
                      batched_grad_copy=batched)
    assert max_rel_diff(mine.module, theirs.module) == 0.0
    my_opt = torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9)
    their_opt = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    for step in range(5):
        x, y = inputs("convbn", step)
        for model, opt in ((mine, my_opt), (theirs, their_opt)):
            opt.zero_grad()
            loss_of("convbn", model(shard(x)), shard(y)).backward()
            opt.step()
    diff = max_rel_diff(mine.module, theirs.module)  # parameters and BatchNorm buffers
    report(f"convbn-{'view' if as_view else 'copy'}{'-batched' if batched else ''}", diff)
    assert diff < TOLERANCE
    assert mine.module.features[1].num_batches_tracked.item() == 5


def test_rank_dependent_unused_branches_match_torch_ddp():
    mine = mpidp.DistributedDataParallel(fresh_branches(), find_unused_parameters=True)
    theirs = TorchDDP(fresh_branches(), find_unused_parameters=True)
    my_opt = torch.optim.SGD(mine.parameters(), lr=0.05)
    their_opt = torch.optim.SGD(theirs.parameters(), lr=0.05)
    use_b = RANK % 2 == 1
    for step in range(3):
        x, y = inputs("mlp", step)
        for model, opt in ((mine, my_opt), (theirs, their_opt)):
            opt.zero_grad(set_to_none=step != 1)
            loss_of("mlp", model(shard(x), use_b), shard(y)).backward()
        for (name, p), q in zip(mine.module.named_parameters(), theirs.module.parameters()):
            if q.grad is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
        my_opt.step()
        their_opt.step()
    assert mine.module.never.weight.grad is None  # unused on every rank: left as it was
    diff = max_rel_diff(mine.module, theirs.module)
    report("branches-find-unused", diff)
    assert diff < TOLERANCE
    if SIZE > 1:  # branch b is used on odd ranks only, yet every rank received its average
        assert mine.module.b.weight.grad is not None


def test_globally_unused_grad_is_left_untouched_like_torch():
    mine = mpidp.DistributedDataParallel(fresh_branches(), find_unused_parameters=True)
    theirs = TorchDDP(fresh_branches(), find_unused_parameters=True)
    for model in (mine, theirs):
        model.module.never.weight.grad = torch.full_like(model.module.never.weight, 3.0)
        x, y = inputs("mlp", 0)
        loss_of("mlp", model(shard(x), False), shard(y)).backward()
    torch.testing.assert_close(mine.module.never.weight.grad, theirs.module.never.weight.grad)
    assert torch.all(mine.module.never.weight.grad == 3.0)


def fresh_branches():
    torch.manual_seed(7 + RANK)
    return Branches()
