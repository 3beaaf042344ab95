"""Hugging Face Accelerate, Transformers' Trainer and Lightning under mpiexec, against one process.

Each framework trains a tiny model built from a config (random weights, nothing
downloaded) under mpiexec, with the process group started by mpidp (its
rendezvous: no MASTER_ADDR set by hand), and the result is compared with the
same training in one process on the whole batch. Accelerate and Transformers
refuse the backend name "mpidp" on CPU (Accelerate's MULTI_CPU path keeps only
"mpi", "ccl" or "gloo"): ``mpidp.init_process_group("mpidp")`` first, and they
use the group that is already there. Skips, with the reason, where accelerate
or transformers is not installed (the ``frameworks`` extra).
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mpidp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RANK, SIZE = mpidp.rank(), mpidp.size()
STEPS, BATCH, LR = 3, 4, 0.1  # BATCH per rank


def report(name: str, value: float) -> None:
    if RANK == 0:
        print(f"FRAMEWORK {name} at {SIZE} ranks: max rel diff vs one process {value:.1e}",
              flush=True)


def difference(a, b) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def finish_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# -- Accelerate ---------------------------------------------------------------------------------

def _regression():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1)).double()


def _rows():
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(STEPS * BATCH * SIZE, 6, generator=generator, dtype=torch.float64)
    return x, x[:, :3].sum(1, keepdim=True).cos()


def _accelerate_fit():
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = _regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _rows()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        optimizer.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
    # evaluation on an uneven set: gather_for_metrics drops the padding of the last batch
    held_out = torch.arange(2 * SIZE + 1, dtype=torch.float64).unsqueeze(1)
    evaluation = accelerator.prepare(torch.utils.data.DataLoader(held_out, batch_size=2))
    seen = torch.cat([accelerator.gather_for_metrics(batch) for batch in evaluation])
    assert sorted(seen.flatten().tolist()) == held_out.flatten().tolist()
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return accelerator, params


def _accelerate_single():
    model = _regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _rows()
    for step in range(STEPS):  # accelerate gives rank r batch r of each run of SIZE batches
        rows = slice(step * BATCH * SIZE, (step + 1) * BATCH * SIZE)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["mpidp", "gloo"])
@pytest.mark.may_skip("without the frameworks extra (the README's command installs it)")
def test_accelerate_training_matches_one_process(backend, finish_group):
    pytest.importorskip("accelerate", reason="the frameworks extra: pip install -e '.[frameworks]'")
    if backend == "mpidp":
        mpidp.init_process_group("mpidp")  # Accelerator(cpu=True) keeps a group already started
    _reset_accelerate()
    accelerator, params = _accelerate_fit()
    assert accelerator.num_processes == SIZE and accelerator.process_index == RANK
    assert dist.get_backend() == backend
    diff = difference(params, _accelerate_single())
    report(f"accelerate over {backend}", diff)
    assert diff < 1e-12
    _reset_accelerate()


# -- Transformers' Trainer ----------------------------------------------------------------------

def _tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    return LlamaForCausalLM(config).double()


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(9)
        self.ids = torch.randint(0, 32, (STEPS * BATCH * SIZE, 8), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_fit(batch: int, ddp_backend: str | None):
    from transformers import Trainer, TrainingArguments
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch,
                                 max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
                                 optim="sgd", weight_decay=0.0, use_cpu=True, report_to=[],
                                 save_strategy="no", logging_strategy="no", seed=1,
                                 ddp_backend=ddp_backend, dataloader_drop_last=True,
                                 disable_tqdm=True, train_sampling_strategy="sequential")
        model = _tiny_lm()
        trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
        trainer.train()
    return args, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["mpidp", "gloo"])
@pytest.mark.may_skip("without the frameworks extra (the README's command installs it)")
def test_trainer_matches_one_process(backend, finish_group):
    pytest.importorskip("transformers", reason="the frameworks extra: pip install -e '.[frameworks]'")
    pytest.importorskip("accelerate", reason="the frameworks extra: pip install -e '.[frameworks]'")
    if backend == "mpidp":
        mpidp.init_process_group("mpidp")  # ddp_backend="mpidp" is refused: start the group first
    args, params = _trainer_fit(BATCH, "gloo")
    assert args.world_size == SIZE and dist.get_backend() == backend
    dist.destroy_process_group()
    _reset_accelerate()
    # one process on the whole batch: in order, SIZE * BATCH rows a step (rank r: batch r of each SIZE)
    hidden = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
    world = {name: os.environ.pop(name) for name in hidden if name in os.environ}
    try:
        alone, reference = _trainer_fit(BATCH * SIZE, None)
        assert alone.world_size == 1
    finally:
        os.environ.update(world)
        _reset_accelerate()
    diff = difference(params, reference)
    report(f"transformers Trainer over {backend}", diff)
    assert diff < 1e-10


# -- Lightning with mpidp's rendezvous ----------------------------------------------------------

@pytest.mark.may_skip("without the lightning extra (the README's command installs it)")
def test_lightning_with_mpidp_rendezvous_matches_one_process():
    """Lightning finds the group mpidp started and keeps it (tests/test_lightning.py covers
    Lightning's own MPIEnvironment rendezvous)."""
    pytest.importorskip("lightning", reason="the lightning extra: pip install -e '.[lightning]'")
    import lightning_fit
    mpidp.init_process_group("mpidp")
    params = lightning_fit.fit("ddp", "mpidp")  # destroys the group at the end
    diff = lightning_fit.difference(params, lightning_fit.single_process())
    report("lightning DDPStrategy over mpidp's rendezvous", diff)
    assert diff < 1e-12
