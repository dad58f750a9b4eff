#!/usr/bin/env python3
"""Set up and run the course with nothing but Python 3.10+ installed.

    python3 tasks.py course    # make .venv, install everything, open JupyterLab on notebooks/
    python3 tasks.py test      # make .venv, install everything, run the whole test suite
    python3 tasks.py test --keep-going   # run every step even after one fails
    python3 tasks.py ui        # only the browser test of JupyterLab (tests/ui; needs Chromium)
    python3 tasks.py setup     # only make .venv and install everything
    python3 tasks.py doctor    # python -m parlib doctor, inside .venv
    python3 tasks.py grade NB [NB ...] [--json FILE]   # python -m parlib grade, inside .venv
    python3 tasks.py build [--check]                   # python -m parlib build, inside .venv

Options (environment variables):
    PARLIB_VENV=path        where the virtual environment lives (default: .venv here)
    PARLIB_TORCH_INDEX=url  a pip index for torch, e.g. https://download.pytorch.org/whl/cpu
                            for a small CPU-only build on a Linux machine without a GPU
    PARLIB_TORCH=spec       the torch requirement to install first (default: torch==2.13.0)
    PARLIB_CHROMIUM=path    the Chromium the browser test drives (default: /usr/bin/chromium)
    CI=true                 a missing Chromium fails the browser test instead of skipping it
    PARLIB_CACHE_DIR=path   where a test run keeps the launching chapter's link fit (default:
                            out/cache, so the tests never replace the fit in ~/.cache/parlib)
Only the standard library is used here, so this runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
import venv
import webbrowser
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("PARLIB_VENV", ROOT / ".venv"))
TORCH = os.environ.get("PARLIB_TORCH", "torch==2.13.0")


def venv_python() -> Path:
    sub = "Scripts/python.exe" if os.name == "nt" else "bin/python"
    return VENV / sub


def run(*cmd: str | Path, env: dict[str, str] | None = None, check: bool = True) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, check=check).returncode


def install_step(what: str, expect: str, *cmd: str | Path) -> None:
    """One install step, said before it starts (with how long it usually takes) and timed
    after: pip's own lines (one per package it collects) show it is moving."""
    print(f"\n--- {what} (usually {expect})", flush=True)
    start = time.time()
    run(*cmd)
    print(f"--- done in {time.time() - start:.0f} s", flush=True)


