"""DistributedDataParallel: torch's DDP interface, with MPI underneath."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from numbers import Real

import torch
from mpi4py import MPI
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from . import _env
from . import comm as _comm
from . import overlap as _overlap
from . import shm as _shm
from . import watchdog as _watchdog
from . import runtime, syncbn, topology
from .kernels import pack, unpack
from .reducer import Reducer, ShardedReducer

__all__ = ["DistributedDataParallel", "DDP", "broadcast_coalesced", "owner"]

# parameter -> weak reference to the DDP that reduces it (ZeroRedundancyOptimizer(stage=2))
_OWNERS = WeakIdKeyDictionary()


def owner(param: torch.Tensor) -> "DistributedDataParallel | None":
    """The open ``DistributedDataParallel`` that reduces ``param``'s gradient, if any."""
    ref = _OWNERS.get(param)
    ddp = ref() if ref is not None else None
    return None if ddp is None or ddp._closed or ddp.reducer is None else ddp

_MB = 1024 * 1024

# torch DDP's first bucket: "Experiments showed 1MB is a reasonable value", and
# a small first bucket lets the first allreduce start early in the backward.
_FIRST_BUCKET_MB = 1.0
_INPLACE_MB = 1  # inplace_threshold_mb="auto" where buckets are copied both ways


def broadcast_coalesced(tensors, root: int = 0, *, comm=None, inplace_bytes: int = 1 << 20) -> None:
    """Broadcast ``tensors`` from ``root``: large ones in place, small ones coalesced.

    Tensors of at least ``inplace_bytes`` are broadcast where they lie (a copy
    would only cost memory); the others go in one broadcast per (dtype, device).

    Args:
        tensors: tensors to overwrite on non-root ranks (any shapes, contiguous or not).
        root: the rank whose values everyone receives.
        comm: None, an ``mpidp.comm.Pool`` or an mpi4py communicator.
        inplace_bytes: size from which a tensor is broadcast on its own.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    is_root = _rank_of(comm) == root
    for tensor in tensors:
        tensor = tensor.detach()
        if tensor.numel() * tensor.element_size() < inplace_bytes:
            groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        elif tensor.is_contiguous():
            _comm.broadcast(tensor, root, comm=comm)
        else:
            staged = tensor.contiguous()
            _comm.broadcast(staged, root, comm=comm)
            tensor.copy_(staged)
    for (dtype, device), group in groups.items():
        flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=device)
        if is_root:
            pack(group, flat)
        _comm.broadcast(flat, root, comm=comm)
        if not is_root:
            unpack(flat, group)


def _rank_of(comm) -> int:
    if comm is None:
        return MPI.COMM_WORLD.Get_rank()
    return comm.rank if isinstance(comm, _comm.Pool) else comm.Get_rank()


def _signature(module: nn.Module, settings: dict) -> list[tuple]:
    entries = [("setting", key, value) for key, value in settings.items()]
    for name, param in module.named_parameters():
        entries.append(("parameter", name, tuple(param.shape), str(param.dtype).removeprefix("torch."),
                        param.requires_grad))
    for name, buffer in module.named_buffers():
        entries.append(("buffer", name, tuple(buffer.shape), str(buffer.dtype).removeprefix("torch.")))
    return entries


def _describe(entry: tuple) -> str:
    if entry[0] == "setting":
        return f"{entry[1]}={entry[2]!r}"
    text = f"{entry[0]} {entry[1]!r} with shape {entry[2]}, dtype {entry[3]}"
    return text + (f", requires_grad={entry[4]}" if entry[0] == "parameter" else "")


def _tensor_count(signature: list[tuple]) -> int:
    return sum(entry[0] != "setting" for entry in signature)


def first_mismatch(signatures: list[list[tuple]]) -> str | None:
    """Describe the first difference between rank 0's signature and another rank's, if any."""
    reference = signatures[0]
    for rank, theirs in enumerate(signatures):
        if theirs == reference:
            continue
        for mine, other in zip(reference, theirs):
            if mine != other:
                return f"rank {rank} has {_describe(other)} where rank 0 has {_describe(mine)}"
        longer, owner = (theirs, rank) if len(theirs) > len(reference) else (reference, 0)
        return (f"rank {rank} has {_tensor_count(theirs)} parameters and buffers but rank 0 has "
                f"{_tensor_count(reference)}; the first extra one, on rank {owner}, is "
                f"{_describe(longer[min(len(theirs), len(reference))])}")
    return None


def _watched_allgather(comm: MPI.Intracomm, obj, label: str) -> list:
    """``comm.allgather(obj)``, named ``label`` in the stall watchdog's reports."""
    slot = _watchdog.begin(label)
    try:
        return comm.allgather(obj)
    finally:
        slot.current = None


