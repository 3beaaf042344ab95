"""The operations of the backend ``"mpidp"``: torch's collectives and messages as mpidp.comm calls.

``Operations`` is the half of ``ProcessGroupMPIDP`` that torch calls for each
operation (``allreduce`` ... ``barrier``, ``send``/``recv``): it checks and
adapts the operands (``mpidp.process_group.operands``), picks mpidp.comm's blocking or
nonblocking call, and hands it to the group's issuing (``ProcessGroupMPIDP._run``
in ``mpidp.process_group``), which starts it and returns a Work (``mpidp.process_group.work``).
An all_reduce larger than ``MPIDP_CHUNK_MB`` goes chunk by chunk
(``mpidp.process_group.chunks``); the numbered rules cited are those of ``mpidp.process_group.progress``.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed import ReduceOp

from .. import comm as _comm
from .. import cuda as _cuda
from . import work as _work
from .chunks import Chunks
from ..comm import staging as _staging
from ..comm.chunking import DEFAULTS as _SIZES  # the backend takes no size arguments
from .operands import (
    _as_moved, _check_dtypes, _check_same_sizes, _check_world_list, _detached, _flat, _one,
    _unpack,
)
from .progress import progress as _progress

__all__ = ["Operations"]

_c10d = torch._C._distributed_c10d  # the *Options classes (some not re-exported by dist)

# torch's reduce op -> mpidp.comm's, keyed by the enum's value (hashing the enum costs
# a microsecond, a noticeable share of a small all_reduce)
_OPS = {int(op): name for op, name in (
    (ReduceOp.SUM, "sum"), (ReduceOp.AVG, "avg"), (ReduceOp.PRODUCT, "prod"),
    (ReduceOp.MIN, "min"), (ReduceOp.MAX, "max"), (ReduceOp.BAND, "band"),
    (ReduceOp.BOR, "bor"), (ReduceOp.BXOR, "bxor"), (ReduceOp.PREMUL_SUM, "premul_sum"))}


class Operations:
    """torch's collectives and point-to-point messages, for ``ProcessGroupMPIDP`` to inherit.

    Every method takes torch's arguments (lists of tensors, an ``*Options``
    object) and returns a ``torch.distributed.Work``. It relies on the group's
    ``_pool``, ``_chunk_comm``, ``_async``, ``rank()``/``size()`` and its issuing
    methods (``_run``, ``_record``, ``_work``, ``_check_usable``).
    """

    def _op(self, opts, tensor: torch.Tensor) -> str:
        op = opts.reduceOp  # a fresh copy at each read: read once
        kind = op.op
        name = _OPS.get(int(kind))
        if name is None:
            raise ValueError(f"reduce op {kind} is not supported by the mpidp backend")
        if name == "premul_sum":  # scale this rank's input, then sum
            if not tensor.is_floating_point():
                raise TypeError(f"reduce op PREMUL_SUM needs a floating-point dtype, got "
                                f"{tensor.dtype}")
            factor = op.factor
            tensor.mul_(factor.to(tensor.device) if isinstance(factor, torch.Tensor) else factor)
            return "sum"
        return name

    # -- collectives -------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else _c10d.AllreduceOptions()
        tensor = _one(tensors, "allreduce")
        if tensor.is_sparse:
            return self._sparse_allreduce(opts, tensor)
        op = self._op(opts, tensor)
        nbytes = _SIZES.chunk
        if tensor.nbytes <= nbytes:
            return self._run(opts, lambda nb: (_comm.iallreduce if nb else _comm.allreduce)(
                tensor, op, comm=self._pool), [tensor], check=("allreduce", tensor, op, 0))
        # MPI's shared-memory bandwidth drops once a message leaves the cache: reduce a
        # large tensor (one DDP bucket may hold 100 MB) in chunks, one after the other,
        # as mpidp.DistributedDataParallel does (4 MiB measured best there), on the
        # group's chunk communicator (docs/concurrency.md, rule 7). The size alone decides, so
        # every rank takes the same path. The tensor is staged once (rule 6):
        # device memory the library cannot read is copied to pinned host memory by the
        # progress thread on a side stream ordered after the caller's (an event, so the
        # caller, often autograd's thread, returns at once); otherwise comm._stage on the
        # calling thread (a non-contiguous tensor through a contiguous copy). Chunks then
        # move host memory only; the copy back runs in finish, and wait() orders the
        # waiting stream after it (Work._record_events).
        self._check_usable()
        if _comm.checks._DEBUG:  # as the whole call would be, on the pool member it would take
            _comm._check_same_call(_comm._collective_comm(self._pool), "allreduce", self._async,
                                   op=repr(op), dtype=_comm.dtypes._dtype_name(tensor.dtype),
                                   numel=tensor.numel())
        if (tensor.is_cuda and tensor.is_contiguous() and self._async
                and not _cuda.takes_device_memory(nonblocking=True)):
            mirror = _staging.HostMirror(tensor, nbytes)
            _cuda.carried("staged")
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
            chunks = Chunks(mirror.host, op, self._chunk_comm, nbytes, stage_from=(mirror, ready))
            # back on the stream of the progress thread, which Work._record_events records
            back = functools.partial(torch.cuda.current_stream, tensor.device)
            finish = lambda: mirror.copy_back(stream=back())  # noqa: E731
        else:
            _, (staged,), finish = _comm._stage((tensor,), (tensor,))
            chunks = Chunks(staged, op, self._chunk_comm, nbytes)
        # the call check, once staging could no longer fail here; no chunk starts before it
        chunks.gate = check = self._call_check(("allreduce", tensor, op, 0), gate=True)
        if not self._async:
            _work.checked_wait([check.handle] if check else [], check, None, [tensor])
            chunks.run()
            if finish is not None:
                finish()
            return self._record(_work.Done([tensor]) if opts.asyncOp else _work.blocking([tensor]))
        work = self._work([], [tensor], finish, chunks=chunks,
                          label=("allreduce in chunks", tensor, "op", op))
        _progress.add(work)
        if not opts.asyncOp or _progress.in_thread():
            work.wait()
            return self._record(_work.Done([tensor]) if opts.asyncOp else _work.blocking([tensor]))
        return self._record(work)

    def _sparse_allreduce(self, opts, tensor):
        """A sparse COO sum, as gloo's: every rank's indices and values gathered, then coalesced."""
        if opts.reduceOp.op != ReduceOp.SUM:
            raise ValueError(f"all_reduce of a sparse tensor supports SUM only, got "
                             f"{opts.reduceOp.op}")
        self._check_usable()
        mine = tensor.detach().coalesce()
        indices, _ = _comm.allgatherv(mine.indices().t().contiguous(), comm=self._pool)
        values, _ = _comm.allgatherv(mine.values().contiguous(), comm=self._pool)
        total = torch.sparse_coo_tensor(indices.t(), values, mine.shape).coalesce()
        tensor.copy_(total)  # in place, as gloo: the caller's tensor holds the sum
        return self._record(_work.Done([tensor]) if opts.asyncOp else _work.blocking([tensor]))

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else _c10d.AllreduceCoalescedOptions()
        tensors = list(tensors)
        if not tensors:
            return _work.Done([])
        _check_dtypes("allreduce_coalesced", tensors, tensors[0].dtype)
        flat = _flat(tensors)
        op = self._op(opts, flat)
        return self._run(opts, lambda nb: (_comm.iallreduce if nb else _comm.allreduce)(
            flat, op, comm=self._pool), tensors, _unpack(flat, tensors),
            check=("allreduce", flat, op, 0))

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else _c10d.BroadcastOptions()
        tensor = _one(tensors, "broadcast")
        moved = _as_moved(tensor)
        root = opts.rootRank
        return self._run(opts, lambda nb: (_comm.ibroadcast if nb else _comm.broadcast)(
            moved, root, comm=self._pool), [tensor], check=("broadcast", moved, None, root))

    def _allgather_flat(self, opts, output, tensor, result, finish=None):
        out, inp = _as_moved(_detached(output)), _as_moved(_detached(tensor))
        return self._run(opts, lambda nb: (_comm.iallgather if nb else _comm.allgather)(
            out, inp, comm=self._pool), result, finish, check=("allgather", inp, None, 0))

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        tensor = _one(inputs, "allgather")
        outputs = _one(output_lists, "allgather")
        _check_world_list("all_gather", "tensor_list", outputs, self.size(), tensor.numel(),
                          tensor.dtype)
        flat = tensor.new_empty((self.size() * tensor.numel(),))
        return self._allgather_flat(opts, flat, tensor, list(outputs), _unpack(flat, outputs))

    def _allgather_base(self, output, tensor, opts=None):
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        if output.dtype != tensor.dtype:
            raise TypeError(f"all_gather_into_tensor: output and input must have the same dtype, "
                            f"got {output.dtype} and {tensor.dtype}")
        if output.is_contiguous():
            return self._allgather_flat(opts, output, tensor, [output])
        flat = output.new_empty(output.shape)  # the comm layer stages it; keep the alias rule
        return self._allgather_flat(opts, flat, tensor, [output], lambda: output.copy_(flat))

    all_gather_single = _allgather_base

    def _many(self, opts, calls, result, finish=None):
        """Coalesced calls: each ``call(nonblocking)`` returns a handle; one Work for all."""
        def start(nb):
            handles = [call(nb) for call in calls]
            return handles if nb else None
        return self._run(opts, start, result, finish)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # torch's layout (gloo's): output_lists[r] holds rank r's copy of every input
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        inputs = list(inputs)
        if len(output_lists) != self.size():
            raise ValueError(f"all_gather_coalesced: output_tensor_lists must have world size "
                             f"({self.size()}) lists, got {len(output_lists)}")
        for outputs in output_lists:
            if [t.numel() for t in outputs] != [t.numel() for t in inputs]:
                raise ValueError(f"all_gather_coalesced: each output list must match the inputs' "
                                 f"sizes {[t.numel() for t in inputs]}, got "
                                 f"{[t.numel() for t in outputs]}")
        if not inputs:
            return self._record(_work.Done([]))
        everything = [t for outputs in output_lists for t in outputs]
        _check_dtypes("all_gather_coalesced", inputs + everything, inputs[0].dtype)
        flat = torch.cat([_detached(t).reshape(-1) for t in inputs])
        gathered = flat.new_empty((self.size() * flat.numel(),))
        return self._allgather_flat(opts, gathered, flat, everything, _unpack(gathered, everything))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        for out, tensor in zip(outputs, inputs):
            if out.dtype != tensor.dtype or not out.is_contiguous():
                raise ValueError("all_gather_into_tensor (coalesced): outputs must be contiguous "
                                 "and of their input's dtype")
        calls = [functools.partial(_gather_call, _as_moved(o), _as_moved(t), self._pool)
                 for o, t in zip(outputs, inputs)]
        return self._many(opts, calls, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        output = _one(outputs, "reduce_scatter")
        inputs = _one(input_lists, "reduce_scatter")
        _check_world_list("reduce_scatter", "input_list", inputs, self.size(), output.numel(),
                          output.dtype)
        flat = _flat(inputs)
        if len(inputs) == 1 and opts.reduceOp.op == ReduceOp.PREMUL_SUM:
            flat = flat.clone()  # a view of the input, which PREMUL_SUM's factor must not touch
        op = self._op(opts, flat)
        return self._run(opts, lambda nb: (_comm.ireduce_scatter if nb else _comm.reduce_scatter)(
            output, flat, op, comm=self._pool), [output], check=("reduce_scatter", output, op, 0))

    def _reduce_scatter_base(self, output, tensor, opts=None):
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        output, tensor = _detached(output), _detached(tensor)
        if _comm._overlap(output, tensor) or opts.reduceOp.op == ReduceOp.PREMUL_SUM:
            tensor = tensor.clone()  # PREMUL_SUM scales it: the caller's input stays as it was
        op = self._op(opts, tensor)
        return self._run(opts, lambda nb: (_comm.ireduce_scatter if nb else _comm.reduce_scatter)(
            output, tensor, op, comm=self._pool), [output], check=("reduce_scatter", output, op, 0))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        premul = opts.reduceOp.op == ReduceOp.PREMUL_SUM  # scales the input: work on a copy
        inputs = [t.clone() if premul or _comm._overlap(o, t) else t
                  for o, t in zip(outputs, inputs)]
        ops = [self._op(opts, t) for t in inputs]
        calls = [functools.partial(_reduce_scatter_call, o, t, op, self._pool)
                 for o, t, op in zip(outputs, inputs, ops)]
        return self._many(opts, calls, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, tensor, output_splits, input_splits, opts=None):
        opts = opts if opts is not None else _c10d.AllToAllOptions()
        out, inp = _as_moved(_detached(output)), _as_moved(_detached(tensor))
        if _comm._overlap(out, inp):  # in place: MPI forbids aliased buffers
            inp = inp.clone()
        if out.dtype != inp.dtype:
            raise TypeError(f"all_to_all_single: output and input must have the same dtype, got "
                            f"{output.dtype} and {tensor.dtype}")
        outs = list(output_splits) or None
        ins = list(input_splits) or None
        return self._run(opts, lambda nb: (_comm.ialltoall if nb else _comm.alltoall)(
            out, inp, outs, ins, comm=self._pool), [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _c10d.AllToAllOptions()
        for name, tensors in (("output_tensor_list", outputs), ("input_tensor_list", inputs)):
            if len(tensors) != self.size():
                raise ValueError(f"all_to_all: {name} must have world size ({self.size()}) "
                                 f"tensors, got {len(tensors)}")
        _check_dtypes("all_to_all", list(outputs) + list(inputs), inputs[0].dtype)
        sent = _flat(inputs)
        received = sent.new_empty((sum(t.numel() for t in outputs),))
        moved_in, moved_out = _as_moved(sent).reshape(-1), _as_moved(received).reshape(-1)
        scale = moved_in.numel() // sent.numel() if sent.numel() else 1  # bytes, complex halves
        splits_in = [t.numel() * scale for t in inputs]
        splits_out = [t.numel() * scale for t in outputs]
        return self._run(opts, lambda nb: (_comm.ialltoall if nb else _comm.alltoall)(
            moved_out, moved_in, splits_out, splits_in, comm=self._pool), list(outputs),
            _unpack(received, outputs))

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else _c10d.ReduceOptions()
        tensor = _one(tensors, "reduce")
        root = opts.rootRank
        # PREMUL_SUM scales the input: a sender's tensor stays as it was, as with other ops
        sent = tensor.clone() if opts.reduceOp.op == ReduceOp.PREMUL_SUM and \
            self.rank() != root else tensor
        op = self._op(opts, sent)
        return self._run(opts, lambda nb: (_comm.ireduce if nb else _comm.reduce)(
            sent, root, op, comm=self._pool), [tensor], check=("reduce", sent, op, root))

    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else _c10d.GatherOptions()
        tensor = _one(inputs, "gather")
        root = opts.rootRank
        if self.rank() != root:
            if output_lists and len(output_lists[0]):
                raise ValueError(f"gather: gather_list must be empty on ranks other than the "
                                 f"destination ({root})")
            moved = _as_moved(tensor)
            return self._run(opts, lambda nb: (_comm.igather if nb else _comm.gather)(
                moved, None, root, comm=self._pool), [])
        outputs = _one(output_lists, "gather")
        if len(outputs) != self.size():
            raise ValueError(f"gather: gather_list must have world size ({self.size()}) "
                             f"tensors on the destination, got {len(outputs)}")
        _check_same_sizes("gather: gather_list", outputs, tensor.numel())
        _check_dtypes("gather: gather_list", outputs, tensor.dtype)
        moved = _as_moved(tensor)
        flat = tensor.new_empty((self.size() * tensor.numel(),))
        return self._run(opts, lambda nb: (_comm.igather if nb else _comm.gather)(
            moved, _as_moved(flat), root, comm=self._pool), list(outputs), _unpack(flat, outputs))

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else _c10d.ScatterOptions()
        output = _one(outputs, "scatter")
        root = opts.rootRank
        moved_out = _as_moved(output)
        if self.rank() != root:
            if input_lists and len(input_lists[0]):
                raise ValueError(f"scatter: scatter_list must be empty on ranks other than the "
                                 f"source ({root})")
            flat = None
        else:
            inputs = _one(input_lists, "scatter")
            if len(inputs) != self.size():
                raise ValueError(f"scatter: scatter_list must have world size ({self.size()}) "
                                 f"tensors on the source, got {len(inputs)}")
            _check_same_sizes("scatter: scatter_list", inputs, output.numel())
            _check_dtypes("scatter: scatter_list", inputs, output.dtype)
            flat = _as_moved(_flat(inputs)).reshape(-1)
        target = moved_out if moved_out.is_contiguous() else moved_out.contiguous()
        finish = None if target is moved_out else (lambda: moved_out.copy_(target))
        return self._run(opts, lambda nb: (_comm.iscatter if nb else _comm.scatter)(
            target.reshape(-1), flat, root, comm=self._pool), [output], finish)

    def barrier(self, opts=None):
        opts = opts if opts is not None else _c10d.BarrierOptions()
        return self._run(opts, lambda nb: _comm.ibarrier(comm=self._pool) if nb else
                         _comm.barrier(comm=self._pool), [])

    # -- point to point (first member of the pool: ordered between two ranks) ----------------

    def send(self, tensors, dst: int, tag: int):
        tensor = _one(tensors, "send")
        moved = _as_moved(tensor)
        self._check_usable()
        handle = _comm.isend(moved, dst, tag, comm=self._pool)
        work = self._work([handle], [tensor], ordered=False)
        if self._async:  # else wait() or is_completed() on the program's thread completes it
            _progress.add(work)
        return work

    def recv(self, tensors, src: int, tag: int):
        return self._receive(tensors, src, tag, "recv")

    def recv_anysource(self, tensors, tag: int):
        return self._receive(tensors, None, tag, "recv_anysource")

    def _receive(self, tensors, src, tag, what):
        tensor = _one(tensors, what)
        moved = _as_moved(tensor)
        self._check_usable()
        handle, status = _comm._irecv(moved, src, tag, self._pool)
        work = self._work([handle], [tensor], ordered=False, source=status)
        if self._async:  # else wait() or is_completed() on the program's thread completes it
            _progress.add(work)
        return work


def _gather_call(output, tensor, pool, nonblocking):
    return (_comm.iallgather if nonblocking else _comm.allgather)(output, tensor, comm=pool)


def _reduce_scatter_call(output, tensor, op, pool, nonblocking):
    return (_comm.ireduce_scatter if nonblocking else _comm.reduce_scatter)(
        output, tensor, op, comm=pool)
