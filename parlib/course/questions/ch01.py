"""Questions of the data-parallel chapter: data parallelism (notebook 01_data_parallel)."""

from __future__ import annotations

import math
import textwrap

import torch

from parlib.course.question_types import Choice, Implementation, Numeric, current_timeout
from parlib.course.registry import register
from parlib.course.results import CheckFailed
from parlib.verify import ATOL, RTOL, close

GiB = 2**30

# --------------------------------------------------------------------------- numeric

_P_RING = 350_000_000  # parameters
_N_RING = 8
_GRAD_BYTES = 4 * _P_RING  # fp32 gradients
register(
    Numeric(
        "01.ring_bytes_model",
        2 * (_N_RING - 1) / _N_RING * _GRAD_BYTES,
        unit="bytes",
        prompt="""
        A model with P = 350 million parameters trains with data parallelism on N = 8 ranks.
        Its gradients are fp32. Each step, the ranks average the gradients with one ring
        all-reduce. How many bytes does each rank send per step? Give a number in bytes.
    """,
        working="""
        The gradients take 4 bytes per parameter: 4 x 350e6 = 1.4e9 bytes.

        A ring all-reduce is a reduce-scatter followed by an all-gather. Each phase has
        N - 1 = 7 steps, and in each step a rank sends one chunk of 1.4e9 / 8 bytes. So
        each rank sends

        2 (N-1)/N x 1.4e9 = 2 x 7/8 x 1.4e9 = **2.45e9 bytes** (about 2.28 GiB) per step.

        On a 100 GB/s link that is about 25 ms, whatever N is: the factor 2(N-1)/N is
        close to 2 for any sizeable N.
    """,
        mistakes={
            2 * (_N_RING - 1) / _N_RING * _P_RING: "that counts one byte per parameter; fp32 "
            "gradients take 4 bytes each",
            2 * (_N_RING - 1) / _N_RING * 2 * _P_RING: "those are bf16 (2-byte) gradients; "
            "these are fp32",
            2 * _GRAD_BYTES: "that is the limit for N -> infinity; with N = 8 the factor is "
            "2(N-1)/N = 1.75",
            2 * (_N_RING - 1) * _GRAD_BYTES: "each of the 2(N-1) steps sends one chunk of "
            "bytes/N, not the whole gradient",
        },
    )
)

_P_MEM = 1_500_000_000
_N_MEM = 8
register(
    Numeric(
        "01.dp_memory",
        16 * _P_MEM / GiB,
        unit="GiB",
        rtol=2e-3,
        prompt="""
        A model with P = 1.5 billion parameters trains with Adam in fp32 under plain data
        parallelism on N = 8 GPUs. How much memory does each GPU need for the model states
        (weights, gradients and Adam's two moments; leave out activations)? Give a number
        in GiB (2^30 bytes).
    """,
        working="""
        Per parameter, in fp32: 4 bytes of weight + 4 of gradient + 4 + 4 for Adam's first
        and second moments = 16 bytes.

        Data parallelism keeps a full copy on every GPU, so N does not appear:
        16 x 1.5e9 = 24e9 bytes = 24e9 / 2^30 = **22.35 GiB per GPU**.

        Mixed precision does not help here: bf16 weights (2) and gradients (2) plus an
        fp32 master copy (4) and two fp32 moments (8) is 16 bytes per parameter too.
    """,
        mistakes={
            4 * _P_MEM / GiB: "that is the weights alone; the gradients and Adam's two moments "
            "need memory too",
            8 * _P_MEM / GiB: "that is weights and gradients; Adam also keeps two moments per "
            "parameter",
            12 * _P_MEM / GiB: "count four fp32 numbers per parameter: weight, gradient and "
            "Adam's two moments",
            16 * _P_MEM / GiB / _N_MEM: "data parallelism does not split the model: every GPU "
            "holds the full copy",
            16 * _P_MEM / 1e9: "that is in GB (10^9 bytes); give GiB (2^30 bytes)",
        },
    )
)

