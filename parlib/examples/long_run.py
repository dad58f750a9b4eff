"""A long run: FSDP training that saves a sharded checkpoint every few steps and resumes from
the newest complete one whenever it starts, so a rank that dies costs only the steps since.

    torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint localhost:0 -m parlib.run parlib.examples.long_run:train ckpts 8 2

(on several nodes: ``--nnodes``, ``--rdzv-endpoint HOST:29500`` and a ``ckpts`` folder every
node sees). When a rank dies, torchrun stops the others and starts every rank again, up to
``--max-restarts`` times; each start finds ``latest_checkpoint(folder)`` (a save cut short
has no ``.metadata`` and is skipped), loads weights, Adam's state and the step, and goes on.
Batch ``step`` is a function of ``step`` alone, so the resumed run trains on the batches the
uninterrupted run trained on and ends with bit-identical weights. It runs unchanged from a
notebook: ``parlib.launch(train, "ckpts", world_size=2)``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from parlib.model import ModelConfig, build_model, make_batch
from parlib.runtime.policy import device
from parlib.strategies.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from parlib.strategies.data import shard_rows
from parlib.strategies.fsdp import FSDP
from parlib.strategies.token_loss import global_token_count, global_token_loss

CONFIG = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
BATCH_ROWS = 8  # the global batch; each of the N ranks trains on BATCH_ROWS / N of them
LEARNING_RATE = 1e-2


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of batch ``step``: the same tensors whichever attempt asks."""
    tokens, targets = make_batch(BATCH_ROWS, CONFIG, step)
    return shard_rows(tokens, rank, world_size), shard_rows(targets, rank, world_size)


def build() -> tuple[FSDP, torch.optim.Optimizer]:
    """The model sharded over every rank, and AdamW on this rank's shards."""
    model = FSDP(build_model(CONFIG, seed=0).to(device()))
    return model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)


def train_step(model: FSDP, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               targets: torch.Tensor) -> float:
    """One step on this rank's rows, the loss normalised by the real tokens of every rank's
    rows; returns this rank's share of the batch's loss."""
    total = global_token_count(targets.to(device()))
    loss = global_token_loss(model(tokens.to(device())), targets.to(device()), total,
                             averaged_over=dist.get_world_size())
    loss.backward()
    model.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item() / dist.get_world_size()


def train(folder: str, steps: int | str = 8, save_every: int | str = 2) -> dict[str, int]:
    """Train to ``steps`` steps, saving ``folder/step-<k>`` after every ``save_every`` steps
    and after the last; start from the newest complete checkpoint in ``folder``, if any.
    Returns the step it started from and the step it ended at."""
    steps, save_every = int(steps), int(save_every)  # torchrun passes strings
    if steps < 0 or save_every < 1:
        raise ValueError(f"long_run.train: steps={steps}, save_every={save_every}: train "
                         f"0 or more steps and save every 1 or more (e.g. ckpts 8 2)")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = build()
    start, newest = 0, latest_checkpoint(folder)
    if newest is not None:
        start = load_checkpoint(newest[1], model, optimizer)["step"]
        if rank == 0:
            print(f"resuming from {newest[1]} (after {start} steps), attempt "
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", flush=True)
    for step in range(start, steps):
        train_step(model, optimizer, *batch(step, rank, world_size))
        if (step + 1) % save_every == 0 or step + 1 == steps:
            save_checkpoint(checkpoint_path(folder, step + 1), model, optimizer,
                            extra={"step": step + 1})
    return {"started_at": start, "ended_at": steps}


__all__ = ["BATCH_ROWS", "CONFIG", "batch", "build", "train", "train_step"]
