"""Answers as plain data: what a notebook hands the grader, and how the grader reads it.

:func:`parlib.check` turns every answer into plain JSON data with :func:`to_plain` and
judges :func:`from_plain` of that, in the learner's kernel and in the grader alike. Only
the built-in types' own methods are used to read an answer (``float.__float__``,
``str.__str__``, a plain ``torch.Tensor``), so an answer's overridden methods (a float
subclass whose ``__float__`` lies, a str subclass whose ``strip`` returns an always-equal
object, a tensor subclass whose ``allclose`` says yes) never take part in a comparison.

A function travels as source (:func:`capture_function`): its own ``def`` plus what the
names it uses are bound to in the notebook (modules as imports, importable functions and
classes as ``from m import x``, literal constants as literals, functions and classes
defined in the notebook as their source, recursively). The grader rebuilds it only on the
ranks (:class:`LearnerFunction` execs the source when first called), never in its own
process, and reads what the ranks send back as plain data only
(:mod:`parlib.runtime.replies`: a rank running the learner's code may send anything; a
pickle that would run code is refused, not unpickled). Limits: a closure over a
non-literal value, a tensor or model defined in another cell, a lambda, or a class whose
source Python cannot find is not carried over; the function then meets a ``NameError``
and the grader's message names what was missing.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import decimal
import fractions
import importlib
import inspect
import linecache
import textwrap
from typing import Any

from parlib.runtime.replies import Opaque  # what a rank's plain reply may hold too

_MAX_ITEMS = 64  # list items / tensor values kept (enough for every message the checks give)
_MAX_STR = 20_000
_MAX_INT_BITS = 4000 * 3  # under 4300 decimal digits: sys.get_int_max_str_digits()
_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
           "uint8", "bool")


def type_name(x: Any) -> str:
    """The type name to show a learner (an :class:`Opaque` answer keeps its original one)."""
    return x.type_name if isinstance(x, Opaque) else type(x).__name__


def _safe_type_name(x: Any) -> str:
    try:
        name = type.__dict__["__name__"].__get__(type(x))
        return str.__str__(name) if isinstance(name, str) else "object"
    except Exception:  # noqa: BLE001
        return "object"


def plain_tensor(t: Any) -> Any:
    """A plain ``torch.Tensor`` copy of ``t`` (a tensor subclass loses its class and methods).

    Returns ``None`` when ``t`` cannot be read as a plain tensor."""
    import torch

    if not isinstance(t, torch.Tensor):
        return None
    try:
        with torch._C.DisableTorchFunctionSubclass():
            base = torch.Tensor.as_subclass(t, torch.Tensor)
            out = torch.Tensor.clone(torch.Tensor.detach(base))
    except Exception:  # noqa: BLE001 - a wrapper subclass without storage
        return None
    return out if type(out) is torch.Tensor else None


def plain_data(x: Any, depth: int = 0) -> Any:
    """``x`` rebuilt from built-in containers, numbers, strings and plain tensors only
    (the grader applies it to what a rank returns before judging it)."""
    import torch

    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, torch.Tensor):
        return plain_tensor(x)
    if depth > 8:
        return None
    if isinstance(x, bool):
        return x is True
    if isinstance(x, int):
        return int.__int__(x)
    if isinstance(x, float):
        return float.__float__(x)
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, dict):
        return {plain_data(k, depth + 1): plain_data(v, depth + 1)
                for k, v in dict.items(x) if type(k) in (int, str)}
    if isinstance(x, (list, tuple)):
        items = [plain_data(v, depth + 1) for v in (list.__iter__(x) if isinstance(x, list)
                                                     else tuple.__iter__(x))]
        return items if isinstance(x, list) else tuple(items)
    return Opaque(_safe_type_name(x))


def to_plain(x: Any, depth: int = 0) -> Any:
    """JSON-able plain data describing ``x``; never calls ``x``'s own methods; never raises."""
    try:
        return _to_plain(x, depth)
    except Exception:  # noqa: BLE001 - whatever it is, the grader sees an opaque object
        return {"__kind__": "object", "type": _safe_type_name(x)}


