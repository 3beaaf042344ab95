"""Tests that need no MPI launch: bucket layout, argument checks, sampler, pack/unpack."""

import builtins
import multiprocessing
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mpidp
from mpidp import cuda, topology
from mpidp.ddp.buckets import LaunchOrder, Shards, assign_buckets
from mpidp.ddp.data_parallel import first_mismatch
from mpidp.kernels import pack, unpack

ROOT = Path(__file__).resolve().parent.parent
F32, F64 = (torch.float32, "cpu"), (torch.float64, "cpu")


def test_buckets_fill_in_reverse_order_with_a_small_first_bucket():
    sizes = [400, 400, 400, 400, 400, 400]
    assert assign_buckets(sizes, [F32] * 6, cap_bytes=1000, first_cap_bytes=300) == [
        [5], [4, 3, 2], [1, 0]]


def test_a_bucket_closes_once_it_reaches_its_cap():
    assert assign_buckets([10, 990, 10, 1], [F32] * 4, cap_bytes=1000, first_cap_bytes=1000) == [
        [3, 2, 1], [0]]


def test_buckets_hold_one_dtype_each_and_keep_gradient_order():
    keys = [F32, F64, F32, F64]
    layout = assign_buckets([8, 8, 8, 8], keys, cap_bytes=1 << 20, first_cap_bytes=1 << 20)
    assert layout == [[3, 1], [2, 0]]
    for members in layout:
        assert len({keys[i] for i in members}) == 1


def test_every_parameter_lands_in_exactly_one_bucket():
    sizes = [(i * 7919) % 5000 + 1 for i in range(200)]
    layout = assign_buckets(sizes, [F32] * 200, cap_bytes=20000, first_cap_bytes=4000)
    assert sorted(i for members in layout for i in members) == list(range(200))
    for members in layout[:-1]:  # every closed bucket reached its cap with its last tensor
        assert sum(sizes[i] for i in members[:-1]) < 20000


def test_solo_parameters_get_their_own_bucket_and_keep_neighbours_together():
    # biases (10 B) and weights (1000 B) alternate, as in an MLP; weights go solo
    sizes = [1000, 10] * 3
    layout = assign_buckets(sizes, [F32] * 6, cap_bytes=500, first_cap_bytes=500, solo_bytes=1000)
    # a bias bucket never spans a solo weight, so each is ready when its layer is done
    assert layout == [[5], [4], [3], [2], [1], [0]]
    layout = assign_buckets([10, 10, 1000, 10, 10], [F32] * 5, cap_bytes=500, first_cap_bytes=500,
                            solo_bytes=1000)
    assert layout == [[4, 3], [2], [1, 0]]


def test_bucket_assignment_follows_a_given_arrival_order():
    layout = assign_buckets([4] * 4, [F32] * 4, cap_bytes=8, first_cap_bytes=8, order=[0, 1, 2, 3])
    assert layout == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="order must hold every index from 0 to 3 once"):
        assign_buckets([4] * 4, [F32] * 4, cap_bytes=8, first_cap_bytes=8, order=[0, 0, 1, 2])


def test_buckets_start_once_full_and_strictly_in_bucket_order():
    order = LaunchOrder([[0, 1], [2], [3, 4]])
    assert order.arrived(1) and list(order.startable()) == []  # full, but bucket 0 is not
    assert not order.arrived(0) and order.arrived(0)
    assert list(order.startable()) == [0, 1]
    assert not order.arrived(2) and list(order.startable()) == []
    assert list(order.startable(all_left=True)) == [2]  # the end: the rest, full or not
    assert list(order.startable(all_left=True)) == []  # each bucket is given once


def test_bucket_assignment_rejects_bad_caps():
    with pytest.raises(ValueError, match="bucket caps must be > 0, got 0 and 10"):
        assign_buckets([1], [F32], cap_bytes=0, first_cap_bytes=10)


