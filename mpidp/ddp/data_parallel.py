"""DistributedDataParallel: torch's DDP interface, with MPI underneath.

The wrapper itself: construction, the forward and its buffer broadcast,
``no_sync``, the hand-over to a stage-2 ``ZeroRedundancyOptimizer``,
conversions, ``close()`` and pickling. It holds its parts, each owning its
state: ``reducer`` (``mpidp.ddp.reducer``, the gradient reduction), ``_joiner``
(``mpidp.ddp.join``, ``join()``) and ``_comm_hooks`` (``mpidp.ddp.comm_hook``,
``register_comm_hook`` and ``record_stats``). Beside it are ``mpidp.ddp.options``
(the argument checks and what the options mean for the reducer) and
``mpidp.ddp.replica`` (the cross-rank model check and the coalesced broadcast).
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from mpi4py import MPI
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from .. import _args
from ..comm import agreement as _agreement
from .. import communicators as _communicators
from .. import comm as _comm
from . import options as _ddp_options
from . import overlap as _overlap
from .. import watchdog as _watchdog
from .. import runtime, topology
from ..comm import chunking as _chunking
from .comm_hook import CommHooks
from .options import base_comm as _base_comm  # mpidp.zero imports it from here
from .join import Joiner
from . import stragglers as _stragglers
from .reducer import Reducer
from .reproducible import ReproducibleReducer
from .replica import broadcast_coalesced, check_replicas, first_mismatch  # noqa: F401 (re-exported)
from .sharded import ShardedReducer

__all__ = ["DistributedDataParallel", "DDP", "broadcast_coalesced", "owner"]

# parameter -> weak reference to the DDP that reduces it (ZeroRedundancyOptimizer(stage=2))
_OWNERS = WeakIdKeyDictionary()


def owner(param: torch.Tensor) -> "DistributedDataParallel | None":
    """The open ``DistributedDataParallel`` that reduces ``param``'s gradient, if any."""
    ref = _OWNERS.get(param)
    ddp = ref() if ref is not None else None
    return None if ddp is None or ddp._closed or ddp.reducer is None else ddp


