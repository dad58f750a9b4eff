"""Questions of the launching chapter: launching ranks and collectives (notebook
00_launching_ranks)."""

from __future__ import annotations

import itertools
import textwrap

import torch

from parlib.course.answers import plain_data, plain_tensor
from parlib.course.question_types import (
    Choice,
    Expression,
    Implementation,
    Numeric,
    current_timeout,
)
from parlib.course.registry import register
from parlib.course.results import CheckFailed
from parlib.verify import ATOL, RTOL, close

MiB = 2**20

# --------------------------------------------------------------------------- numeric

# Ring all-reduce of a float32 tensor of 2^20 elements (4 MiB) on N = 4 ranks.
_RING_N = 4
_RING_BYTES = 4 * MiB
register(Numeric(
    "00.ring_bytes",
    2 * (_RING_N - 1) / _RING_N * _RING_BYTES,
    unit="bytes",
    prompt="""
        A ring all-reduce sums a float32 tensor of 2^20 elements (4 MiB) over N = 4 ranks.
        How many bytes does each rank send? Give a number in bytes.
    """,
    working="""
        The tensor is split into N = 4 chunks of 4 MiB / 4 = 1 MiB.

        * Reduce-scatter: N - 1 = 3 steps, each rank sends one chunk per step: 3 MiB.
        * All-gather: another N - 1 = 3 steps of one chunk: 3 MiB.

        Each rank sends 2(N-1)/N x 4 MiB = 6 MiB = **6,291,456 bytes** (and receives the
        same amount, which is not asked). The factor 2(N-1)/N tends to 2 for large N: the
        bytes per rank hardly grow with the number of ranks, which is why the ring is used.
    """,
    mistakes={
        2 * 6 * MiB: "you counted the bytes sent and the bytes received; count only sends",
        3 * MiB: "that is only the reduce-scatter phase; the all-gather phase sends as much again",
        2 * (_RING_N - 1) * _RING_BYTES: "each step sends one chunk of size bytes / N, "
                                         "not the whole tensor",
        2 * _RING_BYTES: "that is the N -> infinity limit 2 x bytes; the factor is 2(N-1)/N",
        _RING_BYTES: "a rank sends more than its tensor once: two phases of N-1 chunks each",
        8 * 6 * MiB: "that is in bits; give bytes",
        6.0: "that is in MiB; the answer is asked in bytes",
    },
))

# Alpha-beta time of one point-to-point message.
_ALPHA = 20e-6  # s
_BW = 10e9  # bytes/s, so beta = 1e-10 s/byte
_MSG = 16 * MiB
register(Numeric(
    "00.p2p_time",
    (_ALPHA + _MSG / _BW) * 1e3,
    unit="ms",
    rtol=2e-3,
    prompt="""
        A link has latency alpha = 20 us and bandwidth 10 GB/s (beta = 1/bandwidth). How
        long does one dist.send of a 16 MiB message take in the alpha-beta model? Give a
        number in milliseconds.
    """,
    working="""
        The alpha-beta model: T(n) = alpha + n beta, with beta = 1 / (10 x 10^9 B/s)
        = 10^-10 s/byte.

        n = 16 MiB = 16 x 2^20 = 16,777,216 bytes, so n beta = 1.6777 ms and

        T = 0.020 ms + 1.6777 ms = **1.6977 ms**.

        At this size the bandwidth term dominates; alpha matters for messages below about
        alpha / beta = 200 kB.
    """,
    mistakes={
        _MSG / _BW * 1e3: "you left out the latency alpha = 20 us = 0.020 ms",
        (_ALPHA + 16e6 / _BW) * 1e3: "16 MiB is 16 x 2^20 bytes, not 16 x 10^6",
        (_ALPHA + _MSG / (10 * 2**30)) * 1e3: "10 GB/s is 10 x 10^9 bytes/s, not 10 x 2^30",
        _ALPHA + _MSG / _BW: "that is in seconds; give milliseconds",
        (_ALPHA + 8 * _MSG / _BW) * 1e3: "the bandwidth is in bytes per second, not bits",
    },
))

