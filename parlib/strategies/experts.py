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

Shapes in names (``tokens_TW``): T tokens on this rank, W model width, N rows (kept
choices) sent or received, E experts, P ep ranks, L experts on this rank (E/P), K top-k.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Function

from parlib.comm import agree, rank_and_size
from parlib.model import MoE, Routing, TinyGPT, check_routing, route


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
    """Rows of ``rows_NW`` to the ranks of ``group``: the first ``send[0]`` rows to rank 0,
    the next ``send[1]`` to rank 1, ...; returns ``sum(recv)`` rows, rank 0's first.
    Backward: the same exchange reversed (the gradient of each row goes back where it came
    from)."""

    @staticmethod
    def forward(ctx: Any, rows_NW: torch.Tensor, send: list[int], recv: list[int],
                group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        arrived_NW = rows_NW.new_empty((sum(recv), *rows_NW.shape[1:]))
        dist.all_to_all_single(arrived_NW, rows_NW.contiguous(), recv, send, group=group)
        return arrived_NW

    @staticmethod
    def backward(ctx: Any, grad_NW: torch.Tensor) -> tuple[Any, ...]:
        back_NW = grad_NW.new_empty((sum(ctx.send), *grad_NW.shape[1:]))
        dist.all_to_all_single(back_NW, grad_NW.contiguous(), ctx.send, ctx.recv,
                               group=ctx.group)
        return back_NW, None, None, None


def all_to_all(rows_NW: torch.Tensor, send: list[int], recv: list[int],
               group: Any) -> torch.Tensor:
    """:class:`AllToAll` (differentiable) with its split sizes checked."""
    if sum(send) != rows_NW.shape[0]:
        raise ValueError(f"send counts {send} add up to {sum(send)}, not the "
                         f"{rows_NW.shape[0]} rows to send")
    return AllToAll.apply(rows_NW, list(send), list(recv), group)


def dispatch_plan(routing: Routing, n_experts: int, ep: int) -> dict[str, torch.Tensor]:
    """Where this rank's kept choices go: ``token`` and ``weight`` of each choice (N,),
    sorted by expert (``expert``); ``per_expert`` (E,) and ``per_rank`` (P,) counts (rank
    r's experts are contiguous, so sorting by expert groups the rows by destination rank)."""
    token_N, choice_N = torch.nonzero(routing.keep, as_tuple=True)
    expert_N = routing.experts[token_N, choice_N]
    order_N = torch.argsort(expert_N, stable=True)
    token_N, choice_N, expert_N = token_N[order_N], choice_N[order_N], expert_N[order_N]
    per_expert_E = torch.bincount(expert_N, minlength=n_experts)
    return {"token": token_N, "weight": routing.weights[token_N, choice_N], "expert": expert_N,
            "per_expert": per_expert_E, "per_rank": per_expert_E.view(ep, -1).sum(1)}


def _as_linear(router: nn.Module) -> nn.Linear:
    """The router as an ``nn.Linear`` (W -> E): itself, or one sharing the ``weight`` (E, W)
    of another module computing ``x @ weight.T`` (a transformers MoE's gate)."""
    if isinstance(router, nn.Linear):
        return router
    weight = getattr(router, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        raise ValueError(f"router must be an nn.Linear or have a weight (E, W) parameter, "
                         f"got {type(router).__name__}")
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = weight  # the same parameter: one router, its gradient where it was
    return linear


def _stacked_count(experts: nn.Module) -> int:
    """E of experts stacked along dim 0 of every parameter (transformers' layout)."""
    leading = {p.shape[0] for p in experts.parameters()}
    if len(leading) != 1:
        raise ValueError(f"experts is neither a list of E modules nor E experts stacked on "
                         f"dim 0 of every parameter: leading sizes {sorted(leading)}")
    return leading.pop()


def _local_experts(experts: nn.Module, mine: range) -> nn.Module:
    """This rank's experts ``mine`` of ``experts``. A list: its modules ``mine``, in a dict
    keyed by the global index (names as on one device: ``experts.5.up.weight``). Stacked:
    a copy holding the slices ``mine`` of each parameter (names unchanged, dim 0 E/P), its
    ``num_experts`` set to E/P; the whole stack is never copied."""
    if isinstance(experts, (nn.ModuleList, list, tuple)):
        return nn.ModuleDict({str(e): experts[e] for e in mine})
    slices = {id(p): nn.Parameter(p.detach()[mine.start:mine.stop].clone())
              for p in experts.parameters()}
    local = copy.deepcopy(experts, memo=slices)  # each parameter replaced by its slice
    if hasattr(local, "num_experts"):
        local.num_experts = len(mine)
    return local


class ExpertParallelMoE(nn.Module):
    """A mixture-of-experts layer with this rank's E/P experts; the router is replicated.

    ``router``: the linear map from a token to its E expert scores (an ``nn.Linear``, or a
    module whose ``weight`` (E, W) does the same, such as a transformers MoE's gate).
    ``experts``: either E modules (each rows (N, W) -> (N, W)), or one module holding E
    experts stacked on dim 0 of each parameter and called as transformers' experts are,
    ``experts(x_NW, index_NK, weight_NK)``. Routing is :func:`parlib.model.route`: softmax,
    top ``top_k`` (weights not renormalised), ``capacity_factor`` (None: no drops). Every
    rank of ``group`` builds it together, checking that they agree on E, top_k,
    capacity_factor and W."""

    def __init__(self, router: nn.Module, experts: nn.Module, group: Any, *, top_k: int,
                 capacity_factor: float | None = None) -> None:
        super().__init__()
        self.rank, self.ep = rank_and_size(group, "ExpertParallelMoE", allow_none=False)
        self.group = group
        self.router = _as_linear(router)
        self.stacked = not isinstance(experts, (nn.ModuleList, list, tuple))
        self.n_experts = _stacked_count(experts) if self.stacked else len(experts)
        if self.n_experts != self.router.out_features:
            raise ValueError(f"the router scores {self.router.out_features} experts; "
                             f"experts holds {self.n_experts}")
        check_routing(self.n_experts, top_k, capacity_factor)
        _agree_on_layer(group, self.n_experts, top_k, capacity_factor,
                        self.router.in_features)
        self.mine = experts_of_rank(self.rank, self.ep, self.n_experts)
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.experts = _local_experts(experts, self.mine)
        self.aux_loss: torch.Tensor | None = None  # for the loss; the routing itself is
        # observed from outside (parlib.experiments.experts.RoutingRecorder)

    @classmethod
    def from_moe(cls, moe: MoE, group: Any) -> ExpertParallelMoE:
        """From the course's :class:`parlib.model.MoE`: its router, experts and settings."""
        return cls(moe.router, moe.experts, group, top_k=moe.top_k,
                   capacity_factor=moe.capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens_TW = x.reshape(-1, x.shape[-1])  # this rank's tokens
        r = route(tokens_TW, self.router, self.top_k, self.capacity_factor)
        self.aux_loss = r.aux_loss
        plan = dispatch_plan(r, self.n_experts, self.ep)
        # what every rank sends me, per local expert: (P, L) counts, sender-major
        incoming_PL = torch.empty_like(plan["per_expert"])
        dist.all_to_all_single(incoming_PL, plan["per_expert"], group=self.group)
        incoming_PL = incoming_PL.view(self.ep, -1)
        send, recv = plan["per_rank"].tolist(), incoming_PL.sum(1).tolist()
        arrived_NW = all_to_all(tokens_TW[plan["token"]], send, recv, self.group)
        # rows arrive by sender, each sender's sorted by expert: the local expert of each
        local_L = torch.arange(len(self.mine), device=incoming_PL.device)
        expert_N = local_L.repeat(self.ep).repeat_interleave(incoming_PL.reshape(-1))
        computed_NW = self._run_experts(arrived_NW, expert_N)
        returned_NW = all_to_all(computed_NW, recv, send, self.group)  # back in plan order
        out_TW = torch.zeros_like(tokens_TW).index_add(
            0, plan["token"], returned_NW * plan["weight"][:, None])
        return out_TW.view_as(x)

    def _run_experts(self, rows_NW: torch.Tensor, expert_N: torch.Tensor) -> torch.Tensor:
        """Each row through its local expert ``expert_N`` (0 .. L - 1), outputs in row order."""
        if self.stacked:  # the experts route rows themselves; a weight of 1 each
            return self.experts(rows_NW, expert_N[:, None], rows_NW.new_ones(len(rows_NW), 1))
        by_expert_N = torch.argsort(expert_N, stable=True)
        outputs, start = [], 0
        for i, expert in enumerate(self.experts.values()):  # every expert runs, even on none
            n = int((expert_N == i).sum())
            outputs.append(expert(rows_NW[by_expert_N[start:start + n]]))
            start += n
        return torch.empty_like(rows_NW).index_copy(0, by_expert_N, torch.cat(outputs))


def _agree_on_layer(group: Any, n_experts: int, top_k: int, capacity_factor: float | None,
                    width: int) -> None:
    """The ranks' MoE layers route alike (else the counts' all-to-all aborts on a size
    mismatch, or tokens go to experts another rank does not have)."""
    same_config = "build every rank's layer from one config (TinyGPT: the same ModelConfig"
    agree("ExpertParallelMoE", group, {
        "n_experts": (n_experts, f"{same_config}(n_experts=E, ...))"),
        "top_k": (top_k, f"{same_config}(top_k=...))"),
        "capacity_factor": (capacity_factor, f"{same_config}(capacity_factor=...))"),
        "d_model (the router's input width)": (width, f"{same_config}(d_model=...))"),
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
        block.mlp = ExpertParallelMoE.from_moe(block.mlp, group)
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
