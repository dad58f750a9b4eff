"""Collectives under the names every torch version knows, this rank's place in a group, and
the ranks' agreement on their settings.

torch 2.13 renamed ``reduce_scatter_tensor`` to ``reduce_scatter_single`` and
``all_gather_into_tensor`` to ``all_gather_single`` and deprecates the old names. This is
the only module that knows: the rest of parlib, and the learner's code, call
:func:`reduce_scatter` and :func:`all_gather`, which pick whichever this torch has, so the
same code runs on an older cluster. :func:`quiet_renames` hides the deprecation warnings
that torch's own code (FSDP, DTensor) still triggers through the old names.

:func:`agree` is the one set-up check the strategies share: the ranks exchange their
settings (shapes, dtypes, counts) once, and a mismatch raises the same message on every
rank, instead of the backend's size-mismatch abort, a hang or a silent wrong answer.

Point-to-point messages follow NCCL's rules here, whatever the backend: NCCL ignores tags
(messages between two ranks match in the order they were posted) and can deadlock on an
unbatched send and receive to the same peer (NVIDIA/nccl issue 479). :func:`exchange` is
the one place the strategies send and receive through: a single ``dist.batch_isend_irecv``,
no tags. :func:`nccl_rules` holds any code to those rules on gloo, so that what passes on
the CPU holds under NCCL: inside it (or in every process started with the environment
variable ``PARLIB_NCCL_RULES=1``) torch.distributed's ``isend``, ``irecv``, ``send``,
``recv`` and ``batch_isend_irecv`` drop their tags (gloo then matches by order, as NCCL
does), refuse, naming the peer, an unbatched send and receive to one peer that are both
outstanding (posted and not yet waited for) and a receive from any source, and run in
NCCL's order: a batch gets one work, a group's batches complete one at a time in the
order posted, a send waits for its receiver (see ``_Stream``); a wait stuck in that order
raises instead of hanging::

    with parlib.comm.nccl_rules():
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer),
                                        dist.P2POp(dist.irecv, theirs, peer)])
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

_REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)
_ALL_GATHER = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:
    """Sum ``input`` (N x S elements) over the ranks; rank r receives elements
    [r*S, (r+1)*S) into ``output`` (S elements)."""
    return getattr(dist, _REDUCE_SCATTER)(output, input, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    """Concatenate every rank's ``input`` (S elements) into ``output`` (N x S), in rank
    order."""
    return getattr(dist, _ALL_GATHER)(output, input, group=group, async_op=async_op)


def rank_and_size(group: Any = None, what: str = "this", *, required: bool = True,
                  allow_none: bool = True) -> tuple[int, int]:
    """(this rank's index in ``group``, the group's size); ``None`` is the default group,
    or refused with ``allow_none=False`` (functions whose group is always an argument).

    With no process group running: a clear error naming ``what`` needs one, or ``(0, 1)``
    (one rank on its own) when ``required=False``. A rank that is not a member of ``group``
    is refused: torch would give it rank -1 and size -1, which indexing and ring
    arithmetic turn into wrong answers instead of errors."""
    if group is None and not allow_none:
        raise ValueError(f"{what} needs its process group as an argument "
                         "(e.g. dist.group.WORLD or dist.new_group(ranks)), got None")
    if not (dist.is_available() and dist.is_initialized()):
        if not required:
            return 0, 1
        raise RuntimeError(
            f"{what} needs torch.distributed: the process group is not initialised. Run it on "
            "ranks (parlib.launch, a Cluster, %%ranks or torchrun), not in the notebook itself."
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError(f"{what}: global rank {dist.get_rank()} is not a member of the "
                           f"group {_ranks_of(group)}; call it only on the group's ranks")
    return rank, dist.get_world_size(group)


def _ranks_of(group: Any) -> str:
    """The group's global ranks, for a message. On a non-member, dist.new_group returns
    the shared sentinel NON_GROUP_MEMBER, whose recorded ranks are those of the last group
    this rank was left out of, not necessarily this one: say so rather than mislead."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return ("(dist.new_group gave this rank GroupMember.NON_GROUP_MEMBER; torch does not "
                "keep the group's ranks on a non-member)")
    return str(dist.get_process_group_ranks(group))


