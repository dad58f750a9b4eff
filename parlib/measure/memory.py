"""Memory accounting: bytes of parameters, gradients, optimizer state and the
activations autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``),
plus the CUDA peak on a GPU. The predictions to put beside them are in
:mod:`parlib.cost.memory`."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one storage counted once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # DTensor (FSDP2): count this rank's shard
            t = t.to_local()
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def param_bytes(params: Iterable[torch.Tensor]) -> int:
    return tensor_bytes(list(params))


def grad_bytes(params: Iterable[torch.Tensor]) -> int:
    return tensor_bytes([p.grad for p in params])


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | Any) -> int:
    """Bytes of every tensor in ``optimizer.state`` (Adam: exp_avg, exp_avg_sq, step).

    Anything with an ``optimizer`` attribute (such as :class:`parlib.Zero1`) is unwrapped.
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)
    tensors = []
    for state in optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensor_bytes(tensors)


class _Saved:
    """What autograd keeps for a saved tensor; when it is freed, the count drops."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivations:
    """Bytes autograd saves for backward inside ``with SavedActivations(model) as s``.

    Uses ``torch.autograd.graph.saved_tensors_hooks``; each storage counts once, and the
    model's own parameters (which autograd also saves) are left out. After the block:
    ``s.nbytes`` is every byte saved, ``s.live`` what is still held (backward frees what it
    used) and ``s.peak`` the most held at once, which is what a pipeline schedule changes.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] | torch.nn.Module = ()) -> None:
        if isinstance(exclude, torch.nn.Module):
            exclude = list(exclude.parameters())
        self._exclude = {
            (str(t.device), t.untyped_storage().data_ptr())
            for t in (x.to_local() if hasattr(x, "to_local") else x for x in exclude)
        }
        self._refs: dict[tuple[str, int], int] = {}
        self._size: dict[tuple[str, int], int] = {}
        self.nbytes = 0
        self.live = 0
        self.peak = 0
        self._hooks: Any = None

    def _release(self, key: tuple[str, int]) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= self._size.pop(key)

    def _pack(self, t: torch.Tensor) -> Any:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        key = (str(t.device), storage.data_ptr())
        if key in self._exclude or storage.nbytes() == 0:
            return t
        if key not in self._refs:
            self._refs[key] = 0
            self._size[key] = storage.nbytes()
            self.nbytes += storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, key)
        return saved

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class GatheredWeights:
    """Bytes of full weights a :class:`parlib.FSDP` holds, observed from outside through
    its gather hook (the strategy itself keeps no count): ``now``, what is held at this
    moment; ``peak``, the most held at once since the observer was made; ``alive(unit)``,
    how many of the weights the unit's last gather made are still held (0 once FSDP freed
    them). A weight counts from its gather until nothing refers to it.

        gathered = GatheredWeights(fsdp)
        loss_fn(fsdp(x), y).backward()
        gathered.peak        # e.g. two units' worth with prefetch on
        gathered.remove()    # stop observing
    """

    def __init__(self, fsdp: Any) -> None:
        self.now = self.peak = 0
        self._last: dict[int, list[weakref.ref]] = {}  # id(unit) -> its last gather
        self._handle = fsdp.register_gather_hook(self._gathered)

    def _gathered(self, unit: Any, fulls: list[torch.Tensor]) -> None:
        for t in fulls:
            nbytes = t.numel() * t.element_size()
            self.now += nbytes
            weakref.finalize(t, self._freed, nbytes)
        self.peak = max(self.peak, self.now)
        self._last[id(unit)] = [weakref.ref(t) for t in fulls]

    def _freed(self, nbytes: int) -> None:
        self.now -= nbytes

    def alive(self, unit: Any) -> int:
        """How many of ``unit``'s last gathered weights are still held."""
        return sum(ref() is not None for ref in self._last.get(id(unit), []))

    def remove(self) -> None:
        """Stop observing (what was counted stays)."""
        self._handle.remove()


class KeptAllocations(TorchDispatchMode):
    """Bytes of the storages made inside ``with KeptAllocations() as kept``: ``kept.nbytes``,
    those still alive when the block ends (what a forward leaves for its backward, whoever
    holds it: autograd's saved tensors or a checkpoint's cache of the outputs it chose to
    keep, which :class:`SavedActivations`' hooks do not see, plus what the block returns);
    ``kept.peak``, the most alive at once inside it (looked at after every operation). Each
    storage counts once; one made before the block is never counted, nor a view of it. For
    example::

        import torch
        from parlib.measure import KeptAllocations

        x = torch.randn(8, 64)
        w = torch.randn(64, 32, requires_grad=True)
        with KeptAllocations() as kept:
            out = torch.relu(x @ w)  # x @ w is freed; relu keeps its output for backward
        print(kept.nbytes, kept.peak)  # 1024 2048: out, and x @ w beside it for a moment
    """

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[int, tuple[StorageWeakRef, int]] = {}
        self.nbytes = self.peak = 0

    def _alive(self) -> int:
        """Bytes made here and alive now (what has died is forgotten)."""
        dead = [ptr for ptr, (ref, _) in self._made.items() if ref.expired()]
        for ptr in dead:
            del self._made[ptr]
        return sum(size for _, size in self._made.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        # a view of an argument (a weight's transpose, a reshape) allocates nothing
        given = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                 if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                seen = self._made.get(ptr)
                # a freed storage's address can be handed out again: the new one counts
                if ptr not in given and (seen is None or seen[0].expired()):
                    self._made[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self._alive())
        return out

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        self.nbytes = self._alive()
        return result


@dataclass
class MemoryReport:
    """Bytes one rank holds, by kind. ``cuda_peak`` is ``torch.cuda.max_memory_allocated``
    over the measured step (``None`` on the CPU)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    cuda_peak: int | None = None
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer state: what ZeRO shards."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.activations + sum(self.extra.values())

    def as_dict(self) -> dict[str, int]:
        out = {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
        }
        out.update(self.extra)
        return out


def memory_breakdown(
    model: torch.nn.Module,
    optimizer: Any,
    step: Callable[[], Any],
    device: torch.device | str | None = None,
) -> MemoryReport:
    """Run ``step()`` once (forward + backward + optimizer step) and count this rank's bytes.

    Saved activations are counted during ``step``; parameters, gradients and optimizer
    state are counted after it (so Adam's moments exist). Wrappers that keep their own
    shards (:class:`parlib.Zero1`) report through their ``optimizer`` attribute.
    """
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    params = list(model.parameters())
    with SavedActivations(params) as saved:
        step()
    peak = None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
    extra = {}
    if hasattr(optimizer, "extra_bytes"):
        extra = dict(optimizer.extra_bytes())
    return MemoryReport(
        params=param_bytes(params),
        grads=grad_bytes(params),
        optimizer=optimizer_state_bytes(optimizer),
        activations=saved.nbytes,
        cuda_peak=peak,
        extra=extra,
    )


__all__ = [
    "GatheredWeights",
    "KeptAllocations",
    "MemoryReport",
    "SavedActivations",
    "grad_bytes",
    "memory_breakdown",
    "optimizer_state_bytes",
    "param_bytes",
    "tensor_bytes",
]
