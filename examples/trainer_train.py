"""Train a tiny causal language model with Transformers' Trainer under mpiexec, started by mpidp.

    mpiexec -n 2 python examples/trainer_train.py            # over "mpidp" (MPI)
    mpiexec -n 2 python examples/trainer_train.py --gloo     # over gloo, rendezvous by mpidp

The model is built from a config with random weights (nothing is downloaded);
the data are random token sequences, so the loss only falls towards the
entropy of the data. ``TrainingArguments(ddp_backend=...)`` accepts "gloo",
"nccl", "mpi", ... but not "mpidp" (Accelerate, underneath, refuses it on CPU):
``mpidp.init_process_group("mpidp")`` first, and the Trainer keeps that group.
``use_cpu=True`` is handed to Accelerate as its ``cpu=True``, which on a machine
without a GPU is what makes it train on every rank together.
Needs the frameworks extra: pip install -e ".[frameworks]".
"""

import argparse
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import mpidp  # mpidp: exports RANK, WORLD_SIZE, MASTER_ADDR, ... from MPI; a failing rank ends the job

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, length: int = 16, vocab: int = 64):
        self.ids = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gloo", action="store_true", help="let the Trainer start gloo")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if not args.gloo:
        mpidp.init_process_group("mpidp")  # mpidp: the Trainer keeps the group already started
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, per_device_train_batch_size=8,
                                     max_steps=args.steps, learning_rate=3e-3, use_cpu=True,
                                     ddp_backend="gloo",  # mpidp: the name Accelerate accepts
                                     report_to=[], save_strategy="no", logging_steps=5,
                                     disable_tqdm=True)
        result = Trainer(model=model, args=training, train_dataset=Tokens(512)).train()
    if training.process_index == 0:
        print(f"{training.world_size} processes, backend {torch.distributed.get_backend()}: "
              f"mean training loss {result.training_loss:.3f} after {args.steps} steps")


if __name__ == "__main__":
    main()