def _check_shards(numels: list[int], world: int, chunk_elems: int) -> None:
    """Every element of the tensors laid end to end is owned by exactly one rank, at the
    position its rank's blocks give it, and every rank's shard has the same size."""
    total = sum(numels)
    shards = Shards(total, world, chunk_elems)
    assert shards.numel == total
    assert shards.padded % world == 0 and 0 <= shards.padded - total < world
    assert shards.shard_numel * world == shards.padded
    step = world * max(1, chunk_elems // world)
    assert shards.chunks[0][0] == 0 and shards.chunks[-1][1] == shards.padded
    for (start, stop), (after, _) in zip(shards.chunks, shards.chunks[1:]):
        assert stop == after and stop - start == step  # all full but the last
    for start, stop in shards.chunks:
        assert 0 < stop - start <= step and (stop - start) % world == 0
    flat = torch.arange(shards.padded)
    offsets = [sum(numels[:k]) for k in range(len(numels))]
    owner = torch.full((total,), -1)
    for rank in range(world):
        blocks = shards.blocks(rank)
        assert [position for _, _, position in blocks] == \
            [sum(b - a for a, b, _ in blocks[:k]) for k in range(len(blocks))]
        shard = torch.cat([flat[low:high] for low, high, _ in blocks])
        assert shard.numel() == shards.shard_numel  # equal on every rank
        for tensor, start, stop, position in shards.pieces(rank, numels):
            assert 0 <= start < stop <= numels[tensor]
            elements = torch.arange(offsets[tensor] + start, offsets[tensor] + stop)
            assert torch.equal(shard[position:position + stop - start], elements)
            assert (owner[elements] == -1).all(), "an element owned twice"
            owner[elements] = rank
    assert (owner >= 0).all(), f"elements owned by nobody: {(owner < 0).nonzero().flatten()}"


@pytest.mark.parametrize("numels,world,chunk_elems", [
    ([1], 1, 1), ([1], 4, 1), ([1], 4, 1000), ([7], 3, 1), ([10], 4, 3), ([12], 4, 4),
    ([100], 4, 8), ([320, 32, 1024, 32, 160, 5], 3, 131), ([131], 4, 131), ([5, 0, 7], 2, 3),
    ([1, 1, 1], 4, 5), ([1000], 7, 100), ([33, 1, 64], 4, 1 << 20)])
def test_shards_give_every_element_to_exactly_one_rank(numels, world, chunk_elems):
    _check_shards(numels, world, chunk_elems)


def test_shards_give_every_element_to_exactly_one_rank_in_a_sweep():
    generator = torch.Generator().manual_seed(0)
    for world in range(1, 6):
        for chunk_elems in (1, 2, 3, 5, 8, 13, 64):
            for _ in range(6):
                count = int(torch.randint(1, 5, (), generator=generator))
                numels = torch.randint(0, 40, (count,), generator=generator).tolist()
                if sum(numels) > 0:
                    _check_shards(numels, world, chunk_elems)


def test_shards_of_a_big_tensor_split_it_between_all_ranks_evenly():
    shards = Shards(1000, 4, 64)  # chunks of 64: 16 elements of each per rank
    assert shards.padded == 1000 and shards.shard_numel == 250 and len(shards.chunks) == 16
    per_rank = [shards.pieces(rank, [1000]) for rank in range(4)]
    for rank, pieces in enumerate(per_rank):
        assert sum(stop - start for _, start, stop, _ in pieces) == 250
        assert pieces[0][1:3] == (16 * rank, 16 * rank + 16)
    assert Shards(10, 4, 100).padded == 12 and Shards(10, 4, 100).chunks == [(0, 12)]


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(bucket_cap_mb=0), ValueError, "bucket_cap_mb must be a number > 0, got 0"),
    (dict(bucket_cap_mb=-1.5), ValueError, "bucket_cap_mb must be a number > 0, got -1.5"),
    (dict(bucket_cap_mb="25"), ValueError, "bucket_cap_mb must be a number > 0, got '25'"),
    (dict(bucket_cap_mb=True), ValueError, "bucket_cap_mb must be a number > 0, got True"),
    (dict(first_bucket_mb=0), ValueError, "first_bucket_mb must be a number > 0, got 0"),
    (dict(find_unused_parameters="yes"), TypeError, "find_unused_parameters must be a bool, got 'yes'"),
    (dict(broadcast_buffers=1), TypeError, "broadcast_buffers must be a bool or None, got 1"),
    (dict(gradient_as_bucket_view=None), TypeError, "gradient_as_bucket_view must be a bool, got None"),
    (dict(pool_size=0), ValueError, "pool_size must be an int >= 1, got 0"),
    (dict(comm="world"), TypeError, "comm must be None or an mpi4py Intracomm, got str"),
    (dict(overlap="mpi"), ValueError,
     "overlap must be one of 'auto', 'inline', 'thread', 'nonblocking', got 'mpi'"),
    (dict(chunk_mb=0), ValueError, "chunk_mb must be a number > 0, got 0"),
    (dict(inplace_threshold_mb=-1), ValueError, "inplace_threshold_mb must be a number > 0, None or \"auto\", got -1"),
])
def test_ddp_argument_errors_name_argument_rule_and_value(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        mpidp.DistributedDataParallel(nn.Linear(2, 2), **kwargs)


def test_ddp_rejects_a_non_module_and_a_model_without_trainable_parameters():
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got function"):
        mpidp.DistributedDataParallel(lambda x: x)
    with pytest.raises(ValueError, match="module has no parameter that requires grad"):
        mpidp.DistributedDataParallel(nn.Linear(2, 2).requires_grad_(False))


def test_first_mismatch_describes_the_first_difference():
    same = [("parameter", "w", (2,), "float32", True)]
    assert first_mismatch([same, same]) is None
    other = [("parameter", "w", (3,), "float32", True)]
    assert first_mismatch([same, same, other]) == (
        "rank 2 has parameter 'w' with shape (3,), dtype float32, requires_grad=True where "
        "rank 0 has parameter 'w' with shape (2,), dtype float32, requires_grad=True")


@pytest.mark.parametrize("size,drop_last,shuffle", [(10, False, False), (10, True, False),
                                                    (11, False, True), (11, True, True)])
def test_sampler_shards_cover_the_dataset_like_torch(size, drop_last, shuffle):
    dataset = list(range(size))
    samplers = [mpidp.DistributedSampler(dataset, num_replicas=3, rank=r, shuffle=shuffle,
                                         drop_last=drop_last, seed=5) for r in range(3)]
    for sampler in samplers:
        sampler.set_epoch(2)
    shards = [list(s) for s in samplers]
    per_rank = size // 3 if drop_last else -(-size // 3)
    assert [len(s) for s in shards] == [per_rank] * 3 == [len(s) for s in samplers]
    flat = [i for shard in shards for i in shard]
    if drop_last:
        assert len(set(flat)) == len(flat) == 3 * (size // 3)
    else:
        assert set(flat) == set(dataset)  # padded with repeats to an equal share
    if not shuffle:
        assert shards[1][:3] == [1, 4, 7]


def test_sampler_defaults_come_from_mpi_and_bad_rank_is_rejected():
    sampler = mpidp.DistributedSampler(list(range(8)))
    assert (sampler.num_replicas, sampler.rank) == (mpidp.size(), mpidp.rank())
    with pytest.raises(ValueError, match=r"Invalid rank 3, rank should be in the interval \[0, 2\]"):
        mpidp.DistributedSampler(list(range(8)), num_replicas=3, rank=3)


def test_sampler_epochs_reshuffle_the_same_way_on_every_rank():
    dataset = list(range(20))
    orders = []
    for epoch in (0, 1, 0):
        sampler = mpidp.DistributedSampler(dataset, num_replicas=2, rank=0, seed=3)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert orders[0] == orders[2] != orders[1]


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32),
                                             (torch.float32, torch.float16),
                                             (torch.float64, torch.float64),
                                             (torch.int64, torch.int64)])
