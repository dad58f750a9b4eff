"""Rank functions imported by module (not defined in a cell) for the launcher tests."""

import os
import signal
import time

import torch
import torch.distributed as dist

import parlib


def rank_sum(scale=1.0):
    t = torch.tensor([float(dist.get_rank())]) * scale
    dist.all_reduce(t)
    return t.item()


def torchrun_entry(scale="1"):
    value = rank_sum(float(scale))
    return {"rank": dist.get_rank(), "sum": value, "device": str(parlib.device())}


def fail_on(rank):
    if dist.get_rank() == rank:
        raise ValueError(f"bad value on rank {rank}")
    t = torch.ones(1)
    dist.all_reduce(t)  # the others wait here for the failed rank
    return t.item()


def fail_everywhere():
    raise KeyError(f"rank {dist.get_rank()} broke")


def exit_on(rank, code=3):
    if dist.get_rank() == rank:
        os._exit(code)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def kill_on(rank):
    if dist.get_rank() == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def skip_collective(rank):
    """Every rank but ``rank`` enters an all-reduce: they wait for it forever."""
    if dist.get_rank() != rank:
        t = torch.ones(1)
        dist.all_reduce(t)
    return dist.get_rank()


def sleep_on(rank, seconds):
    """Rank ``rank`` sleeps (no CPU, no collective) while the others return at once."""
    if dist.get_rank() == rank:
        time.sleep(seconds)
    return dist.get_rank()


def spin_forever():
    x = 0
    while True:
        x += 1


def unpicklable():
    return (i for i in range(3))  # a generator cannot be pickled


def shout(n_bytes):
    line = "x" * 99
    if dist.get_rank() == 0:
        for _ in range(n_bytes // 100):
            print(line)
    return dist.get_rank()


def sleep_then(seconds):
    time.sleep(seconds)
    return os.getpid()


def report_pid_and_sleep(path, seconds):
    with open(path, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    time.sleep(seconds)


def listening_sockets():
    """This process's listening TCP sockets, as (address hex, port) from /proc/net/tcp*."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            next(fh)
            for row in fh:
                cols = row.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in inodes:  # 0A = LISTEN
                    addr, port = local.split(":")
                    found.append((addr, int(port, 16)))
    t = torch.ones(1)
    dist.all_reduce(t)  # make sure the group's sockets are all up
    return found


def fail_alone(rank):
    """``rank`` raises; the others return at once (no collective: the group stays sound)."""
    if dist.get_rank() == rank:
        raise ZeroDivisionError(f"rank {rank} divided by zero")
    return dist.get_rank()


def _refuse_to_load():
    raise RuntimeError("this object refuses to be unpickled")


class UnloadableResult:
    """Pickles on the rank, fails to unpickle in the notebook."""

    def __reduce__(self):
        return (_refuse_to_load, ())


def unloadable_result():
    return UnloadableResult()


class BadStr(Exception):
    def __str__(self):
        raise TypeError("no str for you")


def raise_bad_str():
    raise BadStr("original message")


def partial_then_progress(path):
    """A partial line, then a \\r progress bar, then a whole line, with pauses between."""
    import sys

    print("loading...", end="")  # no newline, no flush
    with open(path, "a") as fh:
        fh.write(f"partial {time.time()}\n")
    time.sleep(1.5)
    for pct in (10, 50):
        sys.stderr.write(f"\r{pct}%|")
        with open(path, "a") as fh:
            fh.write(f"progress{pct} {time.time()}\n")
        time.sleep(1.5)
    print(" done")
    with open(path, "a") as fh:
        fh.write(f"done {time.time()}\n")


def hog_gil_with_child(path):
    """Start a child process, then hold the GIL in C code (catastrophic regex) forever."""
    import re
    import subprocess

    child = subprocess.Popen(["sleep", "300"])
    with open(path, "a") as fh:
        fh.write(f"{os.getpid()} {child.pid}\n")
    re.match(r"(a+)+$", "a" * 64 + "b")


def call_with_rank(step):
    """A self-test: runs the learner's ``step`` (shipped as an argument)."""
    return step(dist.get_rank())


def pipeline_mixed_orders():
    """Two stages whose op lists are each valid but order the microbatches differently:
    rank 0 runs F0 F1 B0 B1, rank 1 F1 F0 B1 B0."""
    from parlib.model import ModelConfig, make_batch
    from parlib.strategies.pipeline import build_stage, run_schedule
    from parlib.strategies.schedules import BACKWARD, FORWARD, Op

    cfg = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
    stage = build_stage(cfg, 0)
    order = [0, 1] if dist.get_rank() == 0 else [1, 0]
    ops = [Op(FORWARD, i) for i in order] + [Op(BACKWARD, i) for i in order]
    tokens, targets = make_batch(8, cfg, 0, 0)
    loss = run_schedule(stage, ops, tokens, targets, 2)
    return loss, stage.grads()


def column_parallel_uneven(gather_output=True):
    """ColumnParallelLinear from uneven weight slices: 8/8/8/6 rows of a 30-row weight."""
    from parlib.strategies.tensor import ColumnParallelLinear

    rows = [8, 8, 8, 6][dist.get_rank()]
    layer = ColumnParallelLinear(torch.ones(rows, 4), None, None, 30, gather_output)
    return layer(torch.ones(2, 4)).shape
