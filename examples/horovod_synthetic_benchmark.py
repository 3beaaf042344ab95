"""Horovod's PyTorch synthetic benchmark, run by mpidp: only the import changed.

Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py``: images per second
of a model trained on random data. Adapted in two places, tagged ``# mpidp:``:
the import, and a small CNN when torchvision (which has the ``--model``
zoo) is not installed. Run it with

    mpiexec -n 2 python examples/horovod_synthetic_benchmark.py --batch-size 8 --num-iters 3
"""

import argparse
import timeit

import numpy as np
import torch.backends.cudnn as cudnn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import mpidp.horovod as hvd  # mpidp: was `import horovod.torch as hvd`

# Benchmark settings
parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="resnet50", help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--num-warmup-batches", type=int, default=10,
                    help="number of warm-up batches that don't count towards benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=10,
                    help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="use adasum algorithm to do reduction")

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())

cudnn.benchmark = True


def small_cnn():  # mpidp: the model when torchvision is not installed
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, stride=2),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 1000))


try:  # mpidp: torchvision's zoo where it is installed
    from torchvision import models
    model = getattr(models, args.model)()
except ImportError:
    model = small_cnn()

# By default, Adasum doesn't need scaling up learning rate.
lr_scaler = hvd.size() if not args.use_adasum else 1

if args.cuda:
    # Move model to GPU.
    model.cuda()

optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer,
                                     named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Set up fixed fake data
data = torch.randn(args.batch_size, 3, 224, 224)
target = torch.LongTensor(args.batch_size).random_() % 1000
if args.cuda:
    data, target = data.cuda(), target.cuda()


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "")


log(f"Model: {args.model if 'models' in globals() else 'small CNN (no torchvision)'}")  # mpidp
log(f"Batch size: {args.batch_size}")
device = "GPU" if args.cuda else "CPU"
log(f"Number of {device}s: {hvd.size()}")

# Warm-up
log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

# Benchmark
log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} "
    f"+-{hvd.size() * img_sec_conf:.1f}")
