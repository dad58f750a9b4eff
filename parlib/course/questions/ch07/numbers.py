"""The combining chapter's numbers and choices: chips, memory per GPU, what crosses nodes."""

from __future__ import annotations

from parlib.cost import model_state_bytes
from parlib.course.question_types import Choice, Numeric
from parlib.course.registry import register

GiB = 2**30

register(Numeric(
    "07.seed_chips",
    4 * 4 * 64,
    rtol=0.0,
    unit="chips",
    prompt="""
        "A model too big for one GPU is sliced 4 ways (model parallel) and laid out as 4
        stages (pipeline). That whole setup is then copied 64 times (data parallel)." Take
        it literally: t = 4, p = 4, d = 64. How many chips is that?
    """,
    working="""
        One copy is t x p = 4 x 4 = 16 chips (each of the 4 stages is sliced over 4
        chips), and there are d = 64 copies: 64 x 4 x 4 = **1024** chips, not the 256 the
        text says. 256 needs 16 copies of the 16-chip setup, or a 4-chip setup (2 x 2, or
        4 stages with no slicing) copied 64 times.
    """,
    mistakes={256: "that is what the text claims; multiply the three degrees d x t x p",
              68: "the degrees multiply, they do not add",
              72: "the degrees multiply, they do not add"},
))

register(Numeric(
    "07.seed_copies",
    256 // (4 * 4),
    rtol=0.0,
    unit="copies",
    prompt="""
        Keep the slicing (t = 4) and the stages (p = 4) of that layout. How many
        data-parallel copies d fit on 256 chips?
    """,
    working="""
        d = 256 / (t x p) = 256 / 16 = **16**.
    """,
    mistakes={64: "64 copies of a 16-chip setup are 1024 chips",
              4: "256 / 4 divides by only one of t and p; one copy is t x p chips"},
))

_P_SEED = 48e9
_SEED_MEMORY = model_state_bytes(_P_SEED, mixed_precision=True) / (4 * 4) / GiB

register(Numeric(
    "07.seed_memory",
    _SEED_MEMORY,
    rtol=1e-2,
    unit="GiB",
    prompt="""
        The model has P = 48 billion parameters and trains with Adam in mixed precision
        (16 bytes per parameter of weights, gradients and optimizer state, the data-parallel
        chapter).
        On the 16 x 4 x 4 layout, how many GiB of these model states does one chip hold?
        Ignore activations; 1 GiB = 2^30 bytes.
    """,
    working=f"""
        Tensor parallelism keeps 1/t of every layer's weights, the pipeline 1/p of the
        layers, and data parallelism (without ZeRO) copies everything: each chip holds
        16 x P / (t x p) = 16 x 48e9 / 16 = 48e9 bytes = **{_SEED_MEMORY:.1f} GiB**.
        d does not appear: copies do not share the memory.
    """,
    mistakes={2 * _P_SEED / 16 / GiB: "that counts 2 bytes per parameter, the fp16 weights "
                                      "only: training with Adam in mixed precision also "
                                      "holds the gradients (2), an fp32 master copy (4) and "
                                      "two fp32 moments (8), 16 bytes per parameter",
              4 * _P_SEED / 16 / GiB: "that counts 4 bytes per parameter, fp32 weights "
                                      "only: mixed-precision Adam holds 16 bytes per "
                                      "parameter (weights, gradients, master copy, moments)",
              16 * _P_SEED / 4 / GiB: "divide by both t and p: each chip holds 1/t of the "
                                      "matrices of 1/p of the layers",
              16 * _P_SEED / 256 / GiB: "data-parallel copies each hold everything (ZeRO "
                                        "would shard it; plain data parallelism does not)",
              16 * _P_SEED / 16 / 1e9: "that is in GB (10^9 bytes); give GiB (2^30)"},
))

register(Choice(
    "07.crosses_nodes",
    "D",
    options={
        "A": "Only the pipeline's sends: its groups are the ones spread farthest apart.",
        "B": "Only the data-parallel all-reduces: pipeline neighbours share a node.",
        "C": "All three axes cross nodes, since 64 ranks cannot fit in one 8-GPU node.",
        "D": "Pipeline sends and data-parallel all-reduces; tp stays inside one node.",
    },
    prompt="""
        64 GPUs in nodes of 8 (GPUs 0-7 in node 0, 8-15 in node 1, ...) run d x t x p =
        4 x 4 x 4 with the mesh order (pp, dp, tp), tp fastest. Which communication
        crosses nodes? Give one letter.
    """,
    working="""
        **D**. A tensor-parallel group is 4 consecutive ranks (0-3, 4-7, ...): inside one
        node. A data-parallel group is t = 4 ranks apart and spans d x t = 16 ranks
        (0, 4, 8, 12): two nodes. A pipeline group is d x t = 16 ranks apart (0, 16, 32,
        48): four nodes. This is the point of the order: the axis that talks at every
        layer (tp) gets the fast in-node links.
    """,
    hints={"A": "the pipeline is not the only axis that crosses nodes once d x t > 8: write "
                "out rank 0's data-parallel group, ranks t apart, d of them",
           "C": "write out rank 0's tensor-parallel group: which ranks, which node?",
           "B": "write out rank 0's pipeline group: ranks d x t = 16 apart"},
))
