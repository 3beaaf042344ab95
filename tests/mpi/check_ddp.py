"""DistributedDataParallel on shards equals single-process training on the whole batch."""

import contextlib
import copy
import gc
import weakref

import pytest
import torch

import mpidp
from mpidp.ddp import packing as _packing
from _models import (OPTIMIZERS, SIZE, Branches, Frozen, Tied, inputs, loss_of, max_rel_diff,
                     reference_copy, shard, fresh)

STEPS = 5
TOLERANCE = 1e-5


def train_pair(model_name, optimizer, steps=STEPS, **ddp_kwargs):
    """Train DDP on shards and a local copy on whole batches; return (ddp, local)."""
    ddp = mpidp.DistributedDataParallel(fresh(model_name), **ddp_kwargs)
    local = reference_copy(ddp.module, model_name=model_name)
    assert max_rel_diff(ddp.module, local) == 0.0, "rank 0's model was not broadcast"
    ddp_opt = OPTIMIZERS[optimizer](ddp.parameters())
    local_opt = OPTIMIZERS[optimizer](local.parameters())
    for step in range(steps):
        x, y = inputs(model_name, step)
        ddp_opt.zero_grad()
        loss_of(model_name, ddp(shard(x)), shard(y)).backward()
        ddp_opt.step()
        local_opt.zero_grad()
        loss_of(model_name, local(x), y).backward()
        local_opt.step()
    return ddp, local


def report(name, value):
    print(f"EQUIVALENCE size={SIZE} {name} max_rel_diff={value:.3e}")


@pytest.mark.parametrize("bucket_cap_mb", [0.001, 0.01, 1, 25, 1000])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mlp_matches_single_process_for_every_bucket_cap(optimizer, bucket_cap_mb):
    ddp, local = train_pair("mlp", optimizer, bucket_cap_mb=bucket_cap_mb)
    if bucket_cap_mb == 0.001:
        assert len(ddp.reducer.layout.buckets) >= 2
    if bucket_cap_mb >= 1:
        assert len(ddp.reducer.layout.buckets) == 1  # the whole 6 KB model fits the 1 MiB first bucket
    diff = max_rel_diff(ddp.module, local)
    report(f"mlp-{optimizer}-cap{bucket_cap_mb}", diff)
    assert diff < TOLERANCE


