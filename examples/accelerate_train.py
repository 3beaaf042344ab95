"""Train with Hugging Face Accelerate under mpiexec, the process group started by mpidp.

    mpiexec -n 2 python examples/accelerate_train.py            # over "mpidp" (MPI)
    mpiexec -n 2 python examples/accelerate_train.py --gloo     # over gloo, rendezvous by mpidp

On a machine without a GPU, Accelerate is distributed only with
``Accelerator(cpu=True)`` (or ACCELERATE_USE_CPU=true); without it every rank
trains alone. Its CPU path names the backend itself ("mpi" if torch was built
with MPI, else "gloo") and refuses any other name, "mpidp" included; a process
group that is already started is kept, so ``mpidp.init_process_group("mpidp")``
comes first. With
``--gloo`` Accelerate starts gloo itself from the RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT that ``import mpidp`` exported (no launcher variables needed).
A small regression model; the evaluation gathers every rank's predictions with
``gather_for_metrics``. Needs the frameworks extra: pip install -e ".[frameworks]".
"""

import argparse

import torch
from accelerate import Accelerator
from torch import nn

import mpidp  # mpidp: exports RANK, WORLD_SIZE, MASTER_ADDR, ... from MPI; a failing rank ends the job


def data(n: int):
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x[:, :4].sum(1, keepdim=True).sin())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gloo", action="store_true", help="let Accelerate start gloo")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    if not args.gloo:
        mpidp.init_process_group("mpidp")  # mpidp: Accelerate keeps the group already started
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train = torch.utils.data.DataLoader(data(1024), batch_size=32, shuffle=True)
    test = torch.utils.data.DataLoader(data(250), batch_size=32)
    model, optimizer, train, test = accelerator.prepare(model, optimizer, train, test)
    for epoch in range(args.epochs):
        model.train()
        for x, y in train:
            optimizer.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
        model.eval()
        with torch.no_grad():
            pairs = [accelerator.gather_for_metrics((model(x), y)) for x, y in test]
        predicted, wanted = (torch.cat(parts) for parts in zip(*pairs))
        accelerator.print(f"epoch {epoch}: test mse {nn.functional.mse_loss(predicted, wanted):.4f} "
                          f"on {len(predicted)} samples, {accelerator.num_processes} processes, "
                          f"backend {torch.distributed.get_backend()}")


if __name__ == "__main__":
    main()
