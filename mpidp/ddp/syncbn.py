"""SyncBatchNorm: batch normalisation over the global batch of every rank, through MPI.

torch's ``nn.SyncBatchNorm`` needs torch.distributed and a GPU; under mpidp,
``nn.SyncBatchNorm.convert_sync_batchnorm`` leaves layers that silently
normalise with each rank's local statistics. ``mpidp.SyncBatchNorm`` computes
the statistics of the batch concatenated over the ranks of a communicator, on
CPU or CUDA tensors, with one allreduce in the forward and one in the backward.

**Forward** in training mode: each rank sums its input per channel and its
squares in float64, with its sample count, and one allreduce of
``[sums (C), sums of squares (C), count, invalid-input flag]`` gives every rank
the global mean and biased variance (normalisation) and the unbiased variance
(running statistics, ``count / (count - 1)`` as ``nn.BatchNorm`` on the whole
batch). Squares of float32 values are exact in float64, so the only error is
float64 summation and the cancellation in ``sum(x**2) - sum(x)**2 / count``,
which grows with ``mean**2 / var``: over 10**6 values per channel, the variance
was off by 7e-15 relative for a mean of 0, 4e-9 for a mean 1,000 standard
deviations from zero, 1e-6 at 10,000. The elementwise work runs in float32 (float64 for float64 inputs),
and the output is cast back to the input's dtype, so float16 and bfloat16
inputs get float32 statistics.

**Backward**: the two per-channel sums the input gradient needs, of
``grad_output`` and of ``grad_output * x_hat``, go in one allreduce; the input
gradient is that of ``nn.BatchNorm`` on the concatenated batch. The weight and
bias gradients are this rank's own sums, as in torch's SyncBatchNorm: DDP then
averages them over ranks (see the ``SyncBatchNorm`` docstring for what that
means for the loss).

**Evaluation** with running statistics is local: ``F.batch_norm`` with the
running statistics, exactly ``nn.BatchNorm``, with no communication, so one
rank may evaluate alone. A layer with ``track_running_stats=False`` in eval mode
normalises with its local batch statistics, as torch's SyncBatchNorm does (it
synchronises only while ``training``).
"""

from __future__ import annotations

import torch
from mpi4py import MPI
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm import agreement as _agreement
from .. import _args
from .. import comm as _comm
from .. import communicators as _communicators
from .. import runtime

