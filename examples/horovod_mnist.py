"""Horovod's PyTorch MNIST example, run by mpidp: only the import changed.

Horovod's ``examples/pytorch/pytorch_mnist.py``, adapted in two places: the
import (``import mpidp.horovod as hvd``), and synthetic MNIST-shaped data (28x28
images drawn around one pattern per digit), so that nothing is downloaded. The
lines that are Horovod's API keep their ``# Horovod:`` tags; ``# mpidp:`` marks
what changed. Run it with

    mpiexec -n 2 python examples/horovod_mnist.py --epochs 2

Each rank trains on its share (``DistributedSampler``) with the learning rate
scaled by the number of ranks, as Horovod's example does: two ranks at batch
size B train like one process at batch size 2B and learning rate 2x.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import mpidp.horovod as hvd  # mpidp: was `import horovod.torch as hvd`


def synthetic_mnist(count: int, seed: int) -> torch.utils.data.TensorDataset:  # mpidp: no download
    """``count`` 1x28x28 images around one fixed pattern per digit, and their labels."""
    patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=generator)
    images = patterns[labels] + torch.randn(count, 1, 28, 28, generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def parse(argv=None):
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N")
    parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N")
    parser.add_argument("--epochs", type=int, default=10, metavar="N")
    parser.add_argument("--lr", type=float, default=0.01, metavar="LR")
    parser.add_argument("--momentum", type=float, default=0.5, metavar="M")
    parser.add_argument("--no-cuda", action="store_true", default=False)
    parser.add_argument("--seed", type=int, default=42, metavar="S")
    parser.add_argument("--log-interval", type=int, default=10, metavar="N")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    parser.add_argument("--use-adasum", action="store_true", default=False)
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    parser.add_argument("--train-size", type=int, default=6000)  # mpidp: synthetic data sizes
    parser.add_argument("--test-size", type=int, default=1000)
    args = parser.parse_args(argv)
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    return args


def main(argv=None):
    """Train, test each epoch; returns the last (test loss, test accuracy)."""
    args = parse(argv)
    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    train_dataset = synthetic_mnist(args.train_size, seed=1)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)

    test_dataset = synthetic_mnist(args.test_size, seed=2)
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = Net()

    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1

    if args.cuda:
        # Move model to GPU.
        model.cuda()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    def train(epoch):
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                # Horovod: use train_sampler to determine the number of examples in
                # this worker's partition.
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                      f"({100. * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}")

    def metric_average(val, name):
        tensor = torch.tensor(val)
        avg_tensor = hvd.allreduce(tensor, name=name)
        return avg_tensor.item()

    def test():
        model.eval()
        test_loss = 0.
        test_accuracy = 0.
        for data, target in test_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            # sum up batch loss
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            # get the index of the max log-probability
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum()

        # Horovod: use test_sampler to determine the number of examples in
        # this worker's partition.
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)

        # Horovod: average metric values across workers.
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")

        # Horovod: print output only on first rank.
        if hvd.rank() == 0:
            print(f"\nTest set: Average loss: {test_loss:.4f}, "
                  f"Accuracy: {100. * test_accuracy:.2f}%\n")
        return test_loss, test_accuracy

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        result = test()
    return result


if __name__ == "__main__":
    main()
