"""The grader an instructor can trust: cheats that must not raise a score, answers that lie
about themselves, collectives however they are called, timeout hints that fit.

The batch tests (real kernels) are in test_grade_batch.py."""

from __future__ import annotations

import json
import linecache
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from parlib.course import answers, registry
from parlib.course.check import answer_payload, check, recheck
from parlib.course.questions.ch00 import RING_SOLUTION
from parlib.course.registry import get_question
from tests.helpers.learner_code import learner

pytestmark = pytest.mark.usefixtures("clean_checks")

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- answers that lie


def _answer_up_the_stack(kind: type, skip: int) -> object:
    """The ``answer`` of the first question object (a frame's ``self``) up the stack whose
    answer is a ``kind``, starting ``skip`` frames above the helper's caller; else None."""
    frame = sys._getframe(skip + 2)
    while frame is not None:
        q = frame.f_locals.get("self")
        if hasattr(q, "answer") and isinstance(q.answer, kind):
            return q.answer
        frame = frame.f_back
    return None


class FrameReadingFloat(float):
    """Its __float__ reads the expected answer from whichever check frame converts it."""

    def __float__(self):
        answer = _answer_up_the_stack(float, skip=0)
        return 0.0 if answer is None else answer

    def __eq__(self, other):
        return True

    __hash__ = float.__hash__


class FrameReadingStr(str):
    """Its methods return the expected answer read from the checker's frame."""

    def _expected(self):
        answer = _answer_up_the_stack(str, skip=1)
        return str(self) if answer is None else answer

    def strip(self, *args):
        return FrameReadingStr(self._expected())

    def upper(self):
        return self._expected()

    def replace(self, *args):
        return self._expected()


def test_float_subclass_cannot_read_the_answer():
    for qid in ("00.ring_bytes", "00.p2p_time", "00.all_gather_mib"):
        r = check(qid, FrameReadingFloat(1.0))
        assert not r.passed, (qid, r)
        assert recheck(get_question(qid), answer_payload(get_question(qid),
                                                         FrameReadingFloat(1.0))).score == 0


def test_str_subclass_cannot_read_the_answer():
    r = check("00.dp_collective", FrameReadingStr("Z"))
    assert r.status == "failed", r
    r = check("00.ring_formula", FrameReadingStr("N"))
    assert r.status == "failed", r
    assert check("00.dp_collective", "B").passed  # plain answers still work


def test_plain_values_are_built_in_types():
    p = answers.to_plain(FrameReadingFloat(2.5))
    assert type(p) is float and p == 2.5
    s = answers.to_plain(FrameReadingStr("abc"))
    assert type(s) is str and s == "abc"
    t = answers.from_plain(answers.to_plain(torch.tensor(3.0)))
    assert type(t) is torch.Tensor and t.item() == 3.0
    assert answers.from_plain({"__kind__": "tensor", "shape": "x"}).type_name == "object"
    assert answers.from_plain({"__kind__": "object", "type": "Foo"}).type_name == "Foo"


