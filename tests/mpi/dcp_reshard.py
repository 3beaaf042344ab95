"""A distributed checkpoint of FSDP2 state saved at one world size loads at another.

    mpiexec -n 4 python tests/mpi/dcp_reshard.py save DIR
    mpiexec -n 2 python tests/mpi/dcp_reshard.py load DIR

Over "mpidp" as torch's default group. ``save`` trains a sharded transformer two
Adam steps and writes its sharded model and optimizer state with
``torch.distributed.checkpoint`` to DIR, plus the full state (rank 0,
``torch.save``) for comparison, and saves the same state through an
``mpidp.Checkpointer`` in DIR/ckpt. ``load`` shards a differently initialised
model over its own ranks, loads DIR into it (resharding), checks that the full
state equals the saved one exactly, then trains one more step and checks it
against one process continuing from the full copy; a second fresh model resumes
from DIR/ckpt (the Checkpointer, at another size) and must hold the saved full
state and take the same step bit for bit. Exits non-zero on a mismatch.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

import mpidp


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 36)  # 36 rows of 3 x 36 in_proj: uneven shards at 4 ranks
        layer = nn.TransformerEncoderLayer(36, nhead=4, dim_feedforward=50, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(36, 5)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))


def build(seed: int, sharded: bool):
    torch.manual_seed(seed)
    model = Transformer().double()
    if sharded:
        for layer in model.encoder.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def step(model, optimizer, number: int, rank: int, size: int):
    gen = torch.Generator().manual_seed(number)
    x = torch.randn(12, 6, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(12, 6, 5, generator=gen, dtype=torch.float64)
    optimizer.zero_grad()
    F.mse_loss(model(x.chunk(size)[rank]), y.chunk(size)[rank]).backward()
    optimizer.step()


def full_state(model, optimizer):
    """Every rank's view of the whole state, as plain tensors (collective)."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


def compare(got, expected, where="") -> float:
    """Largest |got - expected| over nested dicts of tensors and numbers; keys must agree."""
    if isinstance(expected, dict):
        assert sorted(got, key=str) == sorted(expected, key=str), f"{where}: keys differ"
        return max([compare(got[k], expected[k], f"{where}/{k}") for k in expected] or [0.0])
    if isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        return max([compare(g, e, f"{where}[{i}]") for i, (g, e) in enumerate(zip(got, expected))]
                   or [0.0])
    if torch.is_tensor(expected):
        assert got.shape == expected.shape and got.dtype == expected.dtype, where
        return (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
    assert got == expected, f"{where}: {got!r} != {expected!r}"
    return 0.0


def main():
    mode, directory = sys.argv[1], Path(sys.argv[2])
    mpidp.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    if mode == "save":
        model, optimizer = build(0, sharded=True)
        checkpointer = mpidp.Checkpointer(directory / "ckpt", model=model, optimizer=optimizer,
                                          signals=())
        for number in range(2):
            step(model, optimizer, number, rank, size)
            checkpointer.step()
        checkpointer.save()
        checkpointer.close()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
        full = full_state(model, optimizer)
        if rank == 0:
            torch.save(full, directory / "full.pt")
            print(f"saved at {size} ranks: {len(full['model'])} tensors to {directory}")
    elif mode == "load":
        model, optimizer = build(1, sharded=True)  # other weights; no optimizer state yet
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        saved = torch.load(directory / "full.pt", weights_only=False)
        loaded = compare(full_state(model, optimizer), saved)
        assert loaded == 0.0, f"loaded state differs from the saved one by {loaded}"

        resumed, resumed_opt = build(3, sharded=True)
        checkpointer = mpidp.Checkpointer(directory / "ckpt", model=resumed,
                                          optimizer=resumed_opt, signals=())
        assert checkpointer.resume() == 2
        checkpointer.close()
        through = compare(full_state(resumed, resumed_opt), saved)
        assert through == 0.0, f"the Checkpointer's resume differs from the saved state by {through}"

        local, local_opt = build(2, sharded=False)  # one process, from the full copy
        set_state_dict(local, local_opt, model_state_dict=saved["model"],
                       optim_state_dict=saved["optim"])
        step(model, optimizer, 2, rank, size)
        step(resumed, resumed_opt, 2, rank, size)
        step(local, local_opt, 2, 0, 1)
        assert all(torch.equal(p.to_local(), q.to_local())
                   for p, q in zip(model.parameters(), resumed.parameters()))
        worst = max(((p.full_tensor() - q).abs().max() / q.abs().max()).item()
                    for p, q in zip(model.parameters(), local.parameters()))
        if rank == 0:
            print(f"loaded at {size} ranks: max |loaded - saved| = {loaded:.1e}; after one more "
                  f"step, max relative difference from one process = {worst:.3e}; the "
                  f"Checkpointer's resume: max |resumed - saved| = {through:.1e}, the same step")
        assert worst < 1e-9, worst
    else:
        raise SystemExit(f"usage: {sys.argv[0]} save|load DIR")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
