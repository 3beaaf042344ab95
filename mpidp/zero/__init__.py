"""ZeRO over MPI: sharded optimizer states (stage 1) and gradients (stage 2).

``ZeroRedundancyOptimizer`` has torch's interface: give it the parameters, a
``torch.optim`` class and that class's arguments, and use it as that
optimizer. Each rank keeps the optimizer state of about ``1/N`` of the
parameters' elements, steps that part, and the ranks then allgather the
updated parameters (stage 1, ZeRO's P_os). With ``stage=2`` (DeepSpeed's
name) the ``mpidp.DistributedDataParallel`` that reduces these parameters
reduce-scatters each gradient bucket instead of allreducing it, so each rank
also keeps only its part of the gradients (ZeRO's P_os+g); see
``mpidp.ddp.sharded.ShardedReducer``.

How the elements are divided (``mpidp.ddp.buckets.Shards``): the parameters are
laid end to end in flat buffers ("buckets", by dtype; in stage 2 the DDP's own
gradient buckets), each padded to a multiple of the world size and cut into
chunks; rank ``r`` owns the ``r``-th block of every chunk. So a rank's share is
the same within a few elements for any model, even one of a single huge
tensor, and a tensor may be split between ranks. The parameters become views
into those flat buffers (torch's ``parameters_as_bucket_view``), so the
allgather writes the updated values where the model reads them, with no copy.

Splitting a tensor is exact only for an optimizer whose update of an element
depends on that element alone (SGD, Adam, AdamW, Adagrad, RMSprop, ...): each
class is tried on a small tensor, whole and in two pieces, when the optimizer
is built, and a class whose results differ (LBFGS, Adafactor, ...) is refused.

The package: ``optimizer.py`` (``ZeroRedundancyOptimizer``: construction,
stepping, clipping, param groups), ``bucket.py`` (the flat buffers),
``elementwise.py`` (the elementwise probe), and the two parts the optimizer
holds: ``checkpoint.py`` (whole and sharded checkpoints) and ``partner.py``
(the partner copy and a heal's steps).
"""

from .optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
