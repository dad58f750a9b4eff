"""Fixtures for the browser test: one JupyterLab and one Chromium page for the whole module,
a screenshot in out/ui/ for every failing test."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from .jlab import CHROMIUM_ARGS, ROOT, Lab, find_chromium

OUT = ROOT / "out" / "ui"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"ui_report_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def chromium():
    path = find_chromium()
    if path is None:
        message = ("no Chromium found (install the distribution's `chromium` package or set "
                   "PARLIB_CHROMIUM)")
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run the browser test")
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def lab(tmp_path_factory, chromium):
    """JupyterLab on a free loopback port, serving a temporary copy of the course's notebooks
    (so the test never touches the committed files)."""
    work = tmp_path_factory.mktemp("ui")
    root = work / "course"
    for folder in ("notebooks", "exercises"):
        shutil.copytree(ROOT / folder, root / folder)
    OUT.mkdir(parents=True, exist_ok=True)
    server = Lab(root, work / "home", OUT / "jupyterlab.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def page(lab, chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS,
                                     headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        pg = context.new_page()
        pg.set_default_timeout(60_000)
        pg.goto(f"{lab.url}/lab?token={lab.token}")
        pg.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=90_000)
        pg.evaluate("() => window.jupyterapp.restored")
        yield pg
        browser.close()


@pytest.fixture(autouse=True)
def screenshot_on_failure(request):
    yield
    report = getattr(request.node, "ui_report_call", None)
    if report is None or not report.failed or "page" not in request.fixturenames:
        return
    pg = request.getfixturevalue("page")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    try:
        pg.screenshot(path=str(OUT / f"{name}.png"))
    except Exception as err:  # a dead page must not hide the test's own failure
        print(f"no screenshot for {name}: {err}")
