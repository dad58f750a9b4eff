"""An unwritten code answer is "not attempted" at once, from its source, before any rank
starts; an attempted answer that raises NotImplementedError somewhere is not a stub."""

from __future__ import annotations

import linecache
import textwrap
import time

import pytest
import torch

from parlib.course.check import check, recheck
from parlib.course.question_types import is_stub
from parlib.course.registry import get_question
from parlib.runtime.group import RankGroup

pytestmark = pytest.mark.usefixtures("clean_checks")

BUILDER_STUB = '''
def ring_all_reduce(tensor):
    """Sum `tensor` over all ranks."""
    raise NotImplementedError("your code here")
'''
STUBS = {
    "builder": BUILDER_STUB,
    "bare raise": "def ring_all_reduce(tensor):\n    raise NotImplementedError\n",
    "pass": "def ring_all_reduce(tensor):\n    pass\n",
    "ellipsis": "def ring_all_reduce(tensor):\n    ...\n",
}
OPERATOR_STUB = '''
def copy_to_parallel_region(x, group=None):
    """f: identity forward, all-reduce (sum) of the gradient backward."""

    class CopyToParallelRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            raise NotImplementedError("your code here")

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError("your code here")

    return CopyToParallelRegion.apply(x, group)
'''
ATTEMPTED = {
    "raise in a branch": "def ring_all_reduce(tensor):\n    if tensor.numel() == 0:\n"
                         "        raise NotImplementedError('empty')\n"
                         "    return tensor.clone()\n",
    "code then raise": "def ring_all_reduce(tensor):\n    out = tensor.clone()\n"
                       "    raise NotImplementedError('your code here')\n",
    "computed message": "def ring_all_reduce(tensor):\n"
                        "    raise NotImplementedError(f'{tensor.shape}')\n",
    "another exception": "def ring_all_reduce(tensor):\n    raise ValueError('your code')\n",
}
OPERATOR_ATTEMPTS = {
    # the class left as stubs, but an answer written instead of the apply
    "own return": OPERATOR_STUB.replace("CopyToParallelRegion.apply(x, group)", "x.clone()"),
    "forward written": OPERATOR_STUB.replace(
        'def forward(ctx, x, group):\n            raise NotImplementedError("your code here")',
        "def forward(ctx, x, group):\n            return x.view_as(x)"),
}


def cell_function(src: str, name: str):
    """Define ``name`` as a notebook cell does: its source readable by inspect (IPython
    puts each cell's text in linecache under a made-up file name)."""
    src = textwrap.dedent(src)
    filename = f"<cell {name} {abs(hash(src))}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns = {"__name__": "__main__", "torch": torch}
    exec(compile(src, filename, "exec"), ns)  # noqa: S102
    return ns[name]


@pytest.fixture
def launches(monkeypatch):
    """Every rank group started during the test (none should be, for a stub)."""
    started = []
    real = RankGroup.start

    def start(self):
        started.append(self)
        return real(self)

    monkeypatch.setattr(RankGroup, "start", start)
    return started


@pytest.mark.parametrize("kind", sorted(STUBS))
def test_an_unwritten_function_is_not_attempted_at_once_and_silently(kind, launches, capsys):
    fn = cell_function(STUBS[kind], "ring_all_reduce")
    t0 = time.monotonic()
    r = check("00.ring_all_reduce", fn)
    assert r.status == "not attempted", r
    assert time.monotonic() - t0 < 1.0
    assert launches == []
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""  # no launch banner


def test_the_operator_stub_is_not_attempted_without_a_launch(launches):
    fn = cell_function(OPERATOR_STUB, "copy_to_parallel_region")
    assert check("03.f", fn).status == "not attempted"
    assert launches == []


@pytest.mark.parametrize("kind", sorted(STUBS))
def test_the_grader_sees_a_stub_without_a_launch(kind, launches):
    payload = {"__kind__": "function", "name": "ring_all_reduce", "missing": {},
               "code": "import torch as torch\n" + textwrap.dedent(STUBS[kind])}
    assert recheck(get_question("00.ring_all_reduce"), payload).status == "not attempted"
    assert launches == []


@pytest.mark.parametrize("kind", sorted(ATTEMPTED))
def test_an_attempt_that_raises_not_implemented_somewhere_is_not_a_stub(kind):
    assert not is_stub(cell_function(ATTEMPTED[kind], "ring_all_reduce"))


@pytest.mark.parametrize("kind", sorted(OPERATOR_ATTEMPTS))
def test_an_attempted_operator_is_not_a_stub(kind):
    assert not is_stub(cell_function(OPERATOR_ATTEMPTS[kind], "copy_to_parallel_region"))


def test_an_attempt_raising_in_a_branch_is_run_on_ranks(launches):
    fn = cell_function(ATTEMPTED["raise in a branch"], "ring_all_reduce")
    assert check("00.ring_all_reduce", fn).passed is False  # a clone is not the sum
    assert launches, "the attempt was judged without running it"