register(
    Numeric(
        "01.zero1_memory",
        (4 + 4 + 8 / _N_MEM) * _P_MEM / GiB,
        unit="GiB",
        rtol=2e-3,
        prompt="""
        The same model (P = 1.5 billion parameters, Adam, fp32) now trains with ZeRO-1 on
        N = 8 GPUs: the optimizer state is split evenly over the ranks, while weights and
        gradients stay whole on every rank. How much memory does each GPU need for the
        model states? Give a number in GiB (2^30 bytes).
    """,
        working="""
        ZeRO-1 shards only the optimizer state. Per parameter, per GPU:

        * weights, full copy: 4 bytes
        * gradients, full copy: 4 bytes
        * Adam's moments, 1/N of 8 bytes: 8 / 8 = 1 byte

        9 bytes x 1.5e9 = 13.5e9 bytes = **12.57 GiB per GPU**, down from 22.35 GiB. ZeRO-2
        would also shard the gradients (4 + 12/8 = 5.5 bytes per parameter) and ZeRO-3
        (FSDP) the weights too (16/8 = 2 bytes per parameter).
    """,
        mistakes={
            16 * _P_MEM / GiB: "that is plain data parallelism; ZeRO-1 splits the optimizer "
            "state over the N ranks",
            16 * _P_MEM / GiB / _N_MEM: "that shards everything (ZeRO-3 / FSDP); ZeRO-1 "
            "shards only the optimizer state",
            (4 + 4 / _N_MEM + 8 / _N_MEM) * _P_MEM / GiB: "that also shards the gradients "
            "(ZeRO-2); ZeRO-1 keeps them whole",
            (4 + 4 + 12 / _N_MEM) * _P_MEM / GiB: "in fp32 the weights are the master copy: "
            "the optimizer state is the two moments, 8 "
            "bytes per parameter",
            9 * _P_MEM / 1e9: "that is in GB (10^9 bytes); give GiB (2^30 bytes)",
        },
    )
)

register(
    Choice(
        "01.memory_wall",
        "B",
        options={
            "A": "It fits: 64 GPUs x 80 GB = 5,120 GB, far more than 320 GB.",
            "B": "It does not fit: every GPU must hold all 320 GB; more GPUs add copies, not room.",
            "C": "It fits once the per-GPU batch is cut to one example.",
            "D": "It fits, because the all-reduce averages the memory across the GPUs.",
        },
        prompt="""
        A 20-billion-parameter model, trained with Adam in mixed precision, needs
        16 bytes x 20e9 = 320 GB of model states. You have 64 GPUs with 80 GB each and
        use plain data parallelism. What happens? Give one letter.
    """,
        working="""
        **B**. Data parallelism copies the whole model (weights, gradients, optimizer state)
        onto every device and splits only the batch. Each GPU would need the full 320 GB,
        four times its 80 GB, however many GPUs you add. This is the memory wall: past it
        you must split the model itself, with ZeRO/FSDP sharding of the model states,
        tensor parallelism or pipeline parallelism. (Cutting the batch, C, shrinks only the
        activations; the all-reduce, D, averages gradients, not memory.)
    """,
        hints={
            "A": "under data parallelism memory does not pool: what does each single GPU hold?",
            "C": "a smaller batch shrinks the activations, but the 320 GB of model states stay",
            "D": "the all-reduce averages the gradients' values; every GPU still stores "
            "all of them",
        },
    )
)

register(
    Choice(
        "01.overlap",
        "C",
        options={
            "A": "It sends fewer bytes than one all-reduce at the end of backward.",
            "B": "It lets each rank skip the all-reduce of gradients that are already small.",
            "C": "It starts reducing the last layers' gradients while backward is still "
            "computing the earlier layers, hiding communication behind compute.",
            "D": "It makes the all-reduce exact, where one big all-reduce rounds.",
        },
        prompt="""
        Overlapped data parallelism registers a hook on every parameter and launches an
        asynchronous all-reduce per bucket as soon as the bucket's gradients are ready.
        Where does its speed-up come from? Give one letter.
    """,
        working="""
        **C**. Backward produces gradients from the last layer to the first. A bucket of
        late-layer gradients is complete long before backward ends, so its all-reduce can
        run while autograd computes the rest. The bytes are the same as one all-reduce of
        every gradient (A is wrong), every gradient is still averaged (B), and the numbers
        are the same up to summation order (D). With perfect overlap the step costs
        max(compute, communication) instead of their sum.
    """,
        hints={
            "A": "count the bytes: every gradient is still all-reduced once",
            "B": "every gradient must be averaged, or the copies drift apart",
            "D": "both are floating-point sums; overlap changes when, not what",
        },
    )
)

# --------------------------------------------------------------------------- implementations

# A small model so that the checks take a fraction of a second per launch.
_LR = 0.1
_STEPS = 3
_BATCH = 8  # global batch: divides by 2 and 4
_SEED = 1
_WORLDS = (2, 4)


