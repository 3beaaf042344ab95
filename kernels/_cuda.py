"""The CUDA side of mpidp.kernels: compile pack.cu with CuPy on first use, launch once per call.

Private: ``mpidp.kernels.pack``/``unpack`` check their inputs and call here for
CUDA tensors. Kernels run on torch's current stream of the tensors' device.
"""

from __future__ import annotations

import functools
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


def _pointer(tensor: torch.Tensor):
    import cupy
    return cupy.asarray(tensor.view(torch.uint8) if tensor.dtype == torch.bool
                        else tensor.view(_RAW[tensor.element_size()]))


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _launch(kind: str, tensors, flat: torch.Tensor, scale, to_flat: bool) -> None:
    import cupy
    sizes = tuple(t.numel() for t in tensors)
    offsets, tensor_of, start, count, chunks = _chunk_table(sizes, flat.device)
    if chunks == 0:
        return
    # Pinned and non_blocking: the copy queues on the stream instead of stalling the host.
    addresses = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64).pin_memory()
    addresses = addresses.to(flat.device, non_blocking=True)
    src, dst = (tensors[0].dtype, flat.dtype) if to_flat else (flat.dtype, tensors[0].dtype)
    kernel = _module().get_function(kernel_name(kind, src, dst))
    scaled = scale is not None
    scalars = (cupy.float64(scale if scaled else 1.0), cupy.int32(int(scaled)))
    tables = tuple(_pointer(t) for t in (addresses, offsets, tensor_of, start, count))
    args = ((*tables, _pointer(flat), *scalars) if to_flat
            else (_pointer(flat), *tables, *scalars))
    with cupy.cuda.Device(flat.device.index):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(flat.device).cuda_stream)
        kernel((chunks,), (THREADS,), args, stream=stream)


def pack(tensors, out: torch.Tensor, scale) -> None:
    _launch("pack", tensors, out, scale, to_flat=True)


def unpack(flat: torch.Tensor, tensors, scale) -> None:
    _launch("unpack", tensors, flat, scale, to_flat=False)
