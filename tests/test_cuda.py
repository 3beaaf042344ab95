"""The CUDA-aware decision, branch by branch, and what this machine's MPI reports."""

import pytest

import mpidp
from mpidp.cuda import Decision, job_decision, library_reports_cuda, rank_decision


def never(): raise AssertionError("the probe must not run here")  # noqa: E704


def test_override_wins_and_is_validated():
    assert rank_decision("1", False, None, never) == Decision(True, "MPIDP_CUDA_AWARE=1")
    assert rank_decision("0", True, True, never) == Decision(False, "MPIDP_CUDA_AWARE=0")
    with pytest.raises(ValueError, match="MPIDP_CUDA_AWARE must be 0 or 1, got 'yes'"):
        rank_decision("yes", True, True, never)


def test_no_gpu_or_no_word_from_the_library_means_host_staging_without_probing():
    assert rank_decision(None, False, True, never).cuda_aware is False
    assert "does not say" in rank_decision(None, True, None, never).reason
    assert "reports no CUDA support" in rank_decision(None, True, False, never).reason


def test_a_library_that_claims_support_must_pass_the_probe():
    assert rank_decision(None, True, True, lambda: True).cuda_aware is True
    failed = rank_decision(None, True, True, lambda: False)
    assert failed.cuda_aware is False and "wrong answer" in failed.reason


def test_the_probe_runs_on_every_rank_or_on_none():
    both = [(None, True, True), (None, True, True)]
    assert job_decision(both, 1, lambda: True).cuda_aware is True
    # a node with no GPU (or a library that says no) on one rank: nobody probes
    for mixed in ([(None, True, True), (None, False, None)], [(None, True, True), (None, True, False)]):
        for rank in (0, 1):
            result = job_decision(mixed, rank, never)
            assert result.cuda_aware is False and "not every rank" in result.reason
    assert job_decision([(None, False, None)] * 2, 0, never).reason == "no GPU visible to torch"
    assert job_decision([("1", False, None), ("1", True, True)], 0, never).cuda_aware is True
    with pytest.raises(ValueError, match="MPIDP_CUDA_AWARE must be set alike on every rank, got 1, None"):
        job_decision([("1", True, True), (None, True, True)], 1, never)


def test_a_library_that_reads_device_memory_in_blocking_collectives_only_stages_the_others():
    aware = rank_decision(None, True, True, lambda: True, blocking_only=True)
    assert aware.cuda_aware is True and aware.nonblocking is False
    assert "nonblocking collectives staged" in aware.reason
    assert rank_decision("1", False, None, never, blocking_only=True).nonblocking is False
    assert rank_decision(None, True, True, lambda: True).nonblocking is True
    staged = rank_decision(None, True, False, never, blocking_only=True)  # nothing to add when staged
    assert staged == Decision(False, "the MPI library reports no CUDA support; host staging")
    assert job_decision([(None, True, True)] * 2, 0, lambda: True, blocking_only=True).nonblocking is False


def test_this_machine():
    # MPICH and Open MPI both answer (the wheels: False; bench/build_cuda_mpi.sh's: True)
    assert library_reports_cuda() in (True, False)
    aware_for_nonblocking = mpidp.cuda.takes_device_memory(nonblocking=True)
    assert aware_for_nonblocking == (mpidp.cuda.decision().cuda_aware
                                     and mpidp.cuda.decision().nonblocking)
    if not mpidp.cuda.decision().cuda_aware:
        assert mpidp.cuda.decision().reason in ("no GPU visible to torch",
                                                "the MPI library reports no CUDA support; host staging")


# -- the default backend for every GPU visibility (rendezvous.backend_for, cuda.device_index) --

NCCL = "cpu:gloo,cuda:nccl"


def used(seen: list[list[str]], local_ranks: list[int]) -> list:
    """Each rank's GPU: of the UUIDs it sees, the one ``device_index`` picks (None: it sees none)."""
    return [visible[mpidp.cuda.device_index(local, len(visible))] if visible else None
            for visible, local in zip(seen, local_ranks)]


def test_each_rank_seeing_one_gpu_of_its_own_gets_nccl():
    # srun --gpus-per-task=1: every rank's only GPU is its cuda:0, yet they differ
    gpus = used([["GPU-a"], ["GPU-b"], ["GPU-c"], ["GPU-d"]], [0, 1, 2, 3])
    assert gpus == ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    assert mpidp.rendezvous.backend_for(gpus, [True] * 4)[0] == NCCL


