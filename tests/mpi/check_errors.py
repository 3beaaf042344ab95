"""Misuse of DistributedDataParallel raises the same clear error on every rank, never hangs."""

import pytest
import torch
from torch import nn

import mpidp
from _models import RANK, SIZE, Branches, inputs, loss_of, shard

pytestmark = pytest.mark.skipif(SIZE < 2, reason="cross-rank errors need two ranks")


def agree_on_every_rank(message: str) -> None:
    """Every rank saw the same message (and reached this collective: nobody hung)."""
    from mpi4py import MPI
    messages = MPI.COMM_WORLD.allgather(message)
    assert messages == [messages[0]] * SIZE, messages


def test_different_shapes_on_one_rank():
    model = nn.Sequential(nn.Linear(10, 5 if RANK != 1 else 6), nn.Linear(5 if RANK != 1 else 6, 2))
    with pytest.raises(ValueError) as info:
        mpidp.DistributedDataParallel(model)
    assert str(info.value) == (
        "DistributedDataParallel: the model or its settings differ across ranks: rank 1 has "
        "parameter '0.weight' with shape (6, 10), dtype float32, requires_grad=True where rank 0 "
        "has parameter '0.weight' with shape (5, 10), dtype float32, requires_grad=True")
    agree_on_every_rank(str(info.value))


def test_extra_parameter_on_the_last_rank():
    layers = [nn.Linear(4, 4)] + ([nn.Linear(4, 4)] if RANK == SIZE - 1 else [])
    with pytest.raises(ValueError, match=rf"rank {SIZE - 1} has 4 parameters and buffers "
                                         rf"but rank 0 has 2.*'1.weight'") as info:
        mpidp.DistributedDataParallel(nn.Sequential(*layers), bucket_cap_mb=25)
    agree_on_every_rank(str(info.value))


def test_different_dtype_and_frozen_flag_and_settings():
    model = nn.Linear(3, 3).double() if RANK == 1 else nn.Linear(3, 3)
    with pytest.raises(ValueError, match="dtype float64.*where rank 0 has .*dtype float32") as info:
        mpidp.DistributedDataParallel(model)
    agree_on_every_rank(str(info.value))
    model = nn.Linear(3, 3).requires_grad_(RANK != 1)
    with pytest.raises(ValueError, match="requires_grad=False where rank 0 has .*requires_grad=True"):
        mpidp.DistributedDataParallel(nn.Sequential(model, nn.Linear(3, 1)))
    with pytest.raises(ValueError, match=r"rank 1 has bucket_cap_mb=5 where rank 0 has bucket_cap_mb=25"):
        mpidp.DistributedDataParallel(nn.Linear(3, 3), bucket_cap_mb=5 if RANK == 1 else 25)


def test_missing_gradient_without_find_unused_is_an_error_at_the_next_forward():
    torch.manual_seed(0)
    ddp = mpidp.DistributedDataParallel(Branches())  # find_unused_parameters=False
    x, y = inputs("mlp", 0)
    loss_of("mlp", ddp(shard(x), RANK == 1), shard(y)).backward()  # completes on every rank
    with pytest.raises(RuntimeError) as info:
        ddp(shard(x), False)
    message = str(info.value)
    assert "received no gradient in the last backward pass" in message
    assert f"never.weight (missing on {SIZE} of {SIZE} ranks)" in message
    assert "b.weight (missing on" in message and "a.weight (missing on" in message
    assert "Pass find_unused_parameters=True" in message
    agree_on_every_rank(message)
    # the error is raised once; the communicators stayed consistent, so training goes on
    ddp(shard(x), False)


def test_exception_inside_training_loop_does_not_break_later_steps():
    torch.manual_seed(0)
    ddp = mpidp.DistributedDataParallel(nn.Linear(10, 5))
    x, y = inputs("mlp", 0)
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        ddp(torch.randn(2, 3))
    loss_of("mlp", ddp(shard(x)), shard(y)).backward()
    grad = ddp.module.weight.grad.clone()
    high, low = grad.clone(), grad.clone()
    mpidp.comm.allreduce(high, "max")
    mpidp.comm.allreduce(low, "min")
    assert torch.equal(high, low)
