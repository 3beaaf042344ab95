"""mpidp.DistributedSampler: torch's, plus pad=False (each sample exactly once)."""

import re

import pytest
import torch
from torch.utils.data import TensorDataset

import mpidp


@pytest.mark.parametrize("n,size", [(10, 3), (7, 2), (2, 4), (96, 4)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_pad_false_gives_every_sample_once(n, size, shuffle):
    dataset = TensorDataset(torch.arange(n))
    shares = []
    for rank in range(size):
        sampler = mpidp.DistributedSampler(dataset, num_replicas=size, rank=rank,
                                           shuffle=shuffle, pad=False)
        sampler.set_epoch(3)
        share = list(sampler)
        assert len(share) == len(sampler) == len(range(rank, n, size))
        shares += share
    assert sorted(shares) == list(range(n))


def test_default_pads_like_torch():
    dataset = TensorDataset(torch.arange(10))
    ours = [list(mpidp.DistributedSampler(dataset, num_replicas=3, rank=r, shuffle=False))
            for r in range(3)]
    theirs = [list(torch.utils.data.DistributedSampler(dataset, num_replicas=3, rank=r,
                                                       shuffle=False)) for r in range(3)]
    assert ours == theirs and all(len(share) == 4 for share in ours)


def test_pad_must_be_a_bool():
    with pytest.raises(TypeError, match="pad must be a bool, got 'no'"):
        mpidp.DistributedSampler(TensorDataset(torch.arange(4)), num_replicas=2, rank=0, pad="no")


@pytest.mark.parametrize("n,size", [(10, 3), (7, 2), (24, 4), (13, 1)])
@pytest.mark.parametrize("drop_last,pad", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_rank_equals_torchs_sampler(n, size, drop_last, pad, shuffle):
    """global_order() re-derives torch's list: each rank's share is still torch's exactly."""
    dataset = TensorDataset(torch.arange(n))
    for rank in range(size):
        ours = mpidp.DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle,
                                        seed=5, drop_last=drop_last, pad=pad)
        ours.set_epoch(2)
        if pad or drop_last:
            theirs = torch.utils.data.DistributedSampler(dataset, num_replicas=size, rank=rank,
                                                         shuffle=shuffle, seed=5,
                                                         drop_last=drop_last)
            theirs.set_epoch(2)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
        else:
            assert list(ours) == ours.global_order()[rank::size]


@pytest.mark.parametrize("before,after", [(2, 3), (3, 2), (2, 4), (4, 2), (2, 2)])
def test_resume_at_another_size_keeps_the_global_batches(before, after):
    """Global batch k holds the same samples at any rank count once resumed from ``start``."""
    dataset, batch, epoch = TensorDataset(torch.arange(60)), 12, 1  # 12 samples a global batch
    start = 2 * batch  # two global batches taken before the stop

    def batches(size, start):
        shares = []
        for rank in range(size):
            sampler = mpidp.DistributedSampler(dataset, num_replicas=size, rank=rank, seed=3)
            sampler.resume_from(epoch, start)
            sampler.set_epoch(epoch)  # the same epoch keeps the start
            share = list(sampler)
            assert len(share) == len(sampler)
            shares.append([share[k:k + batch // size] for k in range(0, len(share), batch // size)])
        return [sorted(sum((shares[r][k] for r in range(size)), [])) for k in range(len(shares[0]))]

    uninterrupted = batches(before, 0)
    assert batches(after, start) == uninterrupted[2:]
    assert sorted(sum(uninterrupted, [])) == list(range(60))


def test_a_resume_skips_the_epochs_before_and_a_bad_position_is_refused():
    sampler = mpidp.DistributedSampler(range(20), num_replicas=2, rank=1, seed=3)
    sampler.resume_from(4, 6)
    assert sampler.epoch == 4 and len(sampler) == 7
    sampler.set_epoch(3)  # an epoch dealt before the stop: nothing
    assert len(sampler) == 0 and list(sampler) == []
    sampler.set_epoch(4)
    assert len(sampler) == 7 and len(list(sampler)) == 7
    sampler.set_epoch(5)  # reached: the next epoch from its beginning
    assert sampler.start == 0 and len(sampler) == 10
    with pytest.raises(ValueError, match="start must be a multiple of num_replicas=2"):
        sampler.resume_from(0, 3)
    with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
        sampler.resume_from(-1, 0)
    with pytest.raises(ValueError, match="passes must be"):
        sampler.resume_from(0, 2, passes=-1)


def _passes(sampler, loop, epochs=3) -> list[tuple[int, list[int]]]:
    """(epoch, indices) of each pass that ``loop`` makes over ``sampler``, empty ones left out."""
    dealt = []
    for epoch in loop(sampler, epochs):
        indices = list(sampler)
        if indices:
            dealt.append((sampler.epoch, indices))
    return dealt


def _readme(sampler, epochs):
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        yield epoch


def _from_sampler_epoch(sampler, epochs):
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        yield epoch


def _no_set_epoch(sampler, epochs):
    yield from range(epochs)


@pytest.mark.parametrize("loop", [_readme, _from_sampler_epoch, _no_set_epoch])
@pytest.mark.parametrize("stop", [(0, 0, 4), (1, 0, 0), (1, 0, 8), (1, 0, 12), (2, 0, 10)])
def test_each_loop_goes_on_from_the_position(loop, stop):
    """The loop runs again from its top: what it deals equals the uninterrupted run's rest."""
    epoch, _, start = stop
    make = lambda: mpidp.DistributedSampler(range(12), num_replicas=2, rank=1, seed=3)  # noqa: E731
    whole = _passes(make(), loop)
    passes = epoch if loop is _no_set_epoch else 0  # every pass is over epoch 0 there
    epoch = 0 if loop is _no_set_epoch else epoch
    resumed = make()
    reached = []
    resumed.resume_from(epoch, start, passes=passes, reached=lambda: reached.append(True))
    rest = _passes(resumed, loop)
    k = stop[0]
    assert rest == [(whole[k][0], whole[k][1][start // 2:])] * (start < 12) + whole[k + 1:]
    assert reached == [True]


def test_a_loop_that_skips_or_replays_the_resumed_epoch_is_refused():
    sampler = mpidp.DistributedSampler(range(12), num_replicas=2, rank=0, seed=3)
    sampler.resume_from(1, 4)
    with pytest.raises(ValueError, match=r"set_epoch\(2\): the run was resumed in epoch 1, at "
                                         r"sample 4 .* would skip the rest of epoch 1"):
        sampler.set_epoch(2)
    sampler.resume_from(1, 4)
    list(sampler)  # the resumed epoch, begun without set_epoch, then the loop's own count
    with pytest.raises(ValueError, match=r"set_epoch\(1\) after a pass over the resumed "
                                         r"epoch 1, which began without set_epoch"):
        sampler.set_epoch(1)


def test_epochs_that_go_back_are_marked():
    sampler = mpidp.DistributedSampler(range(12), num_replicas=2, rank=0)
    for epoch in (0, 1, 1, 2):
        sampler.set_epoch(epoch)
        list(sampler)
    assert not sampler.rewound
    sampler.set_epoch(0)
    list(sampler)
    assert sampler.rewound


@pytest.mark.parametrize("before, after", [(4, 3), (3, 2), (2, 1)])
def test_resize_then_resume_deals_the_rest_of_the_epoch_to_fewer_ranks(before, after):
    """What mpidp.Healer does after a lost rank: same epoch, same global order, new split."""
    dataset = TensorDataset(torch.arange(96))
    samplers = [mpidp.DistributedSampler(dataset, num_replicas=before, rank=r, seed=7)
                for r in range(before)]
    for sampler in samplers:
        sampler.set_epoch(2)
    order = samplers[0].global_order()
    samplers = samplers[:after]
    for rank, sampler in enumerate(samplers):
        sampler.resize(after, rank)
        sampler.resume_from(2, 36)
        assert sampler.epoch == 2 and sampler.num_replicas == after and len(sampler) == 60 // after
    dealt = [list(s) for s in samplers]
    assert sorted(sum(dealt, [])) == sorted(order[36:])
    assert [dealt[i % after][i // after] for i in range(60)] == order[36:]


@pytest.mark.parametrize("before, after", [(4, 5), (2, 4), (4, 3), (6, 1)])
def test_micro_batches_resumed_or_resized_at_a_count_that_does_not_divide_them(before, after):
    """6 micro-batches of 4 (a global batch of 24) at any count up to 6: the first ranks take
    one more (5 ranks: 2, 1, 1, 1, 1), and rank order then batch order is the global order."""
    dataset = TensorDataset(torch.arange(100))

    def samplers(size):
        return [mpidp.DistributedSampler(dataset, num_replicas=size, rank=r, seed=7,
                                         micro_batches=6, micro_batch_size=4) for r in range(size)]

    ran = samplers(before)
    for sampler in ran:
        sampler.set_epoch(1)
    order = ran[0].global_order()
    resized = ran[:after] if after <= before else samplers(after)
    for rank, sampler in enumerate(resized):
        sampler.resize(after, rank)
        assert sampler.dealing_problem(after, 24) is None
        sampler.resume_from(1, 48)  # two global batches taken before the stop; 96 in the epoch
        assert sampler.share(24) == sampler.batch_size == 4 * mpidp.sampler.micro_batch_counts(
            6, after)[rank]
        assert len(sampler) == 2 * sampler.batch_size
    dealt = [list(s) for s in resized]
    sizes = [s.batch_size for s in resized]
    assert [i for step in range(2) for share, size in zip(dealt, sizes)
            for i in share[step * size:(step + 1) * size]] == order[48:96]
    assert mpidp.sampler.micro_batch_counts(6, 5) == [2, 1, 1, 1, 1]


def test_more_ranks_than_micro_batches_or_a_start_inside_a_global_batch_is_refused():
    rule = r"micro_batches must be at least the number of ranks .*micro_batches=6 for num_replicas=7"
    with pytest.raises(ValueError, match=rule):
        mpidp.DistributedSampler(range(48), num_replicas=7, rank=0, micro_batches=6,
                                 micro_batch_size=4)
    sampler = mpidp.DistributedSampler(range(48), num_replicas=4, rank=0, micro_batches=6,
                                       micro_batch_size=4)
    assert re.match(rule, sampler.dealing_problem(7, 24))
    with pytest.raises(ValueError, match=r"start must be a multiple of the global batch=24 "
                                         r"and >= 0, got 12"):
        sampler.resume_from(0, 12)
    plain = mpidp.DistributedSampler(range(48), num_replicas=4, rank=0)
    assert plain.dealing_problem(3, 24) is None and plain.share(24) == 6
    assert plain.dealing_problem(5, 24) == "the global batch of 24 samples does not divide " \
                                          "among 5 ranks"
