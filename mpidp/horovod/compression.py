"""Horovod's ``Compression``: what dtype a floating-point tensor takes on the wire.

A compressor's ``compress(tensor)`` returns ``(tensor to send, context)`` and
``decompress(tensor, context)`` undoes it, as in Horovod, so a script's own
``Compressor`` subclass works too. ``fp16`` and ``bf16`` halve the bytes of
float32 tensors; the sum is then computed in that dtype by mpidp's reduction
(MPI's where the library has it, else mpidp's own op; see
``mpidp.comm.dtypes``), rounding each partial sum, as Horovod does. Integer
tensors pass unchanged. (mpidp's DDP hooks ``fp16_compress_hook`` and
``bf16_compress_hook`` accumulate in float32 instead.)
"""

from __future__ import annotations

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class Compressor:
    """Base of the compressors: ``compress`` and ``decompress``, both static."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        """Return ``(tensor to send, context for decompress)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        """Return the received ``tensor`` as the caller's dtype."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor(Compressor):
    wire: torch.dtype

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire:
            return tensor.to(cls.wire), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Send floating-point tensors as float16."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Send floating-point tensors as bfloat16."""

    wire = torch.bfloat16


class Compression:
    """The compressors by name: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
