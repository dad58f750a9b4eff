"""The combining chapter's five axes: where an expert-parallel group lives under each
placement of ep, and what the context-parallel axis sends in a 4-D run."""

from __future__ import annotations

from parlib.cost import Layout
from parlib.cost.context import ring_attention_sent_bytes_per_layer
from parlib.cost.layout import EP_OVER_DP_CP, EP_OVER_TP
from parlib.course.question_types import Numeric, WholeNumbers
from parlib.course.registry import register

GiB = 2**30

# ---- 07.ep_group_dp_cp, 07.ep_group_dp_cp_tp: one rank's ep group under each placement

EP_SIZES = {"pp": 2, "dp": 4, "cp": 2, "tp": 2, "ep": 4}  # 32 ranks
EP_RANK = 21
_NAMES = ("first", "second", "third", "fourth")


def ep_group(borrows: tuple[str, ...]) -> list[int]:
    """The right answer: EP_RANK's ep group in EP_SIZES with ep borrowing ``borrows``."""
    return Layout(**EP_SIZES, ep_borrows=borrows).axis_ranks("ep", EP_RANK)


def _slips(borrows: tuple[str, ...]) -> dict[tuple[int, ...], str]:
    """Plausible wrong groups, each with what went wrong."""
    lay = Layout(**EP_SIZES, ep_borrows=borrows)
    other = EP_OVER_TP if borrows == EP_OVER_DP_CP else EP_OVER_DP_CP
    e, r, block = lay.ep, EP_RANK, lay.dp * lay.cp * lay.tp
    start = r - r % block  # the first rank of this pipeline stage
    return {
        tuple(ep_group(other)): "that is the other placement's group: here ep borrows "
                                + " x ".join(borrows),
        tuple(lay.axis_ranks("dp", r)): "that is the data-parallel group: ep runs over the "
                                        f"{' x '.join(borrows)} index, "
                                        f"{borrows[-1]} the fastest",
        tuple(g - start for g in ep_group(borrows)): "that group is on the first pipeline "
                                                      "stage; ep stays on this rank's stage "
                                                      f"(ranks {start} to {start + block - 1})",
        tuple(range(r, r + e)): f"an ep group does not start at rank {r}: the groups are "
                                "fixed blocks of e consecutive indices, counted from 0",
        tuple(range(r, r + e * lay.tp, lay.tp)): "an ep group does not start at rank "
                                                 f"{r}: find the block of e indices "
                                                 "that holds it",
    }


def ep_group_problems(borrows: tuple[str, ...]):
    """The judge of a 4-rank answer: None when it is ``EP_RANK``'s group, else the slip."""
    want = tuple(ep_group(borrows))
    slips = {k: v for k, v in _slips(borrows).items() if k != want}

    def problems(*ranks: int) -> str | None:
        got = tuple(sorted(ranks))
        if got == want:
            return None
        if got in slips:
            return slips[got]
        if EP_RANK not in got:
            return f"rank {EP_RANK}'s group contains rank {EP_RANK}"
        return ("not its group: write rank 21's coordinates, then its index in the block of "
                "the axes ep borrows, and the e consecutive indices around it")
    return problems


_EP_PROMPT = """
    A 32-rank run, Layout(pp=2, dp=4, cp=2, tp=2, ep=4): the mesh order is (pp, dp, cp,
    tp), tp fastest, and ep adds no ranks, it borrows {over}. Which ranks are in rank 21's
    expert-parallel group? Give a tuple of four ranks, lowest first.
"""


def _register_ep_group(qid: str, borrows: tuple[str, ...], over: str, working: str) -> None:
    """One of the two ep-group questions: the same rank and layout, ep borrowing ``borrows``."""
    register(WholeNumbers(qid, ep_group_problems(borrows), names=_NAMES, example=(0, 1, 2, 3),
                          minimum=0, too_small="ranks are 0 or more",
                          prompt=_EP_PROMPT.format(over=over), working=working))


_register_ep_group(
    "07.ep_group_dp_cp", EP_OVER_DP_CP,
    over="the data- and context-parallel ranks (ep over dp x cp, parlib's default)",
    working=f"""
        Rank 21 = ((pp x 4 + dp) x 2 + cp) x 2 + tp: tp = 1, cp = 0, dp = 1, pp = 1. Its
        index in the dp x cp block is dp x 2 + cp = 2, so its group is indices 0..3 (e = 4
        consecutive ones), at the same pp and tp: (dp, cp) = (0, 0), (0, 1), (1, 0), (1, 1),
        ranks **{tuple(ep_group(EP_OVER_DP_CP))}**, t = 2 apart. The all-to-all spans
        e x t = 8 ranks: inside one 8-GPU node, but once e x t is more than a node it
        crosses nodes.
    """,
)