# All-gather: bytes each rank receives.
_AG_N = 8
register(Numeric(
    "00.all_gather_mib",
    (_AG_N - 1) * 2,
    unit="MiB",
    prompt="""
        N = 8 ranks each hold a 2 MiB shard and run all_gather so that every rank ends with
        all 8 shards. How many MiB does each rank receive? Give a number in MiB.
    """,
    working="""
        Each rank already has its own shard and needs the other N - 1 = 7 shards of 2 MiB:
        it receives 7 x 2 MiB = **14 MiB**, whatever the algorithm (in a ring, one shard
        per step for 7 steps). The full result is 16 MiB; the all-gather moves
        (N-1)/N of it into each rank.
    """,
    mistakes={
        16: "each rank already holds its own shard: it receives only the other N - 1",
        2: "that is one shard; a rank needs every other rank's shard",
        28: "count what a rank receives only, not what it also sends",
        14 * MiB: "that is in bytes; give MiB",
    },
))

register(Expression(
    "00.ring_formula",
    "2*(N-1)/N*n",
    variables=["N", "n"],
    prompt="""
        Write, as a formula in N (ranks) and n (bytes in the tensor), the number of bytes
        each rank sends in a ring all-reduce. Give a string such as "n*(N+1)".
    """,
    working="""
        Two phases (reduce-scatter, then all-gather), each of N - 1 steps, each step sending
        one chunk of n / N bytes: 2 (N-1) n / N, written `2*(N-1)/N*n`.
    """,
    mistakes={
        "(N-1)/N*n": "that is one phase; the ring runs a reduce-scatter and then an all-gather",
        "2*(N-1)*n": "each step sends one chunk of n/N bytes, not the whole tensor",
        "4*(N-1)/N*n": "you counted sends and receives; count only sends",
    },
))

register(Choice(
    "00.dp_collective",
    "B",
    options={
        "A": "broadcast of the parameters from rank 0",
        "B": "all-reduce of the gradients",
        "C": "all-gather of the activations",
        "D": "send/recv of activations between neighbouring ranks",
    },
    prompt="""
        In data parallelism every rank holds the whole model and a slice of the batch.
        Which collective does it pay for on every training step? Give one letter.
    """,
    working="""
        **B**. Each rank computes gradients on its own slice of the batch; before the
        optimizer step every rank needs the same (average) gradient, so the gradients are
        all-reduced once per step: 2(N-1)/N x (bytes of the gradients) per rank with a ring.
        A broadcast of the parameters (A) happens once, at start-up, to give every rank the
        same initial weights. All-gathers (C) and send/recv between neighbours (D) are the
        traffic of tensor and pipeline parallelism.
    """,
    hints={
        "A": "the parameters are broadcast once at start-up; after that every rank applies "
             "the same update. What must every rank agree on each step?",
        "C": "in data parallelism each rank keeps its own activations; nothing about them "
             "is exchanged",
        "D": "neighbour send/recv of activations is pipeline parallelism",
    },
))

# --------------------------------------------------------------------------- ring all-reduce


def _case_input(world: int, case: int, rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * world + 100 * case + rank)
    return torch.randn(n, generator=g, dtype=torch.float32)


def _lengths(world: int) -> list[int]:
    # divisible, not divisible, and a longer uneven one
    return [4 * world, 5 * world + 3, 64 * world + 1]


def _ring_rank(fn) -> list[dict]:
    """Runs on every rank: the cases of one world size, stopping after the first case that
    fails on any rank (so a later case cannot hide it by hanging or crashing)."""
    import torch.distributed as dist

    from parlib.measure import CommLog

    rank, world = dist.get_rank(), dist.get_world_size()
    reports = []
    for case, n in enumerate(_lengths(world)):
        inputs = [_case_input(world, case, r, n) for r in range(world)]
        given = inputs[rank].clone()
        with CommLog(deep=True) as log:  # sees collectives however they are called
            out = fn(given)
        if isinstance(out, torch.Tensor):
            plain = plain_tensor(out)  # a subclass's own methods never judge the result
            out = plain if plain is not None else f"<{type(out).__name__}>"
        elif out is not None:
            out = f"<{type(out).__name__}>"
        reports.append({"n": n, "out": out, "after": plain_tensor(given),
                        "ops": sorted(set(log.pg_calls))})
        ok = (_diagnose(rank, world, inputs, reports[-1]) is None
              and torch.equal(given, inputs[rank]))
        if world > 1:
            flag = torch.tensor([0.0 if ok else 1.0])
            dist.all_reduce(flag)
            ok = flag.item() == 0
        if not ok:
            break
    return reports


