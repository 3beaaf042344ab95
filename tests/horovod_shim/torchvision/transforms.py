"""``Compose``, ``ToTensor`` and ``Normalize``, as the MNIST example calls them (stand-ins)."""

import numpy as np
import torch

__all__ = ["Compose", "ToTensor", "Normalize"]


class Compose:
    """Apply ``transforms`` in order."""

    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, image):
        for transform in self.transforms:
            image = transform(image)
        return image


class ToTensor:
    """A uint8 H x W or H x W x C image (tensor or array) to a float C x H x W tensor in [0, 1]."""

    def __call__(self, image):
        image = torch.as_tensor(np.asarray(image))
        if image.dtype != torch.uint8:
            raise TypeError(f"ToTensor (stand-in) takes uint8 images, got {image.dtype}")
        if image.dim() == 2:
            image = image.unsqueeze(-1)
        return image.permute(2, 0, 1).float().div(255)


class Normalize:
    """``(x - mean) / std`` per channel of a C x H x W float tensor."""

    def __init__(self, mean, std):
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)
        if (self.std == 0).any():
            raise ValueError(f"Normalize: std must be non-zero, got {std}")

    def __call__(self, tensor):
        return (tensor - self.mean) / self.std
