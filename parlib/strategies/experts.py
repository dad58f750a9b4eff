"""Expert parallelism: a mixture-of-experts layer whose E experts are split over ep ranks.

Each rank holds E/ep experts (rank r: experts r x E/ep .. (r + 1) x E/ep - 1) and its own
tokens. In every MoE layer, per rank:

1. route its T tokens (:func:`parlib.model.route`: softmax, top-k, capacity over these T
   tokens; tokens over capacity are dropped here, before they travel, and the residual
   passes them through);
2. sort the kept (token, expert) choices by expert, hence by the rank that holds it, and
   count them per destination rank; swap the per-expert counts with every rank (a small
   all-to-all) so each rank knows what it will receive;
3. dispatch: one ``all_to_all_single`` with those variable split sizes sends each token's
   hidden vector to its expert's rank (:class:`AllToAll`, whose backward is the reverse
   all-to-all);
4. run each local expert on its rows, send the outputs back the same way (the combine),
   and restore the original token order, each output times its router weight.

Forward sends each kept choice's vector out and back; backward sends their gradients the
same two ways (:func:`parlib.cost.experts.ep_all_to_all_bytes_per_layer`).

With data parallelism on the same ranks (DeepSeek style), every rank trains on its own
rows: the shared parameters (attention, norms, router, embeddings) are replicated and their
gradients averaged over all ranks, an expert's gradient is summed over the replicas of that
expert only (:func:`sync_gradients`; :class:`parlib.strategies.mesh.Mesh` builds both groups,
``mesh.group("ep")`` and ``mesh.expert_replica_group()``). Groups are arguments.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Function

from parlib.comm import agree, rank_and_size
from parlib.model import MoE, Routing, TinyGPT, route


def experts_of_rank(rank: int, ep: int, n_experts: int) -> range:
    """The experts rank ``rank`` of ``ep`` holds: a contiguous E/ep of them."""
    if ep < 1 or n_experts % ep:
        raise ValueError(f"n_experts={n_experts} experts do not split over ep={ep} ranks "
                         "(E must be divisible by ep)")
    if not 0 <= rank < ep:
        raise ValueError(f"need 0 <= rank < ep, got rank={rank}, ep={ep}")
    per = n_experts // ep
    return range(rank * per, (rank + 1) * per)


class AllToAll(Function):
    """Rows of ``x`` to the ranks of ``group``: the first ``send[0]`` rows to rank 0, the
    next ``send[1]`` to rank 1, ...; returns ``sum(recv)`` rows, rank 0's first. Backward:
    the same exchange reversed (the gradient of each row goes back where it came from)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int],
                group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """:class:`AllToAll` (differentiable) with its split sizes checked."""
    if sum(send) != x.shape[0]:
        raise ValueError(f"send counts {send} add up to {sum(send)}, not the {x.shape[0]} "
                         "rows to send")
    return AllToAll.apply(x, list(send), list(recv), group)


def dispatch_plan(routing: Routing, n_experts: int, ep: int) -> dict[str, torch.Tensor]:
    """Where this rank's kept choices go: ``token`` and ``weight`` of each choice, sorted by
    expert (``expert``); ``per_expert`` (E,) and ``per_rank`` (ep,) counts (rank r's
    experts are contiguous, so sorting by expert groups the rows by destination rank)."""
    token, choice = torch.nonzero(routing.keep, as_tuple=True)
    expert = routing.experts[token, choice]
    order = torch.argsort(expert, stable=True)
    token, choice, expert = token[order], choice[order], expert[order]
    per_expert = torch.bincount(expert, minlength=n_experts)
    return {"token": token, "weight": routing.weights[token, choice], "expert": expert,
            "per_expert": per_expert, "per_rank": per_expert.view(ep, -1).sum(1)}