def _fmt_tensor_mismatch(out: torch.Tensor, expected: torch.Tensor) -> str:
    bad = (~torch.isclose(out, expected, rtol=RTOL, atol=ATOL)).nonzero()
    i = int(bad[0]) if len(bad) else 0
    return (f"element {i} is {out[i].item():.5g}, expected {expected[i].item():.5g} "
            f"({len(bad)} of {out.numel()} elements wrong)")


def _diagnose(rank: int, world: int, inputs: list[torch.Tensor], rep: dict) -> str | None:
    """None if this rank's result is right; otherwise what is wrong with it."""
    expected = torch.stack(inputs).sum(0)
    own = inputs[rank]
    out, after = rep["out"], rep["after"]
    if out is None:
        if isinstance(after, torch.Tensor) and close(after, expected):
            return ("returned None after summing into its input in place; this exercise "
                    "asks you to return the sum as a new tensor and leave the input unchanged")
        return "returned None; return the summed tensor"
    if isinstance(out, str):
        return f"returned a {out.strip('<>')}; return a torch.Tensor"
    if out.shape != expected.shape:
        return f"returned shape {tuple(out.shape)}, expected {tuple(expected.shape)}"
    if out.dtype != expected.dtype:
        return f"returned dtype {out.dtype}, expected {expected.dtype}"
    if not torch.isfinite(out).all():
        return "returned NaN or inf values"
    if close(out, expected):
        return None
    if world > 1 and close(out, expected - own):
        return "is missing its own contribution: add the received chunk to your own, " \
               "don't replace it"
    if world > 1 and close(out, own):
        return "returned its own input unchanged"
    chunks_out = torch.tensor_split(out, world)
    chunks_exp = torch.tensor_split(expected, world)
    good = [i for i in range(world) if close(chunks_out[i], chunks_exp[i])]
    bad = [i for i in range(world) if i not in good]
    index_hint = ("check the chunk index at each step (reduce-scatter step s: rank r sends "
                  "chunk (r - s) % N and adds the one it receives into chunk (r - s - 1) % N; "
                  "all-gather step s: it sends chunk (r + 1 - s) % N and copies the one it "
                  "receives into chunk (r - s) % N)")
    if world > 1:
        for i in bad:
            for size in range(1, world):
                for subset in itertools.combinations(range(world), size):
                    part = torch.stack([torch.tensor_split(inputs[q], world)[i]
                                        for q in subset]).sum(0)
                    if close(chunks_out[i], part):
                        missing = [q for q in range(world) if q not in subset]
                        own = " (its own input)" if missing == [rank] else ""
                        return (f"has in chunk {i} the sum over rank(s) {list(subset)} only, "
                                f"missing rank(s) {missing}{own}. In the reduce-scatter, add "
                                f"each received chunk to yours (don't copy over it); in the "
                                f"all-gather, pass on only fully summed chunks: {index_hint}")
    if world > 1 and good:
        return (f"has the right sum in chunk(s) {good} but not in chunk(s) {bad} "
                f"(chunks as torch.tensor_split(t, N) makes them): {index_hint}")
    return _fmt_tensor_mismatch(out, expected)


def _grade_ring(fn) -> None:
    from parlib.runtime import launch

    for world in (1, 2, 3, 4):
        results = plain_data(launch(_ring_rank, fn, world_size=world, timeout=current_timeout()))
        for case, n in enumerate(_lengths(world)):
            if any(case >= len(results[r]) for r in range(world)):
                break
            inputs = [_case_input(world, case, r, n) for r in range(world)]
            problems = {r: _diagnose(r, world, inputs, results[r][case]) for r in range(world)}
            where = f"on {world} rank{'s' if world > 1 else ''} with a tensor of {n} elements"
            if world > 1 and n % world:
                where += f" ({n} does not divide by {world})"
            if problems[0] is None and any(problems[r] for r in range(1, world)):
                r = min(r for r in range(1, world) if problems[r])
                raise CheckFailed(
                    f"{where}: rank 0 has the right sum but rank {r} {problems[r]}. An "
                    f"all-reduce leaves the sum on every rank, not only on rank 0 (that is a "
                    f"reduce): after the reduce-scatter phase, pass the summed chunks round "
                    f"the ring once more (all-gather)"
                )
            for r in range(world):
                if problems[r]:
                    raise CheckFailed(f"{where}: rank {r} {problems[r]}")
            for r in range(world):
                if not torch.equal(results[r][case]["after"], inputs[r]):
                    raise CheckFailed(
                        f"{where}: the result is right but rank {r}'s input tensor was "
                        f"changed; work on a copy (out = tensor.clone()) and leave the "
                        f"input as it was"
                    )
            problem = _p2p_problem(world, [results[r][case]["ops"] for r in range(world)])
            if problem:
                raise CheckFailed(f"{where}: the sum is right, but {problem}")


