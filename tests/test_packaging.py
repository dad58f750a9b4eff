"""environment.yml and pyproject.toml must name the same packages, so they cannot drift."""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement):
    return re.split(r"[<>=!~ \[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def pyproject_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])


def environment_requirements():
    """The entries under 'pip:' in environment.yml (a tiny reader: no yaml dependency)."""
    entries, in_pip = set(), False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        stripped = line.split("#", 1)[0].rstrip()
        if stripped.strip() == "- pip:":
            in_pip = True
            continue
        if in_pip and stripped.startswith("      - "):
            entries.add(stripped.strip()[2:].strip())
        elif stripped and not stripped.startswith("      "):
            in_pip = False
    return {e for e in entries if not e.startswith("-e")}


def test_same_packages_and_versions():
    py, env = pyproject_requirements(), environment_requirements()
    assert {_name(r) for r in py} == {_name(r) for r in env}, (
        f"only in pyproject: {sorted({_name(r) for r in py} - {_name(r) for r in env})}; "
        f"only in environment.yml: {sorted({_name(r) for r in env} - {_name(r) for r in py})}"
    )
    assert py == env, f"version bounds differ: {sorted(py ^ env)}"


def test_reader_sees_the_file():
    assert "torch>=2.4" in environment_requirements()
    assert _name("torch>=2.4") == "torch" and _name("pytest-timeout>=2.2") == "pytest-timeout"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 tasks.py test" in readme and "python3 tasks.py test" in ci
    assert "python3 tasks.py course" in readme


def _tasks():
    """tasks.py as a module (it is a script at the root, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tasks_under_test", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    return tasks


def test_a_test_run_keeps_its_own_link_fit(monkeypatch):
    """The notebooks save the launching chapter's fit; under `tasks.py test` it goes to
    out/cache, so a learner's own saved fit (~/.cache/parlib) is never replaced by one taken
    under test load."""
    tasks = _tasks()
    monkeypatch.delenv("PARLIB_CACHE_DIR", raising=False)
    assert Path(tasks.test_env()["PARLIB_CACHE_DIR"]) == ROOT / "out" / "cache"
    monkeypatch.setenv("PARLIB_CACHE_DIR", "/somewhere/else")
    assert tasks.test_env()["PARLIB_CACHE_DIR"] == "/somewhere/else"


def _fake_steps(tasks, monkeypatch, codes):
    ran = []

    def fake_run(*cmd, env=None, check=True):
        ran.append(cmd[0])
        return codes[len(ran) - 1]

    monkeypatch.setattr(tasks, "run", fake_run)
    return [(f"step {i}", [f"cmd{i}"], {}) for i in range(len(codes))], ran


def test_a_failing_step_stops_the_run_and_the_rest_are_not_run_not_failed(monkeypatch):
    tasks = _tasks()
    steps, ran = _fake_steps(tasks, monkeypatch, [0, 1, 0, 0])
    results = tasks.run_steps(steps)
    assert ran == ["cmd0", "cmd1"]
    text = tasks.summary(results, steps, [("browser", "no Chromium")], 90.0)
    assert "steps: 1 passed, 1 failed, 2 not run, 1 skipped, in 1.5 min" in text
    assert "not run         step 2 (an earlier step failed; --keep-going runs it)" in text
    assert "FAIL" in text.splitlines()[3] and "step 1" in text.splitlines()[3]


def test_keep_going_runs_every_step_after_a_failure(monkeypatch):
    tasks = _tasks()
    steps, ran = _fake_steps(tasks, monkeypatch, [0, 1, 0, 1])
    results = tasks.run_steps(steps, keep_going=True)
    assert ran == ["cmd0", "cmd1", "cmd2", "cmd3"]
    assert "steps: 2 passed, 2 failed, 0 not run, 0 skipped" in tasks.summary(
        results, steps, [], 60.0)


def test_every_tasks_command_in_the_readme_is_one_tasks_py_runs(monkeypatch):
    """The README's commands run as written in a new shell, no activated .venv: parlib's
    own commands go through tasks.py, which runs them with the .venv's python."""
    import sys

    tasks = _tasks()
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"python3 tasks\.py ([a-z]+)((?: [^\s`#]+)*)", readme)
    assert {c for c, _ in commands} >= {"course", "test", "doctor", "grade"}, commands
    called = []
    monkeypatch.setattr(tasks, "setup", lambda: Path(sys.executable))
    monkeypatch.setattr(tasks.subprocess, "call", lambda cmd, **kw: called.append(cmd) or 0)
    for name in ("test", "course", "ui"):
        monkeypatch.setattr(tasks, name, lambda *a, **k: 0, raising=False)
    for command, rest in commands:
        assert tasks.main([command, *rest.split()]) == 0, (command, rest)
    assert [sys.executable, "-m", "parlib", "doctor"] in called
    assert not re.search(r"^python -m parlib", readme, re.M), (
        "a bare `python -m parlib` fails in a new shell (no torch outside .venv)")


def test_tasks_refuses_what_it_does_not_know(capsys):
    tasks = _tasks()
    assert tasks.main(["tset"]) == 2 and tasks.main(["test", "--fast"]) == 2
    assert "python3 tasks.py doctor" in capsys.readouterr().out


def test_a_kernel_that_dies_while_starting_is_started_again(capsys):
    from tests import nbval_kernels

    tries = []

    def start(name):
        tries.append(name)
        if len(tries) == 1:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return "kernel"

    saved = nbval_kernels.TRIES, nbval_kernels.PAUSE_S
    nbval_kernels.TRIES, nbval_kernels.PAUSE_S = 2, 0.0
    try:
        assert nbval_kernels.start_with_retries(start, "python3") == "kernel"
        assert tries == ["python3", "python3"]
        assert "starting it again (2 of 2)" in capsys.readouterr().out

        def always_dies(name):
            raise RuntimeError("Kernel died before replying to kernel_info")

        import pytest

        with pytest.raises(RuntimeError, match="Kernel died"):
            nbval_kernels.start_with_retries(always_dies, "python3")
    finally:
        nbval_kernels.TRIES, nbval_kernels.PAUSE_S = saved
