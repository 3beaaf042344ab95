"""Lab 13.2, tasks 1 and 2: how DistributedSampler and BatchSampler split a dataset.

    mpiexec -n 2 python examples/lab_4_sampler.py

Each rank prints what it would load for a few settings; the same shuffle seed
on every rank gives disjoint, consistent shares of every epoch.
"""

import torch

import mpidp  # mpidp: initialises MPI


class SimpleDataSet(torch.utils.data.Dataset):
    def __init__(self, i_length):
        self.m_length = i_length

    def __len__(self):
        return self.m_length

    def __getitem__(self, i_idx):
        return i_idx * 10


def show(title, loader):
    batches = [batch.tolist() for batch in loader]
    everyone = mpidp.comm.MPI.COMM_WORLD.gather(batches)  # mpidp: collect every rank's view
    if mpidp.rank() == 0:  # mpidp: print once
        print(title)
        for rank, seen in enumerate(everyone):
            print(f"  rank {rank}: {seen}")


dataset = SimpleDataSet(10)
for options in (dict(shuffle=False), dict(shuffle=True, seed=0), dict(shuffle=False, drop_last=True),
                dict(shuffle=False, num_replicas=3, rank=mpidp.rank() % 3)):
    sampler = mpidp.DistributedSampler(dataset, **options)  # mpidp: num_replicas, rank from MPI
    show(f"DistributedSampler({options}), batch_size=2:",
         torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler))

for batch_size, drop_last in ((3, False), (3, True)):
    sampler = mpidp.DistributedSampler(dataset, shuffle=False)  # mpidp
    batches = torch.utils.data.BatchSampler(sampler, batch_size=batch_size, drop_last=drop_last)
    show(f"BatchSampler(batch_size={batch_size}, drop_last={drop_last}) over the sampler:",
         torch.utils.data.DataLoader(dataset, batch_sampler=batches))