_P2P_OPS = {"send", "recv", "barrier"}


def _p2p_problem(world: int, ops_per_rank: list[list[str]]) -> str | None:
    """The ring must move its data with send/recv only; None when it did."""
    for r, ops in enumerate(ops_per_rank):
        other = sorted(set(ops) - _P2P_OPS)
        if other:
            return (f"rank {r} called the collective {other[0]}: this exercise builds the "
                    f"all-reduce itself, with dist.send and dist.recv only")
        if world > 1 and not {"send", "recv"} <= set(ops):
            return (f"rank {r} sent or received nothing: a rank can only learn the others' "
                    f"tensors through dist.send / dist.recv")
    return None


# The worked answer's code, written once: the working shows it and the tests derive their
# wrong answers from it.
RING_SOLUTION = """\
def ring_all_reduce(tensor):
    rank, N = dist.get_rank(), dist.get_world_size()
    out = tensor.clone()
    chunks = torch.tensor_split(out, N)
    right, left = (rank + 1) % N, (rank - 1) % N

    def exchange(send_i, recv_i, add):
        buf = torch.empty_like(chunks[recv_i])
        if rank % 2 == 0:
            dist.send(chunks[send_i].contiguous(), right)
            dist.recv(buf, left)
        else:
            dist.recv(buf, left)
            dist.send(chunks[send_i].contiguous(), right)
        if add:
            chunks[recv_i].add_(buf)
        else:
            chunks[recv_i].copy_(buf)

    for s in range(N - 1):
        exchange((rank - s) % N, (rank - s - 1) % N, add=True)
    for s in range(N - 1):
        exchange((rank + 1 - s) % N, (rank - s) % N, add=False)
    return out
"""


register(Implementation(
    "00.ring_all_reduce",
    _grade_ring,
    timeout=20.0,
    timeout_hint="a send with no matching recv (or a recv with no matching send) blocks "
                 "forever: check that each rank sends to (rank + 1) % N and receives from "
                 "(rank - 1) % N, and that sends and receives are ordered so that "
                 "neighbours do not both wait",
    prompt="""
        Write ring_all_reduce(tensor) -> torch.Tensor using only dist.send and dist.recv.
        It returns a new tensor holding the element-wise sum of `tensor` over all ranks, on
        every rank, and leaves its input unchanged. Checked against the exact sum on 1, 2,
        3 and 4 ranks, with 1-D float32 tensors whose length may not divide by N
        (tolerance 1e-5).
    """,
    working=textwrap.dedent("""
        Split a copy of the tensor into N chunks with `torch.tensor_split(out, N)` (views,
        so writing into a chunk writes into `out`; uneven lengths are fine). Rank r sends to
        `right = (r + 1) % N` and receives from `left = (r - 1) % N`.

        1. **Reduce-scatter**, N - 1 steps. In step s rank r sends chunk `(r - s) % N` and
           receives chunk `(r - s - 1) % N`, which it **adds** to its own copy. After N - 1
           steps rank r holds the full sum of chunk `(r + 1) % N`.
        2. **All-gather**, N - 1 steps. In step s rank r sends chunk `(r + 1 - s) % N` (a
           finished sum) and receives chunk `(r - s) % N`, which it **copies** in.

        `dist.send` and `dist.recv` block, so if every rank sent first nobody would be
        receiving: even ranks send then receive, odd ranks receive then send. With N = 1
        there are no steps and the copy is the answer.

    """).strip() + "\n\n```python\n" + RING_SOLUTION + "```\n\n"
    + textwrap.dedent("""
        Each rank sends 2(N-1) chunks of n/N elements: the 2(N-1)/N x bytes of question
        00.ring_bytes.
    """),
))
