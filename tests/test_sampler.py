"""mpidp.DistributedSampler: torch's, plus pad=False (each sample exactly once)."""

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