def test_pack_unpack_roundtrip_with_odd_and_empty_tensors(dtype, out_dtype):
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (0,), (1,), (7, 1, 2), (), (129,)]
    tensors = [(torch.randn(s, generator=gen) * 10).to(dtype) for s in shapes]
    total = sum(t.numel() for t in tensors)
    flat = torch.full((total,), 99, dtype=out_dtype)
    pack(tensors, flat, scale=0.5 if dtype.is_floating_point else None)
    expected = torch.cat([t.reshape(-1) for t in tensors]).to(out_dtype)
    if dtype.is_floating_point:
        expected = (torch.cat([t.reshape(-1) for t in tensors]) * 0.5).to(out_dtype)
    torch.testing.assert_close(flat, expected, rtol=0, atol=0)
    back = [torch.full_like(t, -1) for t in tensors]
    unpack(flat, back, scale=2.0 if dtype.is_floating_point else None)
    for original, restored in zip(tensors, back):
        tol = 1e-2 if out_dtype == torch.float16 else 0
        torch.testing.assert_close(restored, original, rtol=tol, atol=tol)


def test_pack_checks_sizes_and_layout_before_copying():
    with pytest.raises(ValueError, match="out must have 5 elements \\(the tensors' total\\), got 4"):
        pack([torch.ones(2), torch.ones(3)], torch.empty(4))
    with pytest.raises(ValueError, match="flat must be a contiguous 1-d tensor, got shape \\(2, 2\\)"):
        unpack(torch.empty(2, 2), [torch.ones(4)])
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a torch.Tensor, got int"):
        pack([torch.ones(1), 3], torch.empty(2))


