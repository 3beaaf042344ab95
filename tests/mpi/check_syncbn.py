"""SyncBatchNorm equals nn.BatchNorm on the batch concatenated over the ranks.

Every rank builds the same global batch from a seed and takes its slice of it
(slices may differ in size, or be empty), so each rank can run the single-process
reference itself. The reference loss is the sum of the ranks' losses: each rank's
input gradient must be its slice of the reference's, and the weight and bias
gradients, summed over ranks, the reference's.
"""

import copy
import os
import pickle

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
from _models import RANK, SIZE, inputs, loss_of, max_rel_diff, reference_copy, shard, fresh
from mpidp.ddp import syncbn
from mpidp.ddp.syncbn import SyncBatchNorm  # mpidp.SyncBatchNorm once __init__ exports it

TOLERANCE = 1e-5
CHANNELS = 4
SHAPES = {  # reference layer, spatial dimensions
    "1d-2D": (nn.BatchNorm1d, ()),
    "1d-3D": (nn.BatchNorm1d, (5,)),
    "2d": (nn.BatchNorm2d, (3, 4)),
    "3d": (nn.BatchNorm3d, (2, 3, 3)),
}
# A float16 or bfloat16 output (and input gradient) is the float32 result rounded
# once, to 11 or 8 significant bits: off by at most u = 2**-11 or 2**-8 of the
# element, so of the largest. Where the float32 results of the two differ by
# ~1e-7 across a rounding boundary, the rounded ones differ by one unit in the
# last place, 2u; the bounds are 2u plus TOLERANCE. Statistics, running buffers
# and weight and bias gradients are computed in float32 from the same rounded
# inputs as the float32 reference, so they keep TOLERANCE.
HALF_TOLERANCE = {torch.float16: 2 * 2 ** -11 + TOLERANCE, torch.bfloat16: 2 * 2 ** -8 + TOLERANCE}


def report(name, diffs):
    worst = {key: MPI.COMM_WORLD.allreduce(value, op=MPI.MAX) for key, value in diffs.items()}
    text = " ".join(f"{key}={value:.2e}" for key, value in sorted(worst.items()))
    if RANK == 0:
        print(f"SYNCBN size={SIZE} {name}: {text}")


def counts_for(layout, size):
    if layout == "equal":
        return [3] * size
    # Never 2 values per channel in all: then x_hat = +-1 and the input gradient
    # is zero up to rounding, which no relative difference can measure.
    if layout == "unequal":
        return [rank + 3 for rank in range(size)]
    return [0 if rank == 1 else rank + 3 for rank in range(size)]  # "zero": rank 1 has none


def global_batch(step, total, spatial, dtype=torch.float32):
    """Input with a different mean and spread per channel, and the loss's projection."""
    gen = torch.Generator().manual_seed(100 + step)
    shape = (total, CHANNELS, *spatial)
    channel = torch.arange(CHANNELS, dtype=torch.float32).view(1, -1, *[1] * len(spatial))
    x = torch.randn(shape, generator=gen) * (1 + channel) + 3 * channel
    proj = torch.randn(shape, generator=gen)
    # Round to the input dtype first, so the float32 reference sees the same values.
    return x.to(dtype).float(), proj.to(dtype).float()


def part(tensor, counts, rank):
    start = sum(counts[:rank])
    return tensor[start:start + counts[rank]]


def rel(mine, reference):
    """max|mine - its part of reference| over max|reference| (0 for an empty slice)."""
    mine, reference = mine.detach().cpu().double(), reference.detach().cpu().double()
    if mine.numel() == 0:
        return 0.0
    return mine.sub(reference).abs().max().item() / reference.abs().max().item()


def make_pair(reference_cls, comm=None, **options):
    torch.manual_seed(123)
    reference = reference_cls(CHANNELS, **options)
    if reference.affine:
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
            if reference.bias is not None:
                reference.bias.uniform_(-0.5, 0.5)
    mine = SyncBatchNorm(CHANNELS, comm=comm, **options)
    mine.load_state_dict(reference.state_dict())
    return mine, reference


