"""Lightning over the "mpidp" torch.distributed backend, against the same fit over gloo."""

import importlib.util

import pytest

import launch

if importlib.util.find_spec("lightning") is None:  # found, not imported: the launches import it
    pytest.skip("Lightning is an extra: pip install -e '.[lightning]'", allow_module_level=True)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lightning_fit_over_mpidp_equals_gloo_and_single_process(strategy):
    out = launch.run(2, ["tests/mpi/lightning_fit.py", strategy], timeout=300).stdout
    print(out)
    assert f"lightning {strategy} at 2 ranks: mpidp vs gloo 0.0e+00" in out
