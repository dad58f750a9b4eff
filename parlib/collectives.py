"""Chapter 00's pieces: who-holds-what pictures of collectives, and the alpha-beta fit."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from parlib.style import COLORS

# The collectives the course uses and the strategy that pays for each (chapter 00's table).
WHO_PAYS = [
    ("broadcast", "every strategy, once: the same initial weights on every rank"),
    ("all-reduce", "data parallelism: gradients after every step; tensor parallelism: "
                   "partial activations after a row-split layer"),
    ("reduce-scatter", "ZeRO / FSDP: each rank keeps only its shard of the summed gradients"),
    ("all-gather", "ZeRO / FSDP: parameters rebuilt before use; tensor parallelism: "
                   "activations after a column-split layer"),
    ("send / recv", "pipeline parallelism: activations forward and gradients backward "
                    "across each stage boundary"),
]


def draw_collective(name: str, before: Sequence[Sequence[float]],
                    after: Sequence[Sequence[float]], caption: str = "", ax_pair=None):
    """Draw what each rank holds before and after a collective.

    ``before[r]`` and ``after[r]`` are the values rank r holds (lists may differ in length:
    a reduce-scatter shrinks them, an all-gather grows them). Returns the figure.
    """
    import matplotlib.pyplot as plt

    n = len(before)
    if len(after) != n:
        raise ValueError(f"before has {n} ranks but after has {len(after)}")
    width = max(max(len(v) for v in before), max(len(v) for v in after))
    if ax_pair is None:
        fig, ax_pair = plt.subplots(1, 2, figsize=(2.2 + 0.7 * width * 2, 0.5 + 0.5 * n))
    else:
        fig = ax_pair[0].figure
    for ax, rows, label in ((ax_pair[0], before, "before"), (ax_pair[1], after, "after")):
        for r, values in enumerate(rows):
            for c, value in enumerate(values):
                ax.add_patch(plt.Rectangle((c, n - 1 - r), 0.95, 0.9,
                                           color=COLORS["comm"] if label == "after"
                                           else COLORS["forward"], alpha=0.85))
                ax.text(c + 0.47, n - 1 - r + 0.45, _short(value), ha="center", va="center",
                        color="white", fontsize=9)
        ax.set_xlim(-0.1, width)
        ax.set_ylim(-0.1, n)
        ax.set_yticks([n - 1 - r + 0.45 for r in range(n)], [f"rank {r}" for r in range(n)])
        ax.set_xticks([])
        ax.set_title(f"{name}: {label}", fontsize=10)
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
    if caption:
        fig.suptitle(caption, fontsize=9, y=0.02, va="bottom", color="#555555")
    fig.tight_layout(rect=(0, 0.06 if caption else 0, 1, 1))
    return fig


def _short(value: float) -> str:
    value = float(value)
    return f"{value:.0f}" if value.is_integer() else f"{value:.2g}"


def fit_alpha_beta(sizes_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of t = a + b * n: returns (a seconds, b seconds per byte).

    For one message, a is alpha and b is beta. For a ring all-reduce over N ranks the same
    line has a = 2(N-1) alpha and b = 2(N-1)/N beta: divide before comparing links.
    The fit weighs each point by 1/t so small messages count as much as big ones.
    """
    n = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if n.shape != t.shape or n.size < 2:
        raise ValueError("need at least two (size, time) pairs of equal length")
    if np.any(t <= 0) or np.any(n < 0):
        raise ValueError("times must be positive and sizes non-negative")
    weights = 1.0 / t
    design = np.stack([np.ones_like(n), n], axis=1) * weights[:, None]
    (a, b), *_ = np.linalg.lstsq(design, t * weights, rcond=None)
    return float(a), float(b)
