"""Chapter 01 questions: data parallelism (notebook 01_data_parallel)."""

from __future__ import annotations

import math
import textwrap

import torch

from parlib.course.question_types import Choice, Implementation, Numeric, current_timeout
from parlib.course.registry import register
from parlib.course.results import CheckFailed
from parlib.verify import ATOL, RTOL, close, max_abs_diff, reference_params, reference_step

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


def _reference_grads() -> list[torch.Tensor]:
    """Single-device gradients of step 0 on the full batch (the average the ranks want)."""
    return list(reference_step(_cfg(), seed=_SEED, batch_size=_BATCH)["grads"].values())


def _grad_avg_rank(fn) -> dict:
    """On each rank: _STEPS steps of SGD with the learner's gradient averaging."""
    from parlib.model import build_model, loss_fn
    from parlib.strategies import data as dp

    model = build_model(_cfg(), _SEED)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=_LR)
    report: dict = {}
    for step in range(_STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = dp.local_batch(_BATCH, _cfg(), step, _SEED)
        loss_fn(model(x), y).backward()
        if step == 0:
            local = [p.grad.clone() for p in params]
            before = [p.detach().clone() for p in params]
        fn(model)
        if step == 0:
            report["local"] = local
            report["grads"] = [None if p.grad is None else p.grad.detach().clone() for p in params]
            report["changed"] = [not torch.equal(p.detach(), b) for p, b in zip(params, before)]
        opt.step()
    report["final"] = [p.detach().clone() for p in params]
    return report


def _diagnose_grad_avg(
    results: list[dict], world: int, names: list[str], expected: list[torch.Tensor]
) -> str | None:
    where = f"on {world} ranks"
    for r, res in enumerate(results):
        for name, changed in zip(names, res["changed"]):
            if changed:
                return (
                    f"{where}: your function changed the values of parameter {name!r} on "
                    f"rank {r}. Average the gradients (p.grad), not the parameters "
                    f"(p or p.data); the optimizer applies the update afterwards"
                )
    status: list[list[str]] = []  # per rank, per parameter: ok / times_n / local / none / other
    for res in results:
        row = []
        for g, e, loc in zip(res["grads"], expected, res["local"]):
            if g is None:
                row.append("none")
            elif close(g, e):
                row.append("ok")
            elif close(g, world * e):
                row.append("times_n")
            elif close(g, loc):
                row.append("local")
            else:
                row.append("other")
        status.append(row)
    if all(s == "ok" for row in status for s in row):
        return None
    # Judge the patterns on parameters whose gradient is clearly non-zero (attention's key
    # bias, for one, has an exactly-zero true gradient, so any multiple of it looks right).
    sig = [e.abs().max().item() > 1e-4 for e in expected]

    def only(row: list[str], kind: str) -> bool:
        return all(s == kind for s, keep in zip(row, sig) if keep)

    if all(s == "ok" for s in status[0]):
        for r in range(1, world):
            if only(status[r], "times_n"):
                return (
                    f"{where}: rank 0 holds the average, but rank {r}'s gradients are "
                    f"{world} times too big. Every rank must divide by the world size, "
                    f"not only rank 0: each rank uses its own gradients in its own "
                    f"optimizer step"
                )
    for r, row in enumerate(status):
        if "none" in row:
            name = names[row.index("none")]
            return (
                f"{where}: after your function, parameter {name!r} on rank {r} has no "
                f"gradient (p.grad is None). Average p.grad in place, or assign the "
                f"average back to p.grad"
            )
    if all(only(row, "times_n") for row in status):
        return (
            f"{where}: rank 0's gradient for {names[0]!r} is {world} times the "
            f"single-device gradient. all_reduce sums; did you divide by the world "
            f"size (dist.get_world_size()) afterwards?"
        )
    if all(only(row, "local") for row in status):
        return (
            f"{where}: every gradient still holds its rank's local value, as if nothing "
            f"was averaged. Call dist.all_reduce on each p.grad (not on p or p.data), "
            f"then divide it by the world size"
        )
    for r, row in enumerate(status):
        if "local" in row and "ok" in row:
            missing = [names[i] for i, s in enumerate(row) if s == "local"]
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            return (
                f"{where}: parameter {missing[0]!r}{more} was not averaged on rank {r}: "
                f"it still holds that rank's local gradient. Loop over every parameter "
                f"in model.parameters()"
            )
    for r, row in enumerate(status):
        for i, s in enumerate(row):
            if s != "ok":
                g, e = results[r]["grads"][i], expected[i]
                if g.shape != e.shape:
                    return (
                        f"{where}: rank {r}'s gradient for {names[i]!r} has shape "
                        f"{tuple(g.shape)}, expected {tuple(e.shape)}"
                    )
                ratio = (g.flatten() @ e.flatten() / (e.flatten() @ e.flatten())).item()
                return (
                    f"{where}: rank {r}'s gradient for {names[i]!r} is not the average "
                    f"of the ranks' gradients (it is about {ratio:.3g} x the average, "
                    f"largest error {(g - e).abs().max().item():.3g}). Sum with "
                    f"dist.all_reduce, then divide by the world size"
                )
    return None


def _grade_grad_avg(fn) -> None:
    from parlib.model import build_model
    from parlib.runtime import launch

    names = _names(build_model(_cfg(), _SEED))
    expected = _reference_grads()
    final = reference_params(_cfg(), steps=_STEPS, global_batch=_BATCH, seed=_SEED, lr=_LR)
    for world in _WORLDS:
        results = launch(
            _grad_avg_rank, fn, world_size=world, backend="gloo", timeout=current_timeout()
        )
        problem = _diagnose_grad_avg(results, world, names, expected)
        if problem:
            raise CheckFailed(problem)
        for r, res in enumerate(results):
            err = max_abs_diff(res["final"], final)
            if err > 1e-5:
                raise CheckFailed(
                    f"on {world} ranks: the first step was right, but after {_STEPS} SGD steps "
                    f"rank {r}'s parameters differ from single-device training by {err:.3g}. "
                    f"Does your function keep state between calls? It must average the "
                    f"gradients afresh every step"
                )


register(
    Implementation(
        "01.grad_avg",
        _grade_grad_avg,
        timeout=30.0,
        prompt="""
        Write average_gradients(model) -> None. After loss.backward() on each rank's share
        of the batch, it must leave in every parameter's .grad the average of that gradient
        over all ranks, on every rank, using dist.all_reduce. Checked on 2 and 4 ranks: the
        gradients after one call must equal the single-device gradients of the full batch
        (rtol 1e-4), and 3 SGD steps must give the single-device parameters (1e-5).
    """,
        working="""
        The mean loss over the full batch B is the mean of the N ranks' mean losses over
        their B/N rows, so the full-batch gradient is the average of the ranks' gradients:
        sum them with an all-reduce, then divide by N, on every rank.

        ```python
        def average_gradients(model):
            world = dist.get_world_size()
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)   # sum over ranks, in place, on every rank
                    p.grad /= world           # every rank divides
        ```

        Four ways to get it wrong, each caught by the check: not dividing (gradients N times
        too big: SGD takes N-times-too-long steps), dividing on rank 0 only (the copies
        drift apart after one step), skipping a parameter (its copies drift apart), and
        all-reducing the parameters instead of the gradients (the parameters are already
        equal, so nothing changes, and each rank steps with its local gradient). All ranks
        must call all_reduce on the same tensors in the same order.
    """,
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
            f"steps ((N-1)/N of the bytes of an all-reduce, and no full averaged gradient "
            f"in memory); use dp.reduce_scatter (or dist.reduce_scatter_tensor)"
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
        timeout=30.0,
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