def test_abort_hooks_can_be_turned_off_and_on():
    previous = sys.excepthook, sys.exit, builtins.exit, mpidp.exits._abort_enabled
    try:
        mpidp.abort_on_exception(True)
        assert sys.excepthook is mpidp.exits._abort_excepthook
        assert sys.exit is mpidp.exits._exit and isinstance(builtins.exit, mpidp.exits._Quitter)
        with pytest.raises(SystemExit) as exit_info:  # still raises as Python's sys.exit does
            sys.exit(3)
        assert exit_info.value.code == 3
        assert mpidp.exits._exit_request[0] == 3
        mpidp.abort_on_exception(False)
        assert sys.excepthook is mpidp.exits._python_excepthook
        assert sys.exit is mpidp.exits._python_exit
        assert builtins.exit is mpidp.exits._python_quitters["exit"]
    finally:
        sys.excepthook, sys.exit, builtins.exit, mpidp.exits._abort_enabled = previous
        mpidp.exits._exit_request = None


def _rank_in_child(queue):
    try:
        mpidp.rank()
    except RuntimeError as err:
        queue.put(str(err))
    else:
        queue.put("mpidp.rank() worked in a forked child")


def test_mpi_calls_refuse_in_a_forked_child_and_still_work_in_the_parent():
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_rank_in_child, args=(queue,))
    child.start()
    message = queue.get(timeout=60)
    child.join(timeout=60)
    assert "MPI is not available in a multiprocessing child" in message
    assert not mpidp.runtime.in_multiprocessing_child() and mpidp.rank() == 0


@pytest.mark.parametrize("value,expected", [("", True), ("1", True), ("on", True), (" YES ", True),
                                            ("true", True), ("0", False), ("Off", False),
                                            ("no", False), ("FALSE", False)])
def test_mpidp_variables_accept_the_usual_spellings(monkeypatch, value, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name in ("MPIDP_SET_THREADS", "MPIDP_ABORT_ON_EXCEPTION", "MPIDP_STAGE_CPU", "MPIDP_CUDA_AWARE"):
        monkeypatch.setenv(name, value)
    assert (topology.default_threads() is not None) is expected
    assert mpidp.runtime._abort_from_env() is expected
    assert cuda.stage_cpu() is (expected and value != "")  # off unless asked for
    decision = cuda.decision.__wrapped__()  # not the cached start-up decision
    if value:
        assert decision == cuda.Decision(expected, f"MPIDP_CUDA_AWARE={int(expected)}")
    else:
        assert not decision.reason.startswith("MPIDP_CUDA_AWARE")  # empty: no override


READERS = {"MPIDP_SET_THREADS": lambda: topology.default_threads(),
           "MPIDP_ABORT_ON_EXCEPTION": lambda: mpidp.runtime._abort_from_env(),
           "MPIDP_STAGE_CPU": lambda: cuda.stage_cpu(),
           "MPIDP_CUDA_AWARE": lambda: cuda.decision.__wrapped__()}


@pytest.mark.parametrize("name", sorted(READERS))
@pytest.mark.parametrize("value", ["2", "enable", "y"])
def test_mpidp_variables_reject_other_spellings_the_same_way(monkeypatch, name, value):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(
            f"{name} must be one of 1/true/yes/on or 0/false/no/off (any case), got {value!r}")):
        READERS[name]()


def test_world_of_one_without_mpiexec():
    assert (mpidp.rank(), mpidp.size(), mpidp.local_rank(), mpidp.local_size()) == (0, 1, 0, 1)
    mpidp.barrier()


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"<!-- test-command -->\n```bash\n(.+?)\n```", readme, re.S).group(1)
    assert command.strip() in ci


def test_setup_cfg_lists_every_package_of_mpidp():
    # A package missing from setup.cfg is missing from a non-editable install (mpidp.doctor was).
    listed = re.search(r"^packages =\n((?:[ \t]+\S+\n)+)", (ROOT / "setup.cfg").read_text(), re.M)
    listed = set(listed.group(1).split())
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for init in (ROOT / "mpidp").rglob("__init__.py")}
    found.add("mpidp.kernels")
    assert found <= listed, f"setup.cfg [options] packages lacks {sorted(found - listed)}"