def compare(reference_cls, spatial, counts, steps=3, comm=None, dtype=torch.float32,
            input_grad=True, memory_format=torch.contiguous_format, device="cpu", **options):
    """Train ``steps`` forward/backward passes of both; return the worst relative differences."""
    group = MPI.COMM_WORLD if comm is None else comm
    rank = group.Get_rank()
    mine, reference = make_pair(reference_cls, comm, **options)
    mine.to(device)
    reference.to(device)
    diffs = {"output": 0.0}
    for step in range(steps):
        x, proj = (t.to(device) for t in global_batch(step, sum(counts), spatial, dtype))
        ref_x = x.clone().requires_grad_(input_grad)
        ref_out = reference(ref_x)
        (ref_out * proj).sum().backward()
        my_x = part(x, counts, rank).to(dtype).contiguous(memory_format=memory_format)
        my_x.requires_grad_(input_grad)
        my_out = mine(my_x)
        (my_out * part(proj, counts, rank).to(dtype)).sum().backward()  # empty rank: an empty sum
        assert my_out.dtype == dtype and my_out.shape == my_x.shape
        diffs["output"] = max(diffs["output"], rel(my_out, part(ref_out, counts, rank)))
        if input_grad:
            diffs["input_grad"] = max(diffs.get("input_grad", 0.0),
                                      rel(my_x.grad, part(ref_x.grad, counts, rank)))
        for name in ("weight", "bias"):
            theirs = getattr(reference, name)
            if theirs is None:
                assert getattr(mine, name) is None
                continue
            summed = mpidp.comm.allreduce(getattr(mine, name).grad.clone(), comm=group)
            diffs[f"{name}_grad"] = max(diffs.get(f"{name}_grad", 0.0), rel(summed, theirs.grad))
            getattr(mine, name).grad = theirs.grad = None
    if reference.track_running_stats:
        diffs["running_mean"] = rel(mine.running_mean, reference.running_mean)
        diffs["running_var"] = rel(mine.running_var, reference.running_var)
        assert mine.num_batches_tracked.item() == reference.num_batches_tracked.item() == steps
    return diffs


def check(name, diffs, tolerance=TOLERANCE, loose=()):
    report(name, diffs)
    for key, value in diffs.items():
        limit = HALF_TOLERANCE[loose[0]] if key in loose[1:] else tolerance
        assert value < limit, (key, value, limit)


def agree_on_every_rank(message: str) -> None:
    """Every rank saw the same message (and reached this collective: nobody hung)."""
    messages = MPI.COMM_WORLD.allgather(message)
    assert messages == [messages[0]] * SIZE, messages