@pytest.mark.parametrize("model_name", ["tied", "frozen", "mixed"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_special_models_match_single_process(model_name, optimizer, as_view):
    ddp, local = train_pair(model_name, optimizer, bucket_cap_mb=0.001,
                            gradient_as_bucket_view=as_view)
    diff = max_rel_diff(ddp.module, local)
    report(f"{model_name}-{optimizer}-{'view' if as_view else 'copy'}", diff)
    assert diff < TOLERANCE


def test_tied_weight_is_one_parameter_reduced_once():
    ddp = mpidp.DistributedDataParallel(Tied())
    # embed.weight, hidden.weight, hidden.bias, out.bias: out.weight is embed.weight
    assert len(ddp.reducer.params) == 4
    assert sum(len(members) for members in ddp.reducer.layout.members) == len(ddp.reducer.params)


def test_frozen_parameters_are_left_out_and_unchanged():
    ddp, local = train_pair("frozen", "sgd")
    assert not any(p is ddp.module.stem.weight for p in ddp.reducer.params)
    assert ddp.module.stem.weight.grad is None
    torch.testing.assert_close(ddp.module.stem.weight, reference_copy(Frozen(), model_name="frozen").stem.weight,
                               rtol=0, atol=0)


def test_mixed_dtypes_get_one_dtype_per_bucket():
    ddp, _ = train_pair("mixed", "sgd", steps=1, bucket_cap_mb=1000)
    dtypes = [bucket.buffer.dtype for bucket in ddp.reducer.layout.buckets]
    assert sorted(map(str, dtypes)) == ["torch.float32", "torch.float64"]


@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_gradient_as_bucket_view_leaves_grads_in_the_bucket(as_view):
    ddp, _ = train_pair("mlp", "sgd", steps=2, gradient_as_bucket_view=as_view)
    storages = {b.buffer.untyped_storage().data_ptr() for b in ddp.reducer.layout.buckets}
    shares = [p.grad.untyped_storage().data_ptr() in storages for p in ddp.parameters()]
    assert all(shares) if as_view else not any(shares)


@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_no_sync_accumulation_equals_one_big_batch(as_view):
    ddp = mpidp.DistributedDataParallel(fresh("mlp"), bucket_cap_mb=0.001,
                                        gradient_as_bucket_view=as_view)
    local = reference_copy(ddp.module)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        ddp_opt.zero_grad()
        local_opt.zero_grad()
        for micro in range(3):
            x, y = inputs("mlp", 10 * step + micro)
            if micro < 2:
                with ddp.no_sync():
                    loss_of("mlp", ddp(shard(x)), shard(y)).backward()
            else:
                loss_of("mlp", ddp(shard(x)), shard(y)).backward()
            loss_of("mlp", local(x), y).backward()
        for mine, theirs in zip(ddp.parameters(), local.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)
        ddp_opt.step()
        local_opt.step()
    diff = max_rel_diff(ddp.module, local)
    report(f"no_sync-{'view' if as_view else 'copy'}", diff)
    assert diff < TOLERANCE


def test_no_sync_restores_the_flag_after_an_exception():
    ddp = mpidp.DistributedDataParallel(fresh("mlp"))
    with pytest.raises(KeyError):
        with ddp.no_sync():
            assert ddp.require_backward_grad_sync is False
            raise KeyError("inside no_sync")
    assert ddp.require_backward_grad_sync is True


def test_ranks_hold_identical_parameters_after_training():
    ddp, _ = train_pair("mlp", "adam")
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    lowest, highest = flat.clone(), flat.clone()
    mpidp.comm.allreduce(lowest, "min")
    mpidp.comm.allreduce(highest, "max")
    assert torch.equal(lowest, highest)


def test_forward_without_grad_and_eval_do_not_arm_the_reducer():
    ddp, _ = train_pair("mlp", "sgd", steps=1)
    with torch.no_grad():
        ddp(torch.randn(4, 10))
    ddp.eval()
    ddp(torch.randn(4, 10)).sum()  # forward only: no backward follows
    ddp.train()
    ddp, local = train_pair("mlp", "sgd", steps=2)
    assert max_rel_diff(ddp.module, local) < TOLERANCE


def test_find_unused_parameters_with_all_used_matches_single_process():
    ddp, local = train_pair("mlp", "sgd", find_unused_parameters=True)
    assert max_rel_diff(ddp.module, local) < TOLERANCE


@pytest.mark.parametrize("overlap", ["inline", "thread", "nonblocking"])
def test_communication_starts_during_backward(overlap):
    """With several buckets, the first allreduce starts before the last gradient arrives."""
    ddp = mpidp.DistributedDataParallel(fresh("mlp"), bucket_cap_mb=0.001, overlap=overlap)
    launched_when = []
    first = ddp.reducer.params[0]
    first.register_post_accumulate_grad_hook(
        lambda p: launched_when.append(ddp.reducer._step.order.next))
    x, y = inputs("mlp", 0)
    loss_of("mlp", ddp(shard(x)), shard(y)).backward()
    # when the first-registered (last-produced) gradient arrives, all buckets
    # but the one holding it have been launched already
    assert launched_when[0] >= len(ddp.reducer.layout.buckets) - 1


def test_gradient_order_prediction_rebuilds_buckets_and_changes_no_result():
    trained = {}
    for predict in (False, True):
        ddp, local = train_pair("reverse", "sgd", bucket_cap_mb=0.0001,
                                predict_gradient_order=predict)
        assert max_rel_diff(ddp.module, local) < TOLERANCE
        names = ddp.reducer.names
        first_bucket = {names[i] for i in ddp.reducer.layout.members[0]}
        last_bucket = {names[i] for i in ddp.reducer.layout.members[-1]}
        if predict:  # head, then layers.0 (used last in forward), ..., layers.3
            assert first_bucket <= {"head.bias", "head.weight"} and "layers.3.weight" in last_bucket
        else:  # reverse registration: head first, layers.0 last, though it arrives second
            assert first_bucket <= {"head.bias", "head.weight"} and "layers.0.weight" in last_bucket
        trained[predict] = ddp.module
    diff = max_rel_diff(trained[True], trained[False])
    report("order-prediction-on-vs-off", diff)
    assert diff == 0.0 if SIZE <= 2 else diff < 1e-6


@pytest.mark.parametrize("overlap", ["inline", "thread", "nonblocking"])
@pytest.mark.parametrize("inplace", [None, 0.0005], ids=["bucketed", "inplace"])
def test_every_overlap_strategy_and_inplace_reduction_match_single_process(overlap, inplace):
    ddp, local = train_pair("mlp", "adam", bucket_cap_mb=0.001, chunk_mb=0.0005,
                            overlap=overlap, inplace_threshold_mb=inplace)
    if inplace:
        assert any(b.solo for b in ddp.reducer.layout.buckets) and not all(b.solo for b in ddp.reducer.layout.buckets)
    diff = max_rel_diff(ddp.module, local)
    report(f"overlap-{overlap}-{'inplace' if inplace else 'bucketed'}", diff)
    assert diff < TOLERANCE
    ddp.reducer.close()


def test_inplace_reduction_keeps_the_grad_tensor_and_spares_unused_stale_grads():
    torch.manual_seed(0)
    model = Branches()
    ddp = mpidp.DistributedDataParallel(model, find_unused_parameters=True,
                                        inplace_threshold_mb=0.0001)
    x, y = inputs("mlp", 0)
    model.never.weight.grad = torch.full_like(model.never.weight, 3.0)
    grad_object = None
    for step in range(2):
        loss_of("mlp", ddp(shard(x), False), shard(y)).backward()
        if step == 0:
            grad_object = model.trunk.weight.grad
    assert model.trunk.weight.grad is grad_object  # reduced where it lay, no copy
    assert torch.all(model.never.weight.grad == 3.0)  # unused everywhere: untouched
    expected = model.trunk.weight.grad.clone()
    mpidp.comm.allreduce(expected, "max")
    assert torch.equal(expected, model.trunk.weight.grad)  # same on every rank


def test_inplace_reduction_of_a_non_contiguous_gradient():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)
    ddp = mpidp.DistributedDataParallel(conv, inplace_threshold_mb=0.0001)
    reference = copy.deepcopy(conv).to(memory_format=torch.contiguous_format)
    x = torch.randn(SIZE * 2, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    ddp(shard(x).contiguous(memory_format=torch.channels_last)).square().mean().backward()
    reference(x).square().mean().backward()
    torch.testing.assert_close(conv.weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-7)


def test_zero_grad_set_to_none_frees_the_reduced_gradients():
    ddp = mpidp.DistributedDataParallel(fresh("mlp"), inplace_threshold_mb=0.0001)
    x, y = inputs("mlp", 0)
    loss_of("mlp", ddp(shard(x)), shard(y)).backward()
    grads = [weakref.ref(p.grad) for p in ddp.parameters()]
    ddp.zero_grad(set_to_none=True)
    gc.collect()
    assert all(ref() is None for ref in grads)  # mpidp holds no reference to a step's gradient


@contextlib.contextmanager
def packing(how):
    """Build and train under packing ``how`` (mpidp.ddp.packing.FORCE; None: the rule)."""
    before, _packing.FORCE = _packing.FORCE, how
    try:
        yield
    finally:
        _packing.FORCE = before


PACKING_CASES = {  # name: (model, DDP arguments, zero_grad's set_to_none)
    "copy": ("mixed", dict(bucket_cap_mb=0.001), True),
    "view": ("mlp", dict(gradient_as_bucket_view=True), True),
    "kept-grads": ("reverse", dict(bucket_cap_mb=0.002), False),  # .grad zeroed, not new
    "nonblocking": ("tied", dict(overlap="nonblocking", bucket_cap_mb=0.001), True),
    "thread-no-shm": ("mlp", dict(overlap="thread", shared_memory=False), True),
    "unused": ("frozen", dict(find_unused_parameters=True, bucket_cap_mb=0.001), True),
    "hook": ("mlp", dict(bucket_cap_mb=0.001), True),
}


# every case batched by _foreach_copy_; the kernel's branch (through mpidp.kernels.pack's torch
# ops on the CPU) where every gradient of a bucket waits for its copy, and where not. At 2 and
# 3 ranks: a division that is exact and one that rounds (1 divides nothing, 4 as 2 does).
@pytest.mark.skipif(SIZE not in (2, 3), reason="the 2- and 3-rank launches check it")
@pytest.mark.parametrize("how, case", [(_packing.FOREACH, case) for case in sorted(PACKING_CASES)]
                         + [(_packing.KERNEL, "copy"), (_packing.KERNEL, "view")])
def test_a_batched_bucket_copy_gives_the_bits_of_a_copy_per_gradient(how, case):
    """One copy per bucket when its last gradient arrives (torch's batched_grad_copy; the CuPy
    kernel's call on CUDA, torch's on the CPU) leaves the same bits as today's copy and division
    at each gradient's hook: every .grad after every step, and the parameters."""
    model_name, kwargs, set_to_none = PACKING_CASES[case]
    models = {}
    for name in (_packing.EACH, how):
        with packing(name):
            ddp = mpidp.DistributedDataParallel(fresh(model_name), **kwargs)
            if case == "hook":
                ddp.register_comm_hook(None, mpidp.hooks.allreduce_hook)
        models[name] = (ddp, OPTIMIZERS["sgd"](ddp.parameters()))
    assert all(b.packing == how for b in models[how][0].reducer.layout.buckets if not b.solo)
    for step in range(3):
        x, y = inputs(model_name, step)
        for name, (ddp, opt) in models.items():
            with packing(name):  # the layout rebuilt after the first step chooses again
                opt.zero_grad(set_to_none=set_to_none)
                loss_of(model_name, ddp(shard(x)), shard(y)).backward()
        for (label, p), q in zip(models[_packing.EACH][0].module.named_parameters(),
                                 models[how][0].module.parameters()):
            assert (p.grad is None) == (q.grad is None), label
            assert p.grad is None or torch.equal(p.grad, q.grad), f"step {step}: {label}"
        for _, opt in models.values():
            opt.step()
    assert max_rel_diff(models[_packing.EACH][0].module, models[how][0].module) == 0.0
    for ddp, _ in models.values():
        ddp.close()


def test_the_packing_rule_batches_small_gradients_and_copies_big_ones_at_their_hooks():
    cpu, cuda, small = torch.device("cpu"), torch.device("cuda", 0), _packing.SMALL_BYTES
    assert _packing.choose(cpu, torch.float32, small) == _packing.FOREACH
    assert _packing.choose(cpu, torch.float32, small + 1) == _packing.EACH
    assert _packing.choose(cuda, torch.float32, 1 << 30) == _packing.FOREACH  # KERNEL_ON_CUDA off
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(256, 256))  # 256 KiB weight
    ddp = mpidp.DistributedDataParallel(model, bucket_cap_mb=0.0001, inplace_threshold_mb=None)
    big = ddp.reducer.layout.slot[2][0]  # the 256 x 256 weight's bucket
    assert big.packing == _packing.EACH
    assert {b.packing for b in ddp.reducer.layout.buckets if b is not big} == {_packing.FOREACH}
    ddp.close()
