"""``MNIST`` with synthetic digits, so that nothing is downloaded (a stand-in).

Each image is its digit drawn as on a seven-segment display, with some stroke pixels
left out and some background pixels lit at random: uint8 28x28, mostly 0 with strokes
of 255, as MNIST's. The example's CNN tells them apart after a few dozen steps.
Fewer images than MNIST's 60,000 and 10,000, so that a test epoch takes a second or two.
"""

import torch

__all__ = ["MNIST"]

TRAIN_SIZE, TEST_SIZE = 1024, 512

# Rows and columns of the seven segments (a: top, b: top right, c: bottom right,
# d: bottom, e: bottom left, f: top left, g: middle), and each digit's segments.
_SEGMENTS = {"a": (slice(4, 7), slice(8, 21)), "b": (slice(4, 16), slice(18, 21)),
             "c": (slice(13, 25), slice(18, 21)), "d": (slice(22, 25), slice(8, 21)),
             "e": (slice(13, 25), slice(8, 11)), "f": (slice(4, 16), slice(8, 11)),
             "g": (slice(13, 16), slice(8, 21))}
_DIGITS = ["abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg"]


def _strokes() -> torch.Tensor:
    """10 x 28 x 28 booleans: each digit's segments."""
    strokes = torch.zeros(10, 28, 28, dtype=torch.bool)
    for digit, segments in enumerate(_DIGITS):
        for segment in segments:
            strokes[(digit, *_SEGMENTS[segment])] = True
    return strokes


class MNIST(torch.utils.data.Dataset):
    """``(image, label)`` pairs: a 28x28 uint8 image (after ``transform``) and an int in 0..9.

    ``data`` (N x 28 x 28 uint8) and ``targets`` (N int64) hold them, as torchvision's.

    Args:
        root: accepted for torchvision's signature; nothing is read or written there.
        train: the training set (``TRAIN_SIZE`` images) or the test set (``TEST_SIZE``).
        transform, target_transform: applied to the image and to the label.
        download: accepted for torchvision's signature; the data is made in memory.
    """

    classes = ["0 - zero", "1 - one", "2 - two", "3 - three", "4 - four", "5 - five", "6 - six",
               "7 - seven", "8 - eight", "9 - nine"]

    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform
        generator = torch.Generator().manual_seed(1 if train else 2)
        count = TRAIN_SIZE if train else TEST_SIZE
        self.targets = torch.randint(0, 10, (count,), generator=generator)
        images = _strokes()[self.targets]
        images &= torch.rand(count, 28, 28, generator=generator) < 0.85
        images |= torch.rand(count, 28, 28, generator=generator) < 0.03
        self.data = images.to(torch.uint8) * 255

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        image, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
