"""Check a whole pipeline schedule before anything runs it.

:func:`validate` takes ``{rank: [ops]}`` (see :mod:`parlib.strategies.schedules`) and raises
:class:`ScheduleError`, naming the first bad op, for anything that would make
:func:`parlib.strategies.pipeline.run_schedule` hang, stop with an error or train on the
wrong numbers:

* ``shape`` -- a rank missing or extra; a mix of split (with W ops) and unsplit ranks;
* ``unknown`` -- an op of an unknown kind, or a microbatch or chunk out of range;
* ``repeated`` -- the same op twice on a rank;
* ``order`` -- a gradient before its forward (B before F, W before B on the rank), or two
  neighbours exchanging microbatches in different orders;
* ``memory`` -- a rank holding more microbatches than ``max_in_flight``;
* ``missing`` -- some F, B (or W) of a (microbatch, chunk) never runs;
* ``deadlock`` -- every rank left waits for a message that is never sent.

The deadlock check replays the runner's message rules exactly: a send never blocks (it is
queued), a receive blocks until the next message from that peer arrives, and the messages
from one rank to another are received in the order they were sent. Under those rules the
outcome does not depend on timing, so a schedule that passes runs to its end.

Chunk c of rank r is virtual stage c*p + r: its forward receives from virtual stage
c*p + r - 1 (on rank r - 1, or rank p - 1 one chunk lower for r = 0) and sends to the next;
its backward receives the gradient from the next virtual stage and sends to the previous.
Pure Python, like the schedules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from parlib.strategies.schedules import BACKWARD, FORWARD, KINDS, WEIGHT, Op

PROBLEMS = ("deadlock", "order", "missing", "repeated", "memory", "unknown", "shape")
_WHAT = {FORWARD: "activation", BACKWARD: "gradient"}


class ScheduleError(ValueError):
    """A schedule that cannot run as written. ``rank`` and ``index`` (the position in that
    rank's op list) locate the first bad op ``op`` (each None where it does not apply);
    ``problem`` is one of :data:`PROBLEMS`."""

    def __init__(self, message: str, *, problem: str, rank: int | None = None,
                 index: int | None = None, op: Op | None = None) -> None:
        super().__init__(message)
        self.problem, self.rank, self.index, self.op = problem, rank, index, op


def _where(rank: int, index: int, op: Op) -> str:
    return f"rank {rank}, op {index} ({op!r})"


# --------------------------------------------------------------------------- messages


def peer_of(op: Op, rank: int, p: int, v: int) -> tuple[int, int] | None:
    """(rank, chunk) of the virtual stage ``op`` receives from (forward: the previous
    stage's activation; backward: the next stage's gradient); None if it receives nothing
    (the first stage's forward, the last stage's backward, every W)."""
    s = op.chunk * p + rank
    if op.kind == FORWARD and s > 0:
        return (s - 1) % p, (s - 1) // p
    if op.kind == BACKWARD and s < p * v - 1:
        return (s + 1) % p, (s + 1) // p
    return None


def target_of(op: Op, rank: int, p: int, v: int) -> tuple[int, int] | None:
    """(rank, chunk) of the virtual stage ``op`` sends its result to; None if none."""
    s = op.chunk * p + rank
    if op.kind == FORWARD and s < p * v - 1:
        return (s + 1) % p, (s + 1) // p
    if op.kind == BACKWARD and s > 0:
        return (s - 1) % p, (s - 1) // p
    return None


def messages(sched: Mapping[int, Sequence[Op]], p: int, v: int = 1) -> dict[int, int]:
    """Point-to-point messages each rank sends in one step (activations and gradients).
    One activation and one gradient per microbatch cross each of the p*v - 1 boundaries
    between virtual stages: 2m(pv - 1) in all, against 2m(p - 1) with one chunk per rank,
    about v times as many."""
    return {r: sum(target_of(op, r, p, v) is not None for op in sched[r]) for r in range(p)}


# --------------------------------------------------------------------------- validate


def validate(sched: Mapping[int, Sequence[Op]], p: int, m: int, v: int = 1, *,
             max_in_flight: int | Mapping[int, int] | None = None) -> None:
    """Raise :class:`ScheduleError` unless ``sched`` (rank -> ops, ``v`` chunks per rank,
    ``m`` microbatches) runs to its end on ``p`` ranks doing every piece of work once.

    ``max_in_flight``: the most (microbatch, chunk) activations a rank may hold at once
    (one number for all ranks or one per rank); held from F until B, or until W when the
    backward is split."""
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"need p, m, v >= 1, got p={p}, m={m}, v={v}", problem="shape")
    if not isinstance(sched, Mapping):
        raise ScheduleError(f"a schedule is a dict rank -> list of ops, got "
                            f"{type(sched).__name__}", problem="shape")
    ranks = set(sched)
    if ranks != set(range(p)):
        missing = sorted(set(range(p)) - ranks)
        extra = sorted(ranks - set(range(p)), key=repr)
        text = (f"rank {missing[0]} has no op list" if missing
                else f"rank {extra[0]!r} is not one of the {p} ranks 0..{p - 1}")
        raise ScheduleError(f"{text} (a schedule for p={p} has exactly ranks 0..{p - 1})",
                            problem="shape", rank=missing[0] if missing else None)
    split_ranks = {r for r in range(p) if any(getattr(op, "kind", None) == WEIGHT
                                               for op in sched[r])}
    split = bool(split_ranks)
    for r in range(p):
        _check_rank(r, list(sched[r]), p, m, v, split, split_ranks, max_in_flight)
    _check_messages(sched, p, v)


def _limit(max_in_flight: int | Mapping[int, int] | None, rank: int) -> int | None:
    if max_in_flight is None or isinstance(max_in_flight, int):
        return max_in_flight
    return max_in_flight.get(rank)


def _check_rank(r: int, ops: list[Op], p: int, m: int, v: int, split: bool,
                split_ranks: set[int], max_in_flight: int | Mapping[int, int] | None) -> None:
    seen: set[Op] = set()
    live: set[tuple[int, int]] = set()
    limit = _limit(max_in_flight, r)
    for i, op in enumerate(ops):
        if not isinstance(op, Op):
            raise ScheduleError(f"rank {r}, op {i} ({op!r}): not an Op (write F(mb), B(mb), "
                                f"W(mb))", problem="unknown", rank=r, index=i)
        where = _where(r, i, op)
        if op.kind not in KINDS:
            raise ScheduleError(f"{where}: unknown kind {op.kind!r}; one of {KINDS}",
                                problem="unknown", rank=r, index=i, op=op)
        if not (isinstance(op.mb, int) and 0 <= op.mb < m):
            raise ScheduleError(f"{where}: microbatch {op.mb!r} is not one of 0..{m - 1} "
                                f"(m={m})", problem="unknown", rank=r, index=i, op=op)
        if not (isinstance(op.chunk, int) and 0 <= op.chunk < v):
            raise ScheduleError(f"{where}: chunk {op.chunk!r} is not one of 0..{v - 1} "
                                f"(v={v} chunks per rank)", problem="unknown", rank=r,
                                index=i, op=op)
        if split and r not in split_ranks:
            other = min(split_ranks)
            raise ScheduleError(
                f"{where}: rank {r} has no W ops but rank {other} has: either every rank "
                f"splits its backward into B and W, or none does", problem="shape", rank=r,
                index=i, op=op)
        if op in seen:
            raise ScheduleError(f"{where}: {op!r} runs twice on this rank", problem="repeated",
                                rank=r, index=i, op=op)
        key = (op.mb, op.chunk)
        if op.kind == BACKWARD and Op(FORWARD, *key) not in seen:
            raise ScheduleError(f"{where}: its forward {Op(FORWARD, *key)!r} has not run on "
                                f"this rank", problem="order", rank=r, index=i, op=op)
        if op.kind == WEIGHT and Op(BACKWARD, *key) not in seen:
            raise ScheduleError(f"{where}: its backward {Op(BACKWARD, *key)!r} has not run on "
                                f"this rank (W computes the weight gradients from the "
                                f"gradient B received)", problem="order", rank=r, index=i, op=op)
        seen.add(op)
        if op.kind == FORWARD:
            live.add(key)
        elif op.kind == (WEIGHT if split else BACKWARD):
            live.discard(key)
        if limit is not None and len(live) > limit:
            held = " ".join(f"F{mb}" + (f".{c}" if c else "") for mb, c in sorted(live))
            raise ScheduleError(f"{where}: rank {r} now holds {len(live)} microbatches' "
                                f"activations ({held}), more than max_in_flight={limit}",
                                problem="memory", rank=r, index=i, op=op)
    kinds = (FORWARD, BACKWARD, WEIGHT) if split else (FORWARD, BACKWARD)
    for mb in range(m):
        for c in range(v):
            for kind in kinds:
                if Op(kind, mb, c) not in seen:
                    want = Op(kind, mb, c)
                    raise ScheduleError(f"rank {r}: {want!r} never runs (every microbatch "
                                        f"needs {'F, B and W' if split else 'F and B'} on "
                                        f"every rank{' and chunk' if v > 1 else ''})",
                                        problem="missing", rank=r, op=want)


def message_order(sched: Mapping[int, Sequence[Op]], p: int,
                  v: int = 1) -> list[tuple[int, int, int, int]]:
    """Every message of a schedule :func:`validate` accepts, as (sender, the sender's op
    index, receiver, the receiving op's index), in the order of one run of it (the
    replay's, every rank as far as it can go, rank by rank). Each rank that posts its
    messages in this order, one at a time, cannot deadlock under NCCL's rules (a send
    waits for its receiver; a rank's messages run one after another): the first
    unfinished message comes first on both of its ranks, and its sender has every input
    it needs from earlier messages."""
    order: list[tuple[int, int, int, int]] = []
    _check_messages(sched, p, v, order)
    return order


def _check_messages(sched: Mapping[int, Sequence[Op]], p: int, v: int,
                    order: list[tuple[int, int, int, int]] | None = None) -> None:
    """Replay the runner's messages: FIFO queues per (sender, receiver), sends never
    block, receives block. Raises on a message that does not match the receiving op (the
    runner's header check would stop there) or when every unfinished rank waits. Each
    message sent is appended to ``order`` (see :func:`message_order`)."""
    ops = {r: list(sched[r]) for r in range(p)}
    index = {r: {op: i for i, op in enumerate(ops[r])} for r in range(p)}
    queues: dict[tuple[int, int], deque[tuple[Op, int, int]]] = {}  # (src, dst) -> msgs
    pc = [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(ops[r]):
                op = ops[r][pc[r]]
                src = peer_of(op, r, p, v)
                if src is not None:
                    queue = queues.get((src[0], r))
                    if not queue:
                        break  # blocks: nothing from that peer yet
                    want = Op(op.kind, op.mb, op.chunk)
                    got, sent_by, at = queue.popleft()
                    if got != want:
                        raise ScheduleError(
                            f"{_where(r, pc[r], op)}: expects the {_WHAT[op.kind]} for "
                            f"{want!r} from rank {src[0]}, but the next message rank "
                            f"{sent_by} sends it is the {_WHAT[got.kind]} for {got!r} (sent "
                            f"at its op {at}, {ops[sent_by][at]!r}): messages between two "
                            f"ranks arrive in the order they were sent, so neighbouring "
                            f"stages must run their forwards (and backwards) in the same "
                            f"microbatch order", problem="order", rank=r, index=pc[r], op=op)
                dst = target_of(op, r, p, v)
                if dst is not None:
                    # the receiver's op that consumes it: same kind, microbatch, its chunk
                    want = Op(op.kind, op.mb, dst[1])
                    queues.setdefault((r, dst[0]), deque()).append((want, r, pc[r]))
                    if order is not None:
                        order.append((r, pc[r], dst[0], index[dst[0]].get(want, -1)))
                pc[r] += 1
                progress = True
    stuck = [r for r in range(p) if pc[r] < len(ops[r])]
    if not stuck:
        return
    # follow who waits for whom from the lowest stuck rank until the chain closes; the
    # closed loop is the deadlock, any rank before it only waits behind it
    waits_for: dict[int, int] = {}
    r = stuck[0]
    while r not in waits_for:
        src = peer_of(ops[r][pc[r]], r, p, v)
        assert src is not None and pc[src[0]] < len(ops[src[0]])  # stuck ops receive
        waits_for[r] = src[0]
        r = src[0]
    loop = [r]
    while waits_for[loop[-1]] != loop[0]:
        loop.append(waits_for[loop[-1]])
    k = loop.index(min(loop))
    loop = loop[k:] + loop[:k]
    parts = []
    for r in loop:
        op = ops[r][pc[r]]
        src, chunk = peer_of(op, r, p, v)  # type: ignore[misc]
        need = Op(op.kind, op.mb, chunk)
        parts.append(f"rank {r} waits at op {pc[r]} ({op!r}) for the {_WHAT[op.kind]} rank "
                     f"{src} sends at its op {index[src].get(need)} ({need!r})")
    behind = [r for r in stuck if r not in loop]
    tail = (f" (rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} "
            f"wait{'' if len(behind) > 1 else 's'} behind them)" if behind else "")
    first = loop[0]
    raise ScheduleError("deadlock: " + ", but ".join(parts) + ": no rank can go on" + tail,
                        problem="deadlock", rank=first, index=pc[first], op=ops[first][pc[first]])


__all__ = ["PROBLEMS", "ScheduleError", "message_order", "messages", "peer_of", "target_of",
           "validate"]
