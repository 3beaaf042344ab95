"""Pack/unpack kernel benchmark (needs a CUDA GPU and CuPy; the bucket rows also run on a CPU).

    python bench/kernel_bench.py [--out results.jsonl]
    python bench/kernel_bench.py --buckets [--device cpu] [--out results.jsonl]

Two buckets: ~25 MB made of ~160 tensors shaped like ResNet-50's parameters,
and 200 tiny tensors. For each, pack (tensors -> flat) and unpack (flat ->
tensors) by: mpidp.kernels (one launch), per-tensor ``copy_``,
``torch._utils._flatten_dense_tensors`` (pack only) and ``torch._foreach_copy_``.
The device-to-device copy bandwidth of one flat buffer of the same size,
measured in the same run, is the ceiling. Each method is timed twice: a call
(host work and GPU work, events around one call: what a caller waits for), and
its GPU work alone (the kernels and copies CUPTI records, through
torch.profiler). Bandwidths and fractions of the copy use the GPU time.
``mpidp.kernels`` copies through the CuPy kernel; its "torch path" rows
(``PLAIN_COPIES_BY_KERNEL = False``) through ``_foreach_copy_`` into views. Targets: >= 80% of that bandwidth on
the 25 MB bucket; >= 3x faster than per-tensor copies on the 200 tiny tensors.

``--buckets`` times what DDP's hot path does per call to fill one bucket (a
``mpidp.ddp.buckets.Bucket`` of the same tensors, its views made once), each way
of ``mpidp.ddp.packing``, with the division by 2 ranks included: ``each`` (a
divided copy per gradient), ``foreach`` (one ``_foreach_copy_``, then the
chunk-by-chunk division the strategy does) and, on CUDA with CuPy, ``kernel``
(one launch, then the same division). The question it answers: is a kernel call
slower than a ``_foreach_copy_`` where packing would use it.
"""

import argparse
import json
import statistics

import torch
from torch._utils import _flatten_dense_tensors

import time

from mpidp import kernels
from mpidp.comm import chunking
from mpidp.ddp import packing
from mpidp.ddp.buckets import Bucket
from mpidp.kernels import pack, unpack


def resnet50_like(device="cuda"):
    """~160 float32 tensors, ~25 MB: conv weights, BatchNorm pairs, a head."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for _ in range(blocks):
            shapes += [(width, width, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (width * 4, width, 1, 1), (width * 4,), (width * 4,)]
    shapes += [(1000, 512), (1000,)]
    tensors = [torch.randn(s, device=device) for s in shapes]
    while sum(t.numel() for t in tensors) * 4 > 25 << 20:
        tensors.pop(-3)
    return tensors


def timed(call, repeats=50):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        call()
    samples = []
    for _ in range(repeats):
        start.record()
        call()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3)  # microseconds
    return statistics.median(samples)


def gpu_time(call, repeats=20):
    """GPU time alone: the kernels and copies CUPTI records for ``repeats`` calls, per call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            call()
        torch.cuda.synchronize()
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in device) / repeats if device else None


def torch_path(call):
    """``call`` with mpidp.kernels.PLAIN_COPIES_BY_KERNEL off: _foreach_copy_ into views."""
    def run():
        kernels.PLAIN_COPIES_BY_KERNEL = False
        try:
            call()
        finally:
            kernels.PLAIN_COPIES_BY_KERNEL = True
    return run


def run(name, tensors):
    total = sum(t.numel() for t in tensors)
    nbytes = total * 4
    flat = torch.empty(total, device="cuda")
    views = list(flat.split([t.numel() for t in tensors]))
    views = [v.view_as(t) for v, t in zip(views, tensors)]
    copy_src = torch.empty_like(flat)
    calls = {
        "d2d copy (ceiling)": lambda: flat.copy_(copy_src),
        "pack mpidp.kernels": lambda: pack(tensors, flat),
        "pack mpidp.kernels, torch path": torch_path(lambda: pack(tensors, flat)),
        "pack per-tensor copy_": lambda: [v.copy_(t) for v, t in zip(views, tensors)],
        "pack _flatten_dense_tensors": lambda: _flatten_dense_tensors(tensors),
        "pack _foreach_copy_": lambda: torch._foreach_copy_(views, tensors),
        "unpack mpidp.kernels": lambda: unpack(flat, tensors),
        "unpack mpidp.kernels, torch path": torch_path(lambda: unpack(flat, tensors)),
        "unpack per-tensor copy_": lambda: [t.copy_(v) for v, t in zip(views, tensors)],
        "unpack _foreach_copy_": lambda: torch._foreach_copy_(tensors, views),
    }
    results = {method: (timed(call), gpu_time(call)) for method, call in calls.items()}
    ceiling = results["d2d copy (ceiling)"][1] or results["d2d copy (ceiling)"][0]
    rows = []
    for method, (us, gpu_us) in results.items():
        best = gpu_us or us
        rows.append(dict(kind="kernel", bucket=name, tensors=len(tensors), bytes=nbytes, method=method,
                         us=us, gpu_us=gpu_us, gbps=2 * nbytes / best / 1e3, of_copy_bandwidth=ceiling / best))
        gpu = f"{gpu_us:9.1f}" if gpu_us else "        -"
        print(f"{name:10s} {len(tensors):4d} tensors {nbytes / 2**20:7.2f} MiB  {method:32s} "
              f"call {us:8.1f} us  GPU {gpu} us  {2 * nbytes / best / 1e3:8.1f} GB/s  "
              f"{ceiling / best:6.2f} of copy", flush=True)
    return rows