def test_the_store_pauses_between_polls_by_how_long_it_has_been_quiet():
    """mpidp.store.server's polls (docs/concurrency.md): never without a pause, and the limits."""
    from mpidp.store.server import _CALLER_LONGEST, _longest, _next_pause

    def settled(longest: float) -> float:
        pause = 0.0
        for _ in range(20):
            pause = _next_pause(pause, longest)
            assert pause >= 20e-6  # a poll that found nothing always sleeps
        return pause

    assert _next_pause(0.0, 0.001) == 20e-6
    assert settled(_longest(0.0, False)) == 250e-6  # a burst: a start-up's calls
    assert settled(_longest(0.5, False)) == settled(_longest(5.0, True)) == 0.001  # keys coming
    assert settled(_longest(5.0, False)) == 0.020  # idle
    assert settled(_longest(60.0, False)) == 0.100
    assert settled(_longest(60.0, True)) == settled(_CALLER_LONGEST) == 0.001


def test_a_datatype_the_library_lacks_is_not_taken_for_a_native_one():
    """Open MPI 4.1 has no MPI_FLOAT16_T: mpi4py's name for it is a handle that is neither
    DATATYPE_NULL nor valid, and reducing with it crashed inside MPI_Reduce_local."""
    from mpi4py import MPI

    from mpidp.comm import dtypes
    assert not dtypes._usable(MPI.Datatype.fromhandle(0), torch.float16)  # invalid on MPICH too
    assert not dtypes._usable(MPI.DATATYPE_NULL, torch.float32)
    assert not dtypes._usable(MPI.DOUBLE, torch.float32)  # the size must match the dtype's
    assert dtypes._usable(MPI.FLOAT, torch.float32) and dtypes._usable(MPI.C_BOOL, torch.bool)


def _straggler_run(share: float, step_ms: float, late_ms: float, steps: int = 4) -> dict:
    """A 2-rank straggler record fed the sums the bookkeeping allreduce would give: rank 1
    ``late_ms`` late at every step of ``step_ms`` (each rank's period in the last slot)."""
    from mpidp.ddp.stragglers import Stragglers
    record = Stragglers(0, 2, threshold_ms=100.0, steps=3, share=share)
    for step in range(steps):
        record.waited(step, None)
        period_us = 0 if step == 0 else int(step_ms * 1e3)
        # rank 0 waits late_ms for rank 1, which waits almost nothing; both report a period
        record.read(np.array([int(late_ms * 1e3) + 1000, 1000, 2 * period_us], dtype=np.int64))
    return record.named


def test_a_straggler_is_late_by_the_ms_threshold_and_by_a_share_of_the_step():
    """mpidp.ddp.stragglers: 150 ms late is named on 300 ms steps, not on 2 s steps with a
    share of 0.1 (200 ms); a share of 0 keeps the ms threshold alone; 50 ms is never named."""
    assert list(_straggler_run(0.1, 300.0, 150.0)) == [1]
    assert _straggler_run(0.1, 2000.0, 150.0) == {}
    assert list(_straggler_run(0.0, 2000.0, 150.0)) == [1]
    assert _straggler_run(0.1, 300.0, 50.0) == {}
    assert _straggler_run(0.0, 300.0, 50.0) == {}


def test_trace_names_the_rank_that_never_came_before_the_ranks_that_waited_for_it():
    """Real flight records (tests/data/trace-two-nodes: bench/stall_soak.py's ``limit``, MPICH, two
    nodes of 2 ranks): rank 3 sleeps at DDP step 3; DDP's staged reduction left rank 2 in its
    node's stage, waiting for rank 3, and ranks 0 and 1 in the stage across nodes. Rank 0
    started there first, so by time alone the first finding named rank 2, which only waited."""
    from mpidp import trace
    lines, agree = trace.report(str(ROOT / "tests" / "data" / "trace-two-nodes"))
    assert not agree
    first = next(n for n, line in enumerate(lines) if line.startswith("1. "))
    assert lines[first].startswith("1. never arrived on ranks 2-3 #2 (shared-memory reduction: "
                                   "the node's ranks), collective #11"), lines
    assert lines[first + 1].startswith("    rank 3 never started it"), lines
    last = next(n for n, line in enumerate(lines) if line.startswith("3. "))
    assert lines[last].startswith("3. never arrived on ranks 0, 2 #1"), lines
    assert lines[last + 2].startswith("    rank 2 was waiting in shared-memory allreduce op=sum "
                                      "count=68362 dtype=float32 (DDP step 3 bucket 1/2"), lines


