"""The CUDA-aware decision, branch by branch, and what this machine's MPI reports."""

import pytest

import mpidp
from mpidp.cuda import Decision, agree, decide, library_reports_cuda


def never(): raise AssertionError("the probe must not run here")  # noqa: E704


def test_override_wins_and_is_validated():
    assert decide("1", False, None, never) == Decision(True, "MPIDP_CUDA_AWARE=1")
    assert decide("0", True, True, never) == Decision(False, "MPIDP_CUDA_AWARE=0")
    with pytest.raises(ValueError, match="MPIDP_CUDA_AWARE must be 0 or 1, got 'yes'"):
        decide("yes", True, True, never)


def test_no_gpu_or_no_word_from_the_library_means_host_staging_without_probing():
    assert decide(None, False, True, never).cuda_aware is False
    assert "does not say" in decide(None, True, None, never).reason
    assert "reports no CUDA support" in decide(None, True, False, never).reason


def test_a_library_that_claims_support_must_pass_the_probe():
    assert decide(None, True, True, lambda: True).cuda_aware is True
    failed = decide(None, True, True, lambda: False)
    assert failed.cuda_aware is False and "wrong answer" in failed.reason


def test_the_probe_runs_on_every_rank_or_on_none():
    both = [(None, True, True), (None, True, True)]
    assert agree(both, 1, lambda: True).cuda_aware is True
    # a node with no GPU (or a library that says no) on one rank: nobody probes
    for mixed in ([(None, True, True), (None, False, None)], [(None, True, True), (None, True, False)]):
        for rank in (0, 1):
            result = agree(mixed, rank, never)
            assert result.cuda_aware is False and "not every rank" in result.reason
    assert agree([(None, False, None)] * 2, 0, never).reason == "no GPU visible to torch"
    assert agree([("1", False, None), ("1", True, True)], 0, never).cuda_aware is True
    with pytest.raises(ValueError, match="MPIDP_CUDA_AWARE must be set alike on every rank, got 1, None"):
        agree([("1", True, True), (None, True, True)], 1, never)


def test_a_library_that_reads_device_memory_in_blocking_collectives_only_stages_the_others():
    aware = decide(None, True, True, lambda: True, blocking_only=True)
    assert aware.cuda_aware is True and aware.nonblocking is False
    assert "nonblocking collectives staged" in aware.reason
    assert decide("1", False, None, never, blocking_only=True).nonblocking is False
    assert decide(None, True, True, lambda: True).nonblocking is True
    staged = decide(None, True, False, never, blocking_only=True)  # nothing to add when staged
    assert staged == Decision(False, "the MPI library reports no CUDA support; host staging")
    assert agree([(None, True, True)] * 2, 0, lambda: True, blocking_only=True).nonblocking is False


def test_this_machine():
    # MPICH and Open MPI both answer (the wheels: False; bench/build_cuda_mpi.sh's: True)
    assert library_reports_cuda() in (True, False)
    aware_for_nonblocking = mpidp.cuda.takes_device_memory(nonblocking=True)
    assert aware_for_nonblocking == (mpidp.cuda.decision().cuda_aware
                                     and mpidp.cuda.decision().nonblocking)
    if not mpidp.cuda.decision().cuda_aware:
        assert mpidp.cuda.decision().reason in ("no GPU visible to torch",
                                                "the MPI library reports no CUDA support; host staging")