class DistributedDataParallel(nn.Module):
    """Data parallelism over MPI: wrap a model, train on each rank's shard of the data.

    The interface is torch's ``DistributedDataParallel`` (torch 2.13's arguments,
    in its order): construct once per rank after building the model, call it
    like the model, and after ``loss.backward()`` every ``param.grad`` holds the
    average over all ranks, so any optimizer works unchanged. Construction,
    ``close()`` and conversions through the wrapper (``ddp.to(...)``,
    ``ddp.double()``) are collective: every rank must convert the wrapped model
    alike, or the rank that converts alone waits in the conversion's check
    (the stall watchdog names it "module conversion").

    Torch's arguments:
        module: the model; identical on every rank (names, shapes, dtypes are checked).
        device_ids: None, or ``[d]`` with ``d`` the GPU the module is on (then
            inputs are moved to it, as torch does); must be None for CPU modules.
        output_device: None or the module's GPU (outputs stay where the module puts them).
        dim: accepted for compatibility; a single-device module never scatters.
        broadcast_buffers: torch's older switch: False stops the buffer
            broadcast both at construction and before each synced forward.
        init_sync: broadcast rank 0's parameters (and buffers) at construction.
        process_group: an mpi4py communicator (the same as ``comm``).
        bucket_cap_mb: gradient bucket capacity in MiB (> 0; None: 25).
        find_unused_parameters: after each forward, find the parameters that
            the output does not depend on and treat their gradients as ready.
        check_reduction: deprecated in torch and ignored, as there.
        gradient_as_bucket_view: make ``.grad`` a view into the bucket (saves
            one copy of the gradients in memory and time).
        static_graph: the graph is the same at every step: learn in the first
            step how many times each gradient is accumulated (a module reused
            under reentrant activation checkpointing) and which parameters are
            unused, then rely on it (no graph search).
        skip_all_reduce_unused_params, batched_grad_copy: accepted; mpidp's
            results are the same either way (globally unused ``.grad`` is left
            alone; each bucket is filled in one call or a copy per gradient,
            whichever ``mpidp.ddp.packing`` finds cheaper for it).
        forward_sync_buffers: broadcast rank 0's buffers before each forward
            that will synchronise (grad enabled, outside ``no_sync``); None: True.
        delay_all_reduce_named_params, param_to_hook_all_reduce,
        mixed_precision, device_mesh, bucket_cap_mb_list: not supported; a
            value other than None raises a ValueError saying what to use instead.

    mpidp's own (keyword-only):
        comm: the mpi4py communicator to train over (default ``MPI.COMM_WORLD``).
        pool_size: how many duplicated communicators carry bucket allreduces
            round-robin (>= 1).
        first_bucket_mb: capacity of the first bucket in MiB (default 1, capped
            at ``bucket_cap_mb``).
        predict_gradient_order: after the first synced backward, rebuild the
            buckets in the order gradients actually arrived on rank 0 (as
            torch DDP does); results are identical either way.
        overlap: how bucket allreduces run beside the backward pass:
            "inline" (blocking, from the hook as soon as a bucket is ready),
            "thread" (a communication thread; needs MPI_THREAD_MULTIPLE) or
            "nonblocking" (nonblocking collectives polled from the hooks);
            "auto" picks "inline" for CPU models and "thread" for GPU models
            where the MPI thread level allows it; see ``mpidp.ddp.overlap``.
        chunk_mb: largest single allreduce in MiB; bigger buckets are reduced
            in chunks of this size. None (default): ``MPIDP_CHUNK_MB`` (4), as
            every chunked reduction of mpidp (``mpidp.comm.chunking``).
        inplace_threshold_mb: gradients of at least this many MiB skip the
            buckets and are reduced in place by MPI (fusing them saves no
            latency and copying them costs memory bandwidth); None puts every
            gradient in a bucket, as torch does. "auto" (default): 1 MiB, but
            None with shared memory (below) and ``gradient_as_bucket_view``:
            there a bucket costs one copy in and no copy back, and the shared
            reduction is twice as fast as MPI's.
        shared_memory: reduce the CPU buckets in memory the ranks of each
            node share (``mpidp.comm.shm``): the buckets live there, and each rank
            sums its slice of every rank's bucket in place, with no MPI message. None (default): when every
            node holds the same number (> 1) of ranks (``MPIDP_SHARED_MEMORY=0/1``
            changes this default to False/True); True: require it; False:
            always MPI.
        timeout: seconds a collective of a training step (bucket allreduce,
            bookkeeping allreduce, buffer broadcast) may wait before the stall
            watchdog reports the ranks' states and, by default, aborts the job
            (``mpidp.watchdog``); 0 never reports them; None (default): the
            process-wide timeout, ``MPIDP_TIMEOUT`` (600 s) or
            ``mpidp.watchdog.set_timeout()``. Other collectives keep that one.
        reproducible: the same gradients, bit for bit, at any number of ranks
            (``mpidp.ddp.reproducible``): each rank runs its whole micro-batches
            of the global batch (``mpidp.DistributedSampler(micro_batches=,
            micro_batch_size=)``), the first ones under ``no_sync()``; each
            micro-batch's gradient is kept apart, and the synced backward adds
            all of them in micro-batch order and divides by their number. Not
            with ``gradient_as_bucket_view``, ``static_graph``, sparse
            gradients, a comm hook or ``join()`` (docs/reproducible.md).
        micro_batches: with ``reproducible=True``, the number ``M`` of
            micro-batches of every step (the sampler's ``micro_batches``): each
            synced step's counts must be ``micro_batch_counts(M, ranks)``, or every
            rank raises a ValueError. None (default): the first synced step's
            total fixes ``M`` for the DDP's life (a heal keeps it), so a later
            step with another total is refused, but that first step is checked
            only for the shape of the dealing.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: MPI.Intracomm | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None,
                 skip_all_reduce_unused_params: bool = False, bucket_cap_mb_list=None,
                 batched_grad_copy: bool = False, forward_sync_buffers: bool | None = None, *,
                 comm: MPI.Intracomm | None = None, pool_size: int = 2,
                 first_bucket_mb: float | None = None, predict_gradient_order: bool = True,
                 overlap: str = "auto", chunk_mb: float | None = None,
                 inplace_threshold_mb: float | str | None = "auto", timeout: float | None = None,
                 shared_memory: bool | None = None, reproducible: bool = False,
                 micro_batches: int | None = None):
        super().__init__()
        # its forward's bookkeeping calls MPI and keeps Python state: never traced
        runtime.keep_out_of_torch_compile(DistributedDataParallel,
                                          ("_pre_forward", "_post_forward"))
        base = _base_comm(comm, process_group)
        error = None
        try:  # every rank judges its arguments; all raise alike before anything collective
            if not isinstance(module, nn.Module):
                raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
            _watchdog.check_timeout("timeout", timeout)
            _ddp_options.check_supported(
                delay_all_reduce_named_params=delay_all_reduce_named_params,
                param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
                device_mesh=device_mesh, bucket_cap_mb_list=bucket_cap_mb_list)
            if bucket_cap_mb is None:
                bucket_cap_mb = _chunking.BUCKET_CAP_MB
            _ddp_options.check_sizes(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                                     chunk_mb=chunk_mb, inplace_threshold_mb=inplace_threshold_mb)
            _ddp_options.check_flags(
                find_unused_parameters=find_unused_parameters,
                gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
                init_sync=init_sync, check_reduction=check_reduction,
                skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                batched_grad_copy=batched_grad_copy, predict_gradient_order=predict_gradient_order,
                reproducible=reproducible)
            _ddp_options.check_flags(optional=True, broadcast_buffers=broadcast_buffers,
                                     shared_memory=shared_memory,
                                     forward_sync_buffers=forward_sync_buffers)
            _ddp_options.check_micro_batches(micro_batches, reproducible=reproducible,
                                             world=base.Get_size())
            _args.check_int("dim", dim)
            _args.check_int("pool_size", pool_size, minimum=1)
            _ddp_options.check_overlap(overlap)
            _ddp_options.check_module(module)
            self._ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
            named = self._named_params(module)
            if not named:
                raise ValueError("module has no parameter that requires grad; "
                                 "DistributedDataParallel has nothing to synchronise")
            if reproducible:
                _ddp_options.check_reproducible(
                    gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
                    sparse=[n for n, _ in named if n in _ddp_options.sparse_names(module)])
            device = _ddp_options.module_device(module, device_ids, output_device)
            if forward_sync_buffers is not None:
                sync_buffers, init_buffers = forward_sync_buffers, True
            else:  # torch 2.13: the deprecated switch governs both
                sync_buffers = init_buffers = broadcast_buffers is not False
            if first_bucket_mb is None:
                first_bucket_mb = min(_chunking.FIRST_BUCKET_MB, bucket_cap_mb)
            stragglers = _stragglers.from_settings()  # compared across ranks in _connect
        except (TypeError, ValueError) as caught:
            error = caught
        _agreement.agree(base, error, "DistributedDataParallel(): the ranks' arguments")

        self._options = dict(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                             find_unused_parameters=find_unused_parameters,
                             gradient_as_bucket_view=gradient_as_bucket_view,
                             static_graph=static_graph, pool_size=pool_size,
                             predict_gradient_order=predict_gradient_order, overlap=overlap,
                             chunk_mb=_chunking.CHUNK_MB if chunk_mb is None else chunk_mb,
                             inplace_threshold_mb=inplace_threshold_mb,
                             shared_memory=shared_memory, stragglers=stragglers,
                             reproducible=reproducible, micro_batches=micro_batches)
        self.module = module
        self.device_ids = [device] if device_ids else None
        self.output_device = self.device_ids and device
        self.dim = dim
        self.forward_sync_buffers = sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self._over_world = comm is None and process_group is None
        self._timeout = timeout
        self._closed = False
        self._sink = None  # the stage-2 ZeroRedundancyOptimizer fed by the reducer
        self._kept_micro_batches = None  # reproducible: M as the reducer a heal dropped had it
        self._comm_hooks = CommHooks(self)
        self._joiner = Joiner(self, self._comm_hooks)
        self.pool = self.control = self.reducer = None
        self._connect(base, device)
        if init_sync and self.pool.size > 1:
            broadcast_coalesced(list(module.parameters()) +
                                (self._buffers_to_sync() if init_buffers else []),
                                comm=self.control)

    # -- construction -----------------------------------------------------------------

    def _named_params(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in module.named_parameters()
                if p.requires_grad and n not in self._ignored]

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        return [b for n, b in self.module.named_buffers() if n not in self._ignored]

    def _settings(self, device: torch.device) -> dict:
        resolved = _overlap.resolve(self._options["overlap"], device, runtime.thread_level())
        return dict(self._options, overlap=resolved,
                    forward_sync_buffers=self.forward_sync_buffers)

    def _connect(self, base: MPI.Intracomm, device: torch.device) -> None:
        """Check the model across ranks, duplicate the communicators, build the reducer (collective)."""
        settings = self._settings(device)
        # every rank raises alike, none is left in the Dup() below
        check_replicas(base, self.module, settings, "DistributedDataParallel's model check",
                       "DistributedDataParallel: the model or its settings differ across ranks")
        topology.warn_about_binding(base, stacklevel=4)  # names the line that built this DDP
        self.pool = _comm.Pool(base, self._options["pool_size"])
        self.control = _communicators.made(base.Dup(),
                                           f"DDP {id(self):#x}: its small collectives")
        self._node = _ddp_options.shared_memory_node(self._options["shared_memory"], base, device)
        self.reducer = self._make_reducer(settings["overlap"])
        for _, param in self._named_params(self.module):
            _OWNERS[param] = weakref.ref(self)
        if self._over_world:  # a healed world has the survivors: this DDP can follow it
            for comm in self._communicators():
                _communicators.set_rebuild(comm, self._rebuild)

    def _communicators(self) -> list[MPI.Intracomm]:
        node = getattr(self, "_node", None)
        return [*self.pool.comms, self.control, *((node.node, node.cross) if node else ())]

    def _rebuild(self, world: MPI.Intracomm) -> None:
        """The same DDP over ``world``, the survivors of a lost rank (collective; ``mpidp.healing``).

        Its revoked communicators are released and the reducer dropped without
        settling (its collectives cannot finish); the model check, the pool, the
        control communicator, the shared-memory node and a new reducer are made
        over ``world``. The parameters are left as they are: the healing
        broadcasts the state afterwards.
        """
        reducer, self.reducer = self.reducer, None
        if reducer is not None:
            self._kept_micro_batches = getattr(reducer, "micro_batches", None)
            reducer.close()
        for comm in self._communicators():
            _communicators.release(comm)
        self.pool = self.control = self._node = None
        self._connect(world, next(self.module.parameters()).device)

    def _make_reducer(self, overlap: str, sink=None) -> Reducer:
        named = self._named_params(self.module)
        sparse = _ddp_options.sparse_names(self.module)
        device = named[0][1].device
        shared = getattr(self, "_node", None) if sink is None and device.type == "cpu" else None
        kind = Reducer if sink is None else functools.partial(ShardedReducer, sink=sink)
        if self._options["reproducible"]:  # M: given, else the one the reducer before fixed
            known = (self._options["micro_batches"] or getattr(self.reducer, "micro_batches", None)
                     or self._kept_micro_batches)
            kind = functools.partial(ReproducibleReducer, sink=sink, micro_batches=known,
                                     given=self._options["micro_batches"] is not None,
                                     training=lambda: self.module.training)
        reducer = kind(named, self.pool, self.control,
                       **_ddp_options.reducer_options(self._options, overlap, shared),
                       sparse=[i for i, (name, _) in enumerate(named) if name in sparse],
                       timeout=self._timeout, **({"shared": shared} if sink is None else {}))
        self._comm_hooks.equip(reducer)
        return reducer

    # -- ZeRO stage 2 -----------------------------------------------------------------

    def _stage2_problem(self) -> str | None:
        """Why this DDP cannot reduce-scatter into a ZeroRedundancyOptimizer, or None (local)."""
        if self._sink is not None:
            return "the DistributedDataParallel already feeds a stage-2 ZeroRedundancyOptimizer"
        if self._comm_hooks.hook is not None:
            return "the DistributedDataParallel reduces its buckets with a comm hook"
        if self._options["gradient_as_bucket_view"]:
            return ("stage=2 keeps only each rank's shard of the gradients, which "
                    "gradient_as_bucket_view=True cannot give; build the "
                    "DistributedDataParallel without it")
        sparse = [name for name, _ in self._named_params(self.module)
                  if name in _ddp_options.sparse_names(self.module)]
        if sparse:
            return (f"stage=2 shards dense gradients only, but {sparse} have sparse gradients; "
                    f"use stage=1 or sparse=False")
        return None

    def _shard_gradients(self, sink) -> ShardedReducer:
        """Reduce-scatter the gradients into ``sink``'s shards from now on (stage 2; collective-free)."""
        self.reducer.settle()
        self.reducer.close()
        self._sink = sink
        device = next(p for _, p in self._named_params(self.module)).device
        self.reducer = self._make_reducer(self._settings(device)["overlap"], sink=sink)
        return self.reducer

    def _apply(self, fn, recurse=True):
        # .to(), .double(), .half(), .cuda() ... on the wrapper: rebuild the
        # buckets for the parameters' new dtype or device, on every rank alike.
        # Collective, so every rank must convert: a conversion that stayed local
        # would let the next step reduce float64 buckets against float32 ones
        # without an error, and checking that at every forward would cost a
        # collective per step. A rank that converts alone waits in the
        # allgather below, which the stall watchdog reports.
        if getattr(self, "_sink", None) is not None:
            raise RuntimeError(
                "DistributedDataParallel: the module cannot be converted (.to(), .double()...) "
                "once a stage-2 ZeroRedundancyOptimizer shards its gradients: the optimizer's "
                "flat buffers hold the parameters. Convert the module before building the "
                "optimizer")
        result = super()._apply(fn, recurse)
        if getattr(self, "reducer", None) is not None:
            self.reducer.settle()
            device = next(p for _, p in self._named_params(self.module)).device
            settings = self._settings(device)
            check_replicas(
                self.control, self.module, settings,
                "module conversion (.to(), .double()...: every rank must convert the DDP wrapper), "
                "its model check",
                "DistributedDataParallel: after converting the module, it differs across ranks")
            self.reducer.close()
            self.reducer = self._make_reducer(settings["overlap"])
        return result

    # -- forward ----------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        inputs, kwargs = self._pre_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs)
        return self._post_forward(output)

    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._closed:
            raise RuntimeError("DistributedDataParallel was closed; call the module itself "
                               "(ddp.module) or wrap it again")
        if torch.is_grad_enabled():
            # Only a forward that may be followed by a synced backward runs on
            # every rank; evaluation under no_grad may run on one rank alone.
            if self.reducer is None:
                self._connect(runtime.world(), next(self.module.parameters()).device)
            self.reducer.settle()
            self.reducer.raise_pending_error()
            self.reducer.check_parameters()
            root = 0
            if self._joiner.config is not None:
                root = self._joiner.notify()  # may raise on every rank: count nothing before
            if self.require_backward_grad_sync and self.training:
                self.reducer.count_forward()
            if (self.require_backward_grad_sync and self.forward_sync_buffers
                    and self.pool.size > 1):
                buffers = self._buffers_to_sync()
                if buffers:
                    with _watchdog.Scope("DDP buffer broadcast in the forward of step {}",
                                         self.reducer._steps, timeout=self._timeout,
                                         source="DistributedDataParallel(timeout=)"):
                        broadcast_coalesced(buffers, root, comm=self.control)
        if self.device_ids:
            device = self.device_ids[0]
            move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
            inputs, kwargs = tree_map_only(torch.Tensor, move, (inputs, kwargs))
        return inputs, kwargs

    def _post_forward(self, output):
        if torch.is_grad_enabled():
            self.reducer.prepare(output, self.require_backward_grad_sync)
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, inside this context.

        The first backward after leaving it reduces the accumulated sum.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # -- uneven inputs, comm hooks, statistics: the parts' --------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Train on uneven inputs: ranks that ran out of data shadow the others until all have.

        torch's ``DistributedDataParallel.join``. Inside the context, every
        grad-enabled forward tells the other ranks that this rank is still
        active (one small allreduce). A rank that leaves the context (its data
        ran out) then stands in for every synced step the others still take:
        it broadcasts the buffers with them and reduces zeros in every bucket.
        When every rank has left, the model of the last rank to leave (the
        highest such rank) is broadcast to all, as torch does.

        Args:
            divide_by_initial_world_size: divide gradients by the world size
                (joined ranks count as zeros), or by the number of ranks still
                active in that step (False).
            enable: False makes the context do nothing.
            throw_on_early_termination: raise on every rank, at the first step
                after any rank ran out of data, instead of shadowing.
        """
        return self._joiner.context(divide_by_initial_world_size, enable,
                                    throw_on_early_termination)

    def register_comm_hook(self, state: object, hook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` instead of the allreduce (collective).

        torch's contract: ``hook`` returns a ``torch.futures.Future`` whose
        value is the bucket's averaged flat tensor; it is called once per
        bucket, in bucket order, with ``bucket`` a ``mpidp.hooks.GradBucket``
        holding the local sum of the gradients (not yet divided: the hook
        averages). Register once, on every rank, before the first synced
        backward. mpidp's hooks are in ``mpidp.hooks``; torch's
        (``torch.distributed.algorithms.ddp_comm_hooks``) work with a process
        group of the "mpidp" backend as ``state``. Sparse gradients keep being
        gathered without the hook.
        """
        self._comm_hooks.register(state, hook)

    @property
    def record_stats(self) -> bool:
        """Whether ``stats()`` records and each bucket gets a profiler range (default True)."""
        return self._comm_hooks.record

    @record_stats.setter
    def record_stats(self, value: bool) -> None:
        self._comm_hooks.set_record(value)

    def stats(self) -> list[dict]:
        """What the last synced steps (up to 100) communicated, oldest first.

        Each step: ``step`` (its number), ``bytes`` (of the buckets reduced),
        ``collectives`` (bucket collectives, counting chunks, or hook calls,
        plus the bookkeeping allreduce), ``reduction_s`` (from the first bucket
        handed to communication to the last reduction done), ``wait_s``
        (how long the end of the backward pass waited for communication) and
        ``lateness_ms`` (per rank, how many ms after the earliest rank it
        reached the end of this step's backward, the same list on every rank;
        None until the next synced step carries it, and where any rank joined
        or failed, or ``MPIDP_STRAGGLER_MS=0``; ``mpidp.ddp.stragglers``).
        Recorded unless ``record_stats`` is False: a few clock reads and a
        profiler range per bucket (bench/hooks_bench.py measures the cost).
        """
        return [] if self.reducer is None else [dict(entry) for entry in self.reducer.stats]

    def stragglers(self) -> dict[int, float]:
        """The ranks named as stragglers now: rank -> its median lateness in ms.

        A rank is named when its ``lateness_ms`` exceeded ``MPIDP_STRAGGLER_MS``
        at more than half of the last ``MPIDP_STRAGGLER_STEPS`` measured steps,
        and stays named until it is late at half of them or fewer; rank 0 logs a
        warning (logger ``mpidp.stragglers``) once per such episode. The same on
        every rank; local (no communication).
        """
        tracker = None if self.reducer is None else self.reducer.stragglers
        return {} if tracker is None else dict(tracker.named)

    # -- release and serialisation -----------------------------------------------------

    def close(self) -> None:
        """Release the communicators, autograd hooks and thread of this wrapper (collective).

        Call it on every rank at the same point, like the constructor (or use
        the wrapper as a context manager). The module keeps its parameters and
        gradients; calling the wrapper afterwards raises. A second call does
        nothing.
        """
        if self._closed:
            return
        self._closed = True
        reducer, self.reducer = self.reducer, None
        try:
            if reducer is not None:
                try:
                    reducer.settle()
                finally:
                    reducer.close()
        finally:
            if self.pool is not None:
                self.pool.free()
                _communicators.free(self.control)
                self.pool = self.control = None
            node, self._node = getattr(self, "_node", None), None
            if node is not None:
                node.free()  # the buckets' shared memory stays while tensors use it

    def __enter__(self) -> "DistributedDataParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:
        if not self._over_world:
            raise TypeError("a DistributedDataParallel over a communicator other than "
                            "MPI.COMM_WORLD cannot be pickled (as torch's, which needs the "
                            "default process group); pickle ddp.module instead")
        state = super().__getstate__()
        # fresh parts: the copy has no hook and is in no join() (pickle maps self to the copy)
        hooks = CommHooks(self, record=self._comm_hooks.record)
        state.update(pool=None, control=None, reducer=None, _sink=None, _node=None,
                     _comm_hooks=hooks, _joiner=Joiner(self, hooks))
        return state

    def __setstate__(self, state: dict) -> None:
        # The copy has no communicators yet: its first grad-enabled forward
        # builds them (collective); evaluation under no_grad needs none.
        super().__setstate__(state)


DDP = DistributedDataParallel
