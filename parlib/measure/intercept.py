"""The one place parlib intercepts communication: every collective and point-to-point call.

:data:`OPS` is the single table of the ``torch.distributed`` calls parlib sees: for each
name, the normalised operation, where its message is, and how many bytes this rank sends
(:func:`parlib.cost.predicted_sent_bytes` where the cost layer has a formula; counted
from the split sizes for an all-to-all, whose pieces need not be equal). While at least
one observer is subscribed (``with intercept.observing(obs):``), each name is patched
**process-wide** where it is defined (``torch.distributed.distributed_c10d``), under its
``torch.distributed`` re-export and, for the functional collectives DTensor calls, in
``torch.distributed._functional_collectives``; every thread of the rank goes through it,
and the originals come back when the last observer leaves, even after an exception.

An observer has one method, ``around(call, proceed)``: it gets the :class:`Call`
(operation, message bytes, sent bytes, group), must call ``proceed()`` once to run the
rest of the chain and the real call, and returns what ``proceed()`` returned (or a
wrapper of it). The observer subscribed last is the outermost, so a log opened inside an
emulated slow link sees the emulated time. A call made inside another intercepted call
(``all_gather_into_tensor`` forwarding to its new name, ``batch_isend_irecv`` calling
``isend``) is seen once, as the outer one. The collectives of parlib's own agreement
checks (inside :func:`parlib.comm.bookkeeping`: settings compared once at set-up) are not
a strategy's traffic and are not reported.

:func:`spying` is the deeper hook the checks use: it reports every operation that reached a
``ProcessGroup`` method or a ``torch.ops._c10d_functional`` op, whoever issued it.
Collectives issued from C++ (DistributedDataParallel's reducer) reach neither.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from parlib.comm import in_bookkeeping
from parlib.cost import predicted_sent_bytes


def tensor_bytes(t: Any) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(tensor_bytes(x) for x in t)
    return 0


@dataclass
class Call:
    """One intercepted call: ``name`` as called, ``op`` normalised ("all_gather" for
    ``all_gather_into_tensor``, "send" for ``isend``), ``nbytes`` the full message (the
    convention of :func:`parlib.cost.predicted_sent_bytes`), ``sent_bytes`` what this rank
    sends (None where no figure applies), ``group`` (None: the default group),
    ``group_size``, ``async_op`` (the call returns a handle to wait on), and the bound
    ``arguments``."""

    name: str
    op: str
    nbytes: int
    sent_bytes: float | None
    group: Any
    group_size: int
    async_op: bool
    arguments: dict[str, Any]


@dataclass(frozen=True)
class OpRule:
    """How to read one call: its normalised ``op``, the argument holding the message
    (``message``), and an optional ``sent`` counter for ops with no cost-layer formula."""

    op: str
    message: str | None
    sent: Callable[[dict[str, Any], int, int], float | None] | None = None


def _a2a_single_sent(args: dict[str, Any], rank: int, n: int) -> float:
    """All-to-all (one tensor): everything but the rows this rank keeps for itself."""
    x = args["input"]
    splits = args.get("input_split_sizes")
    if not splits:
        return tensor_bytes(x) * (n - 1) / n
    row = tensor_bytes(x) // max(x.shape[0], 1)
    return (sum(splits) - splits[rank]) * row


def _a2a_list_sent(args: dict[str, Any], rank: int, n: int) -> float:
    """All-to-all (lists): every input tensor but the one addressed to this rank."""
    pieces = args["input_tensor_list"]
    return tensor_bytes(pieces) - tensor_bytes(pieces[rank])


def _batch_sent(args: dict[str, Any], rank: int, n: int) -> float:
    return sum(tensor_bytes(p.tensor) for p in args["p2p_op_list"] if _is_send(p))


def _is_send(p2p_op: Any) -> bool:
    return getattr(p2p_op.op, "__name__", "") == "isend"


# The table: every communication call parlib sees. The message is the tensor for
# all-reduce, broadcast and point-to-point, the input of a reduce-scatter or all-to-all,
# the output of an all-gather (as in parlib.cost.collectives).
OPS: dict[str, OpRule] = {
    "all_reduce": OpRule("all_reduce", "tensor"),
    "broadcast": OpRule("broadcast", "tensor"),
    "reduce": OpRule("reduce", "tensor"),
    "reduce_scatter": OpRule("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": OpRule("reduce_scatter", "input"),
    "reduce_scatter_single": OpRule("reduce_scatter", "input"),
    "_reduce_scatter_base": OpRule("reduce_scatter", "input"),
    "all_gather": OpRule("all_gather", "tensor_list"),
    "all_gather_into_tensor": OpRule("all_gather", "output_tensor"),
    "all_gather_single": OpRule("all_gather", "output_tensor"),
    "_all_gather_base": OpRule("all_gather", "output_tensor"),
    "gather": OpRule("gather", "tensor"),
    "scatter": OpRule("scatter", "tensor"),
    # On gloo (torch 2.13) the list form needs equal-sized pieces; the one-tensor form
    # takes uneven split sizes (tests/measure/test_intercept.py runs both).
    "all_to_all_single": OpRule("all_to_all", "input", _a2a_single_sent),
    "all_to_all": OpRule("all_to_all", "input_tensor_list", _a2a_list_sent),
    "barrier": OpRule("barrier", None),
    "monitored_barrier": OpRule("barrier", None),
    "send": OpRule("send", "tensor"),
    "recv": OpRule("recv", "tensor"),
    "isend": OpRule("send", "tensor"),
    "irecv": OpRule("recv", "tensor"),
    "batch_isend_irecv": OpRule("batch_isend_irecv", None, _batch_sent),
}
ALWAYS_ASYNC = frozenset({"isend", "irecv", "batch_isend_irecv"})
POINT_TO_POINT = frozenset({"send", "recv", "batch_isend_irecv"})  # normalised ops

# The functional collectives (DTensor's path): name -> (op, message is the output).
# Their group argument may be a process group, a device mesh or a list of ranks.
FUNCTIONAL: dict[str, tuple[str, bool]] = {
    "all_reduce": ("all_reduce", False),
    "all_gather_tensor": ("all_gather", True),
    "reduce_scatter_tensor": ("reduce_scatter", False),
    "all_to_all_single": ("all_to_all", False),
    "broadcast": ("broadcast", False),
}


class Observer(Protocol):
    def around(self, call: Call, proceed: Callable[[], Any]) -> Any: ...


def _functional_module() -> Any:
    try:
        import torch.distributed._functional_collectives as funcol
    except ImportError:  # a torch without functional collectives
        return None
    return funcol


_lock = threading.Lock()
_observers: list[Observer] = []
_patched: list[tuple[Any, str, Callable]] = []  # (module, name, function it had)
_local = threading.local()


def _group_size(group: Any) -> int:
    try:
        return dist.get_world_size(group) if group is not None else dist.get_world_size()
    except Exception:  # noqa: BLE001 - a group this rank is not in, or no process group
        return 1


def _group_rank(group: Any) -> int:
    try:
        return dist.get_rank(group) if group is not None else dist.get_rank()
    except Exception:  # noqa: BLE001
        return 0


def describe(name: str, arguments: dict[str, Any]) -> Call:
    """The :class:`Call` for ``torch.distributed.<name>`` with these bound arguments."""
    rule = OPS[name]
    if name == "batch_isend_irecv":
        ops = arguments.get("p2p_op_list") or []
        group = ops[0].group if ops else None
        nbytes = sum(tensor_bytes(p.tensor) for p in ops)
    else:
        group = arguments.get("group")
        nbytes = tensor_bytes(arguments.get(rule.message)) if rule.message else 0
    n = _group_size(group)
    if rule.sent is not None:
        sent = rule.sent(arguments, _group_rank(group), n) if n > 1 else 0.0
    else:
        sent = predicted_sent_bytes(rule.op, nbytes, n)
    is_async = name in ALWAYS_ASYNC or bool(arguments.get("async_op", False))
    return Call(name, rule.op, nbytes, sent, group, n, is_async, arguments)


def _functional_group(group: Any) -> Any:
    funcol = _functional_module()
    try:
        return c10d._resolve_process_group(funcol._resolve_group_name(group))
    except Exception:  # noqa: BLE001 - an unusual group spelling: counted on WORLD
        return None


def _describe_functional(name: str, arguments: dict[str, Any]) -> Call:
    op, output_is_message = FUNCTIONAL[name]
    group = _functional_group(arguments.get("group"))
    n = _group_size(group)
    nbytes = tensor_bytes(arguments.get("self")) * (n if output_is_message else 1)
    if op == "all_to_all":
        splits = arguments.get("input_split_sizes")
        sent = _a2a_single_sent({"input": arguments["self"], "input_split_sizes": splits},
                                _group_rank(group), n) if n > 1 else 0.0
    else:
        sent = predicted_sent_bytes(op, nbytes, n)
    return Call(name, op, nbytes, sent, group, n, False, arguments)


def _run(call: Call, chain: list[Observer], original: Callable, args: tuple,
         kwargs: dict) -> Any:
    def step(i: int) -> Any:
        if i < 0:
            _local.depth = getattr(_local, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                _local.depth -= 1
        return chain[i].around(call, lambda: step(i - 1))

    return step(len(chain) - 1)


def _wrap(name: str, original: Callable, read: Callable[[str, dict], Call]) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def intercepted(*args: Any, **kwargs: Any) -> Any:
        chain = list(_observers)
        if getattr(_local, "depth", 0) or not chain or in_bookkeeping():
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # a wrong call: let torch name the problem
            return original(*args, **kwargs)
        if name == "batch_isend_irecv":
            # torch tells sends from receives by identity with its own isend: hand it
            # copies of the ops that name the function it has now (patched or not).
            own = {"isend": c10d.isend, "irecv": c10d.irecv}
            bound.arguments["p2p_op_list"] = [_renamed(p, own)
                                              for p in bound.arguments["p2p_op_list"]]
            args, kwargs = bound.args, bound.kwargs
        call = read(name, dict(bound.arguments))
        return _run(call, chain, original, args, kwargs)

    intercepted.__parlib_original__ = original  # type: ignore[attr-defined]
    return intercepted


def _renamed(p2p_op: Any, own: dict[str, Callable]) -> Any:
    """A copy of a ``P2POp`` whose ``op`` is ``own``'s function of the same name."""
    twin = object.__new__(type(p2p_op))  # P2POp.__new__ would check the op again
    twin.__dict__.update(vars(p2p_op))
    twin.op = own.get(getattr(p2p_op.op, "__name__", ""), p2p_op.op)
    return twin


