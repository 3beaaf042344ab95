"""``ZeroRedundancyOptimizer``: construction, the stage-2 gradient sink, stepping and clipping.

The design (how elements are divided, stages 1 and 2) is described in
``mpidp.zero``. The optimizer holds two parts, each with its own state: its
``Checkpoint`` (``checkpoint.py``: state dicts, sharded saves) and its
``Healing`` (``partner.py``: the partner copy and a heal's steps). The flat
buffers are ``Bucket``'s (``bucket.py``) and the check that an optimizer class
may be sharded ``elementwise_keys`` (``elementwise.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from mpi4py import MPI

from .. import comm as _comm
from .. import communicators as _communicators
from ..comm import chunking as _chunking
from .._args import check_bool, check_number, is_int
from ..comm.agreement import agree, decide
from ..ddp.buckets import Shards, assign_buckets
from .bucket import Bucket
from .checkpoint import Checkpoint, Piece
from .elementwise import elementwise_keys
from .partner import Healing

__all__ = ["ZeroRedundancyOptimizer"]

_LABEL = "ZeroRedundancyOptimizer.{}: error agreement"


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """An optimizer whose state is sharded across the ranks (ZeRO stage 1, or 2 with a DDP).

    torch's ``ZeroRedundancyOptimizer`` interface: ``step()``, ``zero_grad()``,
    ``state_dict()`` after ``consolidate_state_dict(to)``, ``load_state_dict()``
    of a whole (torch-format) state dict on every rank, ``add_param_group()``,
    ``param_groups`` that LR schedulers can change. Construction,
    ``step``, ``consolidate_state_dict``, ``add_param_group``,
    ``clip_grad_norm_`` and the sharded save and load are collective.

    Args:
        params: tensors or param groups, as for any torch optimizer; all on one
            device (the CPU or this rank's GPU), identical on every rank.
        optimizer_class: the ``torch.optim.Optimizer`` subclass each rank runs
            on its shard; its update must be elementwise (checked).
        process_group: an mpi4py communicator (the same as ``comm``).
        parameters_as_bucket_view: accepted; mpidp always makes the parameters
            views into flat buffers.
        overlap_with_ddp: not supported (True raises); ``stage=2`` is mpidp's
            way of joining the optimizer to the DDP's backward pass.
        stage: 1 shards the optimizer state; 2 also the gradients: ``params``
            must then be the trainable parameters of one
            ``mpidp.DistributedDataParallel`` (``ddp.parameters()``), whose
            reducer then reduce-scatters the gradients (no ``param.grad`` is
            left after the backward; use ``clip_grad_norm_`` of this
            optimizer, not torch's). ``step()`` consumes the gradient shards:
            the next backward starts from zero, whether ``zero_grad()`` of the
            optimizer, of the module, or none was called.
        comm: the mpi4py communicator (default ``MPI.COMM_WORLD``; in stage 2,
            the DDP's).
        bucket_cap_mb: size in MiB of the flat buffers the parameters are laid out in
            (stage 1; stage 2 uses the DDP's buckets); None (default): 25, as DDP.
        chunk_mb: largest single allgather in MiB; None (default): ``MPIDP_CHUNK_MB``
            (4). Stage 2 takes the DDP's ``chunk_mb``.
        **defaults: the arguments of ``optimizer_class`` (``lr``...).
    """

    def __init__(self, params, optimizer_class: type, process_group=None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, *,
                 stage: int = 1, comm: MPI.Intracomm | None = None,
                 bucket_cap_mb: float | None = None,
                 chunk_mb: float | None = None, **defaults):
        from ..ddp.data_parallel import _base_comm  # noqa: PLC0415 (ddp imports the reducer, which is fine)

        self._ready = False
        self._buckets: list[Bucket] = []
        error, ddp = None, None
        base = _base_comm(comm, process_group)  # where the ranks agree on errors
        try:
            super().__init__(params, defaults)  # torch's checks: empty, duplicates, leaves...
            if not is_int(stage) or stage not in (1, 2):
                raise ValueError(f"stage must be 1 (optimizer state sharded) or 2 (gradients "
                                 f"too), got {stage!r}")
            if overlap_with_ddp is not False:
                raise ValueError(f"overlap_with_ddp is not supported by mpidp, got "
                                 f"{overlap_with_ddp!r}; pass stage=2 to reduce-scatter the "
                                 f"gradients into the optimizer's shards during the backward")
            check_bool("parameters_as_bucket_view", parameters_as_bucket_view)
            check_number("bucket_cap_mb", bucket_cap_mb, optional=True)
            check_number("chunk_mb", chunk_mb, optional=True)
            if not (isinstance(optimizer_class, type)
                    and issubclass(optimizer_class, torch.optim.Optimizer)):
                raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got "
                                f"{optimizer_class!r}")
            if issubclass(optimizer_class, ZeroRedundancyOptimizer):
                raise TypeError("optimizer_class must be the optimizer to shard, not "
                                "ZeroRedundancyOptimizer itself")
            self._check_devices()
            if stage == 2:
                if comm is not None or process_group is not None:
                    raise ValueError("with stage=2 the optimizer uses the communicator of the "
                                     "DistributedDataParallel it joins; leave comm and "
                                     "process_group None")
                ddp = self._find_ddp()
                base = ddp.control
                chunk_mb = ddp._options["chunk_mb"]
            sizes = _chunking.Sizes.of(bucket_cap_mb=bucket_cap_mb, chunk_mb=chunk_mb)
            first = self._params()[0]
            self._sharded_keys = elementwise_keys(optimizer_class, defaults, first.dtype,
                                                  first.device)
        except (TypeError, ValueError) as caught:
            error = caught
        # Every rank decides the same: a rank that raised alone would leave the
        # others in the collectives below.
        agree(base, error, _LABEL.format("__init__()"))
        decide(base, self._signature(optimizer_class, stage, sizes.chunk), self._mismatch,
               "ZeroRedundancyOptimizer.__init__(): signatures (allgather)")
        # over the world in stage 1, a heal can rebuild it (mpidp.Healer, partner.py)
        self._over_world = stage == 1 and comm is None and process_group is None
        self._checkpoint = Checkpoint(self)
        self._healing = Healing(self, self._checkpoint)
        self._comm = _communicators.made(base.Dup(), f"ZeroRedundancyOptimizer {id(self):#x}",
                                         rebuild=self._rebuild if self._over_world else None)
        self.rank, self.world = self._comm.Get_rank(), self._comm.Get_size()
        self.stage = stage
        self.optimizer_class = optimizer_class
        self._chunk_bytes = sizes.chunk
        self._cap_bytes = sizes.bucket_cap  # every bucket, the first too: no small first one
        self._defaults = defaults
        params = self._params()
        self._index = {id(p): i for i, p in enumerate(params)}
        # Per parameter, whether it has a gradient for the coming step in stage 2
        # (torch: .grad is not None), and whether it had one at the last step.
        self._has = [False] * len(params)
        self._had = [False] * len(params)
        self._ddp = None
        self._targets: dict[int, torch.Tensor] = {}  # take_whole's, per bucket, until reduced()
        self._by_reducer: list[int] = []
        if ddp is not None:
            reducer = ddp._shard_gradients(self)
            self._ddp = weakref.ref(ddp)
            self._by_reducer = [self._index[id(p)] for p in reducer.params]
            for bucket, members in zip(reducer.layout.buckets, reducer.layout.members):
                self._add_bucket([self._by_reducer[i] for i in members], bucket.shards, True)
        placed = {i for bucket in self._buckets for i in bucket.members}
        self._lay_out([i for i in range(len(params)) if i not in placed])
        self.optim = optimizer_class(
            [dict(self._hyper(group), params=[]) for group in self.param_groups], **defaults)
        for bucket in self._buckets:
            self._add_pieces(bucket)
        self._sync_back()
        self._ready = True

    # -- construction -----------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _group_of(self) -> list[int]:
        return [g for g, group in enumerate(self.param_groups) for _ in group["params"]]

    @staticmethod
    def _hyper(group: dict) -> dict:
        return {key: value for key, value in group.items() if key != "params"}

    def _check_devices(self) -> None:
        params = self._params()
        first = params[0]
        for k, param in enumerate(params):
            if param.device != first.device:
                raise ValueError(f"ZeroRedundancyOptimizer needs all parameters on one device, "
                                 f"but parameter {k} ({tuple(param.shape)}) is on "
                                 f"{param.device} and parameter 0 ({tuple(first.shape)}) is on "
                                 f"{first.device}")
            if param.is_sparse or param.layout != torch.strided:
                raise ValueError(f"parameter {k} has layout {param.layout}; ZeroRedundancy"
                                 f"Optimizer shards dense (strided) parameters only")

    def _find_ddp(self):
        from ..ddp.data_parallel import owner  # noqa: PLC0415

        params = self._params()
        owners = {owner(p) for p in params if p.requires_grad}
        if len(owners) != 1 or None in owners:
            raise ValueError(
                "stage=2 needs the parameters of one mpidp.DistributedDataParallel (pass "
                "ddp.parameters()), built before the optimizer; found parameters "
                + ("that no DistributedDataParallel reduces" if None in owners
                   else f"of {len(owners)} different ones"))
        ddp = owners.pop()
        problem = ddp._stage2_problem()
        if problem is not None:
            raise ValueError(problem)
        mine = {id(p) for p in params}
        missing = [name for name, p in ddp._named_params(ddp.module) if id(p) not in mine]
        if missing:
            raise ValueError(
                f"stage=2: parameter(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} of "
                f"the DistributedDataParallel are not in the optimizer; their gradients "
                f"would be reduce-scattered and dropped. Pass all of ddp.parameters()")
        return ddp

    def _signature(self, optimizer_class, stage, chunk_bytes) -> tuple:
        return (getattr(optimizer_class, "__qualname__", repr(optimizer_class)), stage,
                chunk_bytes,
                [[(tuple(p.shape), str(p.dtype)) for p in group["params"]]
                 for group in self.param_groups])

    @staticmethod
    def _mismatch(signatures: list) -> ValueError | None:
        for rank, signature in enumerate(signatures):
            if signature != signatures[0]:
                fields = ("optimizer_class", "stage", "chunk_mb (or MPIDP_CHUNK_MB)",
                          "param_groups (shapes, dtypes)")
                which = [name for name, a, b in zip(fields, signature, signatures[0]) if a != b]
                return ValueError(f"ZeroRedundancyOptimizer: {', '.join(which)} differ between "
                                  f"rank 0 and rank {rank}; every rank must build the same "
                                  f"optimizer over the same model")
        return None

    def _add_bucket(self, members: list[int], shards: Shards, sharded: bool) -> None:
        params = self._params()
        self._buckets.append(Bucket(members, [params[i] for i in members], shards, self.rank,
                                     sharded))

    def _lay_out(self, indices: list[int]) -> None:
        """Stage-1 buckets for ``indices`` (their gradients are read from ``.grad``)."""
        if not indices:
            return
        params = self._params()
        sizes = [params[i].numel() * params[i].element_size() for i in indices]
        keys = [(params[i].dtype, params[i].device) for i in indices]
        for local in assign_buckets(sizes, keys, self._cap_bytes, self._cap_bytes,
                                    order=range(len(indices))):
            members = [indices[k] for k in local]
            first = params[members[0]]
            chunk = _chunking.chunk_numel(self._chunk_bytes, first.element_size())
            self._add_bucket(members, Shards(sum(params[i].numel() for i in members),
                                             self.world, chunk), False)

    def _lay_out_again(self, groups: list[dict]) -> None:
        """Lay the parameters out over ``_comm`` as it is now, with a new inner optimizer of
        hyperparameters ``groups`` (a heal's, after ``_rebuild``; its state is loaded next)."""
        self.rank, self.world = self._comm.Get_rank(), self._comm.Get_size()
        self._buckets = []
        self._lay_out(list(range(len(self._params()))))
        self.optim = self.optimizer_class([dict(hyper, params=[]) for hyper in groups],
                                          **self._defaults)
        for bucket in self._buckets:
            self._add_pieces(bucket)

    def _rebuild(self, world: MPI.Intracomm) -> None:
        """A new communicator over ``world`` (a heal's first step; the healing part's
        ``regroup`` lays out the rest)."""
        _communicators.release(self._comm)
        self._comm = _communicators.made(world.Dup(), f"ZeroRedundancyOptimizer {id(self):#x}",
                                         rebuild=self._rebuild)

    def _add_pieces(self, bucket: Bucket) -> None:
        group_of = self._group_of()
        for member, _, _, _, piece in bucket.pieces:
            self.optim.param_groups[group_of[member]]["params"].append(piece)

    def _sync_back(self) -> None:
        """Copy the inner optimizer's filled-in hyperparameters into ``param_groups``."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            outer.update(self._hyper(inner))

    # -- the stage-2 reducer's sink ---------------------------------------------------

    def grad_target(self, position: int) -> torch.Tensor:
        """Where the DDP's bucket ``position`` reduce-scatters this rank's shard to."""
        bucket = self._buckets[position]
        if bucket.grad is None:
            bucket.grad = torch.empty(bucket.shards.shard_numel, dtype=bucket.flat.dtype,
                                      device=bucket.flat.device)
            bucket.clean = True
        if bucket.clean:
            return bucket.grad
        bucket.scratch = torch.empty_like(bucket.grad)  # accumulated in reduced()
        return bucket.scratch

    def take_whole(self, index: int, grad: torch.Tensor) -> None:
        """Under compiled autograd (mpidp/ddp/compiled.py): the DDP parameter ``index``'s
        averaged gradient, whole; this rank's pieces of it go where the reduce-scatter's would."""
        member, flat = self._by_reducer[index], grad.reshape(-1)
        for position, bucket in enumerate(self._buckets):
            for owner, start, stop, at, _ in bucket.pieces if bucket.sharded else ():
                if owner == member:
                    if position not in self._targets:
                        self._targets[position] = self.grad_target(position)
                    self._targets[position][at:at + stop - start].copy_(flat[start:stop])

    def reduced(self, used: Sequence[bool]) -> None:
        """A synced backward's shards are in (``used``: per DDP parameter, has a gradient)."""
        self._targets = {}
        for bucket in self._buckets:
            if bucket.scratch is not None:
                bucket.grad.add_(bucket.scratch)
                bucket.scratch = None
            if bucket.sharded and bucket.grad is not None:
                bucket.clean = False
        for index, flag in zip(self._by_reducer, used):
            self._has[index] = self._has[index] or flag

    # -- stepping ---------------------------------------------------------------------

    def _piece_states(self) -> list[Piece]:
        """This rank's pieces that have state: ``(member, start, stop, state)`` (local)."""
        return [(member, start, stop, self.optim.state[piece])
                for bucket in self._buckets for member, start, stop, _, piece in bucket.pieces
                if piece in self.optim.state and self.optim.state[piece]]

    def _owned_grads(self):
        """(bucket, piece, gradient of the piece or None) for each piece this rank owns."""
        params = self._params()
        for bucket in self._buckets:
            for member, start, stop, position, piece in bucket.pieces:
                if bucket.sharded:
                    grad = None
                    # zeros after zero_grad(set_to_none=False) when not reduced since
                    if self._has[member] and bucket.grad is not None:
                        grad = bucket.grad[position:position + stop - start]
                else:
                    grad = params[member].grad
                    if grad is not None:
                        if grad.is_sparse:
                            raise RuntimeError(
                                f"ZeroRedundancyOptimizer: parameter {member} has a sparse "
                                f"gradient; it shards dense gradients only")
                        grad = grad.reshape(-1)[start:stop]
                yield bucket, piece, grad

    def _check_storage(self) -> None:
        params = self._params()
        for bucket in self._buckets:
            for member, view in zip(bucket.members, bucket.views):
                param = params[member]
                if param.data_ptr() != view.data_ptr() or param.shape != view.shape:
                    raise RuntimeError(
                        f"ZeroRedundancyOptimizer: parameter {member} "
                        f"({tuple(param.shape)}, {param.dtype}, {param.device}) no longer lies "
                        f"in the optimizer's flat buffer: it was converted or replaced after "
                        f"the optimizer was built (module.to(), .double(), load_state_dict "
                        f"with assign=True...). Convert the model first, then build the "
                        f"optimizer")

    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's shard with the inner optimizer, then allgather the parameters (collective)."""
        loss, pieces, error = None, [], None
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._check_storage()
            for outer, inner in zip(self.param_groups, self.optim.param_groups):
                inner.update(self._hyper(outer))
            for _, piece, grad in self._owned_grads():
                piece.grad = grad
                pieces.append(piece)
            self.optim.step()
            self._healing.step()
        except Exception as caught:  # on one rank, it would leave the others in the allgathers
            error = caught
        finally:
            for piece in pieces:
                piece.grad = None
        agree(self._comm, error, _LABEL.format("step()"))
        # Stage 2 consumes the gradient shards, as DeepSpeed's engine does: the
        # next backward starts from zero even if only module.zero_grad() was
        # called (it cannot reach the shards), not on top of this step's.
        for bucket in self._buckets:
            if bucket.sharded:
                bucket.clean = True
        self._had, self._has = self._has, [False] * len(self._has)
        for bucket in self._buckets:
            bucket.gather(self._comm, self.rank)
        self._sync_back()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients: the parameters' ``.grad`` and (stage 2) this rank's shards."""
        for param in self._params():
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.requires_grad_(False)
                param.grad.zero_()
        for bucket in self._buckets:
            if bucket.grad is not None:
                if set_to_none:
                    bucket.grad = None
                else:
                    bucket.grad.zero_()
                bucket.clean = True
        if set_to_none:
            self._has, self._had = [False] * len(self._has), [False] * len(self._had)
        else:  # as torch: a parameter that had a gradient has a zero one, and is stepped
            self._has = [has or had for has, had in zip(self._has, self._had)]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale the gradients so that their norm over all ranks' shards is at most ``max_norm``.

        ``torch.nn.utils.clip_grad_norm_`` sees only this rank's ``.grad``,
        which stage 2 has released: use this instead (in stage 1 both agree).
        Every element is counted once, on the rank that owns it. Collective.

        Returns:
            The total norm before clipping (a float32 tensor on the parameters' device).
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
        grads = [grad for _, _, grad in self._owned_grads() if grad is not None]
        infinite = norm_type == float("inf")
        local = torch.zeros(1, dtype=torch.float64)
        for grad in grads:
            value = torch.linalg.vector_norm(grad, norm_type, dtype=torch.float64).cpu()
            local = torch.maximum(local, value) if infinite else local + value ** norm_type
        _comm.allreduce(local, "max" if infinite else "sum", comm=self._comm)
        total = local[0].item() if infinite else local[0].item() ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(torch.tensor(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               f"{total}, so they cannot be clipped (error_if_nonfinite=True)")
        coefficient = max_norm / (total + 1e-6)
        if coefficient < 1.0:
            for bucket in self._buckets:
                if bucket.sharded and bucket.grad is not None:
                    bucket.grad.mul_(coefficient)
            params = self._params()
            for bucket in self._buckets:
                if not bucket.sharded:
                    for member in bucket.members:
                        if params[member].grad is not None:
                            params[member].grad.mul_(coefficient)
        return torch.tensor(total, dtype=torch.float32, device=self._params()[0].device)

    # -- checkpoints and heals: the parts' ------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` for ``state_dict()`` (collective)."""
        self._checkpoint.consolidate_state_dict(to)

    def state_dict(self) -> dict:
        """The whole state, in the inner optimizer's format, after ``consolidate_state_dict``.

        Raises:
            RuntimeError: on a rank that did not receive the consolidated state (as torch's).
        """
        return self._checkpoint.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state dict (``state_dict()`` of this class or of a plain torch optimizer
        over the same parameters), given on every rank; each keeps its shard (collective)."""
        self._healing.loaded(self._checkpoint.load_state_dict(state_dict))

    def sharded_state_dict(self) -> dict:
        """This rank's part of the state, with where each piece lies in its parameter.

        Any number of ranks can load the set of all ranks' dicts with
        ``load_sharded_state_dict`` (local; see ``save_sharded``).
        """
        return self._checkpoint.sharded_state_dict()

    def load_sharded_state_dict(self, shards: Sequence[dict]) -> None:
        """Load from every saved rank's ``sharded_state_dict()`` (any number of ranks; collective)."""
        self._healing.loaded(self._checkpoint.load_sharded_state_dict(shards))

    def save_sharded(self, directory: str) -> None:
        """Write this rank's ``sharded_state_dict()`` to ``directory`` (collective).

        One file per rank, ``zero-rank{r:05d}-of-{N:05d}.pt`` (``zero-rank00001-of-00004.pt``
        is rank 1 of 4); files of a save at another number of ranks are removed
        first. ``load_sharded`` reads them back at any number of ranks. The
        directory must be shared by the ranks that will load it.
        """
        self._checkpoint.save_sharded(directory)

    def load_sharded(self, directory: str) -> None:
        """Load what ``save_sharded`` wrote, at any number of ranks (collective)."""
        self._healing.loaded(self._checkpoint.load_sharded(directory))

    def keep_partner_copy(self) -> None:
        """From now on also step rank ``r - 1``'s shard here (collective; see ``Partner``).

        The copy starts from that rank's state now (one message each way).

        Raises:
            ValueError: on every rank, for stage 2 (only the own gradient shard is kept).
        """
        self._healing.keep_partner_copy()

    # -- param groups -----------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (collective once the optimizer is built: the new parameters are sharded too)."""
        if not self._ready:
            super().add_param_group(param_group)
            return
        before, groups, error = len(self._params()), len(self.param_groups), None
        try:
            super().add_param_group(param_group)
            self._check_devices()
        except (TypeError, ValueError) as caught:
            error = caught
        try:
            agree(self._comm, error, _LABEL.format("add_param_group()"))
            signature = self._signature(self.optimizer_class, self.stage, self._chunk_bytes)
            decide(self._comm, signature, self._mismatch,
                   "ZeroRedundancyOptimizer.add_param_group(): signatures (allgather)")
        except (TypeError, ValueError):
            del self.param_groups[groups:]  # as before, on every rank
            raise
        params = self._params()
        self._index = {id(p): i for i, p in enumerate(params)}
        self._has += [False] * (len(params) - before)
        self._had += [False] * (len(params) - before)
        first = len(self._buckets)
        self._lay_out(list(range(before, len(params))))
        self.optim.add_param_group(dict(self._hyper(self.param_groups[-1]), params=[]))
        for bucket in self._buckets[first:]:
            self._add_pieces(bucket)
        self._sync_back()
        self._healing.param_group_added()

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer(stage={self.stage}, rank {self.rank} of {self.world}, "
                f"{self.optim!r})")
