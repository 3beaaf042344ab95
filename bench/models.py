"""The benchmark models and their data: each returns (model, batches, loss function)."""

import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


class SmallResNet(nn.Module):
    """ResNet-style CNN for 3x32x32 images, 4.9M parameters."""

    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.stages = nn.Sequential(BasicBlock(64, 64, 1), BasicBlock(64, 128, 2),
                                    BasicBlock(128, 256, 2), BasicBlock(256, 256, 1),
                                    BasicBlock(256, 256, 2), BasicBlock(256, 256, 1))
        self.head = nn.Linear(256, classes)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1))


class Transformer(nn.Module):
    """Token embedding, TransformerEncoder (d_model 512, 4 layers), token head: 13.6M parameters."""

    def __init__(self, vocab=1000, d_model=512, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


class Wide(nn.Module):
    """Embedding(200000, 128) and a small head: one 98 MiB gradient dominates."""

    def __init__(self, vocab=200_000, dim=128, classes=100):
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.head = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, classes))

    def forward(self, tokens):
        return self.head(self.embed(tokens))


class MLP(nn.Module):
    """12 x Linear(1024, 1024): 12.6M parameters; ``reverse`` runs the layers last to first."""

    def __init__(self, width=1024, depth=12, reverse=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.reverse = reverse

    def forward(self, x):
        layers = list(reversed(self.layers)) if self.reverse else self.layers
        for i, layer in enumerate(layers):
            x = layer(x)
            if i < len(layers) - 1:
                x = F.relu(x)
        return x


def _mse(output, target):
    return F.mse_loss(output, target)


def _tokens_ce(output, target):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def build(name: str, rank: int, nbatches: int = 2):
    """Return (model, batches, loss) for ``name``; the model is the same on every rank."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(100 + rank)
    if name in ("mlp", "mlp-reverse"):
        model = MLP(reverse=name == "mlp-reverse")
        batches = [(torch.randn(64, 1024, generator=gen), torch.randn(64, 1024, generator=gen))
                   for _ in range(nbatches)]
        return model, batches, _mse
    if name == "cnn":
        model = SmallResNet()
        batches = [(torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen))
                   for _ in range(nbatches)]
        return model, batches, F.cross_entropy
    if name == "transformer":
        model = Transformer()
        batches = [(torch.randint(0, 1000, (8, 128), generator=gen),
                    torch.randint(0, 1000, (8, 128), generator=gen)) for _ in range(nbatches)]
        return model, batches, _tokens_ce
    if name == "wide":
        model = Wide()
        batches = [(torch.randint(0, 200_000, (256, 16), generator=gen),
                    torch.randint(0, 100, (256,), generator=gen)) for _ in range(nbatches)]
        return model, batches, F.cross_entropy
    raise ValueError(f"unknown model {name!r}, expected mlp, mlp-reverse, cnn, transformer or wide")


MODELS = ("mlp", "cnn", "transformer", "wide")
