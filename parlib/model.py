"""A small decoder-only transformer and a deterministic token stream, shared by every chapter.

The model is laid out as ``embed -> blocks[0..L-1] -> head`` so that later chapters can cut it
into pipeline stages (consecutive blocks) or shard the matrices inside a block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parlib.cost.experts import expert_capacity


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the model. Defaults make one training step take tens of ms on one CPU core."""

    vocab_size: int = 256  # bytes: the synthetic stream is byte-valued
    seq_len: int = 64  # s
    d_model: int = 128  # h
    n_heads: int = 4
    n_layers: int = 4  # L
    mlp_ratio: int = 4
    # A mixture of experts in place of each block's MLP when n_experts > 0 (0: the dense
    # model, unchanged). Each expert is an MLP of width expert_hidden (0: mlp_ratio x h).
    n_experts: int = 0  # E
    top_k: int = 2  # k: experts per token
    capacity_factor: float | None = None  # None: no expert ever drops a token
    expert_hidden: int = 0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_experts:
            check_routing(self.n_experts, self.top_k, self.capacity_factor)
        if self.n_experts < 0 or self.expert_hidden < 0:
            raise ValueError("n_experts and expert_hidden must be >= 0, got "
                             f"{self.n_experts} and {self.expert_hidden}")


class Embed(nn.Module):
    """Token + learned position embedding: tokens (b, s) -> hidden (b, s, h)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v/out projections (easy to shard)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Heads are counted from the projection width, so a copy whose q/k/v were cut by
        # columns (tensor parallelism) runs its share of the heads unchanged.
        width = self.q.out_features
        head_dim = self.head_dim
        heads = width // head_dim

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, heads, head_dim).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, width))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def check_routing(n_experts: int, top_k: int, capacity_factor: float | None) -> None:
    """A clear error for a routing that cannot work."""
    if n_experts < 1:
        raise ValueError(f"a mixture of experts needs n_experts >= 1, got {n_experts}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or None), got {capacity_factor}")


class Expert(nn.Module):
    """One expert: a small MLP h -> f -> h (f = cfg.expert_hidden, or mlp_ratio x h)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.expert_hidden or cfg.mlp_ratio * cfg.d_model
        self.up = nn.Linear(cfg.d_model, hidden)
        self.down = nn.Linear(hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


@dataclass
class Routing:
    """Where each of T tokens goes: ``experts`` (T, k) long, ``weights`` (T, k) (the
    router's probabilities of those experts, not renormalised), ``keep`` (T, k) bool (False:
    over the expert's capacity, dropped), ``probs`` (T, E), ``aux_loss`` (a scalar)."""

    experts: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    probs: torch.Tensor
    aux_loss: torch.Tensor


def capacity_keep(experts: torch.Tensor, n_experts: int, capacity: int | None) -> torch.Tensor:
    """(T, k) bool: which assignments fit. Each expert takes at most ``capacity``, first come
    first served in choice-major order: every token's first choice (in token order) before
    any second choice, so a token loses its second expert before another loses its first."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    queue = experts.t().reshape(-1)  # choice-major: (k * T,)
    onehot = F.one_hot(queue, n_experts)
    place = (onehot.cumsum(0) * onehot).sum(1) - 1  # place in its expert's queue: 0, 1, ..
    return (place < capacity).view(experts.shape[1], experts.shape[0]).t()


def route(x: torch.Tensor, router: nn.Linear, top_k: int,
          capacity_factor: float | None = None) -> Routing:
    """The router on tokens x (T, h): softmax over the E experts, the top k, capacity
    ceil(capacity_factor x T x k / E) per expert over these T tokens, and the Switch
    Transformer's load-balancing loss E x sum_e f_e x P_e (f_e: the share of the T x k
    choices that picked e, P_e: e's mean probability; 1 when perfectly balanced)."""
    n_experts = router.out_features
    check_routing(n_experts, top_k, capacity_factor)
    probs = F.softmax(router(x), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    capacity = expert_capacity(x.shape[0] * top_k, n_experts, capacity_factor)
    keep = capacity_keep(experts, n_experts, capacity)
    share = F.one_hot(experts, n_experts).sum((0, 1)).to(probs.dtype) / experts.numel()
    aux = n_experts * (share * probs.mean(0)).sum()
    return Routing(experts, weights, keep, probs, aux)


class MoE(nn.Module):
    """A mixture of experts on one device: the router sends each token to its top-k
    experts, and the output is the sum of their outputs times the router's weights.

    A token over an expert's capacity gets nothing from that expert (zero from all of
    them if every choice is dropped): in the block ``x + moe(ln(x))`` the residual passes
    it through unchanged. ``aux_loss`` holds the last call's load-balancing loss (add
    ``coef x aux_loss`` to the training loss to use it)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check_routing(cfg.n_experts, cfg.top_k, cfg.capacity_factor)
        self.top_k, self.capacity_factor = cfg.top_k, cfg.capacity_factor
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.n_experts))
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # (b, s, h) -> (T, h)
        r = route(tokens, self.router, self.top_k, self.capacity_factor)
        self.aux_loss, self.last_routing = r.aux_loss, r
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):  # every expert runs, even on no rows
            token, choice = torch.nonzero((r.experts == e) & r.keep, as_tuple=True)
            y = expert(tokens[token]) * r.weights[token, choice, None]
            out = out.index_add(0, token, y)
        return out.view_as(x)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) (``mlp`` is a
    :class:`MoE` when ``cfg.n_experts > 0``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final norm and projection to vocabulary logits: hidden (b, s, h) -> (b, s, vocab)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer: ``embed``, ``blocks`` (an nn.ModuleList), ``head``."""

    def __init__(self, cfg: ModelConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or ModelConfig()
        self.embed = Embed(self.cfg)
        self.blocks = nn.ModuleList(Block(self.cfg) for _ in range(self.cfg.n_layers))
        self.head = Head(self.cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(cfg: ModelConfig | None = None, seed: int = 0) -> TinyGPT:
    """The same initial weights on every rank and every run, for a given seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyGPT(cfg)


def make_batch(
    batch_size: int, cfg: ModelConfig | None = None, step: int = 0, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of a deterministic synthetic token stream: (tokens, next-token targets).

    The stream has structure a model can learn (noisy repeating ramps), so losses fall.
    Every rank asking for the same (batch_size, step, seed) gets the same tensors; data
    parallel code then slices its own rows.
    """
    cfg = cfg or ModelConfig()
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 8, (batch_size, 1), generator=gen)
    ramp = start + stride * torch.arange(cfg.seq_len + 1)
    noise = (torch.rand(batch_size, cfg.seq_len + 1, generator=gen) < 0.1) * torch.randint(
        0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen
    )
    stream = (ramp + noise) % cfg.vocab_size
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


IGNORE_INDEX = -100  # a target that counts for nothing (padding): torch's default


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every real position (target not IGNORE_INDEX)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def loss_share(logits: torch.Tensor, targets: torch.Tensor,
               batch_tokens: torch.Tensor | int) -> torch.Tensor:
    """This piece's share of the whole batch's mean loss: the sum of its real positions'
    cross-entropy over ``batch_tokens``, the real positions of the whole batch (every
    microbatch, every rank). The shares add up to :func:`loss_fn` of the whole batch and
    their gradients to its gradient, however the batch is split and padded; averaging
    each piece's mean instead weighs a token of a short piece more."""
    if isinstance(batch_tokens, (int, float)) and not batch_tokens >= 1:
        raise ValueError(f"loss_share: batch_tokens={batch_tokens!r}, but it counts the real "
                         f"targets of the whole batch (every microbatch, every rank), so it "
                         f"is at least 1: pass global_token_count(targets, group=group)")
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    return total / batch_tokens


def count_parameters(model: nn.Module) -> int:
    """P: the number of parameters (the elements of every weight and bias)."""
    return sum(p.numel() for p in model.parameters())


def make_optimizer(params: Iterable[torch.Tensor], name: str = "sgd",
                   lr: float = 0.1) -> torch.optim.Optimizer:
    """``"sgd"`` (plain SGD: a wrong gradient shows up directly in the weights) or
    ``"adam"``."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {name!r}")


def train_step(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor,
               sync: Callable[[], Any] | None = None, *, group: Any = None) -> float:
    """zero_grad, forward, backward, ``sync()`` (gradient pooling, if any), step.

    ``group``: the data-parallel ranks whose rows of the batch ``sync`` averages the
    gradients over. The loss is then normalised by the real positions of every rank's rows
    (one all-reduce of a count) and multiplied by the group's size, undoing the average, so
    ranks holding different numbers of real targets (IGNORE_INDEX: padding) step exactly as
    one device on the whole batch would. Returns the loss as a float: with ``group``, the
    whole batch's (one more all-reduce of a scalar).
    """
    optimizer.zero_grad(set_to_none=True)
    if group is None:
        loss = loss_fn(model(x), y)
    else:
        loss = loss_share(model(x), y, _group_tokens(y, group)) * dist.get_world_size(group)
    loss.backward()
    if sync is not None:
        sync()
    optimizer.step()
    if group is None:
        return loss.item()
    whole = loss.detach().reshape(1) / dist.get_world_size(group)
    dist.all_reduce(whole, group=group)
    return whole.item()


def _group_tokens(targets: torch.Tensor, group: Any) -> torch.Tensor:
    """The real targets of every rank of ``group``'s rows; refuses a batch with none."""
    count = (targets != IGNORE_INDEX).sum().reshape(1)
    dist.all_reduce(count, group=group)
    if int(count) < 1:
        raise ValueError(f"train_step: rank {dist.get_rank()}: no rank of the group has a "
                         f"real target (all are IGNORE_INDEX={IGNORE_INDEX})")
    return count[0]


__all__ = [
    "ModelConfig",
    "TinyGPT",
    "Block",
    "Expert",
    "MoE",
    "Routing",
    "route",
    "capacity_keep",
    "check_routing",
    "build_model",
    "make_batch",
    "loss_fn",
    "loss_share",
    "IGNORE_INDEX",
    "count_parameters",
    "make_optimizer",
    "train_step",
]