@pytest.mark.parametrize("layout", ["equal", "unequal", "zero"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_batchnorm_on_the_global_batch(shape, layout):
    if layout == "zero" and SIZE < 2:
        pytest.skip("a rank with no samples needs two ranks")
    reference_cls, spatial = SHAPES[shape]
    check(f"{shape}-{layout}", compare(reference_cls, spatial, counts_for(layout, SIZE)))


def test_channels_last_input():
    diffs = compare(nn.BatchNorm2d, (3, 4), counts_for("unequal", SIZE),
                    memory_format=torch.channels_last)
    check("2d-channels-last", diffs)


def test_momentum_none_is_a_cumulative_average():
    check("momentum-none", compare(nn.BatchNorm2d, (3, 4), counts_for("unequal", SIZE), steps=4,
                                   momentum=None))


@pytest.mark.parametrize("options", [{"affine": False}, {"bias": False}, {"momentum": 0.5}],
                         ids=["affine-false", "bias-false", "momentum-0.5"])
def test_layer_options(options):
    check(str(options), compare(nn.BatchNorm1d, (5,), counts_for("unequal", SIZE), **options))


def test_without_running_stats_training_is_global_and_eval_is_local_batch_stats():
    counts = counts_for("unequal", SIZE)
    check("no-running-stats", compare(nn.BatchNorm2d, (3, 4), counts, track_running_stats=False))
    mine, reference = make_pair(nn.BatchNorm2d, track_running_stats=False)
    mine.eval()
    reference.eval()
    x, _ = global_batch(7, sum(counts), (3, 4))
    local = part(x, counts, RANK)
    # torch's SyncBatchNorm synchronises only while training: in eval mode a
    # layer without running statistics normalises with its own batch.
    diff = rel(mine(local), reference(local))
    report("no-running-stats-eval", {"output": diff})
    assert diff < TOLERANCE


def test_input_that_needs_no_grad_skips_the_backward_collective(monkeypatch):
    calls = count_allreduces(monkeypatch)
    diffs = compare(nn.BatchNorm2d, (3, 4), counts_for("unequal", SIZE), steps=2, input_grad=False)
    check("no-input-grad", diffs)
    assert calls == ["forward", "forward"]  # the weight and bias gradients are local sums


def count_allreduces(monkeypatch):
    calls = []
    real = syncbn._comm.allreduce

    def counted(tensor, op="sum", *, comm=None):
        # SyncBatchNorm's vectors: 2C + 2 values forward, 2C backward (the
        # test's own weight-gradient sums have C).
        kind = {2 * CHANNELS + 2: "forward", 2 * CHANNELS: "backward"}.get(tensor.numel())
        if kind is not None:
            calls.append(kind)
        return real(tensor, op, comm=comm)

    monkeypatch.setattr(syncbn._comm, "allreduce", counted)
    return calls


def test_one_allreduce_in_forward_and_one_in_backward(monkeypatch):
    mine, _ = make_pair(nn.BatchNorm2d)
    calls = count_allreduces(monkeypatch)
    x = torch.randn(3, CHANNELS, 2, 2, requires_grad=True)
    out = mine(x)
    assert calls == ["forward"]
    out.sum().backward()
    assert calls == ["forward", "backward"]


@pytest.mark.parametrize("which", ["self", "split", "world-dup"])
def test_other_communicators(which):
    if which == "self":
        comm = MPI.COMM_SELF
    elif which == "split":
        comm = MPI.COMM_WORLD.Split(RANK % 2, RANK)
    else:
        comm = MPI.COMM_WORLD.Dup()
    try:
        diffs = compare(nn.BatchNorm2d, (3, 4), counts_for("unequal", comm.Get_size()), comm=comm)
        check(f"comm-{which}", diffs)
    finally:
        if comm != MPI.COMM_SELF:
            comm.Free()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_inputs_against_a_float32_reference(dtype):
    diffs = compare(nn.BatchNorm2d, (3, 4), counts_for("unequal", SIZE), dtype=dtype)
    check(f"{dtype}".removeprefix("torch."), diffs, loose=(dtype, "output", "input_grad"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["float32", "float16", "bfloat16"])
@pytest.mark.may_skip("needs a GPU, which CI's machine has not (MPIDP_TEST_GPU=1 requires one)")
def test_cuda_tensors(dtype):
    if not torch.cuda.is_available():
        if os.environ.get("MPIDP_TEST_GPU") == "1":
            pytest.fail("MPIDP_TEST_GPU=1 but torch sees no GPU")
        pytest.skip("no GPU (MPIDP_TEST_GPU=1 turns this into a failure)")
    layout = "zero" if SIZE > 1 else "unequal"
    diffs = compare(nn.BatchNorm2d, (3, 4), counts_for(layout, SIZE), dtype=dtype,
                    device=torch.device("cuda", torch.cuda.current_device()))
    check(f"cuda-{dtype}".replace("torch.", ""), diffs,
          loose=(dtype, "output", "input_grad") if dtype in HALF_TOLERANCE else ())


def test_eval_is_local_and_equals_batchnorm_on_one_rank_alone():
    counts = counts_for("unequal", SIZE)
    mine, reference = make_pair(nn.BatchNorm2d)
    for step in range(2):
        x, _ = global_batch(step, sum(counts), (3, 4))
        reference(x)
        mine(part(x, counts, RANK))
    assert rel(mine.running_var, reference.running_var) < TOLERANCE
    before = mine.running_mean.clone(), mine.running_var.clone()
    if RANK == 0:  # no other rank takes part: a collective here would hang
        reference.load_state_dict(mine.state_dict())  # the same buffers, to the last bit
        mine.eval()
        reference.eval()
        x, proj = global_batch(9, 5, (3, 4))
        my_x, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        (mine(my_x) * proj).sum().backward()
        (reference(ref_x) * proj).sum().backward()
        assert torch.equal(mine(x), reference(x))  # the same F.batch_norm call
        assert torch.equal(my_x.grad, ref_x.grad)
        assert torch.equal(mine.weight.grad, reference.weight.grad)
    MPI.COMM_WORLD.Barrier()
    assert torch.equal(mine.running_mean, before[0]) and torch.equal(mine.running_var, before[1])
    assert mine.num_batches_tracked.item() == 2


def test_too_few_values_per_channel_raise_on_every_rank():
    mine, _ = make_pair(nn.BatchNorm1d)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as info:
        mine(torch.randn(1 if RANK == 0 else 0, CHANNELS))
    assert str(info.value) == ("Expected more than 1 value per channel when training, got input "
                               f"size 1 (values per channel over all {SIZE} ranks)")
    agree_on_every_rank(str(info.value))
    assert mine.num_batches_tracked.item() == 0
    if SIZE > 1:  # one sample on each rank is enough when there are two ranks or more
        diffs = compare(nn.BatchNorm1d, (), [1] * SIZE)
        if SIZE == 2:  # x_hat = +-1: the input gradient is zero up to rounding (see counts_for)
            diffs.pop("input_grad")
        check("one-sample-per-rank", diffs)


def test_invalid_input_on_one_rank_raises_on_every_rank():
    mine, _ = make_pair(nn.BatchNorm2d)
    last = SIZE - 1
    cases = [
        (torch.randn(CHANNELS) if RANK == last else torch.randn(2, CHANNELS, 3, 3),
         f"SyncBatchNorm: rank {last}: expected 2D to 5D input (got 1D input)"),
        (torch.randn(2, 5, 3, 3) if RANK == 0 else torch.randn(2, CHANNELS, 3, 3),
         "SyncBatchNorm: rank 0: expected 4 channels in dim 1 (got input of shape (2, 5, 3, 3))"),
        (torch.ones(2, CHANNELS, 3, 3, dtype=torch.int64),  # the same problem everywhere: once
         f"SyncBatchNorm: {'rank 0' if SIZE == 1 else f'ranks 0-{SIZE - 1}'}: expected a "
         f"float16, bfloat16, float32 or float64 input (got torch.int64)"),
    ]
    if SIZE > 2:  # different problems on different ranks: each with its ranks
        cases.append((torch.randn(CHANNELS) if RANK == 0 else
                      torch.randn(2, 5, 3, 3) if RANK == 1 else torch.randn(2, CHANNELS, 3, 3),
                      "SyncBatchNorm: rank 0: expected 2D to 5D input (got 1D input); rank 1: "
                      "expected 4 channels in dim 1 (got input of shape (2, 5, 3, 3))"))
    for tensor, message in cases:
        with pytest.raises(ValueError) as info:
            mine(tensor)
        assert str(info.value) == message
        agree_on_every_rank(str(info.value))
    assert mine.num_batches_tracked.item() == 0
    mine.eval()
    with pytest.raises(ValueError, match=r"^SyncBatchNorm: expected 2D to 5D input \(got 6D"):
        mine(torch.randn(2, CHANNELS, 1, 1, 1, 1))  # local: raised on each rank alone
    mine.train()
    mine(torch.randn(2, CHANNELS, 3, 3, requires_grad=True)).sum().backward()  # still in step
    assert mine.num_batches_tracked.item() == 1


def test_misuse_at_construction_raises_the_same_on_every_rank():
    with pytest.raises(TypeError) as info:
        SyncBatchNorm(CHANNELS, comm="world")
    assert str(info.value) == "comm must be None or an mpi4py Intracomm, got str"
    agree_on_every_rank(str(info.value))
    with pytest.raises(ValueError, match=r"^num_features must be an int >= 1, got 0$"):
        SyncBatchNorm(0)
    with pytest.raises(TypeError, match="comm must be None or an mpi4py Intracomm, got int"):
        SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(3), comm=3)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(6, 6, 3), nn.BatchNorm2d(6, affine=False), nn.ReLU(),
                                   nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, track_running_stats=False),
                                  nn.Linear(8, 5), nn.SyncBatchNorm(5, momentum=None))

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


