"""A decoder-only transformer described by its sizes: parameter count and training FLOPs.

Layer layout: ``embed -> n_layers x (norm, attention, norm, MLP) -> final norm, output``.
The defaults describe the course's TinyGPT (``parlib.model``): biases everywhere,
LayerNorm, learned positions, untied output, a GELU MLP. Llama-style models set
``gated_mlp=True, bias=False, learned_positions=False`` (RMSNorm, RoPE, SwiGLU).

Mixture of experts (``n_experts`` > 0): every layer's MLP is E expert MLPs of width
``expert_ffn_dim`` (default ``ffn_dim``) and a router (h x E, no bias); each token runs
``top_k`` of them. Parameters grow with E, FLOPs with k (:mod:`parlib.cost.experts`).
``capacity_factor`` (None: no limit, dropless) sizes each expert's buffer at that multiple
of its fair share. The defaults (``n_experts=0``) mean dense.

FLOPs count multiply-adds as 2. Training is forward + backward = 3 x forward, and the
forward of a token is 2 x (weights it multiplies by) plus attention's own term, the
QK^T and attention-times-V products, 2 x 2 x s x h per layer (PaLM, Chowdhery et al. 2022,
Appendix B; no discount for the causal mask). Embedding lookups multiply nothing.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

from parlib.cost.experts import expert_params, moe_params_per_rank

# A backward computes the gradients of both a layer's input and its weights: two matmuls
# for the forward's one.
BACKWARD_PER_FORWARD = 2


@dataclass(frozen=True)
class Model:
    """Sizes of a decoder-only transformer.

    ``ffn_dim`` defaults to 4 x d_model, ``n_kv_heads`` to ``n_heads`` (no grouped KV).
    ``dropout`` says whether the layer keeps dropout masks (activation memory only).
    """

    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    ffn_dim: int | None = None
    n_kv_heads: int | None = None
    _: KW_ONLY
    gated_mlp: bool = False
    bias: bool = True
    learned_positions: bool = True
    tied_embeddings: bool = False
    dropout: bool = False
    name: str = ""
    n_experts: int = 0
    top_k: int = 1
    capacity_factor: float | None = None
    expert_ffn_dim: int | None = None

    def __post_init__(self) -> None:
        for field in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
            _require_positive_int(field, getattr(self, field))
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", 4 * self.d_model)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _require_positive_int("ffn_dim", self.ffn_dim)
        _require_positive_int("n_kv_heads", self.n_kv_heads)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by "
                             f"n_kv_heads={self.n_kv_heads}")
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) \
                or self.n_experts < 0:
            raise ValueError(f"n_experts must be a whole number >= 0 (0: dense), got "
                             f"{self.n_experts!r}")
        if self.expert_ffn_dim is None:
            object.__setattr__(self, "expert_ffn_dim", self.ffn_dim)
        _require_positive_int("expert_ffn_dim", self.expert_ffn_dim)
        _require_positive_int("top_k", self.top_k)
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} is more than the {self.n_experts} experts")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None: no limit), got "
                             f"{self.capacity_factor!r}")

    @classmethod
    def from_config(cls, cfg: Any, name: str = "TinyGPT") -> Model:
        """The course's ``parlib.model.ModelConfig`` (read by attribute, no torch import)."""
        return cls(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                   seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                   ffn_dim=getattr(cfg, "mlp_ratio", 4) * cfg.d_model, name=name)

    # ---- shapes
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): n_kv_heads x head_dim."""
        return self.n_kv_heads * self.head_dim

    # ---- parameters
    @property
    def attention_matmul_params(self) -> int:
        """Weights of one layer's q, k, v and out projections."""
        return 2 * self.d_model * self.d_model + 2 * self.d_model * self.kv_dim

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts (``n_experts`` > 0)."""
        return self.n_experts > 0

    @property
    def _matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def expert_matmul_params(self) -> int:
        """Weights of one expert's matrices (three when gated); 0 for a dense model."""
        return self._matrices * self.d_model * self.expert_ffn_dim if self.is_moe else 0

    @property
    def expert_params_each(self) -> int:
        """All parameters of one expert MLP: :func:`~parlib.cost.experts.expert_params`,
        plus the third matrix (and its bias) when gated; 0 for a dense model."""
        if not self.is_moe:
            return 0
        h, f = self.d_model, self.expert_ffn_dim
        gate = (h * f + (f if self.bias else 0)) if self.gated_mlp else 0
        return expert_params(h, f, self.bias) + gate

    @property
    def layer_expert_params(self) -> int:
        """One layer's experts' parameters, all E of them (the router not counted: every ep
        rank keeps a copy, as it does attention); 0 for a dense model."""
        return self.n_experts * self.expert_params_each

    def moe_layer_params_per_rank(self, ep: int = 1) -> int:
        """One MoE layer's parameters on one of ``ep`` ranks: E/ep experts and the router
        (:func:`~parlib.cost.experts.moe_params_per_rank`, plus the gate matrices when
        gated)."""
        h, f = self.d_model, self.expert_ffn_dim
        gate = (h * f + (f if self.bias else 0)) if self.gated_mlp else 0
        return (moe_params_per_rank(self.n_experts, ep, h, f, self.bias)
                + self.n_experts // ep * gate)

    @property
    def mlp_matmul_params(self) -> int:
        """Weights of one layer's MLP matrices (three when gated); for a mixture of experts,
        all E experts' and the router's."""
        if self.is_moe:
            return self.n_experts * self.expert_matmul_params + self.d_model * self.n_experts
        return self._matrices * self.d_model * self.ffn_dim

    @property
    def mlp_active_matmul_params(self) -> int:
        """Weights of one layer's MLP that one token multiplies: all of a dense MLP; the
        router and top_k experts of a mixture."""
        if self.is_moe:
            return self.top_k * self.expert_matmul_params + self.d_model * self.n_experts
        return self.mlp_matmul_params

    @property
    def activation_ffn_dim(self) -> int:
        """Width of the MLP's hidden activations per token: ffn_dim, or top_k experts'."""
        return self.top_k * self.expert_ffn_dim if self.is_moe else self.ffn_dim

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matrices: q, k, v, out projections and the MLP."""
        return self.attention_matmul_params + self.mlp_matmul_params

    @property
    def layer_active_matmul_params(self) -> int:
        """Weights of one layer that one token multiplies (the layer's matrices when dense)."""
        return self.attention_matmul_params + self.mlp_active_matmul_params

    @property
    def _norm_params(self) -> int:
        # LayerNorm has a weight and a bias; the bias-free models use RMSNorm (weight only).
        return self.d_model * (2 if self.bias else 1)

    @property
    def layer_params(self) -> int:
        """All parameters of one transformer layer (matrices, biases, two norms)."""
        h, f = self.d_model, self.ffn_dim
        if self.is_moe:  # the experts' own biases are in expert_params_each
            biases = 2 * h + 2 * self.kv_dim if self.bias else 0
            return (self.attention_matmul_params + self.d_model * self.n_experts + biases
                    + self.layer_expert_params + 2 * self._norm_params)
        biases = (2 * h + 2 * self.kv_dim + (2 if self.gated_mlp else 1) * f + h
                  if self.bias else 0)
        return self.layer_matmul_params + biases + 2 * self._norm_params

    @property
    def embedding_params(self) -> int:
        """The lookup tables: tokens, and positions when they are learned."""
        positions = self.seq_len * self.d_model if self.learned_positions else 0
        return self.vocab_size * self.d_model + positions

    @property
    def head_params(self) -> int:
        """Final norm and output projection (none of its own when tied to the embedding)."""
        projection = 0 if self.tied_embeddings else self.vocab_size * self.d_model
        bias = self.vocab_size if self.bias and not self.tied_embeddings else 0
        return self._norm_params + projection + bias

    @property
    def n_params(self) -> int:
        return self.n_layers * self.layer_params + self.embedding_params + self.head_params

    @property
    def matmul_params(self) -> int:
        """Weights a token is multiplied by: every layer's matrices (for a mixture, its router
        and top_k experts) and the output projection (the embedding table when tied)."""
        return self.n_layers * self.layer_active_matmul_params + self.vocab_size * self.d_model

    # ---- FLOPs per token
    @property
    def layer_attention_flops_per_token(self) -> int:
        """Forward FLOPs of one layer's QK^T and scores x V: 4 x s x h."""
        return 4 * self.seq_len * self.d_model

    @property
    def attention_flops_per_token(self) -> int:
        """Forward FLOPs of QK^T and scores x V over all layers: 4 x s x h per layer."""
        return self.n_layers * self.layer_attention_flops_per_token

    @property
    def forward_flops_per_token(self) -> int:
        return 2 * self.matmul_params + self.attention_flops_per_token

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward): 6 x matmul params + 12 x L x s x h."""
        return (1 + BACKWARD_PER_FORWARD) * self.forward_flops_per_token

    @property
    def layers_forward_flops_per_token(self) -> int:
        """Forward FLOPs of the transformer layers alone (what full recomputation reruns)."""
        return (2 * self.n_layers * self.layer_active_matmul_params
                + self.attention_flops_per_token)

    @property
    def op_policy_flops_per_token(self) -> int:
        """Forward FLOPs per token torchtitan's per-operation checkpointing policy reruns in
        backward: every layer's matmuls it does not keep, the second, fourth and sixth in
        forward order (K, the attention output's projection, and the MLP's second matrix:
        w3 gated, the output matrix otherwise), 2 x (h x kv + h x h + h x f) per layer. Llama
        3 8B: 2 x 4096 x (1024 + 4096 + 14336) = 159.4 M per layer, 5.10 G over 32 layers.
        For a dense model (a ValueError for experts)."""
        if self.is_moe:
            raise ValueError(f"{self.name}: the per-operation policy is counted for dense "
                             "layers only")
        h = self.d_model
        return self.n_layers * 2 * (h * self.kv_dim + h * h + h * self.ffn_dim)

    def rank_forward_flops_per_token(self, *, layers: int, t: int = 1,
                                     head: bool = False) -> float:
        """Forward FLOPs per token of one rank holding ``layers`` transformer layers split
        ``t`` ways by tensor parallelism (matrices and heads), plus the whole output
        projection when ``head`` (the course's TP copy keeps the head unsplit)."""
        if not 0 <= layers <= self.n_layers or t < 1:
            raise ValueError(f"need 0 <= layers <= {self.n_layers} and t >= 1, got "
                             f"layers={layers!r}, t={t!r}")
        output = 2 * self.vocab_size * self.d_model if head else 0
        return layers * sum(self.layer_forward_flops_per_token(t)) + output

    def layer_forward_flops_per_token(self, t: int = 1) -> tuple[float, float]:
        """Forward FLOPs per token of one layer's two halves on one of ``t`` tensor-parallel
        ranks: (attention: projections and scores, MLP). Megatron ends each half with an
        all-reduce."""
        attention = 2 * self.attention_matmul_params + self.layer_attention_flops_per_token
        return attention / t, 2 * self.mlp_active_matmul_params / t

    def __str__(self) -> str:
        label = self.name or "model"
        return (f"{label}: {self.n_params / 1e9:.3g} B params, L = {self.n_layers}, "
                f"h = {self.d_model}, a = {self.n_heads}, s = {self.seq_len}, "
                f"V = {self.vocab_size}")


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


__all__ = ["BACKWARD_PER_FORWARD", "Model"]