def test_every_rank_seeing_every_gpu_takes_its_local_ranks():
    node = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    gpus = used([node] * 4, [0, 1, 2, 3])
    assert gpus == node and mpidp.rendezvous.backend_for(gpus, [True] * 4)[0] == NCCL
    two_nodes = used([["GPU-a", "GPU-b"]] * 2 + [["GPU-c", "GPU-d"]] * 2, [0, 1, 0, 1])
    assert mpidp.rendezvous.backend_for(two_nodes, [True] * 4)[0] == NCCL


def test_ranks_that_share_a_gpu_get_mpidp_and_are_named():
    one = used([["GPU-a"]] * 2, [0, 1])  # two ranks, one GPU (the GPU machines of this project)
    assert mpidp.rendezvous.backend_for(one, [True, True]) == (
        "mpidp", "ranks 0-1 share a GPU (NCCL refuses two ranks on one GPU)")
    more_ranks = used([["GPU-a", "GPU-b"]] * 4, [0, 1, 2, 3])  # 4 ranks, 2 GPUs: round robin
    backend, why = mpidp.rendezvous.backend_for(more_ranks, [True] * 4)
    assert backend == "mpidp" and why.startswith("ranks 0, 2 share a GPU; ranks 1, 3 share")


def test_no_gpu_on_any_or_some_ranks_or_no_nccl_gets_mpidp():
    backend_for = mpidp.rendezvous.backend_for
    assert backend_for([None, None], [True, True]) == ("mpidp", "no rank sees a GPU")
    assert backend_for(["GPU-a", None], [True, True]) == ("mpidp", "no GPU visible on rank 1")
    assert backend_for(["GPU-a", "GPU-b"], [True, False]) == ("mpidp", "torch has no NCCL on rank 1")
    with pytest.raises(ValueError, match="gpus and nccl must list the same ranks, got 2 and 1"):
        backend_for(["GPU-a", "GPU-b"], [True])
    with pytest.raises(ValueError, match="visible must be >= 1 GPU, got 0"):
        mpidp.cuda.device_index(0, 0)


def test_a_gpu_is_named_by_its_uuid_else_by_host_and_visible_entry(monkeypatch):
    import socket
    from types import SimpleNamespace

    import torch
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="1f-2e"))
    assert mpidp.cuda.gpu_identity(0) == "GPU-1f-2e"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert mpidp.cuda.gpu_identity(1) == f"{socket.gethostname()}:5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert mpidp.cuda.gpu_identity(1) == f"{socket.gethostname()}:1"


def test_the_default_backend_is_the_rule_on_the_gathered_facts():
    gpus, nccl = mpidp.cuda.placements()
    assert len(gpus) == len(nccl) == mpidp.size()
    assert mpidp.rendezvous.default_backend() == mpidp.rendezvous.backend_for(gpus, nccl)[0]


# -- pointer or staged: the one rule (cuda.takes_device_memory) and the count of what was taken --

def test_a_forced_decision_chooses_the_path_within_its_block_and_nests():
    cuda = mpidp.cuda
    start = (cuda.takes_device_memory(False), cuda.takes_device_memory(True))
    with cuda.forced(Decision(True, "aware")):
        assert cuda.takes_device_memory(False) and cuda.takes_device_memory(True) and cuda.cuda_aware()
        with cuda.forced(Decision(True, "Open MPI", nonblocking=False)):
            assert cuda.takes_device_memory(False) and not cuda.takes_device_memory(True)
        with cuda.forced(Decision(False, "staged")):
            assert not cuda.takes_device_memory(False) and not cuda.cuda_aware()
        assert cuda.takes_device_memory(True)
    assert (cuda.takes_device_memory(False), cuda.takes_device_memory(True)) == start
    with pytest.raises(TypeError, match="forced takes a Decision, got bool"):
        with cuda.forced(True):
            pass


def test_paths_count_device_calls_by_kind_and_cpu_tensors_not_at_all():
    import torch
    cuda = mpidp.cuda
    before = cuda.paths()
    mpidp.comm.allreduce(torch.ones(8))  # host memory: neither path
    assert cuda.paths() == before
    cuda.carried("pointer")
    cuda.carried("staged", 3)
    after = cuda.paths()
    assert (after["pointer"] - before["pointer"], after["staged"] - before["staged"]) == (1, 3)
    with pytest.raises(ValueError, match="path must be 'pointer' or 'staged', got 'host'"):
        cuda.carried("host")
