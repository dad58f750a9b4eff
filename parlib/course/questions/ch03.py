"""Questions of the tensor-parallel chapter: tensor parallelism (notebook 03_tensor_parallel)."""

from __future__ import annotations

import textwrap
from typing import Any, Callable

import torch

from parlib.cost.model import Model
from parlib.cost.tensor import tp_layer_params, tp_sent_bytes_per_layer
from parlib.course.question_types import Choice, Implementation, Numeric, current_timeout
from parlib.course.registry import register
from parlib.course.results import CheckFailed

GiB = 2**30

# --------------------------------------------------------------------------- numeric

_B, _S, _H, _T = 4, 2048, 8192, 8
register(Numeric(
    "03.bytes_per_layer",
    tp_sent_bytes_per_layer(_B, _S, _H, _T, dtype_bytes=2),
    unit="bytes",
    prompt=f"""
        A transformer layer with hidden size h = {_H} runs with t = {_T}-way tensor
        parallelism (Megatron's split: attention by heads, MLP column then row). A
        microbatch holds b = {_B} sequences of s = {_S} tokens, and the activations are
        bf16 (2 bytes). How many bytes does one rank send for this layer in one training
        step (forward and backward of the microbatch), with ring all-reduces? Give a
        number in bytes.
    """,
    working=f"""
        One message is the layer's activations (or their gradient):
        b x s x h x 2 bytes = {_B} x {_S} x {_H} x 2 = {_B * _S * _H * 2:,} bytes.

        Forward all-reduces it twice (g after attention, g after the MLP) and backward
        twice (f before attention, f before the MLP): 4 all-reduces.

        A ring all-reduce sends 2(t-1)/t of the message from each rank: 2 x 7/8 = 1.75.

        4 x 1.75 x {_B * _S * _H * 2:,} = **{tp_sent_bytes_per_layer(_B, _S, _H, _T, 2):,.0f}
        bytes** (about 0.88 GiB) per layer per microbatch. With 80 layers that is 70 GiB per
        microbatch on every rank: why the t ranks need NVLink-class links.
    """,
    mistakes={
        tp_sent_bytes_per_layer(_B, _S, _H, _T, 2, passes=("forward",)):
            "that is the forward only; backward all-reduces the gradients twice more",
        4 * _B * _S * _H * 2: "a ring all-reduce sends 2(t-1)/t of the message from each "
                              "rank, not the message once",
        tp_sent_bytes_per_layer(_B, _S, _H, _T, 4): "the activations are bf16: 2 bytes "
                                                    "each, not 4",
        tp_sent_bytes_per_layer(_B, _S, _H, _T, 2) / _T: "every rank sends 2(t-1)/t of the "
            "whole (b, s, h) message; it is not divided by t once more",
        4 * 2 * (_T - 1) * _B * _S * _H * 2: "each of the 2(t-1) ring steps sends a "
                                            "chunk of 1/t of the message, not all of it",
    },
))

_HM, _TM = 8192, 8
_LAYER_PARAMS = tp_layer_params(  # the split part, 12 h^2 / t without biases
    Model(n_layers=1, d_model=_HM, n_heads=64, seq_len=1, vocab_size=1, bias=False),
    _TM)["split"]