__all__ = ["SyncBatchNorm"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Communicator:
    """The duplicated communicator that one or more SyncBatchNorm layers talk over.

    ``copy.deepcopy`` of a model shares it (a copy in this process may use the
    same channel: its collectives still come in model order). Pickling keeps
    only the fact that it was over the world: the unpickled layers duplicate the
    world (``mpidp.runtime.world()``) again at their first collective, which every
    rank reaches together. Any other communicator cannot be pickled.
    """

    def __init__(self, base: MPI.Intracomm | None, world: bool):
        self.world = world  # over the job's world: rebuilt by a heal (mpidp.healing)
        self._comm = None if base is None else self._made(base)

    def _made(self, base: MPI.Intracomm) -> MPI.Intracomm:
        return _communicators.made(base.Dup(), "SyncBatchNorm's channel",
                                   rebuild=self.rebuild if self.world else None)

    @property
    def comm(self) -> MPI.Intracomm:
        if self._comm is None:
            runtime.require_mpi()
            self._comm = self._made(runtime.world())
        return self._comm

    def rebuild(self, world: MPI.Intracomm) -> None:
        """The channel again over ``world``, the survivors of a lost rank (collective)."""
        if self._comm is not None:
            _communicators.release(self._comm)
        self._comm = self._made(world)

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return _comm.allreduce(tensor, "sum", comm=self.comm)

    def __deepcopy__(self, memo) -> "_Communicator":
        return self

    def __reduce__(self):
        if not self.world:
            raise TypeError("a SyncBatchNorm over a communicator other than MPI.COMM_WORLD "
                            "cannot be pickled: the communicator cannot be rebuilt elsewhere")
        return (_Communicator, (None, True))


# While DistributedDataParallel.join() is active, the order in which this
# process's layers made their collectives in the last step, so that a rank that
# has joined can stand in for them in the same order (see ``record``).
_trace: list | None = None


def record(trace: list | None) -> list | None:
    """Start recording the layers' collectives into ``trace`` (None: stop); return the old list."""
    global _trace
    previous, _trace = _trace, trace
    return previous


def _duplicate(comm) -> _Communicator:
    """Check ``comm`` and duplicate it (collective), or share an existing ``_Communicator``."""
    if isinstance(comm, _Communicator):
        return comm
    if comm is not None and not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be None or an mpi4py Intracomm, got {type(comm).__name__}")
    runtime.require_mpi()
    world = runtime.world()
    base = world if comm is None else comm
    return _Communicator(base, world=base in (world, MPI.COMM_WORLD))


def _channel_shape(input: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (input.dim() - 2)


def _reduced_dims(input: torch.Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale(invstd: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    return invstd if weight is None else invstd * weight.to(invstd.dtype)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalise with global statistics; the backward reduces its two channel sums across ranks."""

    @staticmethod
    def forward(ctx, input, weight, bias, mean, invstd, count, allreduce_grads):
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.count = count
        ctx.allreduce_grads = allreduce_grads
        ctx.bias_dtype = None if bias is None else bias.dtype
        shape = _channel_shape(input)
        out = (input.to(mean.dtype) - mean.view(shape)).mul_(_scale(invstd, weight).view(shape))
        if bias is not None:
            out.add_(bias.to(mean.dtype).view(shape))
        return out.to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        shape, dims = _channel_shape(input), _reduced_dims(input)
        x_hat = (input.to(mean.dtype) - mean.view(shape)).mul_(invstd.view(shape))
        grad = grad_output.to(mean.dtype)
        sum_dy = grad.sum(dims, dtype=torch.float64)
        sum_dy_xhat = (grad * x_hat).sum(dims, dtype=torch.float64)
        grad_input = grad_weight = grad_bias = None
        if needs_input:
            total = ctx.allreduce_grads(torch.cat([sum_dy, sum_dy_xhat]))
            mean_dy, mean_dy_xhat = (total / ctx.count).to(mean.dtype).chunk(2)
            grad_input = (grad - mean_dy.view(shape)).sub_(x_hat.mul_(mean_dy_xhat.view(shape)))
            grad_input = grad_input.mul_(_scale(invstd, weight).view(shape)).to(input.dtype)
        if needs_weight:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if needs_bias:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation with statistics over the batches of all ranks of a communicator.

    A drop-in for ``torch.nn.SyncBatchNorm`` under mpidp, for inputs of 2 to 5
    dimensions ``(N, C, ...)`` on CPU or CUDA, in float16, bfloat16, float32 or
    float64. Ranks may hold different batch sizes, zero included; a rank with no
    samples still takes part in both collectives and returns an empty output.

    Every rank must run each training forward, and each backward through it,
    together: the forward makes one allreduce and the backward one (when the
    input needs a gradient). A rank with an empty batch must call backward too,
    e.g. ``out.sum().backward()`` on its empty output. An invalid input (its
    number of dimensions, channels, dtype or device) on any rank raises the
    same ``ValueError`` on every rank, naming the rank; so does a global batch
    of one value per channel.

    Gradients follow torch's SyncBatchNorm: the input gradient is that of
    ``nn.BatchNorm`` on the concatenated batch for the loss *summed over
    ranks*, and the weight and bias gradients are this rank's share, which sum
    over ranks to those of ``nn.BatchNorm`` on the concatenated batch. Under
    ``DistributedDataParallel``, where each rank's loss is its shard's mean and
    gradients are averaged over ranks, training then equals single-process
    training on the whole batch with equal shards.

    Args:
        num_features: C, the number of channels.
        eps, momentum, affine, track_running_stats, device, dtype, bias: as
            ``torch.nn.BatchNorm2d`` (``momentum=None``: cumulative average).
        comm: the mpi4py intracommunicator whose ranks share statistics
            (default: the job's world, ``MPI.COMM_WORLD`` or the survivors
            after a heal, over which a heal rebuilds it). It is duplicated once here
            (collective), so its traffic never mixes with other traffic.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None,
                 *, bias: bool = True, comm: MPI.Intracomm | None = None):
        _args.check_int("num_features", num_features, minimum=1)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        if affine and not bias:  # set here, not passed on: older torch has no bias argument
            self.register_parameter("bias", None)
        self._channel = _duplicate(comm)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module,
                               comm: MPI.Intracomm | None = None) -> nn.Module:
        """Replace every BatchNorm layer in ``module`` by an ``mpidp.SyncBatchNorm``.

        As torch's ``nn.SyncBatchNorm.convert_sync_batchnorm``: every
        ``_BatchNorm`` (``BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm``, an
        ``mpidp.SyncBatchNorm`` over another communicator) is replaced,
        recursively, by a layer that takes over its weight and bias (the same
        ``Parameter`` objects, so ``requires_grad`` and an optimizer built
        before stay valid), running statistics, ``num_batches_tracked`` and
        training flag. The layers converted by one call share one duplicate of
        ``comm`` (collective, made when the first BatchNorm is found).

        Args:
            module: the model, or a single BatchNorm layer.
            comm: as for ``SyncBatchNorm`` (default ``MPI.COMM_WORLD``).

        Returns:
            ``module`` with its BatchNorm layers replaced, or a new layer if
            ``module`` itself is a BatchNorm.
        """
        if comm is not None and not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be None or an mpi4py Intracomm, got {type(comm).__name__}")
        channel = None

        def convert(layer: nn.Module) -> nn.Module:
            nonlocal channel
            converted = layer
            if isinstance(layer, _BatchNorm):
                channel = channel or _duplicate(comm)
                converted = cls._from_batchnorm(layer, channel)
            for name, child in layer.named_children():
                converted.add_module(name, convert(child))
            return converted

        return convert(module)

    @classmethod
    def _from_batchnorm(cls, layer: _BatchNorm, channel: _Communicator) -> "SyncBatchNorm":
        converted = cls(layer.num_features, layer.eps, layer.momentum, layer.affine,
                        layer.track_running_stats, bias=layer.bias is not None, comm=channel)
        if layer.affine:
            converted.weight = layer.weight
            converted.bias = layer.bias
        converted.running_mean = layer.running_mean
        converted.running_var = layer.running_var
        converted.num_batches_tracked = layer.num_batches_tracked
        converted.training = layer.training
        if hasattr(layer, "qconfig"):
            converted.qconfig = layer.qconfig
        return converted

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` (N, C, ...); collective in training mode, local in eval mode."""
        if not self.training:
            return self._local_forward(input)
        problem = self._input_problem(input)
        mean, m2, count = self._global_stats(self._local_stats(input, problem), problem)
        if self.track_running_stats:
            self._update_running_stats(mean, m2, count)
        dtype = _compute_dtype(input.dtype)
        invstd = (m2 / count + self.eps).rsqrt_().to(dtype)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean.to(dtype), invstd,
                                            count, self._allreduce_grads)

    def _local_forward(self, input: torch.Tensor) -> torch.Tensor:
        problem = self._input_problem(input)
        if problem is not None:
            raise ValueError(f"SyncBatchNorm: {problem}")
        batch_stats = self.running_mean is None and self.running_var is None
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                            batch_stats, 0.0, self.eps)

    def _input_problem(self, input) -> str | None:
        """What is wrong with ``input`` on this rank, or None."""
        if not isinstance(input, torch.Tensor):
            return f"expected a tensor (got {type(input).__name__})"
        if not 2 <= input.dim() <= 5:
            return f"expected 2D to 5D input (got {input.dim()}D input)"
        if input.size(1) != self.num_features:
            return (f"expected {self.num_features} channels in dim 1 "
                    f"(got input of shape {tuple(input.shape)})")
        if input.dtype not in _DTYPES:
            return f"expected a float16, bfloat16, float32 or float64 input (got {input.dtype})"
        device = self._device()
        if device is not None and input.device != device:
            return f"expected input on {device}, where the layer is (got {input.device})"
        return None

    def _device(self) -> torch.device | None:
        for tensor in (self.weight, self.running_mean):
            if tensor is not None:
                return tensor.device
        return None

    def _local_stats(self, input, problem: str | None) -> torch.Tensor:
        """This rank's ``[sums (C), sums of squares (C), count, invalid]`` in float64."""
        channels = self.num_features
        device = input.device if problem is None else (self._device() or torch.device("cpu"))
        stats = torch.zeros(2 * channels + 2, dtype=torch.float64, device=device)
        if problem is not None:
            stats[-1] = 1
        elif input.numel() > 0:
            x = input.detach().to(torch.float64, copy=True)  # the one full-size temporary
            dims = _reduced_dims(input)
            stats[:channels] = x.sum(dims)
            stats[channels:2 * channels] = x.square_().sum(dims)
            stats[2 * channels] = input.numel() // channels
        return stats

    def _allreduce_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """The forward's one collective; a joined rank contributes zeros."""
        if _trace is not None:
            _trace.append((self, "stats"))
        return self._channel.allreduce(stats)

    def _allreduce_grads(self, sums: torch.Tensor) -> torch.Tensor:
        """The backward's one collective, ``[sum dy, sum dy * x_hat]``; zeros from a joined rank."""
        if _trace is not None:
            _trace.append((self, "grads"))
        return self._channel.allreduce(sums)

    def _global_stats(self, stats: torch.Tensor, problem: str | None):
        """Reduce ``stats``; return (mean, sum of squared deviations, count) on every rank alike."""
        channels = self.num_features
        total = self._allreduce_stats(stats)
        count, invalid = total[2 * channels:].tolist()
        if invalid:
            self._raise_input_problems(problem)
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"size {int(count)} (values per channel over all "
                             f"{self._channel.comm.Get_size()} ranks)")
        sums, squares = total[:channels], total[channels:2 * channels]
        mean = sums / count
        return mean, (squares - sums * mean).clamp_(min=0), count

    def _raise_input_problems(self, problem: str | None):
        # The flag in the statistics only says that some rank's input was bad: the
        # agreement gathers the reasons (this path only), every rank raises the same.
        _agreement.raise_gathered(self._channel.comm, problem, ValueError, "SyncBatchNorm:",
                                  "SyncBatchNorm's input check (allgather)")

    def _update_running_stats(self, mean: torch.Tensor, m2: torch.Tensor, count: float) -> None:
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            factor = 1.0 / self.num_batches_tracked.item()
        else:
            factor = self.momentum
        for buffer, value in ((self.running_mean, mean), (self.running_var, m2 / (count - 1))):
            updated = buffer.double().mul_(1 - factor).add_(value.to(buffer.device), alpha=factor)
            buffer.copy_(updated)

    def _shadow_forward(self) -> None:
        """Take part in one training forward with no samples (a joined rank): zeros in, same stats."""
        device = self._device() or torch.device("cpu")
        mean, m2, count = self._global_stats(
            torch.zeros(2 * self.num_features + 2, dtype=torch.float64, device=device), None)
        if self.track_running_stats:
            self._update_running_stats(mean, m2, count)

    def _shadow_backward(self) -> None:
        """Take part in one backward through this layer with no samples (a joined rank)."""
        device = self._device() or torch.device("cpu")
        self._allreduce_grads(torch.zeros(2 * self.num_features, dtype=torch.float64,
                                          device=device))

    def _shadow_forward_backward(self, backward: bool = True) -> None:
        """Take part in one training forward (and backward) with no samples, for a joined rank.

        Contributes zeros to both collectives, raises what the others raise,
        and updates the running statistics as they do, so buffers stay equal.
        ``backward`` must be True exactly when the other ranks' backward
        computes an input gradient through this layer.
        """
        self._shadow_forward()
        if backward:
            self._shadow_backward()