def test_trace_reads_the_black_box_of_a_rank_killed_before_it_wrote():
    """Real files (tests/data/trace-killed-box: bench/stall_soak.py's ``killed``, Open MPI, two
    nodes of 2 ranks): rank 3 killed itself with SIGKILL in DDP step 3; ranks 0-2 wrote their
    records at the launcher's SIGTERM, rank 3 left only its black box (no scope, no extras).
    The trace reads the box, does not take the missing extras for a divergence, and names
    rank 3 first."""
    from mpidp import trace
    lines, agree = trace.report(str(ROOT / "tests" / "data" / "trace-killed-box"))
    assert not agree
    assert "written by rank 3: its black box" in "\n".join(lines), lines
    assert not any("divergence" in line for line in lines), lines
    first = next(n for n, line in enumerate(lines) if line.startswith("1. "))
    assert lines[first].startswith("1. never arrived on ranks 1, 3 #1"), lines
    assert "(DDP step 3 bucket 1/2" in lines[first], lines  # described from rank 1's file
    assert lines[first + 1].startswith("    rank 3 never started it; its last there: #5 allreduce "
                                       "count=8320 dtype=float32"), lines


def test_trace_tells_a_stopped_rank_from_a_dead_one_and_from_a_clean_exit(tmp_path):
    """A rank that wrote no file of its own is named by what another rank heard from it as it
    left (stopped, and where), by the pid file a clean exit removes (dead), or, having left
    nothing at all, as a clean exit (a killed rank leaves its pid file and black box)."""
    import json

    from mpidp import trace
    record = json.loads((ROOT / "tests" / "data" / "trace-two-nodes" / "rank-00000.json").read_text())
    record["ended"] = {"1": "stopped at train.py:60 (exit_for_requeue(75), status 75)"}
    (tmp_path / "rank-00000.json").write_text(json.dumps(record))
    (tmp_path / "rank-00002.pid").write_text("mpidp rank 2/4, pid 4242 on n1\n")
    lines, _ = trace.report(str(tmp_path))
    assert lines[1:4] == ["rank 1: stopped at train.py:60 (exit_for_requeue(75), status 75)",
                          "rank 2: dead: process 4242 on n1 ended without a clean exit (killed?)",
                          "no file from rank 3: it exited cleanly (finished or stopped), or wrote "
                          "elsewhere (another node's working directory)"], lines


def test_black_box_round_trip_and_a_clean_close(tmp_path, monkeypatch):
    """What started() and ended() write into the box is what read_box() gives back: ended
    collectives with their end, one in flight without; close_box() removes both files."""
    from mpi4py import MPI

    from mpidp import recorder
    monkeypatch.setenv("MPIDP_TRACE_DIR", str(tmp_path))
    assert recorder._box is None  # one process, no watchdog: nothing opened it
    recorder.open_box()
    try:
        box = next(tmp_path.glob("rank-*.box"))
        for count in (3, 4):
            recorder.ended(recorder.started(MPI.COMM_SELF, "allreduce", count, torch.float64))
        recorder.started(MPI.COMM_SELF, "Bcast", 5, "int64")
        data = recorder.read_box(str(box))
        mine = [e for e in data["entries"] if e["comm"] == data["entries"][-1]["comm"]][-3:]
        assert [(e["op"], e["count"], e["dtype"]) for e in mine] == [
            ("allreduce", 3, "float64"), ("allreduce", 4, "float64"), ("Bcast", 5, "int64")]
        assert [e["seq"] for e in mine] == [mine[0]["seq"] + k for k in range(3)]
        assert mine[0]["end"] >= mine[0]["start"] and mine[1]["end"] is not None
        assert mine[2]["end"] is None and mine[2]["extra"] is None
        assert data["pid"] == __import__("os").getpid()
    finally:
        recorder.close_box()
    assert not list(tmp_path.glob("rank-*"))