def setup() -> Path:
    """Create the venv and install torch first (the CPU build where there is no GPU), then
    parlib with its dev extra. Skipped when pyproject.toml has not changed since last time."""
    py = venv_python()
    if not py.exists():
        print(f"creating a virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp = VENV / ".parlib-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH.encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == want:
        return py
    print("installing the course's packages; later runs skip this until pyproject.toml "
          "changes", flush=True)
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check"]
    has_torch = subprocess.run([str(py), "-c", "import torch"], capture_output=True).returncode == 0
    if not has_torch:
        # Torch first and pinned: a bare 'torch' requirement would pull a multi-GB CUDA build.
        index = os.environ.get("PARLIB_TORCH_INDEX")
        install_step(f"step 1 of 2: {TORCH}, the largest download (200 MB for the CPU build, "
                     "several GB with CUDA)", "1-2 minutes; longer on a slow connection",
                     *pip, TORCH, *(["--index-url", index] if index else []))
    install_step("step 2 of 2: parlib and its dev extra (JupyterLab, pytest, nbval, ruff, "
                 "playwright, ...)", "about a minute", *pip, "-e", ".[dev]")
    stamp.write_text(want)
    return py


def test_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("MPLBACKEND", "Agg")
    env.setdefault("TQDM_DISABLE", "1")  # progress bars would make nbval outputs noisy
    env.pop("PARLIB_CHECK_MODE", None)
    # The notebooks save the launching chapter's link fit; a test run keeps its own (out/cache,
    # wiped with out/ at the start) instead of replacing the one a learner measured.
    env.setdefault("PARLIB_CACHE_DIR", str(ROOT / "out" / "cache"))
    env.update(extra)
    return env


def ui_skip_reason(py: Path) -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    code = ("import sys; sys.path.insert(0, 'tests/ui'); from jlab import find_chromium; "
            "import playwright; print(find_chromium() or '')")
    probe = subprocess.run([str(py), "-c", code], cwd=ROOT, capture_output=True, text=True)
    if probe.returncode != 0:
        return "the playwright package is not importable: " + probe.stderr.strip()[-200:]
    if not probe.stdout.strip():
        return ("no Chromium found (install the distribution's package, e.g. "
                "`apt-get install chromium`, or set PARLIB_CHROMIUM)")
    return None


def ui_step(py: Path) -> tuple[str, list[str | Path], dict[str, str]] | str:
    """The browser step, or the reason it is skipped (a failure in CI, where it must run)."""
    reason = ui_skip_reason(py)
    if reason and not os.environ.get("CI"):
        return reason
    cmd: list[str | Path] = [py, "-m", "pytest", "-p", "no:cacheprovider", "-m", "ui", "-v",
                             "tests/ui"]
    if reason:  # CI: pytest itself fails with the reason
        print(f"browser test cannot run: {reason}", flush=True)
    return ("JupyterLab in Chromium: what a learner sees (tests/ui)", cmd, {})


def test(py: Path, keep_going: bool = False) -> int:
    """The whole suite: drift check, lint, unit and fault tests, every notebook under nbval
    (solutions strict, exercises expect-fail), then proof that every question reported.
    Stops at the first failing step unless ``keep_going``."""
    log_dir = ROOT / "out"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir()
    # tests.nbval_kernels: a kernel that dies while starting (a loaded machine) is started
    # again instead of failing every cell of its notebook
    nbval = [py, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.nbval_kernels",
             "--nbval-lax", "--nbval-current-env", "--nbval-cell-timeout=300",
             "--nbval-kernel-startup-timeout=180",
             "--nbval-sanitize-with", "tests/nbval_sanitize.cfg"]
    steps = [
        ("exercises and solutions match authoring/", [py, "-m", "parlib", "build", "--check"], {}),
        ("lint", [py, "-m", "ruff", "check", "parlib", "tests", "bench", "tasks.py"], {}),
        ("unit, fault and mutant tests", [py, "-m", "pytest", "-p", "no:cacheprovider", "tests"],
         {}),
        ("lesson notebooks", [*nbval, "notebooks"], {}),
        ("solutions, strict: every check must pass", [*nbval, "solutions"],
         {"PARLIB_CHECK_MODE": "strict", "PARLIB_CHECK_LOG": str(log_dir / "solutions.jsonl")}),
        ("exercises, expect-fail: no check may pass", [*nbval, "exercises"],
         {"PARLIB_CHECK_MODE": "expect-fail",
          "PARLIB_CHECK_LOG": str(log_dir / "exercises.jsonl")}),
        ("every declared question reported in both runs",
         [py, "-m", "parlib.course.grading", "--verify-logs", str(log_dir / "solutions.jsonl"),
          str(log_dir / "exercises.jsonl")], {}),
    ]
    ui = ui_step(py)
    skipped = []
    if isinstance(ui, str):
        skipped.append(("JupyterLab in Chromium (tests/ui)", ui))
    else:
        steps.append(ui)
    start = time.time()
    results = run_steps(steps, keep_going)
    print(summary(results, steps, skipped, time.time() - start))
    return 0 if len(results) == len(steps) and all(r[1] == 0 for r in results) else 1


def summary(results: list[tuple], steps: list[tuple], skipped: list[tuple[str, str]],
            seconds: float) -> str:
    """A line per step: ok, FAIL, not run (after a failure) or SKIP, and the counts."""
    lines = ["\n=== summary"]
    for title, code, secs in results:
        lines.append(f"{'ok  ' if code == 0 else 'FAIL'} {secs:6.0f} s  {title}")
    not_run = [step[0] for step in steps[len(results):]]
    lines += [f"not run         {title} (an earlier step failed; --keep-going runs it)"
              for title in not_run]
    lines += [f"SKIP            {title}: {reason}" for title, reason in skipped]
    failed = sum(1 for r in results if r[1] != 0)
    lines.append(f"steps: {len(results) - failed} passed, {failed} failed, {len(not_run)} not "
                 f"run, {len(skipped)} skipped, in {seconds / 60:.1f} min")
    return "\n".join(lines)


def run_steps(steps: list[tuple[str, list[str | Path], dict[str, str]]],
              keep_going: bool = False) -> list[tuple]:
    """Run the steps in order, up to the first that fails (all of them with keep_going)."""
    results = []
    for title, cmd, extra in steps:
        print(f"\n=== {title}", flush=True)
        start = time.time()
        code = run(*cmd, env=test_env(**extra), check=False)
        results.append((title, code, time.time() - start))
        if code != 0 and not keep_going:
            break
    return results


def ui(py: Path) -> int:
    """Only the browser test (what `test` runs last)."""
    step = ui_step(py)
    if isinstance(step, str):
        print(f"browser test skipped: {step}")
        return 0
    (ROOT / "out").mkdir(exist_ok=True)
    return run_steps([step])[0][1]


def has_browser() -> bool:
    """Can JupyterLab open a browser here? (Not on a server or in a container.)"""
    try:
        webbrowser.get()
        return True
    except webbrowser.Error:
        return False


def course(py: Path) -> int:
    # Warnings and the one address to open, not the server's start-up log (which repeats
    # the address with its token).
    args = [py, "-m", "jupyter", "lab", "--notebook-dir", str(ROOT), "--ServerApp.ip=127.0.0.1",
            "--ServerApp.log_level=WARN", "--LabApp.log_level=WARN"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers often run as root
        args.append("--allow-root")
    if not has_browser():
        print("no web browser here: open the address below in one (on another machine, "
              "forward the port first, e.g. ssh -L 8888:127.0.0.1:8888)", flush=True)
        args.append("--no-browser")
    target = "notebooks/00_launching_ranks.ipynb"
    return subprocess.call([str(a) for a in args] + ([f"--LabApp.default_url=/lab/tree/{target}"]
                                                     if (ROOT / target).exists() else []))


PARLIB_COMMANDS = ("doctor", "grade", "build")  # python -m parlib's, run inside .venv


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    known = command in PARLIB_COMMANDS or (
        command in ("course", "ui", "setup") and not rest) or (
        command == "test" and rest in ([], ["--keep-going"]))
    if not known:
        print(__doc__)
        return 2
    py = setup()
    if command in PARLIB_COMMANDS:
        return subprocess.call([str(py), "-m", "parlib", command, *rest])
    if command == "test":
        return test(py, keep_going=bool(rest))
    if command == "course":
        return course(py)
    if command == "ui":
        return ui(py)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
