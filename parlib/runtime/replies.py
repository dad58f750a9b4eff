"""What a rank sends back, read as plain data: for launches whose ranks run code nobody
vouches for (the course's checks run a learner's function on them).

A plain reply is a pickle that names no global but those of :func:`plain_globals`, each
mapped here to a function that only builds a value: ``set``, ``frozenset``, ``complex``,
``range``, ``slice``, ``bytearray``, ``OrderedDict``, torch's dtypes, ``torch.device``,
``torch.Size``, a tensor (dtype, shape and raw bytes: torch's own tensor pickle is not
used, as its storage is read back with a full unpickle) and :class:`Opaque`. Anything else
a pickle names (``builtins.exec``, a class whose ``__reduce__`` runs code) is refused by
:meth:`PlainUnpickler.find_class` before it is looked up, and no object's ``__setstate__``
runs (``BUILD`` is refused but on an :class:`Opaque`). :func:`plain_dumps` writes such a
pickle on the rank; :func:`plain_loads` reads one in the launcher, whatever the rank's code
did to the rank's own pickler.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import pickle
import re
from typing import Any

MAX_REPLY_BYTES = 256 * 2**20  # one reply of a plain launch; a check's are a few KiB
_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128",
                "int8", "int16", "int32", "int64", "uint8", "bool")
_CUDA = re.compile(r"cuda(:\d{1,3})?")


class NotPlainData(pickle.UnpicklingError):
    """A reply that is not plain data: it names a global outside the allow-list, or
    builds something it may not."""


class Opaque:
    """A value the reader only knows the type name of (``you gave a Foo``)."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<{self.type_name}>"


def _opaque(type_name: Any) -> Opaque:
    return Opaque(str.__str__(type_name)[:80] if isinstance(type_name, str) else "object")


def _tensor(dtype: Any, shape: Any, raw: Any, device: Any = "cpu",
            requires_grad: Any = False) -> Any:
    """A tensor from its dtype name, shape and bytes, checked to agree."""
    import torch

    if not isinstance(dtype, str) or dtype not in _DTYPE_NAMES:
        raise NotPlainData(f"a tensor of dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, tuple) or len(shape) > 64 \
            or any(type(s) is not int or s < 0 for s in shape):
        raise NotPlainData("a tensor whose shape is not a tuple of sizes")
    if type(raw) is not bytes:
        raise NotPlainData("a tensor whose data is not bytes")
    dt = getattr(torch, dtype)
    if len(raw) != math.prod(shape) * dt.itemsize:
        raise NotPlainData(f"a tensor of shape {shape} and dtype {dtype} in {len(raw)} bytes")
    if raw:
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)
    else:
        t = torch.empty(shape, dtype=dt)
    if isinstance(device, str) and _CUDA.fullmatch(device) and torch.cuda.is_available():
        t = t.to(device)
    if requires_grad is True and (dt.is_floating_point or dt.is_complex):
        t.requires_grad_(True)
    return t


def _checked(kind: type, check: Any) -> Any:
    """``kind`` called only on arguments ``check`` accepts (plain numbers, for instance)."""
    def build(*args: Any) -> Any:
        if not check(args):
            raise NotPlainData(f"a {kind.__name__} of {len(args)} argument(s) that are "
                               f"not plain data")
        return kind(*args)
    return build


def _numbers(args: tuple) -> bool:
    return len(args) <= 3 and all(type(a) in (int, float, type(None)) for a in args)


def _ordered_dict(*args: Any) -> collections.OrderedDict:
    if args:
        raise NotPlainData("an OrderedDict built with arguments")
    return collections.OrderedDict()


def _device(*args: Any) -> Any:
    import torch

    if len(args) not in (1, 2) or not isinstance(args[0], str) or len(args[0]) > 20 \
            or (len(args) == 2 and type(args[1]) is not int):
        raise NotPlainData("a torch.device that is not a plain device name")
    return torch.device(*args)