_bookkeeping = threading.local()


@contextmanager
def bookkeeping() -> Iterator[None]:
    """Mark the collectives of the block as parlib's own checks, not a strategy's traffic:
    parlib's communication logs (``parlib.measure``) leave them out, so a log shows the
    messages the cost model predicts."""
    _bookkeeping.depth = getattr(_bookkeeping, "depth", 0) + 1
    try:
        yield
    finally:
        _bookkeeping.depth -= 1


def in_bookkeeping() -> bool:
    """Whether this thread is inside :func:`bookkeeping`."""
    return getattr(_bookkeeping, "depth", 0) > 0


_AGREED: dict[tuple[str, int], Any] = {}  # (what, id(group)) -> group, for once=True


def agree(what: str, group: Any, settings: Mapping[str, tuple[Any, str]],
          payload: Any = None, *, once: bool = False) -> list[Any]:
    """Check that every rank of ``group`` passes the same settings, once, before a
    strategy's first message: a mismatch would otherwise end in the backend's size-mismatch
    abort, a hang, or a silent wrong answer.

    ``settings``: name (the argument, as the learner wrote it) -> (this rank's value, the
    fix). Every rank calls it (one ``all_gather_object``, left out of communication logs);
    on a mismatch every rank raises the same ``ValueError``, naming ``what``, the first
    setting that differs, each rank's value (global ranks) and the fix. Returns every
    rank's ``payload`` in group order (for a check of its own, such as a whole schedule).

    ``once=True``: only on this process's first call of ``what`` with ``group`` (for a
    function called every step, where the first call is the set-up); every rank makes the
    same number of calls, so every rank skips or checks alike."""
    _, size = rank_and_size(group, what)
    key = (what, id(group))
    if size == 1 or (once and key in _AGREED):
        return [payload]
    mine = {name: value for name, (value, _) in settings.items()}
    every: list[Any] = [None] * size
    with bookkeeping():
        dist.all_gather_object(every, (mine, payload), group=group)
    for name, (_, fix) in settings.items():
        values = [theirs[name] for theirs, _ in every]
        if any(v != values[0] for v in values):
            raise ValueError(f"{what}: {name} differs across the ranks of its group "
                             f"({_by_rank(values, group)}); {fix}")
    if once:
        _AGREED[key] = group  # held, so that its id is not reused by another group
    return [theirs for _, theirs in every]


def _by_rank(values: list[Any], group: Any) -> str:
    """'rank 0: 4, rank 1: 3' (global ranks), ranks with equal values together."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    seen: list[tuple[Any, list[int]]] = []
    for rank, value in zip(ranks, values):
        for known, members in seen:
            if known == value:
                members.append(rank)
                break
        else:
            seen.append((value, [rank]))
    return ", ".join(f"rank{'s' if len(m) > 1 else ''} {', '.join(map(str, m))}: {v!r}"
                     for v, m in seen)


def quiet_renames() -> None:
    """Hide torch 2.13's deprecation warnings for the two renamed collectives."""
    warnings.filterwarnings(
        "ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated",
        category=FutureWarning,
    )


# --------------------------------------------------------------------------------------
# Point-to-point messages, NCCL's way
# --------------------------------------------------------------------------------------