register(Numeric(
    "03.layer_memory",
    _LAYER_PARAMS * 16 / GiB,
    unit="GiB",
    rtol=2e-3,
    prompt=f"""
        A transformer layer has hidden size h = {_HM} and MLP width 4h; leave out biases
        and LayerNorms. It trains with Adam in mixed precision (16 bytes of model state
        per parameter) under t = {_TM}-way tensor parallelism (q, k, v, out, up and down
        all split). How much memory does one rank need for this layer's model states?
        Give a number in GiB (2^30 bytes).
    """,
    working=f"""
        Parameters of the layer: q, k, v and out are h x h each (4h^2), up and down
        h x 4h each (8h^2): 12h^2 = 12 x {_HM}^2 = {12 * _HM**2:,}.

        Tensor parallelism splits all six matrices, so one rank holds 12h^2 / t =
        {_LAYER_PARAMS:,.0f} parameters.

        At 16 bytes each (bf16 weight and gradient, fp32 master weight and Adam's two
        moments): {_LAYER_PARAMS * 16:,.0f} bytes = **{_LAYER_PARAMS * 16 / GiB:.2f} GiB**.
        On one device the same layer needs {12 * _HM**2 * 16 / GiB:.0f} GiB.
    """,
    mistakes={
        12 * _HM**2 * 16 / GiB: "that is the whole layer; each of the t ranks holds 1/t "
                                "of its matrices",
        8 * _HM**2 * 16 / _TM / GiB: "that is the MLP alone; attention adds q, k, v and "
                                     "out, 4h^2 more",
        4 * _HM**2 * 16 / _TM / GiB: "that is attention alone; the MLP's two h x 4h "
                                     "matrices add 8h^2 more",
        _LAYER_PARAMS * 2 / GiB: "that is the bf16 weights only; count 16 bytes per "
                                 "parameter for weights, gradients and Adam's state",
        _LAYER_PARAMS * 16 / 1e9: "that is in GB (10^9 bytes); give GiB (2^30 bytes)",
    },
))

register(Choice(
    "03.slow_link",
    "B",
    options={
        "A": "t = 16 tensor parallelism over all 16 GPUs: the most memory saved per GPU.",
        "B": "t = 8 tensor parallelism inside each node, data parallelism (N = 2) across "
             "the two nodes.",
        "C": "data parallelism (N = 8) inside each node, t = 2 tensor parallelism across "
             "the two nodes.",
        "D": "Any of them: the bytes per step are the same, so the link does not matter.",
    },
    prompt="""
        You have 2 nodes of 8 GPUs. Inside a node the GPUs share NVLink (hundreds of GB/s);
        between the nodes there is one 100 Gb/s network link. The model fits in memory
        when split 8 ways. How do you lay out the 16 GPUs? Give one letter.
    """,
    working="""
        **B.** Tensor parallelism all-reduces the activations 4 times per layer for every
        microbatch, and each all-reduce sits on the critical path: the next matmul waits
        for it. It needs the fastest link, so keep its t ranks inside a node. Data
        parallelism sends the gradients once per step, in a few large buckets that can
        overlap with backward: it tolerates the slow link between nodes. C puts the
        chatty traffic on the slow link and the patient traffic on the fast one, the
        worst of both; A puts half of every all-reduce's ring on the slow link; D is
        wrong because the two strategies send different things at different rates (and
        time per byte is what differs between the links).
    """,
    hints={
        "A": "every tensor-parallel all-reduce would then cross the 100 Gb/s link, "
             "4 times per layer per microbatch",
        "C": "which traffic is on the critical path of every layer, and which once per "
             "step and overlappable?",
        "D": "the link's time per byte differs by orders of magnitude, and so does when "
             "each strategy sends",
    },
))

register(Choice(
    "03.t_within_node",
    "A",
    options={
        "A": "Each layer all-reduces its activations in forward and backward on the "
             "critical path, so t ranks need the fast links that only GPUs in one node "
             "share.",
        "B": "t must divide the number of layers, and 8 divides most layer counts.",
        "C": "NCCL cannot all-reduce between nodes.",
        "D": "Weights cannot be split more than 8 ways.",
    },
    prompt="""
        Megatron-LM and its successors normally keep the tensor-parallel degree t at or
        below the number of GPUs in one node (often 8). Why? Give one letter.
    """,
    working="""
        **A.** Under tensor parallelism every layer waits for 2 all-reduces in forward
        and 2 in backward, each of the (b, s, h) activations, and nothing can run until
        they finish. Inside a node NVLink moves hundreds of GB/s; between nodes a
        network link moves tens. Past one node the all-reduces slow every layer down.
        The matrices also get thinner as t grows, so each GPU's matmuls become too small
        to run efficiently. t divides the number of heads and the hidden size, not the
        number of layers (B); NCCL all-reduces across nodes all the time, for data
        parallelism (C); and a matrix can be cut into any number of slices that divides
        its width (D).
    """,
    hints={
        "B": "tensor parallelism splits the matrices inside a layer: what must t divide?",
        "C": "data parallelism all-reduces gradients across nodes with NCCL every step",
        "D": "a matrix can be cut into as many slices as its width allows",
    },
))