_register_ep_group(
    "07.ep_group_dp_cp_tp", EP_OVER_TP,
    over="the data-, context- and tensor-parallel ranks (ep over dp x cp x tp, torchtitan's "
         "default)",
    working=f"""
        Borrowing tp too, the block is dp x cp x tp = 16 consecutive ranks of a stage (16 to
        31 on stage 1), and rank 21 is index 5 in it; its group is indices 4..7, ranks
        **{tuple(ep_group(EP_OVER_TP))}**: consecutive, so the all-to-all stays inside a
        node while e fits. The price: every rank holds whole experts (not 1/t of each),
        the tp ranks must hold different tokens (sequence parallelism), and an expert's
        gradient syncs over d x c x t / e = 4 ranks instead of d x c / e = 2.
    """,
)

# ---- 07.cp_bytes_4d: the context-parallel axis's bytes per step in a 4-D run

RUN_4D = {"pp": 2, "dp": 4, "cp": 4, "tp": 8}  # 256 GPUs
LAYERS, HIDDEN, SEQ, MICRO, ROWS, DTYPE = 32, 4096, 16384, 8, 1, 2


def cp_bytes_4d(layers: int = LAYERS, seq: int = SEQ, kv_dim: int | None = None,
                micro: int = MICRO, passes: tuple[str, ...] = ("forward", "backward"),
                dtype: int = DTYPE) -> float:
    """Bytes one rank's ring attention sends per step (cost.context's formula): per layer
    of its stage, per microbatch; keys and values of its h/t heads only."""
    kv = HIDDEN // RUN_4D["tp"] if kv_dim is None else kv_dim
    per_layer = ring_attention_sent_bytes_per_layer(ROWS, seq, kv, RUN_4D["cp"], dtype, passes)
    return micro * layers // RUN_4D["pp"] * per_layer


_CP_4D = cp_bytes_4d() / GiB

register(Numeric(
    "07.cp_bytes_4d",
    _CP_4D,
    rtol=1e-3,
    unit="GiB",
    prompt=f"""
        A 4-D run on 256 GPUs: p = {RUN_4D['pp']}, d = {RUN_4D['dp']}, c = {RUN_4D['cp']},
        t = {RUN_4D['tp']}, a {LAYERS}-layer model with h = {HIDDEN} (32 heads, keys and values
        h wide), sequences of s = {SEQ} tokens in bf16 ({DTYPE} bytes), m = {MICRO}
        microbatches of {ROWS} sequence per step. Ring attention (the context chapter,
        `cost.ring_attention_sent_bytes_per_layer`) passes each rank's K and V blocks on.
        How many GiB does one rank send on the cp axis per step?
    """,
    working=f"""
        One rank holds s/c = {SEQ // RUN_4D['cp']} positions and, with tensor parallelism,
        the keys and values of 32/t heads: h/t = {HIDDEN // RUN_4D['tp']} wide. A K/V block
        is 2 x b x s/c x h/t x 2 bytes = 8 MiB. Per layer: c - 1 = 3 blocks forward, 3
        blocks and 3 gradient blocks backward, 9 blocks; L/p = {LAYERS // RUN_4D['pp']}
        layers on this stage, m = {MICRO} microbatches: 9 x 16 x 8 x 8 MiB =
        **{_CP_4D:g} GiB**. d does not appear: data parallelism sends only gradients.
    """,
    mistakes={
        cp_bytes_4d(kv_dim=HIDDEN) / GiB: "tensor parallelism splits the heads: each rank "
                                          "holds the keys and values of h/t of the width",
        cp_bytes_4d(layers=LAYERS * RUN_4D["pp"]) / GiB:
            "a rank runs the layers of its stage only, L/p of them",
        cp_bytes_4d(seq=SEQ * RUN_4D["cp"]) / GiB: "a rank holds s/c positions: its blocks "
                                                    "are s/c long, not s",
        cp_bytes_4d(micro=1) / GiB: "every microbatch runs its own ring: times m",
        cp_bytes_4d(passes=("forward",)) / GiB: "backward passes the K/V blocks again and "
                                                "sends their gradients back: 3(c - 1) "
                                                "blocks per layer, not c - 1",
        cp_bytes_4d() * 2 / 3 / GiB: "backward sends c - 1 blocks of K and V and c - 1 of "
                                      "their gradients: 3(c - 1) blocks in all per layer",
        cp_bytes_4d() / 2 / GiB: "a block holds keys and values: 2 x b x s/c x h/t",
    },
))

__all__ = ["EP_RANK", "EP_SIZES", "RUN_4D", "cp_bytes_4d", "ep_group", "ep_group_problems"]