def exchange(sends: Sequence[tuple[torch.Tensor, int]],
             recvs: Sequence[tuple[torch.Tensor, int]], group: Any = None) -> list[Any]:
    """Start ``sends`` and ``recvs`` ((tensor, global rank of the peer) pairs) as one
    ``dist.batch_isend_irecv`` over ``group`` and return its works (wait for all of them
    before reading a received tensor or writing a sent one).

    No tags: messages between two ranks match in the order they are posted, as NCCL
    matches them, so a receiver must post its receives from a peer in the order that peer
    posts its sends. One batch may hold a send and a receive to the same peer (NCCL runs a
    batch as one group, where an unbatched pair can deadlock). Nothing to post: ``[]``."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    return list(dist.batch_isend_irecv(ops)) if ops else []


_P2P = ("isend", "irecv", "batch_isend_irecv")  # torch's send / recv call its isend / irecv
_c10d = dist.distributed_c10d if dist.is_available() else None
_rules = threading.local()  # .batching: inside a batch_isend_irecv of the rules
_outstanding: list[_Unbatched] = []  # unbatched isend / irecv not yet waited for
_displaced: dict[str, Any] = {}  # what the rules replaced (torch's, or another wrapper)
_depth = 0  # nccl_rules() entered (the environment variable counts as one for good)


class _Unbatched:
    """An unbatched isend or irecv under the rules: its work, outstanding until waited."""

    def __init__(self, kind: str, peer: int, work: Any) -> None:
        self.kind, self.peer, self.work = kind, peer, work

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self.work.wait(*args, **kwargs)
        if self in _outstanding:
            _outstanding.remove(self)
        return result

    def __getattr__(self, name: str) -> Any:  # is_completed, exception, get_future, ...
        return getattr(self.work, name)


def _peer(group: Any, peer: int | None, group_peer: int | None, kind: str) -> int:
    """The global rank of a message's peer; a receive from any source is refused."""
    if peer is None and group_peer is None:
        raise RuntimeError(f"rank {dist.get_rank()}: {kind} with no peer (a receive from "
                           "any source): NCCL has no such receive; name the peer")
    if peer is not None:
        return peer
    return dist.get_global_rank(group or dist.group.WORLD, group_peer)


def _refuse_pair(kind: str, peer: int) -> None:
    other = "irecv" if kind == "isend" else "isend"
    if any(u.kind == other and u.peer == peer for u in _outstanding):
        way, back = ("to", "from") if kind == "isend" else ("from", "to")
        raise RuntimeError(
            f"rank {dist.get_rank()}: unbatched {kind} {way} rank {peer} while an unbatched "
            f"{other} {back} rank {peer} is still outstanding (posted, not yet waited for). "
            "NCCL runs the two one after the other and can deadlock on such a pair "
            "(NVIDIA/nccl issue 479): post them together with dist.batch_isend_irecv "
            "(parlib.comm.exchange), or wait for the first before posting the second")