register(Choice(
    "03.mlp_split",
    "C",
    options={
        "A": "Splitting A by rows would need more memory for the weights.",
        "B": "Either way works without communication in between; columns are a "
             "convention.",
        "C": "GELU acts on each element, so GELU(XA) cut by columns is GELU of the column "
             "slices: no communication between the two matmuls. Cut by rows, each rank "
             "would hold a partial sum, and GELU of a sum is not the sum of GELUs.",
        "D": "Splitting by columns halves the bytes of the all-reduce.",
    },
    prompt="""
        Megatron's MLP computes GELU(XA) B and splits A by columns and B by rows. Why not
        A by rows? Give one letter.
    """,
    working="""
        **C.** With A = [A_1 A_2] by columns, rank r computes GELU(XA_r), which is exactly
        its slice of GELU(XA): no talking. Its slice is also the input rows that B_r
        needs, so rank r computes the partial sum GELU(XA_r) B_r and one all-reduce (g)
        finishes the MLP. With A split by rows, XA would be a sum of partial products
        over the ranks, and GELU(P_1 + P_2) is not GELU(P_1) + GELU(P_2): the ranks would
        have to all-reduce before the GELU, a second all-reduce per MLP. The weights take
        the same memory either way (A), and the all-reduce that remains carries the same
        (b, s, h) output (D).
    """,
    hints={
        "A": "both cuts give each rank 1/t of A's elements",
        "B": "what does each rank hold after X A_r when A is cut by rows: a slice, or a "
             "partial sum?",
        "D": "the all-reduce after B carries the (b, s, h) output either way",
    },
))

# --------------------------------------------------------------------------- implementations

# A small model, so that a check takes seconds: 4 heads, so t = 2 and 4 both divide them.
CFG_KW = dict(seq_len=16, d_model=32, n_heads=4, n_layers=2)
BATCH = 4
STEPS = 3
LR = 0.1
SEED = 1
WORLDS = (2, 4)

F_SOLUTION = '''\
def copy_to_parallel_region(x, group=None):
    """f: identity forward, all-reduce (sum) of the gradient backward."""

    class CopyToParallelRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)          # every rank already holds the same x

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()          # each rank holds its slice's share of dL/dx
            dist.all_reduce(grad, group=ctx.group)
            return grad, None            # no gradient for the group argument

    return CopyToParallelRegion.apply(x, group)
'''

G_SOLUTION = '''\
def reduce_from_parallel_region(x, group=None):
    """g: all-reduce (sum) forward, identity backward."""

    class ReduceFromParallelRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            out = x.clone()              # each rank holds a partial sum
            dist.all_reduce(out, group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad, None            # the gradient is already whole on every rank

    return ReduceFromParallelRegion.apply(x, group)
'''

ROW_PARALLEL_SOLUTION = '''\
def row_parallel_linear(x, linear, group=None):
    rank, t = dist.get_rank(group), dist.get_world_size(group)
    cols = linear.in_features // t
    # torch stores the weight as (out_features, in_features): this rank's input
    # features are a slice of its columns
    weight = linear.weight[:, rank * cols:(rank + 1) * cols]       # (out, in/t)
    partial = x @ weight.T     # (b, s, in/t) @ (in/t, out) -> (b, s, out), a partial sum
    total = tensor_ops.reduce_from_tensor_parallel_region(partial, group)  # g
    return total + linear.bias  # the bias once, after the sum
'''


