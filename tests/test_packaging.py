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


def test_a_test_run_keeps_its_own_link_fit(monkeypatch):
    """The notebooks save the launching chapter's fit; under `tasks.py test` it goes to out/cache,
    so a
    learner's own saved fit (~/.cache/parlib) is never replaced by one taken under test load."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tasks_under_test", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    monkeypatch.delenv("PARLIB_CACHE_DIR", raising=False)
    assert Path(tasks.test_env()["PARLIB_CACHE_DIR"]) == ROOT / "out" / "cache"
    monkeypatch.setenv("PARLIB_CACHE_DIR", "/somewhere/else")
    assert tasks.test_env()["PARLIB_CACHE_DIR"] == "/somewhere/else"