def _ruled(kind: str) -> Any:
    """isend or irecv under the rules: the tag dropped, an unbatched pair refused, and on
    a backend other than NCCL the message run on its pair's emulated stream."""
    original = _displaced[kind]
    signature = inspect.signature(original)
    way = "dst" if kind == "isend" else "src"

    @functools.wraps(original)
    def ruled(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        call.arguments["tag"] = 0  # NCCL ignores tags: messages match in posting order
        if getattr(_rules, "batching", False):
            return original(*call.args, **call.kwargs)
        got = call.arguments
        group = got.get("group")
        global_peer = _peer(group, got.get(way), got.get(f"group_{way}"), kind)
        _refuse_pair(kind, global_peer)
        if dist.get_rank(group or dist.group.WORLD) < 0:
            return None  # this rank is not in the group: torch posts nothing
        work = _post(("pair", id(group), global_peer), group,
                     lambda: original(*call.args, **call.kwargs),
                     f"{kind} {'to' if kind == 'isend' else 'from'} rank {global_peer} "
                     f"({_size(got['tensor'])})")
        tracked = _Unbatched(kind, global_peer, work)
        _outstanding.append(tracked)
        return tracked

    return ruled


def _ruled_batch(p2p_op_list: list[Any]) -> list[Any]:
    """batch_isend_irecv under the rules: torch's (or the wrapper it displaced), given
    copies of the ops with the tag dropped. On NCCL as it is; elsewhere one work for the
    batch, run on the group's emulated stream."""
    group = p2p_op_list[0].group if p2p_op_list else None
    kinds = ["isend" if getattr(p2p_op.op, "__name__", "") == "isend" else "irecv"
             for p2p_op in p2p_op_list]
    what = ", ".join(f"{'send to' if kind == 'isend' else 'receive from'} rank "
                     f"{p2p_op.peer} ({_size(p2p_op.tensor)})"
                     for kind, p2p_op in zip(kinds, p2p_op_list))

    def start() -> list[Any]:
        twins = []
        for kind, p2p_op in zip(kinds, p2p_op_list):
            twin = object.__new__(type(p2p_op))  # P2POp.__new__ would check the op again
            twin.__dict__.update(vars(p2p_op))
            # torch tells sends from receives by identity with the isend it has when the
            # batch starts (the rules' own, or torch's again once the rules are left)
            twin.op, twin.tag = getattr(_c10d, kind), 0
            twins.append(twin)
        _rules.batching = True  # the ops are the rules' own: post them as they are
        try:
            return _displaced["batch_isend_irecv"](twins)
        finally:
            _rules.batching = False

    work = _post(("batch", id(group)), group, start, what)
    return work if isinstance(work, list) else [work]


def _size(tensor: torch.Tensor) -> str:
    return f"{tensor.numel()} x {str(tensor.dtype).replace('torch.', '')}"


# NCCL's order, emulated. ProcessGroupNCCL runs a batch_isend_irecv as one
# ncclGroupStart/End on the group's communicator and gives it one work: waiting for any
# part waits for the whole batch. Each communicator has one CUDA stream, so a group's
# batches run one after another in the order posted (an unbatched isend / irecv goes to
# a communicator of its own for the pair of ranks: in order per pair). NCCL documents a
# send and a receive as blocking for the GPU until matched; a small send may in fact
# complete into NCCL's buffers before its receive starts, a large one (beyond the buffer,
# 4 MiB by default) waits for it. The emulation models the worst case, the one a learner
# on real GPUs meets with real sizes: a send completes only once its receive has started
# (gloo's sends already wait for the receiver: a send of 4 floats or of 16 MB waited 3 s
# for a receive posted 3 s late). Each stream is a thread posting one batch on gloo,
# waiting for all of it, then the next; what passes under it runs under NCCL whatever the
# sizes. A wait blocks the CPU here where on NCCL it blocks the compute stream: the same
# dependencies, posted in the same order. Not modelled: collectives, which share the
# group's stream on NCCL.
_streams: dict[tuple[Any, ...], _Stream] = {}
_streams_lock = threading.Lock()
DEADLOCK_AFTER_S = 60.0  # a wait with no batch of its stream finishing for this long


class _Batch:
    """One posted batch (or unbatched message) on an emulated stream: its one work."""

    def __init__(self, stream: _Stream, start: Any, what: str, position: int) -> None:
        self.stream, self.start, self.what, self.position = stream, start, what, position
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        while not self.done.wait(1.0):
            if time.monotonic() - self.stream.progress > _deadlock_after:
                raise RuntimeError(self.stream.stuck(self))
        if self.error is not None:
            raise RuntimeError(f"rank {self.stream.rank}: batch ({self.what}) failed: "
                               f"{self.error}") from self.error
        return True


class _Stream:
    """A communicator's stream, emulated: its batches run one at a time, in posting
    order, each until all its messages are done."""

    def __init__(self, name: str) -> None:
        self.name, self.rank = name, dist.get_rank()
        self.queue: deque[_Batch] = deque()
        self.ready = threading.Condition()
        self.posted, self.running = 0, None
        self.progress = time.monotonic()  # when a batch last finished (or was posted idle)
        self.closed = False
        threading.Thread(target=self._run, daemon=True, name=f"nccl-rules {name}").start()

    def post(self, start: Any, what: str) -> _Batch:
        with self.ready:
            self.posted += 1
            batch = _Batch(self, start, what, self.posted)
            if self.running is None and not self.queue:
                self.progress = time.monotonic()
            self.queue.append(batch)
            self.ready.notify()
        return batch

    def _run(self) -> None:
        while True:
            with self.ready:
                while not self.queue and not self.closed:
                    self.ready.wait()
                if not self.queue:  # closed, and every batch posted before it run
                    return
                self.running = batch = self.queue.popleft()
            try:
                works = batch.start()
                for work in works if isinstance(works, list) else [works]:
                    if work is not None:
                        work.wait()
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits
                batch.error = err
            with self.ready:
                self.running, self.progress = None, time.monotonic()
            batch.done.set()

    def stuck(self, waited: _Batch) -> str:
        head = self.running or waited
        where = f"batch {head.position} ({head.what}) on the {self.name} stream"
        if head is not waited:
            where = (f"batch {waited.position} ({waited.what}), waited for, is behind "
                     + where)
        return (
            f"rank {self.rank}: deadlock under NCCL's rules: {where} has not completed in "
            f"{_deadlock_after:g} s. NCCL runs a group's batches one at a time in the order "
            "posted, each until every send and receive in it is done, and a send waits for "
            "its receiver's batch to start: post the messages a peer waits for in an order "
            "both ranks reach (or in one batch)")


def _post(key: tuple[Any, ...], group: Any, start: Any, what: str) -> Any:
    """Post a batch: as torch does on NCCL (the real thing), on its stream elsewhere."""
    if _c10d.get_backend(group) == "nccl":
        return start()
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None:
            name = (f"rank {dist.get_rank()}-{key[2]} pair" if key[0] == "pair" else
                    f"group {_ranks_of(group if group is not None else dist.group.WORLD)}")
            stream = _streams[key] = _Stream(name)
    return stream.post(start, what)


def _close_streams() -> None:
    with _streams_lock:
        for stream in _streams.values():
            with stream.ready:
                stream.closed = True
                stream.ready.notify()
        _streams.clear()


def _install(on: bool) -> None:
    """Put the rules' functions in torch.distributed (on), or put back what was there."""
    if on:
        _displaced.update({name: getattr(_c10d, name) for name in _P2P})
    ruled = {"isend": _ruled("isend"), "irecv": _ruled("irecv"),
             "batch_isend_irecv": _ruled_batch}
    for name in _P2P:
        function = ruled[name] if on else _displaced[name]
        setattr(_c10d, name, function)
        setattr(dist, name, function)


def nccl_rules_on() -> bool:
    """Whether point-to-point messages in this process follow :func:`nccl_rules`."""
    return _depth > 0


@contextmanager
def nccl_rules(deadlock_after_s: float | None = None) -> Iterator[None]:
    """Within: torch.distributed's point-to-point functions follow NCCL's rules on any
    backend (tags dropped; an unbatched send and receive to one peer, both outstanding,
    refused with an error naming the peer; a receive from any source refused) and run in
    NCCL's order: a batch has one work, a group's batches complete one at a time in the
    order posted, and a send waits for its receiver. A wait that sees no batch of its
    stream finish for ``deadlock_after_s`` seconds (default :data:`DEADLOCK_AFTER_S`, or
    ``PARLIB_NCCL_DEADLOCK_S``) raises, naming the batch it is stuck behind: under NCCL
    that wait would hang. Nests (the outermost sets the limit); ``PARLIB_NCCL_RULES=1`` in
    the environment turns the rules on for the whole process."""
    global _depth, _deadlock_after
    if _c10d is None:
        raise RuntimeError("nccl_rules needs torch.distributed, which this torch lacks")
    if _depth == 0:
        _outstanding.clear()
        _deadlock_after = _default_limit() if deadlock_after_s is None else deadlock_after_s
        _install(True)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _install(False)
            _close_streams()


def _default_limit() -> float:
    return float(os.environ.get("PARLIB_NCCL_DEADLOCK_S", "") or DEADLOCK_AFTER_S)


_deadlock_after = DEADLOCK_AFTER_S
if _c10d is not None and os.environ.get("PARLIB_NCCL_RULES", "") not in ("", "0"):
    _install(True)  # for the whole process: as if inside an nccl_rules() never left
    _depth = 1
    _deadlock_after = _default_limit()


__all__ = ["DEADLOCK_AFTER_S", "agree", "all_gather", "bookkeeping", "exchange",
           "in_bookkeeping", "nccl_rules", "nccl_rules_on", "quiet_renames",
           "rank_and_size", "reduce_scatter"]