@functools.lru_cache(maxsize=1)
def plain_globals() -> dict[tuple[str, str], Any]:
    """The globals a plain reply may name, each (module, name) mapped to what builds it
    (a builder that checks its arguments, or a torch dtype)."""
    import torch

    return {
        ("builtins", "set"): _checked(set, lambda a: len(a) == 1 and type(a[0]) is list),
        ("builtins", "frozenset"): _checked(frozenset, lambda a: len(a) <= 1 and all(
            type(x) is list for x in a)),
        ("builtins", "complex"): _checked(complex, lambda a: len(a) <= 2 and all(
            type(x) in (int, float) for x in a)),
        ("builtins", "range"): _checked(range, lambda a: all(type(x) is int for x in a)),
        ("builtins", "slice"): _checked(slice, _numbers),
        ("builtins", "bytearray"): _checked(bytearray, lambda a: len(a) <= 1 and all(
            type(x) is bytes for x in a)),
        ("collections", "OrderedDict"): _ordered_dict,
        ("torch", "device"): _device,
        ("torch", "Size"): _checked(torch.Size, lambda a: len(a) == 1 and type(a[0]) is tuple
                                    and all(type(s) is int for s in a[0])),
        ("parlib.runtime.replies", "_tensor"): _tensor,
        ("parlib.runtime.replies", "_opaque"): _opaque,
        **{("torch", name): getattr(torch, name) for name in _DTYPE_NAMES},
    }


class PlainUnpickler(pickle._Unpickler):  # noqa: SLF001 - the Python one: BUILD is ours
    """Reads a pickle naming only :func:`plain_globals`; refuses anything else."""

    dispatch = dict(pickle._Unpickler.dispatch)  # noqa: SLF001

    def find_class(self, module: str, name: str) -> Any:
        try:
            return plain_globals()[(module, name)]
        except (KeyError, TypeError):
            raise NotPlainData(f"it names {str(module)[:80]}.{str(name)[:80]}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise NotPlainData("it names a persistent id")

    def load_build(self) -> None:
        """``BUILD`` sets an object's state; only an :class:`Opaque`'s, as plain data."""
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) is not Opaque or type(state) is not dict:
            raise NotPlainData(f"it sets the state of a {type(inst).__name__}")
        inst.type_name = _opaque(state.get("type_name")).type_name

    dispatch[pickle.BUILD[0]] = load_build


def plain_loads(data: bytes) -> Any:
    """The value a plain pickle holds; :class:`NotPlainData` (naming what it held) for any
    other pickle, nothing in it called but the builders of :func:`plain_globals`."""
    if type(data) is not bytes:
        raise NotPlainData(f"a {type(data).__name__} in place of a pickle")
    try:
        return PlainUnpickler(io.BytesIO(data)).load()
    except NotPlainData:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated, malformed, a builder refused it
        raise NotPlainData(f"it is not a well-formed pickle ({type(exc).__name__}: "
                           f"{str(exc)[:200]})") from None


_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray, list, tuple,
                dict, set, frozenset, range, slice)


class _PlainPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            return _tensor_reduce(obj)
        if isinstance(obj, Opaque):
            return _opaque, (str(obj.type_name),)
        if type(obj) is collections.OrderedDict:
            return collections.OrderedDict, (), None, None, iter(obj.items())
        if type(obj) in _PLAIN_TYPES or type(obj) in (torch.dtype, torch.device, torch.Size):
            return NotImplemented
        name = (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None))
        if callable(obj) and name in plain_globals():  # a builder, saved by its name
            return NotImplemented
        raise pickle.PicklingError(f"an object of type {type(obj).__qualname__} is not "
                                   "plain data")


def _tensor_reduce(t: Any) -> tuple:
    import torch

    if t.layout != torch.strided or t.device.type == "meta":
        raise pickle.PicklingError(f"a {t.layout} tensor on {t.device} is not plain data: "
                                   f"return a dense tensor")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPE_NAMES:
        raise pickle.PicklingError(f"a tensor of dtype {dtype} is not plain data")
    with torch._C.DisableTorchFunctionSubclass():
        flat = torch.Tensor.as_subclass(t, torch.Tensor).detach().cpu()
        flat = flat.resolve_conj().resolve_neg().contiguous()
        raw = flat.reshape(-1).view(torch.uint8).numpy().tobytes()
    return _tensor, (dtype, tuple(t.shape), raw, str(t.device), bool(t.requires_grad))


def plain_dumps(value: Any) -> bytes:
    """A pickle :func:`plain_loads` reads back: tensors as dtype, shape and bytes;
    :class:`pickle.PicklingError` naming what is not plain data."""
    out = io.BytesIO()
    _PlainPickler(out, protocol=5).dump(value)
    data = out.getvalue()
    plain_loads(data)  # the same verdict on the rank as in the launcher, with the rank's frame
    return data


__all__ = ["MAX_REPLY_BYTES", "NotPlainData", "Opaque", "PlainUnpickler",
           "plain_dumps", "plain_loads"]