def _cfg():
    from parlib.model import ModelConfig

    return ModelConfig(**CFG_KW)


def _rank_values(shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """A tensor that differs from rank to rank: every element is scale x (rank + 1)."""
    import torch.distributed as dist

    return torch.full(shape, scale * (dist.get_rank() + 1))


def _train_record(model: Any, steps: int) -> dict[str, Any]:
    """SGD on batches 0..steps-1: logits, losses and gradients by name at every step."""
    from parlib.model import loss_fn, make_batch

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"logits": [], "loss": [], "grads": []}
    for step in range(steps):
        x, y = make_batch(BATCH, _cfg(), step, SEED)
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = loss_fn(logits, y)
        loss.backward()
        out["logits"].append(logits.detach().clone())
        out["loss"].append(loss.item())
        out["grads"].append({n: None if p.grad is None else p.grad.detach().clone()
                             for n, p in model.named_parameters()})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _first_mismatch(got: dict[str, Any], ref: dict[str, Any]) -> str | None:
    """Where a TP run first departs from the single-device one, as a sentence (``ref``'s
    gradients and parameters already cut to this rank's pieces); None if it never does."""
    from parlib.verify import close

    for step in range(len(ref["loss"])):
        if not close(got["logits"][step], ref["logits"][step]):
            return f"at step {step} the logits differ from single-device training"
        wrong = [n for n, gr in got["grads"][step].items()
                 if gr is None or not close(gr, ref["grads"][step][n])]
        if wrong:
            more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
            return (f"at step {step} the logits are right but the gradient of "
                    f"{wrong[0]}{more} differs from single-device training")
    wrong = [n for n, p in got["params"].items() if not close(p, ref["params"][n])]
    if wrong:
        return f"after {STEPS} steps the parameter {wrong[0]} differs from single-device"
    return None


# ---- f and g


def _probe_op(fn: Callable) -> dict[str, torch.Tensor]:
    """On each rank: the learner's operator on rank + 1 (a non-leaf tensor, as inside a
    model), and the gradient it passes back for an incoming gradient of 10 x (rank + 1)."""
    x = _rank_values((3,), 1.0).requires_grad_()
    y = fn(x * 1.0, None)
    if not isinstance(y, torch.Tensor):
        return {"error": f"it returned {type(y).__name__}, not a tensor"}
    if not y.requires_grad:
        return {"error": "its output does not require grad: build it with "
                         "torch.autograd.Function (forward and backward), call .apply"}
    out = {"forward": y.detach().clone()}
    y.backward(_rank_values(tuple(y.shape), 10.0))
    out["backward"] = None if x.grad is None else x.grad.detach().clone()
    return out


# The expected value of each probe and the known wrong values, per operator. Values are
# functions of (rank, t); the hints name the mistake.
_OPS = {
    "f": {
        "forward": (lambda r, t: r + 1.0, {
            lambda r, t: t * (t + 1) / 2: "f all-reduces in forward: its input is the same on "
            "every rank already (it enters a column-parallel region), so f's forward is the "
            "identity and its all-reduce belongs in backward",
            lambda r, t: (t + 1) / 2: "f averages in forward: its forward is the identity"}),
        "backward": (lambda r, t: 10.0 * t * (t + 1) / 2, {
            lambda r, t: 10.0 * (r + 1): "f's backward returns the gradient unchanged: each "
            "rank's slice of the next layer gives only part of dL/dx, so f's backward must "
            "all-reduce (sum) it",
            lambda r, t: 10.0 * (t + 1) / 2: "f's backward divides by t: the ranks' partial "
            "gradients add up, sum them without dividing"}),
    },
    "g": {
        "forward": (lambda r, t: t * (t + 1) / 2, {
            lambda r, t: r + 1.0: "g returns its input: each rank holds a partial sum after a "
            "row-parallel layer, so g must all-reduce it in forward",
            lambda r, t: (t + 1) / 2: "g averages: the partial sums add up to the output, sum "
            "them without dividing"}),
        "backward": (lambda r, t: 10.0 * (r + 1), {
            lambda r, t: 10.0 * t * (t + 1) / 2: "g's backward all-reduces: the gradient of "
            "g's output is already the same whole gradient on every rank, so summing it makes "
            "it t times too big; g's backward is the identity",
            lambda r, t: 10.0 * (t + 1) / 2: "g's backward averages: it must return the "
            "gradient unchanged"}),
    },
}


