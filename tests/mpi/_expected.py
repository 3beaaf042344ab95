"""Expected results of reductions, computed with numpy from the ranks' inputs (shared by test files)."""

import numpy as np
import torch

import mpidp

SIZE = mpidp.size()
BITWISE = ("band", "bor", "bxor")
NP_COMBINE = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum,
              "prod": np.multiply, "band": np.bitwise_and, "bor": np.bitwise_or,
              "bxor": np.bitwise_xor}
NP_BOOL_COMBINE = {"sum": np.logical_or, "max": np.logical_or, "min": np.logical_and,
                   "prod": np.logical_and, "band": np.logical_and, "bor": np.logical_or,
                   "bxor": np.logical_xor}


def contribution(rank: int, count: int, op: str, dtype: torch.dtype) -> np.ndarray:
    """Rank ``rank``'s input to a reduction: small integers every dtype holds exactly."""
    index = np.arange(count)
    if dtype == torch.bool:
        return (index + rank) % 3 == 0
    if op == "prod":
        return 1.0 + (index + rank) % 2
    if op in BITWISE:
        return (index * 7 + rank * 5) % 64
    return (index % 5 + rank).astype(np.float64)


def reduced(count: int, op: str, dtype: torch.dtype, ranks=None) -> np.ndarray:
    """The reduction of ``ranks``' contributions (default: every rank)."""
    ranks = list(range(SIZE)) if ranks is None else ranks
    table = NP_BOOL_COMBINE if dtype == torch.bool else NP_COMBINE
    result = contribution(ranks[0], count, op, dtype)
    for rank in ranks[1:]:
        result = table[op](result, contribution(rank, count, op, dtype))
    return result / len(ranks) if op == "avg" else result


def as_tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)


def check_reduced(result: torch.Tensor, values: np.ndarray, op: str) -> None:
    if op == "avg":
        torch.testing.assert_close(result.double(), torch.from_numpy(values).double(),
                                   rtol=1e-2 if result.element_size() == 2 else 1e-6, atol=0)
    else:
        assert torch.equal(result, as_tensor(values, result.dtype)), (result, values)


def ops_for(dtype: torch.dtype) -> list[str]:
    """mpidp.comm's ops that apply to ``dtype``."""
    return [op for op in mpidp.comm.OPS
            if not (dtype.is_floating_point and op in BITWISE)
            if op != "avg" or dtype.is_floating_point]