def _targets() -> list[tuple[Any, str, Callable[[str, dict], Call]]]:
    out = [(module, name, describe) for name in OPS for module in (c10d, dist)]
    funcol = _functional_module()
    if funcol is not None:
        out += [(funcol, name, _describe_functional) for name in FUNCTIONAL]
    return out


def _patch() -> None:
    wrappers: dict[tuple[int, str], Callable] = {}  # one wrapper per distinct function
    for module, name, read in _targets():
        original = getattr(module, name, None)
        if original is None:
            continue
        key = (id(original), read.__name__)
        if key not in wrappers:
            wrappers[key] = _wrap(name, original, read)
        _patched.append((module, name, original))
        setattr(module, name, wrappers[key])


def _restore() -> None:
    for module, name, original in reversed(_patched):
        setattr(module, name, original)
    _patched.clear()


@contextmanager
def observing(observer: Observer) -> Iterator[Observer]:
    """Subscribe ``observer`` to every intercepted call for the block (nestable; several
    at once; the originals are restored when the last one leaves)."""
    with _lock:
        if not _observers:
            _patch()
        _observers.append(observer)
    try:
        yield observer
    finally:
        with _lock:
            _observers.remove(observer)
            if not _observers:
                _restore()


class OnWait:
    """An async call's handle (or a list of them) that runs ``done()`` once every handle
    it wraps has been waited for; ``done`` may sleep (an emulated link)."""

    def __init__(self, work: Any, done: Callable[[], None]) -> None:
        self._work, self._done, self._called = work, done, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        if not self._called:
            self._called = True
            self._done()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def on_wait(result: Any, done: Callable[[], None]) -> Any:
    """``result`` (a handle, a list of handles, or None) with ``done()`` run after its
    last handle's ``wait()``; at once when there is nothing to wait for."""
    if isinstance(result, list):
        left = [len(result)]
        if not result:
            done()

        def one() -> None:
            left[0] -= 1
            if left[0] == 0:
                done()

        return [OnWait(w, one) for w in result]
    if result is None:
        done()
        return None
    return OnWait(result, done)


