"""Define a learner's function the way a notebook cell does, for the check tests."""

import textwrap

import torch


def learner(src: str, name: str, prelude: str = ""):
    """Exec ``src`` in a namespace named __main__ (so cloudpickle ships it by value, as it
    does a cell's function) with torch, torch.distributed as dist and ``prelude`` imported."""
    ns = {"__name__": "__main__", "torch": torch}
    exec("import torch.distributed as dist\n" + prelude + textwrap.dedent(src), ns)  # noqa: S102
    return ns[name]