class AlwaysClose(torch.Tensor):
    """A tensor subclass that answers 'yes' to every comparison."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.allclose, torch.equal):
            return True
        if func is torch.isclose:
            return torch.ones(args[0].shape, dtype=torch.bool)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensor_subclass_whose_allclose_says_yes_fails():
    f = learner("def f(t):\n    return AlwaysClose(t.clone())\n", "f")
    f.__globals__["AlwaysClose"] = AlwaysClose
    r = check("00.ring_all_reduce", f)
    assert r.status == "failed", r
    assert "2 ranks" in r.message


# --------------------------------------------------------------------------- collectives


@pytest.mark.parametrize("call", [
    "dist.all_reduce(out)",
    "torch.distributed.distributed_c10d.all_reduce(out)",
    "dist.group.WORLD.allreduce([out]).wait()",
])
def test_ring_rejects_a_collective_in_place_of_the_ring(call):
    f = learner(f"def f(t):\n    out = t.clone()\n    {call}\n    return out\n", "f")
    r = check("00.ring_all_reduce", f)
    assert r.status == "failed", r
    assert "all_reduce" in r.message and "send" in r.message, r


def test_ring_rejects_the_sum_without_messages():
    # every rank can compute every rank's input (the course ships the grader's seeds): the
    # right numbers without a single send/recv must still fail
    f = learner("""
        def f(t):
            from parlib.course.questions.ch00 import _case_input, _lengths
            world = dist.get_world_size()
            case = _lengths(world).index(t.numel())
            return sum(_case_input(world, case, r, t.numel()) for r in range(world))
        """, "f")
    r = check("00.ring_all_reduce", f)
    assert r.status == "failed", r
    assert "sent or received nothing" in r.message, r


def test_zero1_sees_the_c10d_all_reduce():
    src = """
    def zero1_step(params, shard, optimizer):
        N = dist.get_world_size()
        S = shard.numel()
        flat_grad = torch.zeros(N * S)
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        flat_grad[: grads.numel()] = grads
        torch.distributed.distributed_c10d.all_reduce(flat_grad)
        rank = dist.get_rank()
        shard.grad = flat_grad[rank * S:(rank + 1) * S] / N
        optimizer.step()
        flat = torch.empty(N * S)
        dp.all_gather(flat, shard.detach())
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
    """
    f = learner(src, "zero1_step", prelude="from parlib.strategies import data as dp\n")
    r = check("01.zero1_step", f, timeout=120)
    assert r.status == "failed", r
    assert "all_reduce" in r.message, r


# --------------------------------------------------------------------------- timeout hints


def test_timeout_hint_fits_the_question():
    import parlib
    from parlib.course.question_types import Implementation, current_timeout

    def grader(fn):
        parlib.launch(fn, world_size=2, timeout=current_timeout())

    register_hang = Implementation("99.hang", grader, prompt="p", working="w")
    registry.register(register_hang)
    f = learner("""
        def average(t=None):
            if dist.get_rank() == 0:
                return  # rank 0 skips the collective: the other waits forever
            dist.all_reduce(torch.ones(1))
        """, "average")
    try:
        r = check("99.hang", f, timeout=4)
    finally:
        registry._REGISTRY.pop("99.hang", None)
    assert r.status == "failed", r
    assert "same collectives in the same order" in r.message, r
    assert "recv" not in r.message, r
    assert "send" in get_question("00.ring_all_reduce").timeout_hint


# --------------------------------------------------------------------------- re-check


def notebook_cells(*cells: str) -> dict:
    """Run cells the way a kernel does: one namespace named __main__, each cell's source
    in linecache under its own file name (so inspect.getsource finds it)."""
    ns = {"__name__": "__main__"}
    for i, src in enumerate(cells):
        src = textwrap.dedent(src)
        filename = f"/tmp/ipykernel_parlib_test/{i}.py"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        exec(compile(src, filename, "exec"), ns)  # noqa: S102
    return ns


def test_function_travels_as_source_with_what_it_uses():
    ns = notebook_cells(
        "import torch\nimport math as m\nfrom parlib.verify import close\nSCALE = 2.0\n",
        "big = torch.ones(3)\n\ndef helper_scale(t):\n    return t * SCALE * m.sqrt(1)\n",
        """
        def doubled(t: torch.Tensor) -> torch.Tensor:
            assert close(t, t)
            return helper_scale(t)

        def uses_big(t):
            return t + big
        """,
    )
    payload = answers.capture_function(ns["doubled"])
    assert payload["name"] == "doubled" and not payload.get("error")
    code = payload["code"]
    assert "import torch as torch" in code and "import math as m" in code
    assert "from parlib.verify import close as close" in code and "SCALE = 2.0" in code
    assert code.index("def helper_scale") < code.index("def doubled")
    rebuilt = answers.from_plain(json.loads(json.dumps(payload)))
    assert isinstance(rebuilt, answers.LearnerFunction) and rebuilt._fn is None
    assert torch.equal(rebuilt(torch.ones(2)), torch.full((2,), 2.0))
    # a tensor from another cell cannot travel: the grader's message names it
    payload = answers.capture_function(ns["uses_big"])
    assert payload["missing"] == {"big": "Tensor"}
    with pytest.raises(NameError):
        answers.from_plain(payload)(torch.ones(3))
    assert answers.capture_function(lambda t: t)["error"]
    assert answers.capture_function(print)["error"]


def test_recheck_ignores_the_logged_verdict_and_clamps():
    q = get_question("00.ring_bytes")
    assert recheck(q, 6 * 2**20).score == q.points
    assert recheck(q, 1.0).score == 0
    assert recheck(q, {"__kind__": "nonsense"}).status == "failed"
    assert recheck(q, [1, 2, 3]).status == "failed"


def test_recheck_uses_the_registry_of_the_grader(monkeypatch):
    q = get_question("00.p2p_time")
    monkeypatch.setattr(type(q), "grade", lambda self, answer: "correct")
    assert check("00.p2p_time", 5.0).passed  # the notebook's own process is fooled...
    monkeypatch.undo()
    assert recheck(get_question("00.p2p_time"), 5.0).score == 0  # ...the grader is not


def test_grader_rebuilds_the_ring_from_its_source():
    src = RING_SOLUTION.replace("def ring_all_reduce", "def my_ring")
    payload = {"__kind__": "function", "name": "my_ring", "missing": {},
               "code": "import torch as torch\nimport torch.distributed as dist\n" + src}
    r = recheck(get_question("00.ring_all_reduce"), payload)
    assert r.passed, r
    stub = {**payload, "code": "def my_ring(t):\n    ...\n"}
    assert recheck(get_question("00.ring_all_reduce"), stub).status == "not attempted"


def test_readme_says_what_the_grader_protects_against():
    text = (ROOT / "README.md").read_text()
    section = text.split("## For instructors", 1)[1].split("\n## ", 1)[0]
    assert "does not protect" in section and "re-check" in section
    assert "docker run" in section and "--network none" in section


def test_registry_is_untouched():
    assert "99.num" not in registry.questions()


def _solution_function(qid: str):
    """The function a solutions notebook passes to parlib.check(qid, ...), defined as its
    kernel would: the notebook's first (import) cell, then the cell with its def."""
    import re

    chapter = qid.split(".")[0]
    path = next((ROOT / "solutions").glob(f"{chapter}_*.ipynb"))
    cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]
             if c["cell_type"] == "code"]
    call = next(c for c in cells if f'parlib.check("{qid}",' in c)
    name = re.search(rf'parlib\.check\("{re.escape(qid)}",\s*(\w+)\)', call).group(1)
    defining = next(c for c in cells if f"def {name}(" in c)
    return notebook_cells(cells[0], defining)[name]