def _diagnose_op(which: str, results: list[dict[str, Any]], t: int) -> str | None:
    where = f"on {t} ranks"
    for r, res in enumerate(results):
        if "error" in res:
            return f"{where}: rank {r}: {res['error']}"
        for key in ("forward", "backward"):
            got = res[key]
            if got is None:
                return (f"{where}: rank {r} got no gradient for x: backward must return the "
                        f"gradient of x (and None for the group)")
            want, known = _OPS[which][key]
            if torch.allclose(got, torch.full_like(got, want(r, t))):
                continue
            for value, hint in known.items():
                if torch.allclose(got, torch.full_like(got, value(r, t))):
                    return f"{where}: {hint}"
            came = "" if key == "forward" else ", the incoming gradient 10 x (rank + 1)"
            return (f"{where}: rank {r}'s {which} gave {got.tolist()} in {key}, expected "
                    f"{[want(r, t)] * got.numel()} (its input was rank + 1 = {r + 1}{came})")
    return None


def _tp_with_op(which: str, fn: Callable, steps: int) -> dict[str, Any]:
    """On each rank: the TP copy of a small TinyGPT with the learner's f (or g) inside."""
    from parlib.model import build_model
    from parlib.strategies import tensor_ops
    from parlib.strategies.tensor import local_shards, tensor_parallel_copy

    name = {"f": "copy_to_tensor_parallel_region", "g": "reduce_from_tensor_parallel_region"}
    setattr(tensor_ops, name[which], lambda x, group=None: fn(x, group))
    ref = _train_record(build_model(_cfg(), SEED), steps)
    tp = tensor_parallel_copy(build_model(_cfg(), SEED))
    got = _train_record(tp, steps)
    ref["grads"] = [local_shards(tp, gr) for gr in ref["grads"]]
    ref["params"] = local_shards(tp, ref["params"])
    return {"problem": _first_mismatch(got, ref)}


def _grader(which: str) -> Callable[[Callable], None]:
    def grade(fn: Callable) -> None:
        from parlib.runtime import launch

        for t in WORLDS:
            problem = _diagnose_op(
                which, launch(_probe_op, fn, world_size=t, timeout=current_timeout()), t)
            if problem:
                raise CheckFailed(problem)
        for t in WORLDS:
            for r, res in enumerate(launch(_tp_with_op, which, fn, STEPS, world_size=t,
                                           timeout=current_timeout())):
                if res["problem"]:
                    raise CheckFailed(
                        f"training a tensor-parallel TinyGPT with your {which} on {t} ranks, "
                        f"rank {r}: {res['problem']}. Your {which} passed the small test on "
                        f"its own: does it keep state between calls, or change its input in "
                        f"place?")
    return grade


_CLASS_NOTE = """
        Define the torch.autograd.Function class inside the function and return
        Class.apply(x, group): the grader rebuilds your function from its source, and a
        class defined in another cell would not come with it.
"""

