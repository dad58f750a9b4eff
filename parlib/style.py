"""One palette and one caption rule for every figure in the course (see the house style)."""

from __future__ import annotations

# One colour per kind of work, the same in every chapter. Idle is light grey so that
# pipeline bubbles read as empty space.
COLORS: dict[str, str] = {
    "forward": "#4C72B0",  # compute, forward pass
    "backward": "#DD8452",  # compute, backward pass
    "comm": "#55A868",  # communication (send, recv, collectives)
    "send": "#55A868",
    "recv": "#8CC79A",
    "optimizer": "#8172B3",
    "idle": "#E5E5E5",
    "theory": "#333333",  # dashed lines / outlines for predictions
}


def run_label(world_size: int, device: str, backend: str, emulated: bool = False) -> str:
    """The 'what ran it' caption every figure carries, e.g. '4 ranks, CPU, gloo'."""
    dev = "CPU" if str(device).startswith("cpu") else str(device).split(":")[0].upper()
    label = f"{world_size} rank{'s' if world_size != 1 else ''}, {dev}, {backend}"
    if emulated:
        label += ", emulated stage cost"
    return label
