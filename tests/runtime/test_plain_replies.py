"""A plain launch reads what its ranks send back as plain data: values round-trip, and a
pickle that would run code (or build anything else) is refused, never run."""

from __future__ import annotations

import collections
import pickle

import pytest
import torch

from parlib.runtime import RankError, launch
from parlib.runtime.replies import NotPlainData, Opaque, plain_dumps, plain_loads

RAN: list[str] = []


def record(text: str) -> None:
    RAN.append(text)


class Exploit:
    """A reply whose unpickling would call ``record`` (as one would call exec, os.system)."""

    def __reduce__(self):
        return (record, ("ran in the reader",))


def plain_values() -> dict:
    return {"numbers": [1, 2.5, True, None, 2**80], "text": ("x", b"y", bytearray(b"z")),
            "sets": ({1, 2}, frozenset({3})), "complex": 1 + 2j, "range": range(2, 9, 3),
            "ordered": collections.OrderedDict(b=1, a=2), "dtype": torch.bfloat16,
            "device": torch.device("cpu"), "size": torch.Size([2, 3]), "opaque": Opaque("Foo"),
            "view": torch.arange(12.0).reshape(3, 4)[:, 1], "empty": torch.empty(0, 3),
            "scalar": torch.tensor(7), "bool": torch.tensor([True, False]),
            "half": torch.ones(3, dtype=torch.bfloat16), "grad": torch.ones(2, requires_grad=True)}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.detach(), b.detach()) and a.requires_grad == b.requires_grad)
    if isinstance(a, Opaque):
        return type(b) is Opaque and a.type_name == b.type_name
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def test_plain_values_round_trip():
    values = plain_values()
    assert same(values, plain_loads(plain_dumps(values)))


@pytest.mark.parametrize(("make", "named"), [
    (lambda: pickle.dumps([1, Exploit()]), "tests.runtime.test_plain_replies"),
    (lambda: pickle.dumps(Exploit(), protocol=0), "tests.runtime.test_plain_replies"),
    (lambda: b"cbuiltins\nexec\n(S'print(1)'\ntR.", "builtins.exec"),
    (lambda: b"cos\nsystem\n(S'true'\ntR.", "os.system"),
    # torch's own tensor pickle reads its storage back with a full unpickle
    (lambda: pickle.dumps(torch.ones(2)), "torch._utils._rebuild_tensor_v2"),
    # BUILD: a tensor's __setstate__ (it sets attributes, backward hooks among them)
    (lambda: plain_dumps(torch.ones(1))[:-1] + pickle.dumps({"x": 1}, protocol=5)[2:-1]
     + pickle.BUILD + pickle.STOP, "sets the state of a Tensor"),
])
def test_a_pickle_that_is_not_plain_data_is_refused_unrun(make, named):
    RAN.clear()
    with pytest.raises(NotPlainData, match=named.replace(".", r"\.")):
        plain_loads(make())
    assert RAN == []


def test_a_value_that_is_not_plain_data_is_named_when_written():
    with pytest.raises(pickle.PicklingError, match="type Exploit is not plain data"):
        plain_dumps({"a": [Exploit()]})
    assert RAN == []


def _exploit_reply() -> Exploit:
    return Exploit()


def test_a_plain_launch_refuses_what_is_not_plain_data_and_another_launch_reads_it():
    with pytest.raises(RankError, match="not plain data") as err:
        launch(_exploit_reply, world_size=1, timeout=60, plain_replies=True)
    assert err.value.exc_type == "PicklingError"  # refused on the rank, saying why
    assert launch(_exploit_reply, world_size=1, timeout=60) == [None]
    assert RAN == ["ran in the reader"]  # the ordinary launch unpickled it: it ran here
    RAN.clear()
    assert same(launch(plain_values, world_size=1, timeout=60, plain_replies=True)[0],
                plain_values())