def _cfg():
    from parlib.model import ModelConfig

    return ModelConfig(seq_len=16, d_model=32, n_heads=2, n_layers=1)


def _names(model) -> list[str]:
    return [n for n, _ in model.named_parameters()]


# ---- gradient accumulation with one sync

_ACC_MICRO = 3  # microbatches per step, k
_ACC_ROWS = 2   # rows per microbatch, b
_ACC_STEPS = 2
_ACC_WORLDS = (2, 4)


def _acc_batch(world: int) -> int:
    """Global batch B = b x k x N."""
    return _ACC_ROWS * _ACC_MICRO * world


def _acc_rank(fn) -> dict:
    """On each rank: _ACC_STEPS calls of the learner's accumulation step (plain SGD), with
    this rank's B/N rows cut into k microbatches. Records the gradient each step applied
    (parameters before and after) and the bytes all-reduced."""
    import torch.distributed as dist

    from parlib.measure import CommLog
    from parlib.model import build_model, loss_fn
    from parlib.strategies import data as dp

    world = dist.get_world_size()
    model = build_model(_cfg(), _SEED)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=_LR)
    report: dict = {"before": [], "after": [], "reduced_bytes": [],
                    "grad_bytes": sum(p.numel() * p.element_size() for p in params)}
    for step in range(_ACC_STEPS):
        x, y = dp.local_batch(_acc_batch(world), _cfg(), step, _SEED)
        micro = list(zip(x.chunk(_ACC_MICRO), y.chunk(_ACC_MICRO)))
        before = [p.detach().clone() for p in params]
        with CommLog() as log:
            fn(model, opt, micro, loss_fn)
        report["reduced_bytes"].append(sum(r.nbytes for r in log.records if r.op == "all_reduce"))
        report["before"].append(before)
        report["after"].append([p.detach().clone() for p in params])
    return report