def timed_in_turns(calls: dict, clock, repeats=50) -> dict:
    """Median microseconds per call of each of ``calls``, the calls taking turns (a busy
    machine's drift then hits all alike)."""
    samples = {method: [] for method in calls}
    for _ in range(3):
        for call in calls.values():
            call()
    for _ in range(repeats):
        for method, call in calls.items():
            samples[method].append(clock(call))
    return {method: statistics.median(times) for method, times in samples.items()}


def one_call_cpu(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e6


def one_call_cuda(call) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3


def bucket_rows(name, tensors):
    """Per call: fill one DDP bucket of ``tensors`` (divided by 2 ranks) each way of packing."""
    device = tensors[0].device
    clock = one_call_cuda if device.type == "cuda" else one_call_cpu
    bucket = Bucket([torch.nn.Parameter(torch.empty_like(t)) for t in tensors])
    copies = list(enumerate(tensors))
    chunk = chunking.chunk_bytes()

    def divide_by_the_strategy():
        for _ in chunking.pieces(bucket.buffer, chunk, 2):
            pass

    def each():
        for view, tensor in zip(bucket.views, tensors):
            chunking.divided(tensor, 2, out=view)

    def batched(how):
        def call():
            bucket.packing = how
            packing.pack(bucket, list(copies))
            divide_by_the_strategy()
        return call

    calls = {"each: a divided copy per gradient": each,
             "foreach: _foreach_copy_ + chunked divide": batched(packing.FOREACH)}
    if kernels.fused(tensors, bucket.buffer):
        calls["kernel: CuPy launch + chunked divide"] = batched(packing.KERNEL)
    expected = torch.cat([t.reshape(-1) for t in tensors]) / 2
    for method, call in calls.items():
        call()
        if not torch.equal(bucket.buffer, expected):
            raise SystemExit(f"{method}: the bucket differs from the tensors divided by 2")
    rows, nbytes = [], sum(t.numel() for t in tensors) * tensors[0].element_size()
    for method, us in timed_in_turns(calls, clock).items():
        rows.append(dict(kind="bucket-pack", device=device.type, bucket=name, tensors=len(tensors),
                         bytes=nbytes, method=method, us=us))
        print(f"{device.type:4s} {name:10s} {len(tensors):4d} tensors {nbytes / 2**20:7.2f} MiB  "
              f"{method:42s} call {us:9.1f} us", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--buckets", action="store_true",
                        help="only the per-call rows of filling a DDP bucket (mpidp.ddp.packing); "
                             "without it they follow the pack/unpack rows (CUDA)")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kernel_bench needs a CUDA GPU (--buckets --device cpu runs without)")
    if args.device == "cpu" and not args.buckets:
        raise SystemExit("on the CPU only the bucket rows run: pass --buckets")
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)  # as bench/train_bench.py's ranks
    rows = []
    if not args.buckets:
        rows += run("resnet50", resnet50_like()) + run("tiny", [torch.randn(7, device="cuda") for _ in range(200)])
    rows += bucket_rows("resnet50", resnet50_like(args.device)) + bucket_rows(
        "tiny", [torch.randn(7, device=args.device) for _ in range(200)])
    # buckets of ~4 MiB of equal gradients, 1 KiB to 1 MiB each: where one call starts to pay
    # (mpidp.ddp.packing.SMALL_BYTES on the CPU)
    for kib in (1, 16, 32, 64, 256, 1024):
        count = max(4, min(200, 4096 // kib))
        rows += bucket_rows(f"{kib}KiBx{count}", [torch.randn(kib * 256, device=args.device)
                                                  for _ in range(count)])
    if args.out:
        with open(args.out, "a") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