class ExpertParallelMoE(nn.Module):
    """The MoE layer with this rank's E/ep experts; the router is replicated.

    ``experts`` is an ``nn.ModuleDict`` keyed by the global expert index, so parameter
    names are those of the single-device :class:`parlib.model.MoE`
    (``experts.5.up.weight``): this rank's are a subset of them. Every rank of ``group``
    builds it together, checking that they agree on n_experts, top_k, capacity_factor and
    d_model."""

    def __init__(self, moe: MoE, group: Any) -> None:
        super().__init__()
        self.rank, self.ep = rank_and_size(group, "ExpertParallelMoE", allow_none=False)
        self.group = group
        self.n_experts = len(moe.experts)
        _agree_on_layer(moe, group)
        self.mine = experts_of_rank(self.rank, self.ep, self.n_experts)
        self.top_k, self.capacity_factor = moe.top_k, moe.capacity_factor
        self.router = moe.router
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in self.mine})
        self.aux_loss: torch.Tensor | None = None  # for the loss; the routing itself is
        # observed from outside (parlib.experiments.experts.RoutingRecorder)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # this rank's (T, h)
        r = route(tokens, self.router, self.top_k, self.capacity_factor)
        self.aux_loss = r.aux_loss
        plan = dispatch_plan(r, self.n_experts, self.ep)
        # what every rank sends me, per local expert: (ep, E/ep) counts, sender-major
        incoming = torch.empty_like(plan["per_expert"])
        dist.all_to_all_single(incoming, plan["per_expert"], group=self.group)
        incoming = incoming.view(self.ep, -1)
        send, recv = plan["per_rank"].tolist(), incoming.sum(1).tolist()
        arrived = all_to_all(tokens[plan["token"]], send, recv, self.group)
        # rows arrive by sender, each sender's sorted by expert: group them by expert
        local = torch.arange(len(self.mine), device=incoming.device).repeat(self.ep)
        row_expert = local.repeat_interleave(incoming.reshape(-1))
        by_expert = torch.argsort(row_expert, stable=True)
        outputs, start = [], 0
        for i, expert in enumerate(self.experts.values()):  # every expert runs, even on none
            n = int((row_expert == i).sum())
            outputs.append(expert(arrived[by_expert[start:start + n]]))
            start += n
        computed = torch.empty_like(arrived).index_copy(0, by_expert, torch.cat(outputs))
        returned = all_to_all(computed, recv, send, self.group)  # back in `plan` order
        out = torch.zeros_like(tokens).index_add(0, plan["token"],
                                                 returned * plan["weight"][:, None])
        return out.view_as(x)


def _agree_on_layer(moe: MoE, group: Any) -> None:
    """The ranks' MoE layers route alike (else the counts' all-to-all aborts on a size
    mismatch, or tokens go to experts another rank does not have)."""
    same_config = "build every rank's model from the same ModelConfig"
    agree("ExpertParallelMoE", group, {
        "n_experts": (len(moe.experts), f"{same_config}(n_experts=E, ...)"),
        "top_k": (moe.top_k, f"{same_config}(top_k=...)"),
        "capacity_factor": (moe.capacity_factor, f"{same_config}(capacity_factor=...)"),
        "d_model (the router's input width)": (moe.router.in_features,
                                               f"{same_config}(d_model=...)"),
    })


def expert_parallel_copy(model: TinyGPT, group: Any) -> TinyGPT:
    """A copy of an MoE ``model`` whose every MoE layer holds only this rank's experts of
    ``group`` (the ep ranks); everything else is replicated, names unchanged."""
    if not model.cfg.n_experts:
        raise ValueError("expert_parallel_copy needs a mixture-of-experts model "
                         "(ModelConfig(n_experts=E, ...)), got a dense one")
    rank_and_size(group, "expert_parallel_copy", allow_none=False)
    ep_model = copy.deepcopy(model)
    for block in ep_model.blocks:
        block.mlp = ExpertParallelMoE(block.mlp, group)
    return ep_model


def is_expert_parameter(name: str) -> bool:
    """Whether a parameter (by name) belongs to an expert, not to the shared model."""
    return ".experts." in f".{name}"


def sync_gradients(model: nn.Module, data_group: Any, replica_group: Any = None) -> None:
    """Gradients of a model trained on different rows on every rank of ``data_group``
    (each loss the mean over its rows, equal shares), made those of the mean loss.

    Shared parameters: averaged over ``data_group``. An expert's gradient already sums the
    contributions of every rank whose tokens it computed (they came back through the
    all-to-all): summed over its replicas (``replica_group``; None when each expert lives
    once), then divided by the number of data ranks, as the shared ones."""
    _, n = rank_and_size(data_group, "sync_gradients", allow_none=False)
    if replica_group is not None:
        rank_and_size(replica_group, "sync_gradients (replica_group)")
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if not is_expert_parameter(name):
            dist.all_reduce(p.grad, group=data_group)
        elif replica_group is not None and dist.get_world_size(replica_group) > 1:
            dist.all_reduce(p.grad, group=replica_group)
        p.grad /= n


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the last forward's load-balancing losses over the model's MoE layers."""
    losses = [m.aux_loss for m in model.modules()
              if isinstance(m, (MoE, ExpertParallelMoE)) and m.aux_loss is not None]
    if not losses:
        raise ValueError("no MoE layer has run a forward yet: no auxiliary loss to add")
    return torch.stack(losses).sum()


def split_rows(t: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's equal share of the batch rows of ``t`` (data parallel over ``group``)."""
    rank, n = rank_and_size(group, "split_rows", allow_none=False)
    if t.shape[0] % n:
        raise ValueError(f"a batch of {t.shape[0]} rows does not split over {n} ranks")
    return t.chunk(n)[rank]


__all__ = ["AllToAll", "ExpertParallelMoE", "all_to_all", "aux_loss", "dispatch_plan",
           "expert_parallel_copy", "experts_of_rank", "is_expert_parameter",
           "split_rows", "sync_gradients"]
