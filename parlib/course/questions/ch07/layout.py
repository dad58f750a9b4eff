"""07.pick_layout: choose (d, t, p) for a model on a cluster by the rules taught."""

from __future__ import annotations

from parlib.cost import Hardware, Layout, Model, estimate
from parlib.course.question_types import WholeNumbers
from parlib.course.registry import register

GiB = 2**30

PICK_MODEL = Model(60, 8192, 64, 2048, 32000, name="a 60-layer model")
PICK_HARDWARE = Hardware.dgx_a100(64)
PICK_BATCH = 128  # sequences per step; m = PICK_BATCH / d microbatches of one sequence


def pick_layout_problems(d: int, t: int, p: int) -> str | None:
    """None if (d, t, p) follows the rules taught, else the first rule it breaks."""
    n, node = PICK_HARDWARE.n_devices, PICK_HARDWARE.devices_per_node
    if d * t * p != n:
        return f"d x t x p = {d} x {t} x {p} = {d * t * p}, but there are {n} GPUs"
    if t > node:
        return (f"t = {t} is more than the {node} GPUs of a node: the tensor-parallel "
                f"all-reduces of every layer would cross the slow network")
    if PICK_MODEL.n_heads % t:
        return f"t = {t} does not divide the {PICK_MODEL.n_heads} attention heads"
    if PICK_MODEL.n_layers % p:
        return f"p = {p} does not divide the {PICK_MODEL.n_layers} layers into equal stages"
    est = estimate(PICK_MODEL, PICK_HARDWARE, Layout(dp=d, tp=t, pp=p), m=PICK_BATCH // d,
                   global_batch=PICK_BATCH)
    if not est.fits:
        return (f"it does not fit: {est.memory_total / GiB:.0f} GiB per GPU (cost.estimate) "
                f"against {PICK_HARDWARE.memory_bytes / GiB:.1f} GiB")
    return None


register(WholeNumbers(
    "07.pick_layout",
    pick_layout_problems,
    names=("d", "t", "p"),
    example=(8, 4, 2),
    too_small="every degree must be at least 1",
    prompt=f"""
        Pick (d, t, p) for {PICK_MODEL.name} ({PICK_MODEL.n_params / 1e9:.0f} billion
        parameters, {PICK_MODEL.n_layers} layers, {PICK_MODEL.n_heads} heads) on 64 A100
        GPUs of 80 GB in nodes of 8, global batch {PICK_BATCH} sequences (microbatches of
        one sequence). The rules: d x t x p = 64; t within a node and dividing the heads;
        p dividing the layers; memory per GPU under 80 GB by `cost.estimate` (mixed
        precision, Adam, no ZeRO and no recomputation: every data-parallel copy keeps its
        whole part of the model states). Give a tuple (d, t, p).
    """,
    working="""
        Tensor parallelism first, inside the node: t = 8 at most. Memory: 16 bytes x P
        / (t x p) must leave room for activations in 74.5 GiB, so t x p >= 16 or so. p must
        divide 60: 1, 2, 3, 4, 5, 6, 10, 12, 15, ... and t x p must divide 64, so p is 1, 2
        or 4. With t = 8, p = 2 or 4 fit (d = 4 or 2); with t = 4, p = 4 (d = 4) fits.
        (2, 8, 4) leaves the most room. (1, 8, 8) is out: 8 does not divide 60, and
        (4, 16, 1) fits but puts tensor parallelism across nodes. With ZeRO-3 or
        recomputation more layouts would fit, even d = 64 alone, but slowly: the combining
        chapter's first section counts why.
    """,
))


__all__ = ["PICK_HARDWARE", "PICK_MODEL", "pick_layout_problems"]