# --------------------------------------------------------------------------- deep spying

# ProcessGroup method (or functional op) -> normalised op name
PG_METHODS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather", "_allgather_base": "all_gather",
    "allgather_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_single": "all_gather", "all_gather_single_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "recv_anysource": "recv",
    "barrier": "barrier", "monitored_barrier": "barrier",
}
FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}
_spies: list[Callable[[str], None]] = []
_spied: list[tuple[Any, str, Any, bool]] = []  # (owner, name, value, was_own_attr)


def _spy(op: str, original: Callable) -> Callable:
    def spy(*args: Any, **kwargs: Any) -> Any:
        for report in list(_spies):  # bookkeeping included: a check sees every call
            report(op)
        return original(*args, **kwargs)

    return spy


def _spy_patch() -> None:
    from torch._C._distributed_c10d import ProcessGroup

    targets: list[tuple[Any, dict[str, str]]] = [(ProcessGroup, PG_METHODS)]
    try:
        targets.append((torch.ops._c10d_functional, FUNCTIONAL_OPS))
    except Exception:  # noqa: BLE001 - a torch without functional collectives
        pass
    for owner, names in targets:
        for name, op in names.items():
            try:
                original = getattr(owner, name)
            except (AttributeError, RuntimeError):
                continue
            own = name in vars(owner)  # restore the raw entry (a pybind11 instancemethod)
            _spied.append((owner, name, vars(owner).get(name), own))
            setattr(owner, name, _spy(op, original))


def _spy_restore() -> None:
    for owner, name, original, own in reversed(_spied):
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
    _spied.clear()


@contextmanager
def spying(report: Callable[[str], None]) -> Iterator[None]:
    """Call ``report(op)`` for every operation that reaches a ``ProcessGroup`` method or a
    functional-collective op during the block, whatever Python function issued it."""
    with _lock:
        if not _spies:
            _spy_patch()
        _spies.append(report)
    try:
        yield
    finally:
        with _lock:
            _spies.remove(report)
            if not _spies:
                _spy_restore()


__all__ = ["ALWAYS_ASYNC", "Call", "FUNCTIONAL", "OPS", "Observer", "OnWait", "OpRule",
           "POINT_TO_POINT", "describe", "observing", "on_wait", "spying", "tensor_bytes"]
