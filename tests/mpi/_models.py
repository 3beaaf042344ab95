"""Models, data and comparisons shared by the MPI test files."""

import copy

import torch
from torch import nn
from torch.nn import functional as F

import mpidp

RANK, SIZE = mpidp.rank(), mpidp.size()
BATCH = 12  # divisible by 1, 2, 3 and 4 ranks, so shards are equal


def mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


class Tied(nn.Module):
    """A language-model shape: the output layer shares the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(10, 16)
        self.stem.requires_grad_(False)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x):
        return self.head(self.stem(x))


class MixedDtypes(nn.Module):
    """A float64 layer feeding float32 layers: buckets must split by dtype."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(10, 16).double()
        self.second = nn.Linear(16, 16)
        self.third = nn.Linear(16, 5).double()

    def forward(self, x):
        hidden = torch.relu(self.first(x.double())).float()
        return self.third(torch.tanh(self.second(hidden)).double()).float()


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
            nn.Conv2d(6, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.features(x))


class Branches(nn.Module):
    """Takes branch a or b depending on the rank; ``never`` is unused everywhere."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(10, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x, use_b: bool):
        hidden = torch.relu(self.trunk(x))
        return self.head(self.b(hidden) if use_b else self.a(hidden))


class ReverseOrder(nn.Module):
    """Layers registered in the reverse of the order forward uses them."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(10, 10) for _ in range(4)])
        self.head = nn.Linear(10, 5)

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return self.head(x)


def inputs(model_name: str, step: int):
    """The global batch of one step: (input, target), identical on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    if model_name == "tied":
        return torch.randint(0, 20, (BATCH, 6), generator=gen), torch.randint(0, 20, (BATCH, 6), generator=gen)
    if model_name == "convbn":
        return torch.randn(BATCH, 3, 8, 8, generator=gen), torch.randn(BATCH, 5, generator=gen)
    return torch.randn(BATCH, 10, generator=gen), torch.randn(BATCH, 5, generator=gen)


def loss_of(model_name: str, output, target):
    if model_name == "tied":
        return F.cross_entropy(output.reshape(-1, 20), target.reshape(-1))
    return F.mse_loss(output, target)


def shard(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.chunk(SIZE)[RANK]


MODELS = {"mlp": mlp, "tied": Tied, "frozen": Frozen, "mixed": MixedDtypes, "convbn": ConvBN,
          "reverse": ReverseOrder}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}


def fresh(model_name: str, seed: int = 0) -> nn.Module:
    """Build a model; every rank uses a different seed so the rank-0 broadcast matters."""
    torch.manual_seed(seed + RANK)
    return MODELS[model_name]()


def reference_copy(model: nn.Module, seed: int = 0, model_name: str = "mlp") -> nn.Module:
    """Rank 0's initial model, as every rank holds it after DDP's broadcast."""
    torch.manual_seed(seed)
    return MODELS[model_name]()


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest, over parameters and buffers, of max|a - b| / max|b|."""
    worst = 0.0
    for x, y in zip(list(a.parameters()) + list(a.buffers()), list(b.parameters()) + list(b.buffers())):
        x, y = x.detach().double(), y.detach().double()
        scale = y.abs().max().item() or 1.0
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def deepcopy(model):
    return copy.deepcopy(model)
