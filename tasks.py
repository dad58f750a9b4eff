#!/usr/bin/env python3
"""Set up and run the course with nothing but Python 3.10+ installed.

    python3 tasks.py course    # make .venv, install everything, open JupyterLab on notebooks/
    python3 tasks.py test      # make .venv, install everything, run the whole test suite
    python3 tasks.py ui        # only the browser test of JupyterLab (tests/ui; needs Chromium)

Options (environment variables):
    PARLIB_VENV=path        where the virtual environment lives (default: .venv here)
    PARLIB_TORCH_INDEX=url  a pip index for torch, e.g. https://download.pytorch.org/whl/cpu
                            for a small CPU-only build on a Linux machine without a GPU
    PARLIB_TORCH=spec       the torch requirement to install first (default: torch==2.13.0)
    PARLIB_CHROMIUM=path    the Chromium the browser test drives (default: /usr/bin/chromium)
    CI=true                 a missing Chromium fails the browser test instead of skipping it
    PARLIB_CACHE_DIR=path   where a test run keeps the launching chapter's link fit (default:
    out/cache,
                            so the tests never replace the fit saved in ~/.cache/parlib)
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
    env.pop("PARLIB_CHECK_MODE",
    None)
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


def test(py: Path) -> int:
    """The whole suite: drift check, lint, unit and fault tests, every notebook under nbval
    (solutions strict, exercises expect-fail), then proof that every question reported."""
    log_dir = ROOT / "out"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir()
    nbval = [py, "-m", "pytest", "-p", "no:cacheprovider", "--nbval-lax",
             "--nbval-current-env", "--nbval-cell-timeout=300",
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
    results = run_steps(steps)
    print("\n=== summary")
    for title, code, secs in results:
        print(f"{'ok  ' if code == 0 else 'FAIL'} {secs:6.0f} s  {title}")
    for title, reason in skipped:
        print(f"SKIP          {title}: {reason}")
    failed = [r for r in results if r[1] != 0]
    passed = len(results) - len(failed)
    print(f"steps: {passed} passed, {len(steps) - passed} failed, {len(skipped)} skipped")
    return 1 if failed or len(results) < len(steps) else 0


def run_steps(steps: list[tuple[str, list[str | Path], dict[str, str]]]) -> list[tuple]:
    results = []
    for title, cmd, extra in steps:
        print(f"\n=== {title}", flush=True)
        start = time.time()
        code = run(*cmd, env=test_env(**extra), check=False)
        results.append((title, code, time.time() - start))
        if code != 0:
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


def course(py: Path) -> int:
    args = [py, "-m", "jupyter", "lab", "--notebook-dir", str(ROOT)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers often run as root
        args.append("--allow-root")
    target = "notebooks/00_launching_ranks.ipynb"
    return subprocess.call([str(a) for a in args] + ([f"--LabApp.default_url=/lab/tree/{target}"]
                                                     if (ROOT / target).exists() else []))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("course", "test", "ui", "setup"):
        print(__doc__)
        return 2
    py = setup()
    if argv[0] == "test":
        return test(py)
    if argv[0] == "course":
        return course(py)
    if argv[0] == "ui":
        return ui(py)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
