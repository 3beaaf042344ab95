"""Test-only stand-in for ``torchvision``: what Horovod's two PyTorch examples use, no more.

Horovod's ``examples/pytorch/pytorch_mnist.py`` and ``pytorch_synthetic_benchmark.py``
import torchvision, which has no CPU build for the torch this project pins.
``tests/test_horovod_suite.py`` puts ``tests/horovod_shim`` on ``PYTHONPATH`` so that they
run unchanged; this package is never installed and is not torchvision:

- ``datasets.MNIST``: synthetic 28x28 digits of MNIST's shapes and types, made in memory
  (nothing is read or downloaded), fewer of them than MNIST has;
- ``transforms.Compose``, ``ToTensor``, ``Normalize``: the three the MNIST example uses;
- ``models.<name>``: one small CNN under torchvision's classification model names, a
  stand-in for each (the benchmark builds ``getattr(models, args.model)()``).
"""

from . import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
