"""parlib through a real Jupyter kernel (nbclient): cell-defined functions, output routing,
tracebacks mapped to cells, %%ranks, interrupts and a killed kernel."""

import os
import re
import signal
import threading
import time

import nbformat
import pytest

from parlib.course.nbclient import notebook_client
from tests.helpers.procutil import alive

pytestmark = pytest.mark.slow


def _text(cell):
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append(re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(out.traceback)))
        elif "data" in out:
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


class Kernel:
    """Run cells one at a time in one kernel, the way a learner does."""

    def __init__(self):
        self.nb = nbformat.v4.new_notebook()
        self.client = notebook_client(self.nb, kernel_name="python3", timeout=120,
                                      allow_errors=True)

    def __enter__(self):
        self._ctx = self.client.setup_kernel(cwd=os.path.dirname(__file__))
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    def run(self, source):
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.nb.cells) - 1)
        self.last_count = cell.execution_count
        return _text(cell)


def test_notebook_session():
    with Kernel() as k:
        k.run("import torch, torch.distributed as dist, parlib, os")
        # A function and a class defined in a cell, a result back, output in this cell.
        out = k.run(
            "class Scale:\n    def __init__(self, k): self.k = k\n"
            "def f(s):\n    print('hi from', dist.get_rank())\n    return s.k * dist.get_rank()\n"
            "parlib.launch(f, Scale(3), world_size=2)"
        )
        assert "[rank 0] hi from 0" in out and "[rank 1] hi from 1" in out
        assert "[0, 3]" in out
        # A failing cell-defined function: RankError with the cell's source line.
        out = k.run(
            "def broken():\n    x = 1\n    if dist.get_rank() == 1:\n"
            "        raise ValueError('rank one is unhappy')\n    return x\n"
            "parlib.launch(broken, world_size=2)"
        )
        assert "RankError" in out and "rank 1 failed: ValueError: rank one is unhappy" in out
        assert "raise ValueError('rank one is unhappy')" in out  # source mapped from the cell
        assert f"Cell In[{k.last_count}], line 4, in broken" in out
        # learner's frames first and briefly: no parlib frame on either side
        assert "group.py" not in out and "_collect" not in out and "worker.py" not in out
        before = out.split("rank 1 failed")[0]
        assert f"Cell In[{k.last_count}], line 6" in before and len(before.splitlines()) < 12
        assert "ValueError" in k.run("import sys\nprint(sys.last_value.full_traceback)")

        # %%ranks: state stays on ranks, -o brings values back, output lands in its own cell.
        out = k.run("%load_ext parlib\n%ranks start 2")
        assert "Cluster(world_size=2" in out
        out = k.run("%%ranks\nt = torch.tensor([dist.get_rank() + 1.0])\ndist.all_reduce(t)\n"
                    "print('sum is', t.item())")
        assert "[rank 0] sum is 3.0" in out and "[rank 1] sum is 3.0" in out
        out = k.run("%%ranks -o t\nt * 2")
        assert "[tensor([6.]), tensor([6.])]" in out
        assert "[tensor([3.]), tensor([3.])]" in k.run("t")
        out = k.run("%%ranks --rank 1\nprint('only me', dist.get_rank())")
        assert "[rank 1] only me 1" in out and "[rank 0]" not in out
        out = k.run("%%ranks\nundefined_name + 1")
        # named as the page names the cell, line 2 (the %%ranks line is line 1), briefly
        assert "NameError" in out and "undefined_name + 1" in out
        assert f"Cell In[{k.last_count}], line 2" in out and "%%ranks cell" not in out
        assert "run_cell_magic" not in out and "magic.py" not in out
        assert len(out.split("NameError")[0].splitlines()) < 6, out
        # a plain exception keeps the ranks and their variables
        out = k.run("%%ranks\nprint('back', 't' in dir())")
        assert "rebuilding" not in out and "[rank 0] back True" in out

        # Interrupt while ranks sleep: stopped within a second, in one line plus where each
        # rank was; the ranks and their variables are kept.
        kernel_pid = k.client.km.provisioner.process.pid
        pids = eval(k.run("print(parlib.runtime.magic.current_cluster().pids())"))
        timer = threading.Timer(1.5, os.kill, (kernel_pid, signal.SIGINT))  # the kernel alone
        timer.start()
        start = time.time()
        out = k.run("%%ranks\nimport time\ntime.sleep(60)")
        took = time.time() - start
        assert "interrupted: ranks 0-1 stopped" in out and took < 1.5 + 1.2, \
            f"interrupt took {took:.1f} s"
        assert f"rank 1 was at Cell In[{k.last_count}], line 3" in out
        assert len(out.strip().splitlines()) <= 4 and "selectors" not in out, out
        assert all(alive(p) for p in pids)
        out = k.run("%%ranks\nprint(t.item(), dist.get_world_size())")
        assert "rebuilding" not in out and "[rank 1] 3.0 2" in out

        # Interrupt of a plain launch too, this time to the kernel's process group (Jupyter's
        # interrupt button does this), ranks included.
        timer = threading.Timer(1.5, os.killpg, (os.getpgid(kernel_pid), signal.SIGINT))
        timer.start()
        out = k.run("import time\nparlib.launch(time.sleep, 60, world_size=2)")
        assert "interrupted: ranks 0-1 stopped" in out and len(out.strip().splitlines()) <= 4
        assert "[2, 2]" in k.run("%%ranks\ndist.get_world_size()")

        # A killed kernel leaves no rank alive.
        pids = eval(k.run("print(parlib.runtime.magic.current_cluster().pids())"))
        assert pids and all(alive(p) for p in pids)
        os.kill(kernel_pid, signal.SIGKILL)
        deadline = time.time() + 5
        while any(alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), "ranks outlived their kernel"