@pytest.mark.slow
@pytest.mark.parametrize("qid", [q for q, v in registry.questions().items()
                                 if v.kind == "function"])
def test_solution_functions_pass_when_rebuilt_from_source(qid):
    payload = answer_payload(get_question(qid), _solution_function(qid))
    assert not payload.get("error") and not payload["missing"], payload
    r = recheck(get_question(qid), json.loads(json.dumps(payload)), timeout=120)
    assert r.passed, r


# --------------------------------------------------------------------------- rank replies

# A function answer that, on its rank, makes what the rank sends back a pickle that runs code
# where it is read: its result pickler swapped ("result"), or a message of its own on the
# rank's reply channel ("channel"). Read by cloudpickle/pickle in the grader, it ran there.
REPLY_ATTACK = '''
def my_ring(t):
    import pickle, sys
    import cloudpickle
    import parlib.runtime.worker as worker

    class Exploit:
        def __reduce__(self):
            return (exec, ("open(%(path)r, 'w').write('ran in the grader')",))

    if %(how)r == "result":
        worker._dump_result = lambda *args: pickle.dumps(Exploit())
        cloudpickle.dumps = lambda *args, **kwargs: pickle.dumps(Exploit())
    else:
        frame = sys._getframe()
        while "ctrl" not in frame.f_locals:
            frame = frame.f_back
        frame.f_locals["ctrl"].send(Exploit())
    return t.clone()
'''


@pytest.mark.parametrize("how", ["result", "channel"])
def test_a_rank_reply_never_runs_code_in_the_grader(tmp_path, how):
    planted = tmp_path / "pwned"
    payload = {"__kind__": "function", "name": "my_ring", "missing": {},
               "code": REPLY_ATTACK % {"path": str(planted), "how": how}}
    r = recheck(get_question("00.ring_all_reduce"), payload, timeout=60)
    assert not planted.exists(), "a rank's reply ran code in the grader's process"
    assert r.status == "failed" and r.score == 0, r
    assert "not plain data" in r.message and "builtins.exec" in r.message, r.message