def test_convert_sync_batchnorm_takes_over_state_and_flags():
    torch.manual_seed(5)
    model = Small()
    with torch.no_grad():
        model.stem[1].running_mean.uniform_(-1, 1)
        model.stem[1].running_var.uniform_(0.5, 2)
        model.stem[1].num_batches_tracked.fill_(7)
    model.stem[1].weight.requires_grad_(False)
    model.block[1].eval()
    reference = copy.deepcopy(model)
    layers = {name: layer for name, layer in model.named_modules()
              if isinstance(layer, nn.modules.batchnorm._BatchNorm)}
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted is model
    channels = set()
    for name, old in layers.items():
        new = converted.get_submodule(name)
        assert type(new) is SyncBatchNorm, name
        assert (new.num_features, new.eps, new.momentum, new.affine, new.track_running_stats) == \
               (old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats)
        assert new.weight is old.weight and new.bias is old.bias, name
        assert new.running_mean is old.running_mean and new.running_var is old.running_var
        assert new.num_batches_tracked is old.num_batches_tracked
        assert new.training == old.training, name
        channels.add(id(new._channel))
    assert len(channels) == 1  # one communicator for the layers of one call
    assert converted.stem[1].weight.requires_grad is False and converted.stem[1].bias.requires_grad
    assert converted.stem[1].num_batches_tracked.item() == 7
    assert converted.block[1].training is False
    assert sorted(converted.state_dict()) == sorted(reference.state_dict())
    single = SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm3d(2, eps=1e-3))
    assert type(single) is SyncBatchNorm and single.eps == 1e-3
    # Training forward on equal shards equals the unconverted model on the whole batch.
    x = torch.randn(4 * SIZE, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    out = converted(x.chunk(SIZE)[RANK])
    expected = reference(x).chunk(SIZE)[RANK]
    report("convert", {"output": rel(out, expected)})
    assert rel(out, expected) < TOLERANCE


def test_ddp_training_of_a_converted_model_matches_single_process():
    # Each rank's loss is its shard's mean and DDP averages the gradients, so with
    # equal shards one step equals a step on the whole batch with nn.BatchNorm2d.
    model = SyncBatchNorm.convert_sync_batchnorm(fresh("convbn"))
    ddp = mpidp.DistributedDataParallel(model, bucket_cap_mb=0.001)
    reference = reference_copy(None, 0, "convbn")
    my_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        x, y = inputs("convbn", step)
        my_opt.zero_grad()
        loss_of("convbn", ddp(shard(x)), shard(y)).backward()
        my_opt.step()
        ref_opt.zero_grad()
        loss_of("convbn", reference(x), y).backward()
        ref_opt.step()
    diff = max_rel_diff(ddp.module, reference)  # parameters and BatchNorm buffers
    report("ddp-convbn", {"parameters_and_buffers": diff})
    assert diff < TOLERANCE
    assert ddp.module.features[1].num_batches_tracked.item() == 4
    ddp.close()


def test_copies_share_the_communicator_and_pickles_rebuild_it():
    model = SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    twin = copy.deepcopy(model)
    assert twin[1]._channel is model[1]._channel
    loaded = pickle.loads(pickle.dumps(model))
    assert loaded[1]._channel is not model[1]._channel
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(RANK))
    outputs = [m(x) for m in (model, twin, loaded)]  # the unpickled one duplicates COMM_WORLD here
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    split = MPI.COMM_WORLD.Split(0, RANK)
    layer = SyncBatchNorm(4, comm=split)
    with pytest.raises(TypeError, match="other than MPI.COMM_WORLD cannot be pickled"):
        pickle.dumps(layer)
    split.Free()


def test_shadow_forward_backward_stands_in_for_a_rank_without_a_batch():
    if SIZE < 2:
        pytest.skip("a joined rank needs two ranks")
    counts = counts_for("zero", SIZE)  # rank 1 has no samples: it contributes zeros
    mine, reference = make_pair(nn.BatchNorm2d)
    x, proj = global_batch(0, sum(counts), (3, 4))
    ref_x = x.clone().requires_grad_()
    ref_out = reference(ref_x)
    (ref_out * proj).sum().backward()
    if RANK == 1:
        mine._shadow_forward_backward()
        assert mine.weight.grad is None
    else:
        my_x = part(x, counts, RANK).clone().requires_grad_()
        my_out = mine(my_x)
        (my_out * part(proj, counts, RANK)).sum().backward()
        assert rel(my_out, part(ref_out, counts, RANK)) < TOLERANCE
        assert rel(my_x.grad, part(ref_x.grad, counts, RANK)) < TOLERANCE
    assert rel(mine.running_mean, reference.running_mean) < TOLERANCE
    assert rel(mine.running_var, reference.running_var) < TOLERANCE
    assert mine.num_batches_tracked.item() == 1
