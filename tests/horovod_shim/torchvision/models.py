"""One small CNN under torchvision's classification model names (stand-ins, not those models).

Horovod's synthetic benchmark builds ``getattr(models, args.model)()`` (``resnet50`` by
default) and feeds it 3x224x224 images for 1000 classes. Every name here builds the
same few-layer CNN of that input and output, so the benchmark runs in seconds on a CPU;
its img/sec says how mpidp.horovod carries a step, not how fast a ResNet-50 trains.
"""

from torch import nn

__all__ = ["small_cnn", "alexnet", "vgg16", "resnet18", "resnet34", "resnet50", "resnet101",
           "resnet152", "inception_v3", "densenet121", "mobilenet_v2"]


def small_cnn(num_classes=1000):
    """A three-layer CNN of 3xHxW images (any H, W) to ``num_classes`` logits."""
    return nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=7, stride=4, padding=3), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes))


# The names the benchmark's --model may give: each is the small CNN above.
alexnet = vgg16 = resnet18 = resnet34 = resnet50 = resnet101 = resnet152 = small_cnn
inception_v3 = densenet121 = mobilenet_v2 = small_cnn
