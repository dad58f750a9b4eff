"""``%load_ext parlib``: the ``%%ranks`` cell magic and the ``%ranks`` line magic.

    %%ranks 4                 run this cell on every rank of a 4-rank cluster
    %%ranks --rank 0          run it on rank 0 only (the others skip it)
    %%ranks -o total          bring `total` back: a list, one value per rank
    %ranks start 4 | status | stop | restart

Variables a cell defines stay on each rank for the next ``%%ranks`` cell, also after an
exception in a cell or an interrupt; they are lost only when a rank process died or ranks
were left waiting in a collective (the error says so, and the cluster restarts). A cell
whose last line is an expression returns that expression's value from every rank it ran on.
"""

from __future__ import annotations

import argparse
import itertools
import linecache
import shlex
import sys
from typing import Any

from parlib.runtime.cluster import Cluster

_cluster: Cluster | None = None
_cell_counter = itertools.count(1)


def current_cluster() -> Cluster | None:
    """The cluster ``%%ranks`` uses (None before the first ``%%ranks`` or ``%ranks start``)."""
    return _cluster


def _ensure(world_size: int | None) -> Cluster:
    global _cluster
    if _cluster is not None and _cluster.state != "closed":
        if world_size is None or world_size == _cluster.world_size:
            return _cluster
        print(f"parlib: resizing the cluster from {_cluster.world_size} to {world_size} ranks")
        _cluster.close()
    _cluster = Cluster(world_size or 4)
    return _cluster


def _run_cell_on(ranks: tuple[int, ...] | None, source: str, filename: str,
                 outputs: tuple[str, ...]) -> Any:
    """Runs on a rank: execute the cell if this rank is selected."""
    import torch.distributed as dist

    from parlib.runtime.worker import exec_cell

    if ranks is not None and dist.get_rank() not in ranks:
        return None
    return exec_cell(source, filename, outputs)


def _running_cell_number(shell: Any) -> int:
    """The In[n] of the cell running this magic: the number IPython gave the file of the
    frame that called it (``execution_count`` may already point at the next cell)."""
    known = getattr(shell.compile, "_filename_map", {})
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename in known:
            return known[frame.f_code.co_filename]
        frame = frame.f_back
    return shell.execution_count


def _cell_file(line: str, cell: str) -> tuple[str, str]:
    """A file name for the cell that tracebacks show as IPython does (``Cell In[5]``), and
    the source to run, padded so that its line numbers are the cell's as the page shows
    them (the ``%%ranks`` line is line 1)."""
    text = f"%%ranks {line}".rstrip() + "\n" + cell
    source = "\n" + cell
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None and hasattr(shell, "compile"):
        number = _running_cell_number(shell)
        try:
            name = shell.compile.cache(text, number, raw_code=f"# %%ranks {number}\n{text}")
            return name, source
        except Exception:  # noqa: BLE001 - fall back to a name of our own
            pass
    filename = f"<%%ranks cell {next(_cell_counter)}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    return filename, source


def _parser(cell: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%%ranks" if cell else "%ranks", add_help=False,
                                     exit_on_error=False)
    if cell:
        parser.add_argument("world_size", nargs="?", type=int, default=None)
        parser.add_argument("--rank", "-r", default=None,
                            help="comma-separated ranks to run on (default: all)")
        parser.add_argument("-o", "--output", action="append", default=[],
                            help="a variable to collect from every rank into the notebook")
        parser.add_argument("--timeout", type=float, default=None)
    else:
        parser.add_argument("command", choices=["start", "status", "stop", "restart"])
        parser.add_argument("world_size", nargs="?", type=int, default=None)
    return parser


def ranks_magic(line: str, cell: str | None = None, local_ns: dict | None = None) -> Any:
    """Implementation shared by the line and cell forms (see the module docstring)."""
    global _cluster
    __tracebackhide__ = True
    try:
        opts = _parser(cell is not None).parse_args(shlex.split(line))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"{'%%' if cell is not None else '%'}ranks: {exc}. "
                         f"Usage:\n{__doc__}") from None
    if cell is None:
        if opts.command == "start":
            return _ensure(opts.world_size)
        if opts.command == "status":
            return _cluster if _cluster is not None else "no cluster: use %ranks start N"
        if opts.command == "stop":
            if _cluster is not None:
                _cluster.close()
            _cluster = None
            return None
        cluster = _ensure(opts.world_size)
        return cluster.restart()

    cluster = _ensure(opts.world_size)
    selected = None
    if opts.rank is not None:
        try:
            selected = tuple(int(r) for r in str(opts.rank).split(","))
        except ValueError:
            raise ValueError(f"--rank takes comma-separated integers, got {opts.rank!r}") from None
        bad = [r for r in selected if not 0 <= r < cluster.world_size]
        if bad:
            raise ValueError(f"--rank {bad} is outside 0..{cluster.world_size - 1}")
    filename, source = _cell_file(line, cell)
    outputs = tuple(opts.output)
    results = cluster.run_with_timeout(
        _run_cell_on, (selected, source, filename, outputs), timeout=opts.timeout
    )
    chosen = list(selected) if selected is not None else list(range(cluster.world_size))
    if outputs and local_ns is not None:
        for name in outputs:
            local_ns[name] = [results[r][1][name] for r in chosen]
    values = [results[r][0] for r in chosen]
    if any(v is not None for v in values):
        return values
    return None


def load_ipython_extension(ipython: Any) -> None:
    from parlib.runtime.errors import install_short_tracebacks

    install_short_tracebacks()

    def ranks(line: str, cell: str | None = None) -> Any:
        __tracebackhide__ = True
        return ranks_magic(line, cell, ipython.user_ns)

    ranks.__doc__ = __doc__
    ipython.register_magic_function(ranks, magic_kind="line_cell", magic_name="ranks")


def unload_ipython_extension(ipython: Any) -> None:
    global _cluster
    if _cluster is not None:
        _cluster.close()
        _cluster = None


__all__ = ["current_cluster", "load_ipython_extension", "ranks_magic", "unload_ipython_extension"]