def _check_flag(name: str, value, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, got {value!r}")


def _base_comm(comm, process_group) -> MPI.Intracomm:
    if comm is not None and process_group is not None:
        raise ValueError("pass the communicator as comm or as process_group, not both")
    base = comm if comm is not None else process_group
    if base is None:
        return MPI.COMM_WORLD
    name = "comm" if comm is not None else "process_group"
    if not isinstance(base, MPI.Intracomm):
        raise TypeError(f"{name} must be None or an mpi4py Intracomm, got {type(base).__name__}; "
                        f"mpidp communicates through MPI, not through a torch.distributed "
                        f"process group")
    return base


def _sparse_names(module: nn.Module) -> set[str]:
    """Names of the parameters whose gradients are sparse, found as torch's DDP finds them."""
    found = set()
    for prefix, child in module.named_modules():
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse:
            found.update(f"{prefix}.{name}" if prefix else name
                         for name, _ in child.named_parameters(recurse=False))
    return found


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
            alone, bucket copies are already fused).
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
            where the MPI thread level allows it; see ``mpidp.overlap``.
        chunk_mb: largest single allreduce in MiB; bigger buckets are reduced
            in chunks of this size.
        inplace_threshold_mb: gradients of at least this many MiB skip the
            buckets and are reduced in place by MPI (fusing them saves no
            latency and copying them costs memory bandwidth); None puts every
            gradient in a bucket, as torch does. "auto" (default): 1 MiB, but
            None with shared memory (below) and ``gradient_as_bucket_view``:
            there a bucket costs one copy in and no copy back, and the shared
            reduction is twice as fast as MPI's.
        shared_memory: reduce the CPU buckets in memory the ranks of each
            node share (``mpidp.shm``): the buckets live there, and each rank
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
                 overlap: str = "auto", chunk_mb: float = 4,
                 inplace_threshold_mb: float | str | None = "auto", timeout: float | None = None,
                 shared_memory: bool | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        base = _base_comm(comm, process_group)
        _watchdog.check_timeout("timeout", timeout)
        for name, value, instead in (
                ("delay_all_reduce_named_params", delay_all_reduce_named_params,
                 "leave those parameters out with requires_grad=False and reduce them yourself "
                 "with mpidp.comm.allreduce"),
                ("param_to_hook_all_reduce", param_to_hook_all_reduce, "the same"),
                ("mixed_precision", mixed_precision,
                 "run the forward under torch.autocast; gradients are reduced in the "
                 "parameters' dtype"),
                ("device_mesh", device_mesh, "pass an mpi4py communicator as comm"),
                ("bucket_cap_mb_list", bucket_cap_mb_list, "bucket_cap_mb and first_bucket_mb")):
            if value is not None:
                raise ValueError(f"{name} is not supported by mpidp.DistributedDataParallel, "
                                 f"got {value!r}; use {instead}")
        if bucket_cap_mb is None:
            bucket_cap_mb = 25
        for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb),
                            ("chunk_mb", chunk_mb), ("inplace_threshold_mb", inplace_threshold_mb)):
            if name == "inplace_threshold_mb" and value == "auto":
                continue
            if value is not None and (isinstance(value, bool) or not isinstance(value, Real)
                                      or not value > 0):
                also = ', None or "auto"' if name == "inplace_threshold_mb" else ""
                raise ValueError(f"{name} must be a number > 0{also}, got {value!r}")
        for name, value in (("find_unused_parameters", find_unused_parameters),
                            ("gradient_as_bucket_view", gradient_as_bucket_view),
                            ("static_graph", static_graph), ("init_sync", init_sync),
                            ("check_reduction", check_reduction),
                            ("skip_all_reduce_unused_params", skip_all_reduce_unused_params),
                            ("batched_grad_copy", batched_grad_copy),
                            ("predict_gradient_order", predict_gradient_order)):
            _check_flag(name, value)
        _check_flag("broadcast_buffers", broadcast_buffers, optional=True)
        _check_flag("shared_memory", shared_memory, optional=True)
        _check_flag("forward_sync_buffers", forward_sync_buffers, optional=True)
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim must be an int, got {dim!r}")
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ValueError(f"pool_size must be an int >= 1, got {pool_size!r}")
        if overlap not in _overlap.NAMES:
            raise ValueError(f"overlap must be one of {', '.join(map(repr, _overlap.NAMES))}, "
                             f"got {overlap!r}")
        torch_sync_bn = [name for name, child in module.named_modules()
                         if isinstance(child, nn.SyncBatchNorm)]
        if torch_sync_bn:
            raise ValueError(
                f"module holds torch.nn.SyncBatchNorm ({', '.join(map(repr, torch_sync_bn))}), "
                f"which needs torch.distributed and would compute local statistics here; "
                f"convert it with mpidp.SyncBatchNorm.convert_sync_batchnorm(module) (or "
                f"nn.BatchNorm for local statistics) before wrapping")
        self._ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = self._named_params(module)
        if not named:
            raise ValueError("module has no parameter that requires grad; "
                             "DistributedDataParallel has nothing to synchronise")
        device = self._check_devices(module, device_ids, output_device)
        if forward_sync_buffers is not None:
            sync_buffers, init_buffers = forward_sync_buffers, True
        else:  # torch 2.13: the deprecated switch governs both
            sync_buffers = init_buffers = broadcast_buffers is not False
        if first_bucket_mb is None:
            first_bucket_mb = min(_FIRST_BUCKET_MB, bucket_cap_mb)

        self._options = dict(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                             find_unused_parameters=find_unused_parameters,
                             gradient_as_bucket_view=gradient_as_bucket_view,
                             static_graph=static_graph, pool_size=pool_size,
                             predict_gradient_order=predict_gradient_order, overlap=overlap,
                             chunk_mb=chunk_mb, inplace_threshold_mb=inplace_threshold_mb,
                             shared_memory=shared_memory)
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
        self._join: _JoinConfig | None = None
        self._sink = None  # the stage-2 ZeroRedundancyOptimizer fed by the reducer
        self._comm_hook = None  # (state, hook): register_comm_hook
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

    @staticmethod
    def _check_devices(module: nn.Module, device_ids, output_device) -> torch.device:
        tensors = list(module.named_parameters()) + list(module.named_buffers())
        device = tensors[0][1].device
        for name, tensor in tensors:
            if tensor.device != device or device.type not in ("cpu", "cuda"):
                raise ValueError(f"{name!r} is on {tensor.device} but {tensors[0][0]!r} is on "
                                 f"{device}; DistributedDataParallel needs the whole module on "
                                 f"one device, the CPU or one GPU per rank")
        if not device_ids and output_device is None:  # torch takes [] as None too
            return device
        if device.type == "cpu":
            raise ValueError(f"device_ids and output_device must be None for a CPU module, got "
                             f"device_ids={device_ids!r}, output_device={output_device!r}")
        if not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1:
            raise ValueError(f"device_ids must be None or hold one device, the module's "
                             f"({device}), got {device_ids!r}")
        for name, value in (("device_ids[0]", device_ids[0]), ("output_device", output_device)):
            if value is None:
                continue
            target = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
            if target != device:
                raise ValueError(f"{name} must be the module's device {device}, got {value!r}; "
                                 f"move the module there first (one GPU per rank)")
        return device

    def _settings(self, device: torch.device) -> dict:
        resolved = _overlap.resolve(self._options["overlap"], device, runtime.thread_level())
        return dict(self._options, overlap=resolved,
                    forward_sync_buffers=self.forward_sync_buffers)

    def _connect(self, base: MPI.Intracomm, device: torch.device) -> None:
        """Check the model across ranks, duplicate the communicators, build the reducer (collective)."""
        settings = self._settings(device)
        # Gather first, then every rank decides the same: no rank may raise alone
        # and leave the others in the Dup() below.
        mismatch = first_mismatch(base.allgather(_signature(self.module, settings)))
        if mismatch is not None:
            raise ValueError(f"DistributedDataParallel: the model or its settings differ "
                             f"across ranks: {mismatch}")
        topology.warn_about_binding(base, stacklevel=4)  # names the line that built this DDP
        self.pool = _comm.Pool(base, self._options["pool_size"])
        self.control = base.Dup()
        self._node = self._shared_memory_node(base, device)
        if base == MPI.COMM_WORLD:
            _watchdog.start()  # collective over COMM_WORLD, as this is; a no-op once started
        self.reducer = self._make_reducer(settings["overlap"])
        for _, param in self._named_params(self.module):
            _OWNERS[param] = weakref.ref(self)

    def _shared_memory_node(self, base: MPI.Intracomm, device: torch.device):
        """The ranks grouped by node for shared-memory reduction, or None (collective)."""
        wanted = self._options["shared_memory"]
        if wanted is None:
            wanted = _env.flag("MPIDP_SHARED_MEMORY", None)  # the default for every DDP
        if wanted is False or base.Get_size() == 1 or device.type != "cpu":
            if wanted and device.type != "cpu":
                raise ValueError(f"shared_memory=True reduces CPU gradients; the module is on "
                                 f"{device} (leave shared_memory=None)")
            return None
        node = _shm.node_of(base)  # usable or not, the same on every rank; this DDP's own
        if not node.usable:
            node.free()
            if wanted:
                raise ValueError(f"shared_memory=True needs every node to hold the same number "
                                 f"(> 1) of the communicator's ranks, but {node.reason}")
            return None
        return node

    def _make_reducer(self, overlap: str, sink=None) -> Reducer:
        options = self._options
        named = self._named_params(self.module)
        sparse = _sparse_names(self.module)
        solo = options["inplace_threshold_mb"]
        device = named[0][1].device
        shared = getattr(self, "_node", None) if sink is None and device.type == "cpu" else None
        if solo == "auto":  # measured: README, "Shared-memory reduction"
            solo = None if shared is not None and options["gradient_as_bucket_view"] else _INPLACE_MB
        kind = Reducer if sink is None else functools.partial(ShardedReducer, sink=sink)
        reducer = kind(named, self.pool, self.control,
                       bucket_cap_bytes=int(options["bucket_cap_mb"] * _MB),
                       first_bucket_bytes=int(options["first_bucket_mb"] * _MB),
                       find_unused_parameters=options["find_unused_parameters"],
                       gradient_as_bucket_view=options["gradient_as_bucket_view"],
                       predict_order=options["predict_gradient_order"], overlap=overlap,
                       chunk_bytes=int(options["chunk_mb"] * _MB),
                       solo_bytes=None if solo is None else int(solo * _MB),
                       sparse=[i for i, (name, _) in enumerate(named) if name in sparse],
                       static_graph=options["static_graph"], timeout=self._timeout,
                       **({"shared": shared} if sink is None else {}))
        reducer.comm_hook = getattr(self, "_comm_hook", None)
        reducer.record = getattr(self, "_record_stats", True)
        return reducer

    # -- communication hooks and statistics -------------------------------------------

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
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        if self.reducer is None:
            self._connect(MPI.COMM_WORLD, next(self.module.parameters()).device)
        problem = None
        if self._comm_hook is not None:
            problem = "register_comm_hook can only be called once (as in torch)"
        elif self._sink is not None:
            problem = ("a comm hook cannot reduce the buckets of a stage-2 "
                       "ZeroRedundancyOptimizer, which reduce-scatters them")
        elif self.reducer.stats or (self.reducer._step is not None
                                    and self.reducer._step.state != "armed"):
            problem = ("register_comm_hook must be called before the first backward (as torch "
                       "requires): buckets were already reduced another way")
        name = f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"
        reports = _watched_allgather(self.control, (name, problem), "register_comm_hook's check")
        names = {rank: report[0] for rank, report in enumerate(reports)}
        problems = [report[1] for report in reports if report[1] is not None]
        if problems:
            raise RuntimeError(f"DistributedDataParallel.register_comm_hook: {problems[0]}")
        if len(set(names.values())) > 1:
            raise ValueError(f"DistributedDataParallel.register_comm_hook: the ranks register "
                             f"different hooks ({names}); every rank must register the same")
        self._comm_hook = (state, hook)
        self.reducer.comm_hook = self._comm_hook

    @property
    def record_stats(self) -> bool:
        """Whether ``stats()`` records and each bucket gets a profiler range (default True)."""
        return getattr(self, "_record_stats", True)

    @record_stats.setter
    def record_stats(self, value: bool) -> None:
        _check_flag("record_stats", value)
        self._record_stats = value
        if self.reducer is not None:
            self.reducer.record = value

    def stats(self) -> list[dict]:
        """What the last synced steps (up to 100) communicated, oldest first.

        Each step: ``step`` (its number), ``bytes`` (of the buckets reduced),
        ``collectives`` (bucket collectives, counting chunks, or hook calls,
        plus the bookkeeping allreduce), ``reduction_s`` (from the first bucket
        handed to communication to the last reduction done) and ``wait_s``
        (how long the end of the backward pass waited for communication).
        Recorded unless ``record_stats`` is False: a few clock reads and a
        profiler range per bucket (bench/hooks_bench.py measures the cost).
        """
        return [] if self.reducer is None else [dict(entry) for entry in self.reducer.stats]

    # -- ZeRO stage 2 -----------------------------------------------------------------

    def _stage2_problem(self) -> str | None:
        """Why this DDP cannot reduce-scatter into a ZeroRedundancyOptimizer, or None (local)."""
        if self._sink is not None:
            return "the DistributedDataParallel already feeds a stage-2 ZeroRedundancyOptimizer"
        if self._comm_hook is not None:
            return "the DistributedDataParallel reduces its buckets with a comm hook"
        if self._options["gradient_as_bucket_view"]:
            return ("stage=2 keeps only each rank's shard of the gradients, which "
                    "gradient_as_bucket_view=True cannot give; build the "
                    "DistributedDataParallel without it")
        sparse = [name for name, _ in self._named_params(self.module)
                  if name in _sparse_names(self.module)]
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
            signatures = _watched_allgather(
                self.control, _signature(self.module, settings),
                "module conversion (.to(), .double()...: every rank must convert the DDP wrapper), "
                "its model check")
            mismatch = first_mismatch(signatures)
            if mismatch is not None:
                raise ValueError(f"DistributedDataParallel: after converting the module, it "
                                 f"differs across ranks: {mismatch}")
            self.reducer.close()
            self.reducer = self._make_reducer(settings["overlap"])
        return result

    # -- forward ----------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        inputs, kwargs = self._pre_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs)
        return self._post_forward(output)

    @torch.compiler.disable
    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._closed:
            raise RuntimeError("DistributedDataParallel was closed; call the module itself "
                               "(ddp.module) or wrap it again")
        if torch.is_grad_enabled():
            # Only a forward that may be followed by a synced backward runs on
            # every rank; evaluation under no_grad may run on one rank alone.
            if self.reducer is None:
                self._connect(MPI.COMM_WORLD, next(self.module.parameters()).device)
            self.reducer.settle()
            self.reducer.raise_pending_error()
            self.reducer.check_parameters()
            root = 0
            if self._join is not None:
                root = self._notify_join()  # may raise on every rank: count nothing before
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

    @torch.compiler.disable
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

    # -- uneven inputs ----------------------------------------------------------------

    @contextlib.contextmanager
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
        for name, value in (("divide_by_initial_world_size", divide_by_initial_world_size),
                            ("enable", enable),
                            ("throw_on_early_termination", throw_on_early_termination)):
            _check_flag(name, value)
        if not enable:
            yield
            return
        if self._join is not None:
            raise RuntimeError("DistributedDataParallel.join() is already active; do not nest it")
        if self._comm_hook is not None:
            raise RuntimeError("DistributedDataParallel.join() does not support a comm hook: "
                               "a joined rank cannot run the hook's collectives in step; give "
                               "every rank the same number of batches")
        if self._sink is not None:
            raise RuntimeError("DistributedDataParallel.join() cannot shadow a stage-2 "
                               "ZeroRedundancyOptimizer's step (its parameter allgather); give "
                               "every rank the same number of batches (DistributedSampler with "
                               "drop_last=True)")
        if self.reducer is None:
            self._connect(MPI.COMM_WORLD, next(self.module.parameters()).device)
        layers = [m for m in self.module.modules() if isinstance(m, syncbn.SyncBatchNorm)]
        if layers and runtime.thread_level() < MPI.THREAD_MULTIPLE:
            raise ValueError("join() with mpidp.SyncBatchNorm layers needs MPI_THREAD_MULTIPLE "
                             "(a joined rank stands in for their backward collectives from a "
                             "second thread), but MPI granted a lower thread level")
        config = self._join = _JoinConfig(divide_by_initial_world_size, throw_on_early_termination)
        # The last step's order of SyncBatchNorm collectives on this rank: what
        # it replays with zeros once joined (module order if it never ran a step).
        config.trace = ([(layer, "stats") for layer in layers] +
                        [(layer, "grads") for layer in reversed(layers)])
        if layers:
            syncbn.record([])
        try:
            yield
        except BaseException:
            self._join = None  # as torch: the exception goes on, no shadowing
            self.reducer.set_divisor(self.pool.size)
            syncbn.record(None)
            raise
        if layers:
            config.trace = syncbn.record(None) or config.trace
        try:
            self._shadow_until_all_joined(config)
        finally:
            self._join = None
            self.reducer.set_divisor(self.pool.size)

    def _join_verdict(self, active: torch.Tensor, config: "_JoinConfig") -> tuple[int, int]:
        """From the summed activity vector: (active ranks, the highest of them); maybe raise."""
        world = self.pool.size
        ranks = active[:world].nonzero().flatten().tolist()
        if config.throw and len(ranks) < world:
            joined = sorted(set(range(world)) - set(ranks))
            raise RuntimeError(f"DistributedDataParallel.join: rank(s) {joined} ran out of inputs "
                               f"and throw_on_early_termination=True, so every rank raises")
        return len(ranks), ranks[-1] if ranks else -1

    def _notify_join(self) -> int:
        """An active rank's forward inside join(): say so; return the buffers' source rank."""
        world, rank = self.pool.size, self.pool.rank
        active = torch.zeros(world + 1, dtype=torch.int64)
        active[rank] = 1
        active[world] = int(self.require_backward_grad_sync)
        _comm.allreduce(active, "sum", comm=self.control)
        count, authority = self._join_verdict(active, self._join)
        if syncbn._trace is not None:  # a new step: the last one's order is complete
            self._join.trace = syncbn.record([]) or self._join.trace
        self.reducer.set_divisor(world if self._join.divide_by_initial else count)
        # torch's rule under join: buffers come from the highest active rank,
        # since rank 0 may have joined and hold stale ones.
        return authority

    def _shadow_until_all_joined(self, config: "_JoinConfig") -> None:
        world, rank = self.pool.size, self.pool.rank
        last_joiner = True
        while True:
            active = torch.zeros(world + 1, dtype=torch.int64)
            _comm.allreduce(active, "sum", comm=self.control)
            if not active[:world].any():
                break
            last_joiner = False
            _, authority = self._join_verdict(active, config)
            if active[world]:  # the active ranks' forward will sync (not inside no_sync)
                buffers = self._buffers_to_sync() if self.forward_sync_buffers else []
                if buffers and world > 1:
                    broadcast_coalesced(buffers, authority, comm=self.control)
            for layer, kind in config.trace:
                if kind == "stats":
                    layer._shadow_forward()
            self._shadow_backward([layer for layer, kind in config.trace if kind == "grads"],
                                  buckets=bool(active[world]))
        # Every rank has joined: the last one to join holds the final model.
        source = torch.tensor([rank if last_joiner else -1], dtype=torch.int64)
        _comm.allreduce(source, "max", comm=self.control)
        if world > 1:
            broadcast_coalesced(list(self.module.parameters()) +
                                (self._buffers_to_sync() if self.forward_sync_buffers else []),
                                int(source), comm=self.control)

    def _shadow_backward(self, layers: list, buckets: bool) -> None:
        # The active ranks' backward interleaves the SyncBatchNorm collectives
        # (on their communicator) with the bucket allreduces (on the pool) in an
        # order only their autograd engine knows; a second thread takes the
        # layers' part so that neither sequence can block the other. (MPI never
        # matches a nonblocking collective with a blocking one, so posting them
        # nonblocking would not do.)
        failure: list[BaseException] = []

        def layers_part():
            try:
                for layer in layers:
                    layer._shadow_backward()
            except BaseException as error:  # re-raised below, on this thread
                failure.append(error)

        helper = threading.Thread(target=layers_part, name="mpidp-join-syncbn", daemon=True)
        if layers:
            helper.start()
        try:
            if buckets:
                self.reducer.shadow()
        finally:
            if layers:
                helper.join()
        if failure:
            raise failure[0]

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
                self.control.Free()
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
        state.update(pool=None, control=None, reducer=None, _sink=None, _comm_hook=None, _node=None)
        return state

    def __setstate__(self, state: dict) -> None:
        # The copy has no communicators yet: its first grad-enabled forward
        # builds them (collective); evaluation under no_grad needs none.
        super().__setstate__(state)


class _JoinConfig:
    """The settings of one ``join()`` context."""

    __slots__ = ("divide_by_initial", "throw", "trace")

    def __init__(self, divide_by_initial: bool, throw: bool):
        self.divide_by_initial = divide_by_initial
        self.throw = throw
        self.trace: list = []  # (SyncBatchNorm layer, "stats" or "grads") in call order


DDP = DistributedDataParallel