register(Implementation(
    "03.f",
    _grader("f"),
    timeout=90.0,
    prompt="""
        Write copy_to_parallel_region(x, group=None) -> Tensor, Megatron's f: identity in
        forward, all-reduce (sum over the group) of the gradient in backward, as a
        torch.autograd.Function with forward(ctx, x, group) and backward(ctx, grad).
    """ + _CLASS_NOTE + """
        Checked on 2 and 4 ranks: forward and backward on rank-dependent values, then as
        the f of a tensor-parallel TinyGPT trained for 3 SGD steps, whose logits,
        gradients and parameters must equal single-device training (rtol 1e-4).
    """,
    working=textwrap.dedent("""
        f sits where a replicated activation x enters column-parallel layers. Forward:
        every rank already has x, so pass it through. Backward: rank r's slice of the
        next layer contributes only its part of dL/dx (the gradient flows back through
        rank r's columns only), so the ranks sum their parts: an all-reduce.

        backward returns one gradient per forward input: (gradient of x, None for the
        group). Clone before the in-place all-reduce, so the tensor autograd handed you is
        left alone.
    """) + "\n```python\n" + F_SOLUTION + "```\n",
))

register(Implementation(
    "03.g",
    _grader("g"),
    timeout=90.0,
    prompt="""
        Write reduce_from_parallel_region(x, group=None) -> Tensor, Megatron's g:
        all-reduce (sum over the group) in forward, identity in backward, as a
        torch.autograd.Function with forward(ctx, x, group) and backward(ctx, grad).
    """ + _CLASS_NOTE + """
        Checked on 2 and 4 ranks: forward and backward on rank-dependent values, then as
        the g of a tensor-parallel TinyGPT trained for 3 SGD steps, whose logits,
        gradients and parameters must equal single-device training (rtol 1e-4).
    """,
    working=textwrap.dedent("""
        g sits after a row-parallel layer. Forward: each rank holds a partial sum of the
        output, so all-reduce (on a clone: the partial sum is autograd's tensor).
        Backward: the loss is computed the same way on every rank from the summed output,
        so the gradient arriving at g is whole and identical on every rank: pass it
        through. Summing it again would make it t times too big.
    """) + "\n```python\n" + G_SOLUTION + "```\n",
))


# ---- a row-parallel linear layer


class _LearnerRowParallel(torch.nn.Module):
    """A full nn.Linear driven by the learner's row_parallel_linear (same on every rank)."""

    def __init__(self, linear: torch.nn.Linear, fn: Callable) -> None:
        super().__init__()
        self.linear = linear
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.linear, None)


def _probe_row(fn: Callable) -> dict[str, Any]:
    """On each rank: the learner's layer on a square 8 x 8 linear, this rank's slice of a
    random input, against the full layer; and the candidates for common mistakes."""
    import torch.distributed as dist

    rank, t = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(SEED)
    full = torch.nn.Linear(8, 8)
    with torch.no_grad():
        full.weight.copy_(torch.randn(8, 8, generator=gen))
        full.bias.copy_(torch.randn(8, generator=gen))
    x = torch.randn(2, 3, 8, generator=gen)
    dy = torch.randn(2, 3, 8, generator=gen)
    cols = 8 // t
    mine = slice(rank * cols, (rank + 1) * cols)
    xf = x.clone().requires_grad_()
    yf = full(xf)
    yf.backward(dy)
    w, bias = full.weight.detach(), full.bias.detach()
    partials = [x[..., r * cols:(r + 1) * cols] @ w[:, r * cols:(r + 1) * cols].T
                for r in range(t)]
    wrong_dim = sum(x[..., r * cols:(r + 1) * cols] @ w[r * cols:(r + 1) * cols, :]
                    for r in range(t))
    candidates = {
        "bias_every_rank": yf.detach() + (t - 1) * bias,
        "no_all_reduce": partials[rank] + bias,
        "average": sum(partials) / t + bias,
        "wrong_dim": wrong_dim + bias,
        "wrong_dim_no_bias_fix": wrong_dim + t * bias,
    }
    mine_layer = torch.nn.Linear(8, 8)
    mine_layer.load_state_dict(full.state_dict())
    xs = x[..., mine].clone().requires_grad_()
    try:
        y = fn(xs, mine_layer, None)
    except NotImplementedError:  # the exercise's stub: "not attempted"
        raise
    except RuntimeError as exc:  # a shape mismatch, most often
        return {"error": str(exc).splitlines()[0]}
    if not isinstance(y, torch.Tensor):
        return {"error": f"row_parallel_linear returned {type(y).__name__}, not a tensor"}
    out = {"y": y.detach().clone(), "want": yf.detach(), "candidates": candidates}
    if y.shape == yf.shape and y.requires_grad:
        y.backward(dy)
        wg = mine_layer.weight.grad
        out["x_grad"] = (None if xs.grad is None else xs.grad.clone(), xf.grad[..., mine])
        out["w_grad"] = (None if wg is None else wg[:, mine].clone(),
                         full.weight.grad[:, mine])
        out["b_grad"] = (None if mine_layer.bias.grad is None else
                         mine_layer.bias.grad.clone(), full.bias.grad)
    return out