def test_two_threads_write_the_black_box_at_once(tmp_path, monkeypatch):
    """The box is one mapping that every thread writes (rule: a slot per ticket, the ticket
    written last): two threads recording at once on communicators of their own leave whole
    slots, each channel's collectives in its order, every end after its start."""
    import threading

    from mpi4py import MPI

    from mpidp import recorder
    monkeypatch.setenv("MPIDP_TRACE_DIR", str(tmp_path))
    comms = [MPI.COMM_SELF.Dup() for _ in range(2)]
    recorder.open_box()
    try:
        def record(comm):
            for count in range(3000):
                recorder.ended(recorder.started(comm, "allreduce", count, torch.float32))
        threads = [threading.Thread(target=record, args=(comm,)) for comm in comms]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        data = recorder.read_box(str(next(tmp_path.glob("rank-*.box"))))
    finally:
        recorder.close_box()
        for comm in comms:
            comm.Free()
    entries = data["entries"]
    assert len(entries) == recorder._BOX_SLOTS  # the last 256 of 6000, all whole
    by_comm = {}
    for entry in entries:  # oldest first
        by_comm.setdefault(entry["comm"], []).append(entry)
        assert entry["op"] == "allreduce" and entry["dtype"] == "float32"
        assert entry["end"] is not None and entry["end"] >= entry["start"]
    for mine in by_comm.values():
        assert [e["seq"] for e in mine] == sorted(e["seq"] for e in mine)
        assert all(e["count"] == e["seq"] - mine[0]["seq"] + mine[0]["count"] for e in mine)


def test_profile_merge_gives_each_rank_its_process_and_a_gpu_its_lanes():
    """mpidp.profiler.rank_events on a trace shaped as torch exports one with a GPU: the
    host's threads keep their ids, the device's streams and the profiler's spans become
    named lanes of the rank's process, flow ids stay unique across ranks."""
    from mpidp.profiler import DEVICE_LANES, rank_events
    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 100, "tid": 0, "ts": 5,
         "args": {"name": "python"}},
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "ts": 5, "args": {"name": "GPU 0"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "ts": 5,
         "args": {"name": "stream 7"}},
        {"ph": "X", "name": "aten::mm", "pid": 100, "tid": 101, "ts": 10.5, "dur": 2.0},
        {"ph": "X", "name": "gemm", "pid": 0, "tid": 7, "ts": 11.0, "dur": 1.0},
        {"ph": "X", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
         "ts": 5, "dur": 20},
        {"ph": "s", "name": "launch", "pid": 100, "tid": 101, "ts": 10.5, "id": 3},
        {"ph": "f", "name": "launch", "pid": 0, "tid": 7, "ts": 11.0, "id": 3},
        {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": 25},
    ]}
    events = rank_events(trace, rank=1, size=2, shift_us=-5.0, host_pid=100)
    assert all(e["pid"] == 1 for e in events)
    assert not [e for e in events if e["name"] == "process_name"]
    by_name = {e["name"]: e for e in events if e["ph"] != "M"}
    assert by_name["aten::mm"]["tid"] == 101 and by_name["aten::mm"]["ts"] == 5.5
    assert by_name["gemm"]["tid"] >= DEVICE_LANES and by_name["gemm"]["ts"] == 6.0
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes[by_name["gemm"]["tid"]] == "GPU 0 stream 7"
    assert lanes[by_name["PyTorch Profiler (0)"]["tid"]] == "Spans PyTorch Profiler"
    assert lanes[by_name["Record Window End"]["tid"]] == "profiler"
    assert by_name["Record Window End"]["s"] == "p"  # the rank's own mark, not one across all
    assert [e["id"] for e in events if e["ph"] in "sf"] == [3 * 2 + 1, 3 * 2 + 1]


def test_one_sizes_object_holds_every_size_in_bytes():
    import dataclasses

    from mpidp.comm import chunking

    defaults = chunking.DEFAULTS
    assert defaults == chunking.Sizes.of()
    assert (defaults.bucket_cap, defaults.first_bucket, defaults.inplace) == (25 << 20, 1 << 20, 1 << 20)
    assert defaults.chunk == chunking.chunk_bytes()  # MPIDP_CHUNK_MB as read at import
    small = chunking.Sizes.of(bucket_cap_mb=0.5, chunk_mb=2, inplace_mb=None)
    assert (small.bucket_cap, small.first_bucket, small.chunk, small.inplace) == \
        (1 << 19, 1 << 19, 2 << 20, None)  # the first bucket is never larger than the cap
    with pytest.raises(dataclasses.FrozenInstanceError):
        small.chunk = 1
