"""A rank dies under ``torchrun --max-restarts``: torchrun starts every rank again, the run
(:mod:`parlib.examples.long_run`, started as the README's cluster section starts a rank
function) resumes from its newest checkpoint and ends bit-exactly where a run that never
failed ends."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import parlib
import parlib.examples.long_run as long_run
from parlib.strategies.checkpoint import checkpoint_path, latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAVE_EVERY, DYING_RANK, DIES_AT = 8, 3, 1, 5  # saves after 3, 6, 8; dies in the 6th
pytestmark = pytest.mark.slow


def torchrun(target: str, *args: object, max_restarts: int = 0) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run ... -m parlib.run target args`` on 2 gloo ranks."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "localhost:0", "-m", "parlib.run", target,
               *map(str, args), "--backend", "gloo"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)


def documented_command(folder: Path) -> list[str]:
    """The torchrun line of long_run's docstring, as written, with ``torchrun`` spelled
    ``python -m torch.distributed.run``, its ``ckpts`` in ``folder`` and gloo (here no rank
    has a GPU of its own)."""
    line = re.search(r"^\s+(torchrun .*?)\n\n", long_run.__doc__, re.S | re.M).group(1)
    words = shlex.split(line.replace("\\\n", " "))
    assert words[0] == "torchrun" and words.count("ckpts") == 1, words
    return [sys.executable, "-m", "torch.distributed.run", *words[1:], "--backend", "gloo"]


def run_as_documented(folder: Path) -> subprocess.CompletedProcess:
    command = [str(folder) if w == "ckpts" else w for w in documented_command(folder)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)


def returned(stdout: str) -> dict[int, dict]:
    """What each rank's function returned, as parlib.run printed it (the two ranks share
    one pipe: a line may end where the other rank's begins)."""
    return {int(rank): ast.literal_eval(value)
            for rank, value in re.findall(r"\[rank (\d)\] returned (\{[^{}]*\})", stdout)}


def saved_tensors(folder: Path, step: int, tmp: Path) -> dict[str, torch.Tensor]:
    """The whole tensors (weights, Adam's state) of the checkpoint after ``step`` steps."""
    out = tmp / f"{folder.name}-{step}.pt"
    dcp_to_torch_save(checkpoint_path(folder, step), out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("restart")
    failing, steady = tmp / "failing", tmp / "steady"
    return {"tmp": tmp, "failing": failing, "steady": steady,
            "failed": torchrun("tests.helpers.long_run_faults:train_dying_once", failing,
                               STEPS, SAVE_EVERY, DYING_RANK, DIES_AT, max_restarts=1),
            "never_failed": run_as_documented(steady)}


def test_a_dead_rank_is_restarted_once_and_the_job_succeeds(runs):
    failed = runs["failed"]
    assert failed.returncode == 0, failed.stderr[-3000:]
    assert f"rank {DYING_RANK} dies as step {DIES_AT} begins" in failed.stdout
    assert failed.stdout.count("dies as step") == 1
    assert returned(failed.stdout) == {r: {"started_at": 6 - SAVE_EVERY, "ended_at": STEPS,
                                           "attempt": 1} for r in range(2)}


def test_the_restart_resumes_from_the_last_checkpoint_losing_only_the_steps_since(runs):
    """Dying as step 5 (0-based) begins, the run had saved after 3 steps: the restart
    resumes there and redoes steps 3 and 4, the work lost."""
    last_saved = DIES_AT // SAVE_EVERY * SAVE_EVERY
    assert f"resuming from {checkpoint_path(runs['failing'], last_saved)} " \
           f"(after {last_saved} steps), attempt 1" in runs["failed"].stdout
    assert returned(runs["failed"].stdout)[0]["started_at"] == last_saved
    assert latest_checkpoint(runs["failing"])[0] == STEPS


def test_the_restarted_run_ends_bit_exactly_where_the_run_that_never_failed_ends(runs):
    """The run that never failed is the docstring's command, as written: it saves every
    2 steps where the failing run saved every 3, and ends on the same bits all the same."""
    words = documented_command(runs["steady"])
    assert words[words.index("ckpts") + 1] == str(STEPS)
    steady = runs["never_failed"]
    assert steady.returncode == 0, steady.stderr[-3000:]
    assert returned(steady.stdout) == {r: {"started_at": 0, "ended_at": STEPS}
                                       for r in range(2)}
    got = saved_tensors(runs["failing"], STEPS, runs["tmp"])
    want = saved_tensors(runs["steady"], STEPS, runs["tmp"])
    assert got.keys() == want.keys()
    assert any(k.startswith("optim.") and k.endswith("exp_avg") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want), \
        [k for k in want if not torch.equal(got[k], want[k])]


def test_the_same_function_runs_from_a_notebook_and_a_second_launch_resumes(tmp_path):
    """The example's docstring: ``parlib.launch(train, "ckpts", world_size=2)``; launched
    again on the finished folder, it starts at the end and trains nothing."""
    folder = str(tmp_path / "ckpts")
    first = parlib.launch(long_run.train, folder, world_size=2, timeout=120)
    again = parlib.launch(long_run.train, folder, world_size=2, timeout=120)
    assert first == [{"started_at": 0, "ended_at": 8}] * 2
    assert again == [{"started_at": 8, "ended_at": 8}] * 2
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == \
        [f"step-0000000{k}" for k in (2, 4, 6, 8)]


@pytest.mark.parametrize("steps, save_every", [(8, 0), (-1, 2)])
def test_bad_step_counts_are_refused_before_any_rank_starts(steps, save_every, tmp_path):
    with pytest.raises(ValueError, match=f"steps={steps}, save_every={save_every}: train 0 "
                                         "or more steps and save every 1 or more"):
        long_run.train(str(tmp_path), str(steps), str(save_every))