def _local_acc_grads(world: int) -> list[list[torch.Tensor]]:
    """Step 0's gradient of each rank's own b x k rows alone: what a rank that never syncs
    applies."""
    from parlib.model import build_model, loss_fn
    from parlib.strategies import data as dp

    out = []
    for rank in range(world):
        model = build_model(_cfg(), _SEED)
        x, y = dp.local_batch(_acc_batch(world), _cfg(), 0, _SEED, rank=rank, world_size=world)
        loss_fn(model(x), y).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _expected_acc_grads(world: int) -> list[list[torch.Tensor]]:
    """Single-device SGD on the full batch B = b x k x N: the gradient applied each step."""
    from parlib.model import build_model, loss_fn, make_batch

    model = build_model(_cfg(), _SEED)
    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    grads = []
    for step in range(_ACC_STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = make_batch(_acc_batch(world), _cfg(), step, _SEED)
        loss_fn(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def _stepped(before: list[torch.Tensor], after: list[torch.Tensor], grads: list[torch.Tensor],
             scale: float = 1.0) -> bool:
    """Did SGD step from ``before`` to ``after`` with ``scale`` x ``grads``? (Compared in
    parameter space, where fp32 rounding is small.)"""
    return all(close(a, b - _LR * scale * g) for a, b, g in zip(after, before, grads))


def _diagnose_acc(results: list[dict], world: int, expected: list[list[torch.Tensor]],
                  local: list[list[torch.Tensor]]) -> str | None:
    k = _ACC_MICRO
    where = f"on {world} ranks with k = {k} microbatches"
    grad_bytes = results[0]["grad_bytes"]
    for step in range(_ACC_STEPS):
        want = expected[step]
        for r, res in enumerate(results):
            before, after = res["before"][step], res["after"][step]
            if _stepped(before, after, want):
                continue
            if step == 1 and _stepped(before, after,
                                      [w + e0 for w, e0 in zip(want, expected[0])]):
                return (f"{where}: step 1 was right, but step 2 applied step 1's gradient "
                        f"as well. Zero the gradients (optimizer.zero_grad()) at the start "
                        f"of each step: backward adds into p.grad")
            if res["reduced_bytes"][step] > 1.5 * grad_bytes:
                times = res["reduced_bytes"][step] / grad_bytes
                return (f"{where}: rank {r} all-reduced {times:.1f} times its gradient "
                        f"bytes in one step, and its update is wrong. Sync once, after the "
                        f"last microbatch: an all-reduce inside the loop sums gradients that "
                        f"were already summed, and pays the communication k times")
            if _stepped(before, after, want, k):
                return (f"{where}: rank {r} applied {k} x the full-batch gradient. backward() "
                        f"adds each microbatch's gradient into p.grad, so after k microbatches "
                        f"p.grad holds a sum of k means: divide by k (or scale each "
                        f"microbatch's loss by 1/k)")
            if _stepped(before, after, want, world):
                return (f"{where}: rank {r} applied {world} x the full-batch gradient. "
                        f"all_reduce sums over the ranks: divide by N = dist.get_world_size()")
            if _stepped(before, after, want, world * k):
                return (f"{where}: rank {r} applied {world * k} = N x k times the full-batch "
                        f"gradient: divide by k for the microbatches and by N for the ranks")
            if step == 0 and any(_stepped(before, after, local[r], s) for s in (1.0, k)):
                return (f"{where}: rank {r} stepped with its own rows' gradient only, as "
                        f"if it never synced. After the last microbatch all-reduce every "
                        f"p.grad and divide by N, on every rank")
            if res["reduced_bytes"][step] == 0:
                return (f"{where}: rank {r} made no all_reduce call. Sync the accumulated "
                        f"gradients once per step with dist.all_reduce")
            return (f"{where}: after step {step + 1} rank {r}'s parameters are not those of "
                    f"full-batch SGD. Accumulate k backward passes, all-reduce once, divide "
                    f"by k x N, then optimizer.step()")
    for r, res in enumerate(results):
        for step in range(_ACC_STEPS):
            if res["reduced_bytes"][step] > 1.5 * grad_bytes:
                return (f"{where}: the numbers are right, but rank {r} all-reduced "
                        f"{res['reduced_bytes'][step] / grad_bytes:.1f} x its gradient bytes "
                        f"in one step. Accumulate locally and sync once per step: that is the "
                        f"point of accumulation (DDP's no_sync)")
    return None


_ACC_ORDER_HINT = (
    "your function did not finish on every rank{t} ({where}). Every rank must issue the same "
    "collectives, on tensors of the same size, in the same order: a rank that skips a sync "
    "(or syncs a different parameter, or one time more) leaves its peers waiting in "
    "all_reduce for ever"
)


def _grade_acc(fn) -> None:
    from parlib.runtime import RankError, launch

    for world in _ACC_WORLDS:
        expected, local = _expected_acc_grads(world), _local_acc_grads(world)
        try:
            results = launch(_acc_rank, fn, world_size=world, backend="gloo",
                             timeout=current_timeout())
        except RankError as err:
            kind = (err.exc_type or "").lower()
            text = f"{err} {err.remote_traceback or ''}".lower()
            # A hang, or a peer's collective torn down: the ranks' collectives did not match.
            stuck = kind in ("timeout", "timeouterror", "exited") or any(
                w in text for w in ("connection closed", "connection reset", "gloo",
                                    "broken pipe", "sigabrt"))
            if stuck and kind != "notimplementederror":
                t = f" after {current_timeout():g} s" if kind.startswith("timeout") else ""
                where = f"rank {err.rank} stopped first" if err.rank is not None else \
                    f"{world} ranks"
                raise CheckFailed(_ACC_ORDER_HINT.format(t=t, where=where)) from None
            raise
        problem = _diagnose_acc(results, world, expected, local)
        if problem:
            raise CheckFailed(problem)


# The worked answer's code, written once: the working shows it and the tests derive their
# wrong answers from it.
ACCUM_SOLUTION = """\
def accumulation_step(model, optimizer, microbatches, loss_fn):
    k, N = len(microbatches), dist.get_world_size()
    optimizer.zero_grad()
    for x, y in microbatches:
        loss = loss_fn(model(x), y) / k        # mean over b rows, / k: mean over b x k
        loss.backward()                        # adds into p.grad; no communication
    for p in model.parameters():
        dist.all_reduce(p.grad)                # one sync per step, after the last microbatch
        p.grad /= N
    optimizer.step()
"""


register(
    Implementation(
        "01.grad_accum",
        _grade_acc,
        timeout=120.0,
        prompt="""
        Write accumulation_step(model, optimizer, microbatches, loss_fn) -> None: one
        data-parallel training step with gradient accumulation. `microbatches` is this rank's
        list of k (x, y) pairs of b rows each; loss_fn(model(x), y) is the mean loss over
        those b rows. Accumulate the k backward passes, sync the gradients ONCE with
        dist.all_reduce, and call optimizer.step(), so that the step equals single-device SGD
        on the global batch of B = b x k x N rows. Checked on 2 and 4 ranks with k = 3, b = 2,
        over 2 steps (rtol 1e-4); the check also counts the bytes you all-reduce.
    """,
        working=textwrap.dedent("""
        The full-batch loss is the mean over B = b x k x N rows: the mean over ranks of the
        mean over microbatches of each microbatch's mean. backward() *adds* into p.grad, so
        after k microbatches p.grad holds a sum of k means: divide by k (scaling each loss by
        1/k does it on the way). The all-reduce sums over the N ranks: divide by N. Sync once,
        after the last microbatch: the bytes per step are those of one all-reduce whatever k
        is, so accumulation buys k times the compute per sync (DDP does this with `no_sync()`
        on the first k-1 microbatches).
    """).strip() + "\n\n```python\n" + ACCUM_SOLUTION + "```\n\n" + textwrap.dedent("""
        Ways to get it wrong, each caught by the check: all-reducing inside the loop (it
        re-sums gradients that were already summed, and pays k syncs), forgetting 1/k or
        1/N (steps k or N times too long under SGD), forgetting zero_grad (step 2 adds
        step 1's gradient), and a rank that skips the sync: its peers wait in all_reduce,
        because every rank must issue the same collectives in the same order.
    """).strip(),
    )
)


# ---- ZeRO-1 step


def _flat_params(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _zero1_rank(fn) -> dict:
    """On each rank: _STEPS steps of SGD with momentum through the learner's ZeRO-1 step."""
    import torch.distributed as dist

    from parlib.measure import CommLog
    from parlib.model import build_model, loss_fn
    from parlib.strategies import data as dp

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(_cfg(), _SEED)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    size = math.ceil(total / world)
    flat = torch.zeros(size * world)
    flat[:total] = _flat_params(params)
    shard = flat[rank * size : (rank + 1) * size].clone().requires_grad_(True)
    opt = torch.optim.SGD([shard], lr=_LR, momentum=0.9)
    report: dict = {"flats": []}
    ops: list[str] = []
    for step in range(_STEPS):
        for p in params:
            p.grad = None
        x, y = dp.local_batch(_BATCH, _cfg(), step, _SEED)
        loss_fn(model(x), y).backward()
        with CommLog() as log:
            fn(params, shard, opt)
        ops += [rec.op for rec in log.records]
        report["flats"].append(_flat_params(params))
    report["ops"] = sorted(set(ops))
    report["shard_size"] = size
    return report


def _expected_zero1_flats() -> list[torch.Tensor]:
    from parlib.model import build_model, loss_fn, make_batch

    model = build_model(_cfg(), _SEED)
    opt = torch.optim.SGD(model.parameters(), lr=_LR, momentum=0.9)
    flats = []
    for step in range(_STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = make_batch(_BATCH, _cfg(), step, _SEED)
        loss_fn(model(x), y).backward()
        opt.step()
        flats.append(_flat_params(model.parameters()))
    return flats


def _which_param(names: list[str], sizes: list[int], index: int) -> str:
    offset = 0
    for name, n in zip(names, sizes):
        if index < offset + n:
            return name
        offset += n
    return "?"


def _diagnose_zero1(
    results: list[dict],
    world: int,
    names: list[str],
    sizes: list[int],
    start: torch.Tensor,
    expected: list[torch.Tensor],
) -> str | None:
    where = f"on {world} ranks"
    size = results[0]["shard_size"]
    want = expected[0]
    for r, res in enumerate(results):
        got = res["flats"][0]
        if close(got, want):
            continue
        if close(got, start):
            return (
                f"{where}: rank {r}'s parameters did not change in the first step. After "
                f"optimizer.step() updates the shard, all-gather the shards and copy the "
                f"result back into the parameters (p.copy_(...) under torch.no_grad())"
            )
        if close(got, start + world * (want - start)):
            return (
                f"{where}: rank {r}'s first update is {world} times too big. The "
                f"reduce-scatter sums the gradients over the ranks: divide the shard's "
                f"gradient by the world size before optimizer.step()"
            )
        lo, hi = r * size, min((r + 1) * size, got.numel())
        own_ok = close(got[lo:hi], want[lo:hi])
        rest = torch.cat([got[:lo], got[hi:]])
        rest_start = torch.cat([start[:lo], start[hi:]])
        if own_ok and close(rest, rest_start):
            return (
                f"{where}: rank {r} updated only its own slice of the parameters "
                f"(elements {lo}..{hi - 1}); the rest kept their old values. All-gather "
                f"the updated shards from every rank before copying them into the "
                f"parameters"
            )
        bad = (~torch.isclose(got, want, rtol=RTOL, atol=ATOL)).nonzero()
        i = int(bad[0])
        return (
            f"{where}: after the first step rank {r}'s parameter "
            f"{_which_param(names, sizes, i)!r} is wrong (flat element {i} is "
            f"{got[i].item():.6g}, expected {want[i].item():.6g}; {len(bad)} elements "
            f"wrong). Rank r owns flat elements [r*S, (r+1)*S) with S = shard.numel(): "
            f"reduce-scatter the flattened, zero-padded gradients into shard.grad, "
            f"divide by N, step, all-gather"
        )
    for r, res in enumerate(results):
        for step, (got, want) in enumerate(zip(res["flats"], expected)):
            if not close(got, want):
                return (
                    f"{where}: the first step was right, but after step {step + 1} rank "
                    f"{r}'s parameters differ from single-device SGD with momentum. Keep "
                    f"the optimizer's state: step the optimizer you were given, on the "
                    f"shard you were given, every call"
                )
    ops = results[0]["ops"]
    if "all_reduce" in ops:
        return (
            f"{where}: your numbers are right, but you used all_reduce. ZeRO-1 "
            f"reduce-scatters the gradients, so each rank receives only the slice it "
            f"steps: half the bytes of an all-reduce (a ring all-reduce is a "
            f"reduce-scatter then an all-gather), and no full averaged gradient in memory. "
            f"Use dp.reduce_scatter (or dist.reduce_scatter_tensor)"
        )
    return None


def _grade_zero1(fn) -> None:
    from parlib.model import build_model
    from parlib.runtime import launch

    model = build_model(_cfg(), _SEED)
    names = _names(model)
    sizes = [p.numel() for p in model.parameters()]
    start = _flat_params(model.parameters())
    expected = _expected_zero1_flats()
    for world in _WORLDS:
        results = launch(
            _zero1_rank, fn, world_size=world, backend="gloo", timeout=current_timeout()
        )
        problem = _diagnose_zero1(results, world, names, sizes, start, expected)
        if problem:
            raise CheckFailed(problem)


# The worked answer's code, written once: the working shows it and the tests derive their
# wrong answers from it.
ZERO1_SOLUTION = """\
def zero1_step(params, shard, optimizer):
    N = dist.get_world_size()
    S = shard.numel()
    flat_grad = torch.zeros(N * S)
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    flat_grad[: grads.numel()] = grads
    shard.grad = torch.empty(S)
    dp.reduce_scatter(shard.grad, flat_grad)   # sum of my slice over the ranks
    shard.grad /= N
    optimizer.step()
    flat = torch.empty(N * S)
    dp.all_gather(flat, shard.detach())       # everyone's updated slice
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
"""


register(
    Implementation(
        "01.zero1_step",
        _grade_zero1,
        timeout=120.0,
        prompt="""
        Write zero1_step(params, shard, optimizer) -> None, one ZeRO-1 optimizer step after
        loss.backward(). `params` is the model's parameter list (same order on every rank,
        p.grad holds this rank's local gradient); `shard` is this rank's slice of the
        parameters flattened into one vector and zero-padded to N x S elements (rank r owns
        elements [r*S, (r+1)*S), S = shard.numel()); `optimizer` steps `shard` only. Use a
        reduce-scatter and an all-gather (dp.reduce_scatter / dp.all_gather). Checked on 2
        and 4 ranks against 3 single-device steps of SGD with momentum (rtol 1e-4).
    """,
        working=textwrap.dedent("""
        1. Flatten the local gradients into one zero-padded vector of N x S elements.
        2. Reduce-scatter it: rank r receives the **sum** over ranks of its S elements.
           Divide by N to get the average, and make it the shard's gradient.
        3. optimizer.step() updates the shard, and the optimizer keeps state (momentum,
           or Adam's moments) for S elements only: that is the memory ZeRO-1 saves.
        4. All-gather the shards into the full vector and copy it back into the parameters,
           so every rank again holds the whole, identical model.

    """).strip() + "\n\n```python\n" + ZERO1_SOLUTION + "```\n\n"
        + textwrap.dedent("""
        Bytes per rank with ring algorithms: (N-1)/N x 4P for the reduce-scatter plus
        (N-1)/N x 4P for the all-gather, the same 2(N-1)/N x 4P as the all-reduce of plain
        data parallelism. (On gloo, measured in the chapter, reduce-scatter is implemented
        as a full all-reduce, so there ZeRO-1 sends 1.5 times as much.)
    """),
    )
)