def _to_plain(x: Any, depth: int) -> Any:
    import sys

    if x is None:
        return None
    if x is Ellipsis:
        return {"__kind__": "ellipsis"}
    if isinstance(x, bool):  # bool cannot be subclassed
        return x is True
    if isinstance(x, int):
        if int.bit_length(x) > _MAX_INT_BITS:  # json cannot write it (Python's digit limit)
            return {"__kind__": "object", "type": f"int of {int.bit_length(x)} bits"}
        return int.__int__(x)
    if isinstance(x, float):
        return float.__float__(x)
    if type(x) in (fractions.Fraction, decimal.Decimal):  # the standard library's own numbers
        return float(x)
    if isinstance(x, complex):
        return {"__kind__": "complex", "real": complex.real.__get__(x),
                "imag": complex.imag.__get__(x)}
    if isinstance(x, str):
        return str.__str__(x)[:_MAX_STR]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        t = plain_tensor(x)
        if t is None:
            return {"__kind__": "object", "type": _safe_type_name(x)}
        return _tensor_payload(t)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, (numpy.ndarray, numpy.generic)):
        arr = numpy.array(x, copy=True, subok=False)
        if arr.dtype.kind not in "biuf" or torch is None:
            return {"__kind__": "object", "type": _safe_type_name(x)}
        return _tensor_payload(torch.from_numpy(numpy.ascontiguousarray(arr)))
    if depth < 4 and isinstance(x, (list, tuple)):
        n = list.__len__(x) if isinstance(x, list) else tuple.__len__(x)
        get = list.__getitem__ if isinstance(x, list) else tuple.__getitem__
        return {"__kind__": "list" if isinstance(x, list) else "tuple", "len": n,
                "items": [_to_plain(get(x, i), depth + 1) for i in range(min(n, _MAX_ITEMS))]}
    for kind, base in (("dict", dict), ("set", set), ("frozenset", frozenset)):
        if isinstance(x, base):
            return {"__kind__": kind, "len": base.__len__(x)}
    if inspect.isfunction(x) or callable(x):
        return {"__kind__": "object", "type": _safe_type_name(x), "callable": True}
    return {"__kind__": "object", "type": _safe_type_name(x)}


def _tensor_payload(t: Any) -> dict[str, Any]:
    dtype = str(t.dtype).removeprefix("torch.")
    out: dict[str, Any] = {"__kind__": "tensor", "shape": list(t.shape), "dtype": dtype}
    if t.numel() <= _MAX_ITEMS and dtype in _DTYPES:
        out["values"] = t.detach().cpu().reshape(-1).tolist()
    return out


def from_plain(p: Any) -> Any:
    """The answer the checks judge, rebuilt from :func:`to_plain`'s data (or from a forged
    log line: anything that is not well formed becomes an :class:`Opaque`)."""
    if p is None or type(p) in (bool, int, float, str):
        return p
    if type(p) is list:  # not produced by to_plain; treat as a list answer
        return [from_plain(v) for v in p[:_MAX_ITEMS]]
    if type(p) is not dict:
        return Opaque("object")
    kind = p.get("__kind__")
    try:
        if kind == "ellipsis":
            return ...
        if kind == "complex":
            return complex(float(p["real"]), float(p["imag"]))
        if kind == "tensor":
            return _tensor_from(p)
        if kind in ("list", "tuple"):
            items = [from_plain(v) for v in list(p.get("items", []))[:_MAX_ITEMS]]
            n = int(p.get("len", len(items)))
            items += [None] * max(0, min(n, 10**6) - len(items))
            return items if kind == "list" else tuple(items)
        if kind in ("dict", "set", "frozenset"):
            n = max(0, min(int(p.get("len", 0)), 10**6))
            return {"dict": dict.fromkeys(range(n)), "set": set(range(n)),
                    "frozenset": frozenset(range(n))}[kind]
        if kind == "function":
            return LearnerFunction(p)
    except (KeyError, TypeError, ValueError, RuntimeError):
        pass
    name = p.get("type") if isinstance(p.get("type"), str) else "object"
    return Opaque(name[:80])


def _tensor_from(p: dict[str, Any]) -> Any:
    import torch

    shape = [int(s) for s in p["shape"]]
    dtype = p.get("dtype")
    if dtype not in _DTYPES:
        return Opaque(f"Tensor of dtype {str(dtype)[:20]}")
    dt = getattr(torch, dtype)
    if "values" in p:
        values = [float(v) if dt.is_floating_point else v for v in p["values"]]
        return torch.tensor(values, dtype=dt).reshape(shape)
    return torch.empty(shape, dtype=dt, device="meta")


# --------------------------------------------------------------------------- functions


class _CannotCapture(Exception):
    pass


def capture_function(fn: Any) -> dict[str, Any]:
    """The source bundle of a learner's function (see the module docstring); never raises.
    ``error`` says why it could not be read."""
    out: dict[str, Any] = {"__kind__": "function", "name": "", "code": "", "missing": {}}
    if not inspect.isfunction(fn):
        out["error"] = (f"a {_safe_type_name(fn)} is not a function written with def; "
                        f"pass a function defined with def in a cell")
        return out
    if fn.__name__ == "<lambda>":
        out["error"] = "a lambda's source cannot be read reliably; define it with def"
        return out
    bundle = _Bundle()
    try:
        out["name"] = bundle.add_function(fn)
    except _CannotCapture as exc:
        out["error"] = str(exc)
        return out
    except Exception as exc:  # noqa: BLE001 - never let collecting break a learner's check
        out["error"] = f"reading its source failed ({type(exc).__name__}: {exc})"
        return out
    out["code"] = "\n".join(bundle.lines) + "\n"
    out["missing"] = bundle.missing
    return out


