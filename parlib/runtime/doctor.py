"""``python -m parlib doctor``: what this machine offers and what ``launch`` will do."""

from __future__ import annotations

import os
import platform
import sys


def report() -> str:
    import torch
    import torch.distributed as dist

    from parlib.runtime.policy import plan, start_context, threads_per_rank

    lines = [
        f"python      {sys.version.split()[0]} ({platform.system()} {platform.machine()})",
        f"torch       {torch.__version__}",
        f"cpu cores   {os.cpu_count()}",
    ]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
        lines.append(f"cuda gpus   {gpus}: {names}")
    else:
        lines.append("cuda gpus   0 (no CUDA GPU visible)")
    backends = [name for name, ok in (
        ("gloo", dist.is_gloo_available()),
        ("nccl", dist.is_nccl_available() and gpus > 0),
        ("mpi", dist.is_mpi_available()),
    ) if ok]
    lines.append(f"backends    {', '.join(backends) or 'none'}")
    lines.append(f"start       {start_context().get_start_method()} (torch preloaded, functions "
                 "shipped with cloudpickle)")
    lines.append("rendezvous  a file store in a private temp folder; gloo on the loopback "
                 "interface only")
    lines.append("")
    lines.append("what parlib.launch(fn, world_size=N) will do:")
    for n in (1, 2, 4, 8):
        p = plan(n)
        lines.append(
            f"  N={n}: {p.backend} on {p.device_type}, {threads_per_rank(n)} thread(s) per rank"
            f" ({p.reason})"
        )
    cores = os.cpu_count() or 1
    if cores < 4:
        lines.append(f"note: 4 ranks share {cores} core(s) here: timings show contention, not "
                     "what 4 devices would do.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    print(report())
    return 0


__all__ = ["main", "report"]
