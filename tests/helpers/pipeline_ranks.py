"""Rank functions for the pipeline-schedule tests (imported by module on every rank)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def schedules_on_ranks(cfg: Any, runs: list[tuple[Any, int, int]], batch_size: int = 8,
                       seed: int = 0) -> list[dict[str, Any]]:
    """One training step per entry of ``runs``: (name or whole schedule dict, m, v), each
    from fresh parameters. Returns per run this rank's ``loss`` and ``grads``."""
    from parlib.model import make_batch
    from parlib.strategies.pipeline import build_chunks, build_stage, run_schedule
    from parlib.strategies.schedules import all_ranks, chunks_of

    rank, p = dist.get_rank(), dist.get_world_size()
    tokens, targets = make_batch(batch_size, cfg, 0, seed)
    out = []
    for sched, m, v in runs:
        if isinstance(sched, str):
            v = chunks_of(sched, v)
            sched = all_ranks(sched, p, m, v)
        stage = build_chunks(cfg, seed, v=v) if v > 1 else build_stage(cfg, seed)
        loss = run_schedule(stage, sched[rank], tokens, targets, m)
        out.append({"loss": loss, "grads": stage.grads()})
    return out