def _source(obj: Any) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError) as exc:
        raise _CannotCapture(f"Python cannot find the source of {obj.__name__} ({exc}); "
                             f"define it in a notebook cell") from None


def _loaded_names(tree: ast.AST) -> list[str]:
    return sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)})


class _Bundle:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.bound: set[str] = set()
        self.missing: dict[str, str] = {}

    def add_function(self, fn: Any) -> str:
        src = _source(fn)
        tree = ast.parse(src)
        node = tree.body[0] if tree.body else None
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            raise _CannotCapture(f"the source of {fn.__name__} is not a def")
        self.bound.add(node.name)
        scope = dict(fn.__globals__) if hasattr(fn, "__globals__") else {}
        if getattr(fn, "__closure__", None):
            scope.update(inspect.getclosurevars(fn).nonlocals)
        if inspect.isclass(fn):
            scope = dict(vars(importlib.import_module("__main__")))
        for name in _loaded_names(tree):
            if name not in self.bound and name in scope:
                self._bind(name, scope[name])
        self.lines.append(src.rstrip("\n"))
        return node.name

    def _bind(self, name: str, value: Any) -> None:
        self.bound.add(name)
        if getattr(builtins, name, _NOTHING) is value:
            return
        if inspect.ismodule(value):
            self.lines.append(f"import {value.__name__} as {name}")
            return
        if (inspect.isfunction(value) or inspect.isclass(value)) \
                and getattr(value, "__module__", None) == "__main__":
            try:
                defined = self.add_function(value)
            except _CannotCapture:
                self.missing[name] = _safe_type_name(value)
                return
            if defined != name:
                self.lines.append(f"{name} = {defined}")
            return
        ref = _import_reference(value)
        if ref is not None:
            self.lines.append(f"from {ref[0]} import {ref[1]} as {name}")
            return
        literal = _literal(value)
        if literal is not None:
            self.lines.append(f"{name} = {literal}")
            return
        self.missing[name] = _safe_type_name(value)


_NOTHING = object()


def _import_reference(value: Any) -> tuple[str, str] | None:
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__" \
            or not qualname.isidentifier():
        return None
    try:
        if getattr(importlib.import_module(module), qualname) is value:
            return module, qualname
    except Exception:  # noqa: BLE001
        return None
    return None


def _literal(value: Any) -> str | None:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return f"__import__('torch').{str(value).removeprefix('torch.')}"
    if torch is not None and isinstance(value, torch.device):
        return f"__import__('torch').device({str(value)!r})"
    if type(value) not in (int, float, str, bool, bytes, complex, tuple, list, dict,
                           frozenset, set, type(None)):
        return None
    text = repr(value)
    try:
        ok = len(text) < 100_000 and ast.literal_eval(text) == value
    except (ValueError, SyntaxError, RecursionError):
        ok = False
    return text if ok else None


class LearnerExited(RuntimeError):
    """The learner's function tried to end its process (``os._exit``) on a rank."""


@contextlib.contextmanager
def no_process_exit() -> Any:
    """On a rank, around a learner's function: ``os._exit(n)`` raises
    :class:`LearnerExited` saying what the code did, instead of ending the rank silently
    (its peers would then be reported as stuck in a collective)."""
    import os

    real = os._exit

    def refuse(code: int = 0) -> None:
        raise LearnerExited(f"your function called os._exit({code!r}): it must return, not "
                            f"end the rank's process")

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


class LearnerFunction:
    """A learner's function rebuilt from its source bundle on first call (on a rank).

    Pickles as its source, so the grader's process never runs the learner's code; what the
    ranks return comes back as plain data (``parlib.launch(..., plain_replies=True)``)."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.__name__ = str(payload.get("name") or "learner_function")
        self.code = str(payload.get("code") or "")
        missing = payload.get("missing") or {}
        self.missing = {str(k): str(v) for k, v in dict(missing).items()}
        self.error = payload.get("error")
        self._fn: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fn": None}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fn is None:
            filename = f"<your notebook: {self.__name__}>"
            linecache.cache[filename] = (len(self.code), None, self.code.splitlines(True),
                                         filename)
            namespace: dict[str, Any] = {"__name__": "__main__"}
            if self.error:
                raise TypeError(f"the grader could not read your function: {self.error}")
            exec(compile(self.code, filename, "exec"), namespace)  # noqa: S102
            if not callable(namespace.get(self.__name__)):
                raise TypeError(f"the grader could not rebuild your function "
                                f"{self.__name__!r} from its source: define it with def "
                                f"in a cell")
            self._fn = namespace[self.__name__]
        return self._fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<your function {self.__name__}, rebuilt from its source>"


__all__ = ["LearnerExited", "LearnerFunction", "Opaque", "capture_function", "from_plain",
           "no_process_exit", "plain_data", "plain_tensor", "to_plain", "type_name"]
