"""This rank's random number generators: their states, and a seed for a rank that had none.

The generators a training step may draw from: Python's ``random``, NumPy's
global one, torch's CPU generator and, once CUDA is initialised, the current
device's. Local: nothing here talks to other ranks.
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["states", "restore", "derived_seed", "seed_all"]


def states() -> dict:
    """Every generator's state, in a form ``torch.load(weights_only=True)`` reads back."""
    version, keys, position, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [version, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict) -> None:
    """Put back what ``states()`` returned."""
    random.setstate(state["python"])
    version, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((version, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def derived_seed(step: int, rank: int) -> int:
    """The seed of a rank that a saved run did not have: a function of the step and the rank."""
    return int(np.random.SeedSequence([step, rank]).generate_state(2, dtype=np.uint64)[0] >> 1)


def seed_all(seed: int) -> None:
    """Seed every generator (torch's call seeds every CUDA device's too)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