def _diagnose_row(results: list[dict[str, Any]], t: int) -> str | None:
    from parlib.verify import close

    where = f"on {t} ranks"
    hints = {
        "bias_every_rank": "the output is t - 1 biases too big: every rank adds the bias "
                           "before the all-reduce, so the sum holds it t times. Add it once, "
                           "after the all-reduce",
        "no_all_reduce": "each rank returns only its own partial sum: all-reduce the partial "
                         "products in forward (g), then add the bias",
        "average": "the output is the average of the partial sums: they add up to XW, so sum "
                   "them (no division by t)",
        "wrong_dim": "you took rows of linear.weight, but torch stores it as "
                     "(out_features, in_features): this rank's input features are the "
                     "columns [r * in/t, (r + 1) * in/t)",
        "wrong_dim_no_bias_fix": "you took rows of linear.weight (torch stores it as "
                                 "(out_features, in_features): the input features are "
                                 "columns), and the bias is added on every rank",
    }
    for r, res in enumerate(results):
        if "error" in res:
            return (f"{where}: rank {r}: {res['error']}. x holds this rank's in_features/t "
                    f"input features; the matching weight slice is the columns "
                    f"linear.weight[:, r * in/t:(r + 1) * in/t] (shape (out, in/t))")
        y, want = res["y"], res["want"]
        if y.shape != want.shape:
            return (f"{where}: rank {r} returned shape {tuple(y.shape)}, expected "
                    f"{tuple(want.shape)}: every rank returns the whole output")
        if not close(y, want):
            for key, hint in hints.items():
                if close(y, res["candidates"][key]):
                    return f"{where}: {hint}"
            return (f"{where}: rank {r}'s output differs from the full layer's (max "
                    f"|difference| {(y - want).abs().max().item():.3g})")
        if "x_grad" not in res:
            return (f"{where}: the output does not require grad: build it from x and "
                    f"linear.weight with differentiable operations")
        for key, what in (("x_grad", "x"), ("w_grad", "this rank's columns of the weight"),
                          ("b_grad", "the bias")):
            got, exp = res[key]
            if got is None:
                return f"{where}: rank {r} got no gradient for {what}"
            if close(got, exp):
                continue
            if close(got, t * exp):
                return (f"{where}: the gradient of {what} is t times too big: your "
                        f"all-reduce also sums in backward. The output's gradient is "
                        f"already whole on every rank, so the reduction's backward must "
                        f"be the identity (Megatron's g)")
            return (f"{where}: rank {r}'s gradient of {what} differs from the full "
                    f"layer's (max |difference| {(got - exp).abs().max().item():.3g})")
    return None


