"""Without the sandbox, the batch grader kills what a notebook left running: pass after pass
until none is left, a process that forks in a loop included; the caller's own are spared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parlib.course import sandbox

ROOT = Path(__file__).resolve().parents[2]

# Runs in its own process: a subreaper (as the batch grader is without the sandbox), so
# the pytest process is not made one.
LEFTOVERS = textwrap.dedent('''
    import json, os, signal, subprocess, time
    from parlib.course.sandbox import become_subreaper, kill_descendants

    def fork_loop(seconds, own_session, pause):
        """Fork and exit, over and over, each generation ``pause`` s old when it forks;
        it ends by itself after ``seconds`` so that nothing lingers if the test fails."""
        if own_session:
            os.setsid()
        else:  # a group of its own in our session: its group is not to be signalled
            os.setpgid(0, 0)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(pause)
            if os.fork():
                os._exit(0)
        os._exit(0)

    assert become_subreaper()
    spared = subprocess.Popen(["sleep", "30"], start_new_session=True)
    leader = os.fork()
    if leader == 0:
        fork_loop(20, OWN_SESSION, PAUSE)
    time.sleep(0.5)  # well under way: its generations come back to us as they exit
    kill_descendants({spared.pid})
    time.sleep(0.2)
    while True:  # collect our exited children, so that only a live process keeps the group
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    try:
        os.killpg(leader, 0)
        survived = True
    except ProcessLookupError:
        survived = False
    print(json.dumps({"survived": survived, "spared": spared.poll() is None}))
    for stop in (lambda: os.killpg(leader, signal.SIGKILL), spared.kill):
        try:
            stop()
        except OSError:
            pass
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux subreaper")
@pytest.mark.parametrize(("own_session", "pause"), [
    (True, 0.0),  # as fast as it can, in a session of its own as a notebook's kernel is
    # in our session (pids only), each generation living 2 ms: one pass misses it, the
    # next ones catch it
    (False, 0.002),
])
def test_a_process_forking_in_a_loop_is_killed_and_the_spared_one_is_not(own_session, pause):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = f"OWN_SESSION, PAUSE = {own_session!r}, {pause!r}\n" + LEFTOVERS
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"survived": False, "spared": True}, out.stderr


def test_what_survives_is_named(monkeypatch, capsys):
    ours = sandbox.descendants()
    monkeypatch.setattr(sandbox, "_kill", lambda pids, groups: None)  # a process we cannot kill
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        sandbox.kill_descendants(ours, passes=3, within=1.0)
        err = capsys.readouterr().err
        assert "survived 3 kill passes" in err and str(sleeper.pid) in err, err
    finally:
        sleeper.kill()
        sleeper.wait()
