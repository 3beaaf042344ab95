"""The elementwise probe: may ``ZeroRedundancyOptimizer`` split a tensor between ranks?

Sharding by elements is exact only for an optimizer whose update of an
element depends on that element alone (SGD, Adam, AdamW, Adagrad, RMSprop,
...). Each class is tried here on a small tensor, whole and in two pieces,
when the optimizer is built, and a class whose results differ (LBFGS,
Adafactor, ...) is refused with a message that says why.
"""

from __future__ import annotations

import torch

__all__ = ["elementwise_keys"]


def elementwise_keys(optimizer_class: type, defaults: dict, dtype: torch.dtype,
                     device: torch.device) -> frozenset[str]:
    """Check that ``optimizer_class`` updates a tensor's pieces as it updates the whole.

    Returns:
        The state keys that hold one value per element (``exp_avg``...); the
        others (``step``...) are one value per tensor.

    Raises:
        ValueError: the class cannot step a piece on its own, or its result differs.
    """
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    generator = torch.Generator().manual_seed(1234)
    shape, cut = (4, 6), 7
    start = torch.randn(shape, generator=generator, dtype=torch.float64)
    grads = [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(3)]
    if not dtype.is_floating_point:
        dtype = torch.float32
    whole = start.to(dtype=dtype, device=device)
    parts = [whole.reshape(-1)[:cut].clone(), whole.reshape(-1)[cut:].clone()]
    whole = whole.clone()
    try:
        one, two = optimizer_class([whole], **defaults), optimizer_class(parts, **defaults)
    except (TypeError, ValueError) as error:
        arguments = ", ".join(f"{key}={value!r}" for key, value in defaults.items())
        raise type(error)(f"{name}({arguments}) raised {type(error).__name__}: {error}") from None
    try:
        for grad in grads:
            grad = grad.to(dtype=dtype, device=device)
            whole.grad = grad.clone()
            parts[0].grad, parts[1].grad = grad.reshape(-1)[:cut].clone(), grad.reshape(-1)[cut:].clone()
            one.step()
            two.step()
    except Exception as error:
        raise ValueError(
            f"optimizer_class {name} cannot step a piece of a tensor on its own, as "
            f"ZeroRedundancyOptimizer does (trying it raised {type(error).__name__}: {error}); "
            f"it needs an optimizer with per-parameter state and an elementwise update, such "
            f"as torch.optim.SGD, Adam or AdamW") from None
    joined = torch.cat(parts).to(torch.float64)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    if not torch.allclose(joined, whole.reshape(-1).to(torch.float64), rtol=tolerance, atol=tolerance):
        difference = (joined - whole.reshape(-1).to(torch.float64)).abs().max().item()
        raise ValueError(
            f"optimizer_class {name} does not update each element on its own: stepping a "
            f"tensor in two pieces gave results up to {difference:.3g} away from stepping it "
            f"whole, so sharding it by elements (ZeroRedundancyOptimizer) would change the "
            f"training; use an optimizer with per-parameter state and an elementwise update "
            f"(SGD, Adam, AdamW, Adagrad, RMSprop, ...)")
    if any(not any(key is part for part in parts) for key in two.state):
        raise ValueError(
            f"optimizer_class {name} keeps state under keys other than its parameters, so "
            f"ZeroRedundancyOptimizer cannot tell which rank's shard it belongs to; it needs an "
            f"optimizer with per-parameter state (optimizer.state[param])")
    state = two.state.get(parts[0], {})
    return frozenset(key for key, value in state.items()
                     if isinstance(value, torch.Tensor) and value.shape == parts[0].shape)

