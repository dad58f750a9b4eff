"""A failure injected into :mod:`parlib.examples.long_run` from outside, for the restart test:
on torchrun's first attempt only, one rank kills itself as a given step begins."""

from __future__ import annotations

import os
import signal

import parlib.examples.long_run as long_run


def train_dying_once(folder: str, steps: str, save_every: str, dying_rank: str,
                     dies_at: str) -> dict[str, int]:
    """``long_run.train``, with rank ``dying_rank`` SIGKILLed as step ``dies_at`` begins on
    attempt 0 (TORCHELASTIC_RESTART_COUNT, set by torchrun); returns train's result and the
    attempt that produced it."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    honest_batch = long_run.batch

    def batch(step: int, rank: int, world_size: int):
        if attempt == 0 and step == int(dies_at) and rank == int(dying_rank):
            print(f"rank {rank} dies as step {step} begins", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return honest_batch(step, rank, world_size)

    long_run.batch = batch
    return {**long_run.train(folder, steps, save_every), "attempt": attempt}
