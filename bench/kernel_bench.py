"""Pack/unpack kernel benchmark (needs a CUDA GPU and CuPy).

    python bench/kernel_bench.py [--out results.jsonl]

Two buckets: ~25 MB made of ~160 tensors shaped like ResNet-50's parameters,
and 200 tiny tensors. For each, pack (tensors -> flat) and unpack (flat ->
tensors) by: mpidp.kernels (one launch), per-tensor ``copy_``,
``torch._utils._flatten_dense_tensors`` (pack only) and ``torch._foreach_copy_``.
The device-to-device copy bandwidth of one flat buffer of the same size,
measured in the same run, is the ceiling. Targets: >= 80% of that bandwidth on
the 25 MB bucket; >= 3x faster than per-tensor copies on the 200 tiny tensors.
"""

import argparse
import json
import statistics

import torch
from torch._utils import _flatten_dense_tensors

from mpidp.kernels import pack, unpack


def resnet50_like():
    """~160 float32 tensors, ~25 MB: conv weights, BatchNorm pairs, a head."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for _ in range(blocks):
            shapes += [(width, width, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (width * 4, width, 1, 1), (width * 4,), (width * 4,)]
    shapes += [(1000, 512), (1000,)]
    tensors = [torch.randn(s, device="cuda") for s in shapes]
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


def run(name, tensors):
    total = sum(t.numel() for t in tensors)
    nbytes = total * 4
    flat = torch.empty(total, device="cuda")
    views = list(flat.split([t.numel() for t in tensors]))
    views = [v.view_as(t) for v, t in zip(views, tensors)]
    copy_src = torch.empty_like(flat)
    results = {
        "d2d copy (ceiling)": timed(lambda: flat.copy_(copy_src)),
        "pack mpidp.kernels": timed(lambda: pack(tensors, flat)),
        "pack per-tensor copy_": timed(lambda: [v.copy_(t) for v, t in zip(views, tensors)]),
        "pack _flatten_dense_tensors": timed(lambda: _flatten_dense_tensors(tensors)),
        "pack _foreach_copy_": timed(lambda: torch._foreach_copy_(views, tensors)),
        "unpack mpidp.kernels": timed(lambda: unpack(flat, tensors)),
        "unpack per-tensor copy_": timed(lambda: [t.copy_(v) for v, t in zip(views, tensors)]),
        "unpack _foreach_copy_": timed(lambda: torch._foreach_copy_(tensors, views)),
    }
    ceiling = results["d2d copy (ceiling)"]
    rows = []
    for method, us in results.items():
        rows.append(dict(kind="kernel", bucket=name, tensors=len(tensors), bytes=nbytes, method=method,
                         us=us, gbps=2 * nbytes / us / 1e3, of_copy_bandwidth=ceiling / us))
        print(f"{name:10s} {len(tensors):4d} tensors {nbytes / 2**20:7.2f} MiB  {method:30s} "
              f"{us:9.1f} us  {2 * nbytes / us / 1e3:8.1f} GB/s  {ceiling / us:6.2f} of copy", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench needs a CUDA GPU")
    torch.manual_seed(0)
    rows = run("resnet50", resnet50_like()) + run("tiny", [torch.randn(7, device="cuda") for _ in range(200)])
    if args.out:
        with open(args.out, "a") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
