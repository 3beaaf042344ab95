"""mpidp.kernels: pack/unpack against a torch reference, the nvcc compile check, GPU tests.

GPU tests skip without a GPU and fail instead when MPIDP_TEST_GPU=1.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mpidp import kernels
from mpidp.kernels import _cuda, fused, pack, unpack

KERNELS = Path(_cuda.__file__).parent
NEED_GPU = os.environ.get("MPIDP_TEST_GPU") == "1"
HAVE_GPU = torch.cuda.is_available()


def devices():
    yield "cpu"
    if HAVE_GPU or NEED_GPU:
        yield "cuda"


def gpu_or_skip(device):
    if device == "cuda" and not HAVE_GPU:
        if NEED_GPU:
            pytest.fail("MPIDP_TEST_GPU=1 but torch sees no GPU")
        pytest.skip("no GPU")


POISON = {torch.bool: True, torch.uint8: 77, torch.int32: -7, torch.int64: -7}


def poisoned(numel, dtype, device):
    return torch.full((numel,), POISON.get(dtype, float("nan")), dtype=dtype, device=device)


def random_tensors(shapes, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        if dtype == torch.bool:
            t = torch.rand(shape, generator=gen) > 0.5
        elif dtype.is_floating_point:
            t = torch.randn(shape, generator=gen) * 3
        else:
            t = torch.randint(0, 100, shape, generator=gen)
        out.append(t.to(dtype).to(device))
    return out


MIXES = {
    "odd": [(3, 5), (0,), (1,), (7, 1, 2), (), (129,), (4097,)],
    "tiny": [(1,)] * 200,
    "resnet-like": [(64, 3, 7, 7), (64,), (64,), (128, 64, 3, 3), (256, 128, 3, 3), (1000, 2048), (1000,)],
}


@pytest.mark.parametrize("device", list(devices()))
@pytest.mark.parametrize("src,dst", _cuda.PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_pack_unpack_match_torch_for_every_dtype_pair(device, src, dst, mix):
    gpu_or_skip(device)
    tensors = random_tensors(MIXES[mix], src, device)
    total = sum(t.numel() for t in tensors)
    scale = 0.5 if src.is_floating_point and dst.is_floating_point else None
    flat = poisoned(total, dst, device)
    pack(tensors, flat, scale=scale)
    reference = torch.cat([t.reshape(-1).to(torch.float64 if src.is_floating_point else src)
                           for t in tensors]) if tensors else torch.empty(0)
    if scale is not None:
        reference = reference * scale
    torch.testing.assert_close(flat.cpu(), reference.to(dst).cpu(), rtol=0, atol=0)  # every element written
    back = [poisoned(t.numel(), src, device).view(t.shape) for t in tensors]
    unpack(flat, back, scale=None if scale is None else 2.0)
    for original, restored in zip(tensors, back):
        expected = original
        if scale is not None:  # through dst's precision and back; exact where dst holds src
            expected = (original.double() * 0.5).to(dst).double().mul(2.0).to(src)
        torch.testing.assert_close(restored.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", list(devices()))
def test_one_huge_tensor_among_small_ones(device):
    gpu_or_skip(device)
    tensors = random_tensors([(3,), (1 << 22) + 5, (2,)], torch.float32, device)
    flat = poisoned(sum(t.numel() for t in tensors), torch.float32, device)
    pack(tensors, flat)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.int64, torch.bool],
                         ids=str)
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_the_kernel_copies_plain_buckets_bit_for_bit(dtype, mix, monkeypatch):
    """Plain copies: the kernel's 16-byte path (aligned tensors) and its element path (the
    odd mix's misaligned ones) give the bits torch's path gives."""
    gpu_or_skip("cuda")
    pytest.importorskip("cupy")
    monkeypatch.setattr(kernels, "PLAIN_COPIES_BY_KERNEL", True)
    tensors = random_tensors(MIXES[mix], dtype, "cuda")
    flat = poisoned(sum(t.numel() for t in tensors), dtype, "cuda")
    assert fused(tensors, flat)
    pack(tensors, flat)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))
    back = [poisoned(t.numel(), dtype, "cuda").view(t.shape) for t in tensors]
    unpack(flat, back)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


def test_cuda_path_is_chosen_only_for_one_dtype_contiguous_cuda_tensors():
    cpu = [torch.ones(3)]
    assert not fused(cpu, torch.empty(3))
    assert not fused([], torch.empty(0))


def test_scale_on_integers_is_rejected_before_any_launch():
    with pytest.raises(TypeError, match="scale needs floating-point tensors, but out is torch.int64"):
        pack([torch.ones(2, dtype=torch.int64)], torch.empty(2, dtype=torch.int64), scale=2.0)


def test_chunk_table_uses_64_bit_offsets_and_never_crosses_a_tensor():
    sizes = (5, 0, _cuda.CHUNK * 2 + 1, 3)
    offsets, tensor_of, start, count, chunks = _cuda._chunk_table(sizes, torch.device("cpu"))
    assert offsets.dtype == torch.int64 and start.dtype == torch.int64
    assert offsets.tolist() == [0, 5, 5, 5 + _cuda.CHUNK * 2 + 1, 5 + _cuda.CHUNK * 2 + 4]
    assert tensor_of.tolist() == [0, 2, 2, 2, 3]
    assert count.tolist() == [5, _cuda.CHUNK, _cuda.CHUNK, 1, 3]
    assert chunks == 5
    big = (1 << 31) + 7  # more elements than an int32 can count
    offsets, _, start, count, chunks = _cuda._chunk_table((big, 1), torch.device("cpu"))
    assert offsets[-1].item() == big + 1 and start[-1].item() == 0 and start[-2].item() == big - 7 + 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
def test_every_cu_file_compiles_with_nvcc(tmp_path):
    sources = sorted(KERNELS.glob("*.cu"))
    assert sources, "no .cu files found"
    for source in sources:
        check = tmp_path / f"check_{source.stem}.cu"
        check.write_text(f'#include "{source}"\n' + "\n".join(_cuda.instantiations()) + "\n")
        result = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "--ptx", "-o",
                                 str(tmp_path / f"{source.stem}.ptx"), str(check)],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        ptx = (tmp_path / f"{source.stem}.ptx").read_text()
        assert ptx.count(".entry") == 2 * len(_cuda.PAIRS)  # every pack and unpack instantiated


def test_nvrtc_compiles_every_instantiation_as_cupy_will():
    """The compile CuPy's RawModule runs (NVRTC, same options and name expressions); no GPU needed."""
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc
    try:
        nvrtc.getVersion()
    except Exception as err:  # CuPy without the NVRTC library
        pytest.skip(f"NVRTC unavailable: {err}")
    program = nvrtc.createProgram(_cuda.SOURCE.read_text(), "pack.cu", [], [])
    for name in _cuda.names():
        nvrtc.addNameExpression(program, name)
    try:
        nvrtc.compileProgram(program, [*_cuda.compile_options(), "-arch=compute_90"])
    except Exception:
        pytest.fail(nvrtc.getProgramLog(program))
    lowered = [nvrtc.getLoweredName(program, name) for name in _cuda.names()]
    assert len(set(lowered)) == 2 * len(_cuda.PAIRS)
