"""Bytes each axis sends per training step when pipeline, data, context, tensor and expert
parallelism combine (the combining chapter): each axis' own chapter's formula, with the
sizes the other axes leave it.

A rank of a pp x dp x cp x tp mesh (ep borrowing the dp x cp ranks) runs m microbatches of
b rows, each row s/c positions of a sequence of s, through the L/p layers of its stage:

- **tp**: the tensor-parallel all-reduces of (b, s/c, h) activations, per layer and
  microbatch (:func:`parlib.cost.tensor.tp_sent_bytes_per_layer`; attention's only when
  the MLP is a mixture of experts, which every tensor-parallel rank runs whole);
- **cp**: ring attention's K/V blocks of this rank's h/t of the key-value width
  (:func:`parlib.cost.context.ring_attention_sent_bytes_per_layer`), then the all-reduce
  of the shared parameters' gradients (and the last stage's 4-byte loss);
- **dp**: the all-reduce of the gradients the dp group averages (the shared parameters',
  and the experts' when their copies are the dp group, ep = c), and the loss;
- **pp**: one (b, s/c, h) activation per microbatch and boundary, forward out of every
  stage but the last, its gradient backward out of every stage but the first
  (:func:`parlib.cost.pipeline.boundary_bytes`);
- **ep**: what a rank puts into the all-to-alls (the token rows out and back, forward and
  backward, and the counts), :func:`parlib.cost.experts.ep_all_to_all_bytes_per_layer`:
  a rank's own share depends on where the router sends the tokens, the mean over an ep
  group does not (it is exact whatever the routing, without dropped tokens).
"""

from __future__ import annotations

from parlib.cost.collectives import predicted_sent_bytes
from parlib.cost.context import ring_attention_sent_bytes_per_layer
from parlib.cost.experts import ep_all_to_all_bytes_per_layer, ep_count_bytes_per_layer
from parlib.cost.layout import Layout
from parlib.cost.pipeline import boundary_bytes
from parlib.cost.tensor import tp_sent_bytes_per_layer

LOSS_BYTES = 4  # the last stage's float32 loss, averaged over dp and cp


def mesh_sent_bytes_per_step(layout: Layout, *, b: int, s: int, h: int, m: int, layers: int,
                             stage: int, shared_param_bytes: float,
                             expert_param_bytes: float = 0.0, n_experts: int = 0,
                             top_k: int = 0, dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank at pipeline stage ``stage`` of ``layout`` sends per step on each axis
    of size > 1 (``"ep"``: bytes put into its all-to-alls, the mean over its ep group).

    ``b`` rows per microbatch, ``s`` the whole sequence, ``h`` the hidden width, ``m``
    microbatches, ``layers`` per stage; ``shared_param_bytes`` / ``expert_param_bytes``:
    the rank's parameters outside / inside its experts; ``n_experts`` > 0 for a mixture
    of experts routing each token to ``top_k``. The loss is float32 whatever
    ``dtype_bytes``."""
    t, c, d, e, p = layout.tp, layout.cp, layout.dp, layout.ep, layout.pp
    if e > 1 and (e not in (c, d * c) or (t > 1 and "tp" in layout.ep_borrows)):
        raise ValueError(f"{layout!r}: these formulas price ep over the cp ranks (e = c = {c})"
                         f" or over all dp x cp ranks (e = {d * c}), each MoE whole on every "
                         f"tp rank, as build_nd runs it: pick one of those e and leave "
                         f"ep_borrows at its default")
    last = stage == p - 1
    loss = LOSS_BYTES if last else 0
    s_local = s // c
    out: dict[str, float] = {}
    if t > 1:
        out["tp"] = m * layers * tp_sent_bytes_per_layer(b, s_local, h, t, dtype_bytes,
                                                         split_mlp=not n_experts)
    if c > 1:
        ring = ring_attention_sent_bytes_per_layer(b, s, h // t, c, dtype_bytes)
        out["cp"] = (m * layers * ring
                     + predicted_sent_bytes("all_reduce", shared_param_bytes + loss, c))
    if d > 1:
        averaged = shared_param_bytes + (expert_param_bytes if e == c else 0)
        out["dp"] = predicted_sent_bytes("all_reduce", averaged + loss, d)
    if p > 1:
        directions = (stage > 0) + (not last)
        out["pp"] = directions * m * boundary_bytes(b, s_local, h, dtype_bytes)
    if e > 1:
        out["ep"] = m * layers * (ep_all_to_all_bytes_per_layer(b * s_local, h, top_k,
                                                                dtype_bytes)
                                  + ep_count_bytes_per_layer(n_experts))
    return out


__all__ = ["LOSS_BYTES", "mesh_sent_bytes_per_step"]
