"""The CUDA side of mpidp.kernels: compile pack.cu with CuPy on first use, launch once per call.

Private: ``mpidp.kernels.pack``/``unpack`` check their inputs and call here for
CUDA tensors. Kernels run on torch's current stream of the tensors' device.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("pack.cu")
CHUNK = 4096      # elements per block: long enough to stream, short enough to balance
THREADS = 256

CUDA_TYPES = {
    torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float",
    torch.float64: "double", torch.int32: "int", torch.int64: "long long",
    torch.uint8: "unsigned char", torch.bool: "bool",
}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Every dtype copies to itself; floating dtypes also cast to one another (compressed buckets).
PAIRS = sorted({(t, t) for t in CUDA_TYPES} | {(a, b) for a in _FLOATS for b in _FLOATS},
               key=lambda pair: (str(pair[0]), str(pair[1])))


def kernel_name(kind: str, src: torch.dtype, dst: torch.dtype) -> str:
    """The template instantiation that ``kind`` ("pack"/"unpack") uses for src -> dst."""
    return f"mpidp_{kind}<{CUDA_TYPES[src]}, {CUDA_TYPES[dst]}>"


def instantiations() -> list[str]:
    """``MPIDP_INSTANTIATE(...)`` lines for every pair, for compiling pack.cu with nvcc."""
    return [f"MPIDP_INSTANTIATE({CUDA_TYPES[a]}, {CUDA_TYPES[b]})" for a, b in PAIRS]


def names() -> list[str]:
    """Every kernel the module exports, as CuPy name expressions."""
    return [kernel_name(kind, a, b) for kind in ("pack", "unpack") for a, b in PAIRS]


def compile_options() -> tuple[str, ...]:
    """NVRTC options: C++17, and the CUDA headers (cuda_fp16.h, cuda_bf16.h) CuPy knows of."""
    import cupy
    options = ["-std=c++17"]
    cuda_path = cupy.cuda.get_cuda_path()
    if cuda_path and Path(cuda_path, "include", "cuda_fp16.h").exists():
        options.append(f"-I{Path(cuda_path, 'include')}")
    return tuple(options)


@functools.cache
def _module():
    try:
        import cupy
    except ImportError as err:
        raise ImportError("packing CUDA tensors needs CuPy: pip install 'mpidp[cuda]' "
                          "(or the cupy-cudaXXx wheel for your CUDA)") from err
    return cupy.RawModule(code=SOURCE.read_text(), options=compile_options(), name_expressions=names())


@functools.lru_cache(maxsize=256)
def _chunk_table(sizes: tuple[int, ...], device: torch.device):
    """Offsets and chunk table for tensors of ``sizes`` elements, on ``device`` (cached)."""
    offsets, tensor_of, start, count = [0], [], [], []
    for index, size in enumerate(sizes):
        for first in range(0, size, CHUNK):
            tensor_of.append(index)
            start.append(first)
            count.append(min(CHUNK, size - first))
        offsets.append(offsets[-1] + size)
    as_device = functools.partial(torch.tensor, device=device)
    return (as_device(offsets, dtype=torch.int64), as_device(tensor_of, dtype=torch.int32),
            as_device(start, dtype=torch.int64), as_device(count, dtype=torch.int32), len(count))


@functools.lru_cache(maxsize=1024)
def _address_table(addresses: tuple[int, ...], device: torch.device):
    """The tensors' addresses on ``device``, and the event that marks them copied.

    Kept for the next call with the same addresses: DDP packs the same
    gradients step after step. A miss queues the copy from pinned memory on the
    current stream, without a host stall; a stream that uses the table waits
    for the event (on the GPU), so another stream's later hit is safe too.
    """
    pinned = torch.tensor(addresses, dtype=torch.int64).pin_memory()
    table = pinned.to(device, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(device))
    return table, copied


@functools.lru_cache(maxsize=256)
def _function(kind: str, src: torch.dtype, dst: torch.dtype, device_index: int):
    """The compiled kernel, loaded on the current device (``device_index``: the cache key)."""
    return _module().get_function(kernel_name(kind, src, dst))


@functools.lru_cache(maxsize=64)
def _stream(handle: int, device_index: int):
    """CuPy's view of one of torch's streams (made once: building one costs ~10 us)."""
    import cupy
    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream for Stream.from_external
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device_index)


def _address(tensor: torch.Tensor):
    import numpy
    return numpy.uint64(tensor.data_ptr())  # a pointer argument, passed by value


def _launch(kind: str, sizes: tuple[int, ...], addresses: tuple[int, ...], dtype: torch.dtype,
            flat: torch.Tensor, scale, to_flat: bool) -> None:
    import cupy
    import numpy
    offsets, tensor_of, start, count, chunks = _chunk_table(sizes, flat.device)
    if chunks == 0:
        return
    table, copied = _address_table(addresses, flat.device)
    src, dst = (dtype, flat.dtype) if to_flat else (flat.dtype, dtype)
    scaled = scale is not None
    scalars = (numpy.float64(scale if scaled else 1.0), numpy.int32(int(scaled)))
    stream = torch.cuda.current_stream(flat.device)
    stream.wait_event(copied)
    for cached in (table, offsets, tensor_of, start, count):  # kept until this stream is
        cached.record_stream(stream)                           # past the kernel
    tables = tuple(_address(t) for t in (table, offsets, tensor_of, start, count))
    args = ((*tables, _address(flat), *scalars) if to_flat
            else (_address(flat), *tables, *scalars))
    index = flat.device.index
    with cupy.cuda.Device(index):
        _function(kind, src, dst, index)((chunks,), (THREADS,), args,
                                         stream=_stream(stream.cuda_stream, index))


def pack(sizes, addresses, dtype, out: torch.Tensor, scale) -> None:
    """Tensors of ``sizes`` elements at ``addresses``, of ``dtype``, into ``out``."""
    _launch("pack", sizes, addresses, dtype, out, scale, to_flat=True)


def unpack(flat: torch.Tensor, sizes, addresses, dtype, scale) -> None:
    """``flat`` into tensors of ``sizes`` elements at ``addresses``, of ``dtype``."""
    _launch("unpack", sizes, addresses, dtype, flat, scale, to_flat=False)