def _tp_with_row(fn: Callable, steps: int) -> dict[str, Any]:
    """On each rank: a TP TinyGPT whose attention out and MLP down run the learner's
    row_parallel_linear on full copies of the single-device layers."""
    import copy

    import torch.distributed as dist

    from parlib.model import build_model
    from parlib.strategies.tensor import local_shards, tensor_parallel_copy

    rank, t = dist.get_rank(), dist.get_world_size()
    model = build_model(_cfg(), SEED)
    ref = _train_record(build_model(_cfg(), SEED), steps)
    tp = tensor_parallel_copy(model)
    for block, full_block in zip(tp.blocks, model.blocks):
        block.attn.out = _LearnerRowParallel(copy.deepcopy(full_block.attn.out), fn)
        block.mlp.down = _LearnerRowParallel(copy.deepcopy(full_block.mlp.down), fn)
    got = _train_record(tp, steps)
    names = [n for n, _ in tp.named_parameters()]

    def columns(d: dict[str, Any]) -> dict[str, Any]:
        """The learner's layers hold the full weight; only this rank's columns count."""
        out = dict(d)
        for n in names:
            if ".linear.weight" in n and out[n] is not None:
                w = out[n].shape[1] // t
                out[n] = out[n][:, rank * w:(rank + 1) * w]
        return out

    def local(full: dict[str, torch.Tensor]) -> dict[str, Any]:
        return columns(local_shards(tp, {n: full[n.replace(".linear.", ".")] for n in names}))

    got["grads"] = [columns(gr) for gr in got["grads"]]
    got["params"] = columns(got["params"])
    ref["grads"] = [local(gr) for gr in ref["grads"]]
    ref["params"] = local(ref["params"])
    return {"problem": _first_mismatch(got, ref)}


def _grade_row(fn: Callable) -> None:
    from parlib.runtime import launch

    for t in WORLDS:
        problem = _diagnose_row(
            launch(_probe_row, fn, world_size=t, timeout=current_timeout()), t)
        if problem:
            raise CheckFailed(problem)
    for t in WORLDS:
        for r, res in enumerate(launch(_tp_with_row, fn, STEPS, world_size=t,
                                       timeout=current_timeout())):
            if res["problem"]:
                raise CheckFailed(
                    f"training a tensor-parallel TinyGPT with your layer as attention's "
                    f"out and the MLP's down on {t} ranks, rank {r}: {res['problem']}")


register(Implementation(
    "03.row_parallel",
    _grade_row,
    timeout=90.0,
    prompt="""
        Write row_parallel_linear(x, linear, group=None) -> Tensor. linear is a full
        nn.Linear, the same on every rank; x (shape (b, s, in_features/t)) is this rank's
        slice of the layer's input features, slice r of t. Return the layer's whole output
        (b, s, out_features) on every rank, computed from this rank's slice of the weight
        only, with the right communication in forward and backward: use g (all-reduce
        forward, identity backward), tensor_ops.reduce_from_tensor_parallel_region from
        parlib.strategies, or your own from 02.g. Checked on 2 and 4
        ranks: a square layer against nn.Linear (output, and the gradients of x, of this
        rank's weight columns and of the bias), then as attention's out and the MLP's
        down in a tensor-parallel TinyGPT trained for 3 SGD steps against single-device
        training (rtol 1e-4).
    """,
    working=textwrap.dedent("""
        Cut W by rows of the maths, which are **columns** of torch's weight: nn.Linear
        stores W as (out_features, in_features) and computes x @ W.T + b. Rank r's input
        features are [r * in/t, (r + 1) * in/t), so it needs linear.weight[:, that range]
        (shape (out, in/t)). x @ weight.T is then a partial sum of the whole output: the
        other ranks' features contribute the rest.

        All-reduce the partial sums with g. Its backward is the identity: the loss is
        computed from the summed output identically on every rank, so the gradient of
        the output is already whole everywhere, and each rank's gradients of its own x
        and weight columns follow from it without communication.

        Add the bias **after** the all-reduce: added before, every rank's copy would be
        summed, t biases in all.
    """) + "\n```python\n" + ROW_PARALLEL_SOLUTION + "```\n",
))
