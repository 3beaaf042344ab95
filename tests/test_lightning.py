"""Lightning over the "mpidp" torch.distributed backend, against the same fit over gloo."""

import importlib.util

import pytest

import launch

if importlib.util.find_spec("lightning") is None:  # found, not imported: the launches import it
    pytest.skip("Lightning is an extra: pip install -e '.[lightning]'", allow_module_level=True)


STRATEGIES = ["ddp", "fsdp2"]


@pytest.fixture(scope="module")
def fits() -> str:
    """Both strategies' fits, one after the other in one 2-rank launch (tests/mpi/run_scripts.py:
    each fit ends its process group, as the script's gloo fit does before its mpidp fit)."""
    return launch.run(2, ["tests/mpi/run_scripts.py",
                          *(f"tests/mpi/lightning_fit.py {strategy}" for strategy in STRATEGIES)],
                      timeout=400).stdout


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lightning_fit_over_mpidp_equals_gloo_and_single_process(strategy, fits):
    print(fits)
    assert f"lightning {strategy} at 2 ranks: mpidp vs gloo 0.0e+00" in fits
