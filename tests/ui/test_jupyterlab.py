"""The learner's view, in a real JupyterLab in a real browser (issue 15).

nbval executes cells but never sees the page. This opens the launching and pipeline chapters and
the launching exercises
in JupyterLab (headless Chromium), runs every cell, and checks what a learner sees: no error
output, `[rank k]` lines streaming while a cell runs, the pipeline chapter's explorer drawn once and
redrawn when a slider moves, notebooks that open unmodified, and, in a scratch notebook, how
errors and interrupts on ranks look and what they leave behind.

Run it alone (needs Chromium: `apt-get install chromium`, and the dev extra):
    .venv/bin/python -m pytest -m ui tests/ui -v
Screenshots of failing checks land in out/ui/.

Checks named "issue 15 item N" test behaviour fixed on other branches (runtime: items 1-3;
ch03fix: item 4). They are written for the target behaviour and are never skipped.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import pytest

from parlib.course import nbform

from .jlab import (
    JS_CELLS,
    JS_CLOSE,
    JS_DIRTY,
    JS_KERNEL_IDLE,
    JS_OPEN,
    JS_RUN_ALL,
    JS_RUN_CELL,
    JS_WATCH_STREAMING,
)

# Run All of one notebook; the three together take about 3 minutes on a quiet 2-core machine.
# Raise it (seconds) on a machine shared with other work.
RUN_ALL_TIMEOUT = float(os.environ.get("PARLIB_UI_RUN_ALL_TIMEOUT", 300))
pytestmark = [pytest.mark.ui, pytest.mark.timeout(RUN_ALL_TIMEOUT + 180)]

CH00 = "notebooks/00_launching_ranks.ipynb"
EX00 = "exercises/00_launching_ranks.ipynb"
CH03 = "notebooks/04_pipeline_parallel.ipynb"
PROBE = "probe.ipynb"
RANK_LINE = re.compile(r"\[rank \d+\]")


@dataclass
class Opened:
    path: str
    widget_id: str
    dirty_on_open: dict
    cells: list = field(default_factory=list)
    streams: dict = field(default_factory=dict)
    seconds: float = 0.0
    unfinished: str = ""  # why Run All did not finish, if it did not


_RESULTS: dict[str, Opened] = {}  # every notebook opened so far, with what was seen
_OPEN: set[str] = set()            # the one notebook open now (the others' kernels are shut)


def _wait(predicate, timeout, what, poll=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def open_notebook(page, path: str) -> Opened:
    """Open `path` (closing, and shutting down the kernels of, any other notebook first), wait
    for its kernel, and note whether JupyterLab considers it modified the first time."""
    if path in _OPEN:
        return _RESULTS[path]
    for other in list(_OPEN):
        page.evaluate(JS_CLOSE, other)
        _OPEN.discard(other)
    widget_id = page.evaluate(JS_OPEN, path)
    _wait(lambda: page.evaluate(JS_KERNEL_IDLE, path), 90, f"the kernel of {path}")
    time.sleep(1.5)  # the kernel's info reply updates the metadata just after it is idle
    _OPEN.add(path)
    if path in _RESULTS:
        _RESULTS[path].widget_id, _RESULTS[path].cells = widget_id, []
    else:
        _RESULTS[path] = Opened(path, widget_id, page.evaluate(JS_DIRTY, path))
    return _RESULTS[path]


def cells(page, path):
    return page.evaluate(JS_CELLS, path)


def busy(cell) -> bool:
    return "*" in cell["prompt"]


def show_cell(page, nb: Opened, index: int) -> None:
    """Scroll a cell into view, so a failure's screenshot shows it."""
    if nb.path in _OPEN:
        page.locator(f"#{nb.widget_id} .jp-Cell").nth(index).scroll_into_view_if_needed()


def ran(page, path: str) -> Opened:
    """What Run All showed in `path` (running it if no test has yet)."""
    nb = _RESULTS.get(path)
    return nb if nb is not None and (nb.cells or nb.unfinished) else run_all(page, path)


def run_all(page, path: str, timeout: float = RUN_ALL_TIMEOUT) -> Opened:
    """Run every cell of `path`, open in the page (once while it stays open)."""
    if path in _OPEN and _RESULTS[path].cells:
        return _RESULTS[path]
    nb = open_notebook(page, path)
    page.evaluate(JS_WATCH_STREAMING, path)
    start = time.monotonic()
    page.evaluate(JS_RUN_ALL, path)
    time.sleep(1.0)

    def finished():
        now = cells(page, path)
        return (not any(busy(c) for c in now if c["type"] == "code")
                and page.evaluate(JS_KERNEL_IDLE, path)) and now

    try:
        _wait(finished, timeout, f"Run All in {path}", poll=0.5)
    except AssertionError as err:  # keep what was shown; no later test runs it again
        nb.unfinished = str(err)
    time.sleep(1.0)  # widgets render after the kernel goes idle
    nb.seconds = time.monotonic() - start
    nb.cells = cells(page, path)
    nb.streams = {int(k): v for k, v in page.evaluate("(p) => window.__streams[p]", path).items()}
    print(f"{path}: Run All took {nb.seconds:.0f} s")
    return nb


def run_cell(page, path: str, index: int, timeout: float = 120):
    page.evaluate(JS_RUN_CELL, [path, index])
    time.sleep(0.3)
    return _wait(lambda: (lambda c: not busy(c) and c)(cells(page, path)[index]), timeout,
                 f"cell {index} of {path}")


# ---- every notebook: opens unmodified, runs clean, streams ------------------------------

NOTEBOOKS = [CH00, EX00, CH03]


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_run_all_shows_no_error(page, path):
    nb = run_all(page, path)
    assert not nb.unfinished, nb.unfinished
    errors = [(c["index"], o["name"], o["text"][-600:]) for c in nb.cells
              for o in c["outputs"] if o["type"] == "error"]
    if errors:
        show_cell(page, nb, errors[0][0])
    assert not errors, f"error output in {path}: {errors[0]}"
    not_run = [c["index"] for c in nb.cells
               if c["type"] == "code" and c["source"].strip() and not re.search(r"\d", c["prompt"])]
    assert not not_run, f"cells {not_run} of {path} never ran"


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_rank_lines_appear_while_the_cell_runs(page, path):
    """A `[rank k]` line must be on the page while its cell is still busy, not only once the
    cell has finished."""
    nb = ran(page, path)
    late = [c["index"] for c in nb.cells
            if RANK_LINE.search(c["shown"]) and not nb.streams.get(c["index"], {}).get("streamed")]
    if late:
        show_cell(page, nb, late[0])
    assert not late, f"{path}: [rank k] lines in cells {late} appeared only after the cell finished"


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_notebook_opens_unmodified(page, path):
    """Issue 15 item 9: a committed notebook not in the form JupyterLab writes is marked
    modified as soon as its kernel answers (python -m parlib.course.nbform fixes it)."""
    nb = _RESULTS[path] if path in _RESULTS else open_notebook(page, path)
    assert nb.dirty_on_open == {"model": False, "tab": False}, (
        f"{path} is marked modified right after opening ({nb.dirty_on_open}); closing it "
        "untouched would ask to save")


JS_OUTPUT_WIDTH = """(path) => {
  const pre = window.__nb[path].content.node.querySelector('.jp-OutputArea-output pre');
  if (!pre) return null;
  const probe = document.createElement('span');
  probe.textContent = 'x'.repeat(100);
  pre.appendChild(probe);
  const charPx = probe.getBoundingClientRect().width / 100;
  probe.remove();
  return {charPx, prePx: pre.getBoundingClientRect().width};
}"""


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_printed_lines_fit_the_output_area(page, path):
    """Printed lines at most LINE_WIDTH characters long, and that many fit the output area: the
    area breaks a longer line anywhere, mid-word included (word-break: break-all)."""
    from parlib.measure.tables import LINE_WIDTH

    nb = ran(page, path)
    size = page.evaluate(JS_OUTPUT_WIDTH, path)
    assert size, f"{path} shows no text output"
    assert size["prePx"] >= LINE_WIDTH * size["charPx"], (
        f"{LINE_WIDTH} characters take {LINE_WIDTH * size['charPx']:.0f} px; the output area of "
        f"{path} is {size['prePx']:.0f} px wide")
    long = [(c["index"], line) for c in nb.cells for o in c["outputs"] if o["type"] == "stream"
            and o["name"] == "stdout" for line in o["text"].split("\n")
            if len(line.split("\r")[-1]) > LINE_WIDTH]
    if long:
        show_cell(page, nb, long[0][0])
    assert not long, f"{path}: printed lines over {LINE_WIDTH} characters: {long[:3]}"


# ---- the pipeline chapter's explorer ------------------------------------------------------------

def _explorer(page):
    nb = run_all(page, CH03)
    index = next(c["index"] for c in nb.cells if "def explore(" in c["source"])
    cell = page.locator(f"#{nb.widget_id} .jp-Cell").nth(index)
    sliders = cell.locator(".widget-slider")
    (sliders.first if sliders.count() else cell).scroll_into_view_if_needed()
    return nb, index, cell


def _figures(cell):
    return cell.locator(".jp-OutputArea img").evaluate_all("els => els.map(e => e.src)")


def test_explorer_draws_its_figure_once(page):
    """Issue 15 item 4 (ch03fix): the figure was drawn twice, once above the sliders (never
    updated) and once below."""
    _nb, _index, cell = _explorer(page)
    assert cell.locator(".widget-slider").count() >= 1, "the explorer shows no slider"
    assert len(_figures(cell)) == 1, f"the explorer shows {len(_figures(cell))} figures"


def test_explorer_redraws_when_a_slider_moves(page):
    _nb, _index, cell = _explorer(page)
    before = _figures(cell)
    assert before, "the explorer shows no figure"
    handle = cell.locator(".widget-slider .noUi-handle").first
    handle.click()
    handle.press("ArrowRight")
    start = time.monotonic()
    after = _wait(lambda: (lambda now: now and now != before and now)(_figures(cell)), 15,
                  "the explorer's figure to change after the slider moved")
    print(f"explorer redrawn {time.monotonic() - start:.2f} s after the slider moved")
    time.sleep(1.0)
    assert len(_figures(cell)) == len(before), (
        f"{len(before)} figure(s) before the slider moved, {len(_figures(cell))} after")
    assert after[-1] != before[-1]


def test_explorer_labels_are_readable(page):
    """Issue 15 item 4 (ch03fix): "microbatches m" was cut to "microbatc..."."""
    _nb, _index, cell = _explorer(page)
    cut = cell.locator(".widget-label").evaluate_all(
        "els => els.filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent)")
    assert not cut, f"slider labels cut at the default width: {cut}"


# ---- a scratch notebook: streaming, errors and interrupts on ranks ------------------------

PROBE_CELLS = [
    "import time\n\nimport torch\nimport torch.distributed as dist\n\nimport parlib\n"
    "%load_ext parlib",
    # 1: streaming from parlib.launch
    "def slow_hello():\n    print('starting', flush=True)\n    time.sleep(3)\n"
    "    print('finishing', flush=True)\n\nparlib.launch(slow_hello, world_size=2)",
    # 2: warm ranks with a variable
    "%%ranks 2\nimport time\nx = 41 + dist.get_rank()\nprint('x =', x)",
    # 3: streaming from %%ranks
    "%%ranks\nprint('starting', flush=True)\ntime.sleep(3)\nprint('finishing', flush=True)",
    # 4: a plain exception on one rank
    "%%ranks\nif dist.get_rank() == 1:\n    1 / 0\nprint('rank', dist.get_rank(), 'went on')",
    # 5: is x still there?
    "%%ranks\nprint('x is still', x)",
    # 6: interrupted while the ranks sleep
    "%%ranks\nprint('sleeping', flush=True)\ntime.sleep(60)",
    # 7: an uncaught RankError from a launched function
    "def picky():\n    if dist.get_rank() == 1:\n"
    "        raise ValueError('rank 1 does not like this input')\n    return 'fine'\n\n"
    "parlib.launch(picky, world_size=2)",
]


@pytest.fixture(scope="module")
def probe(lab, page):
    nb = {"cells": [{"cell_type": "code", "id": f"probe{i}", "metadata": {},
                     "execution_count": None, "outputs": [], "source": src}
                    for i, src in enumerate(PROBE_CELLS)],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (lab.root / PROBE).write_text(nbform.dumps(nbform.normal_form(nb)))
    opened = open_notebook(page, PROBE)
    first = run_cell(page, PROBE, 0)
    assert not any(o["type"] == "error" for o in first["outputs"]), first["outputs"]
    return opened


def _error_text(cell) -> str:
    return "\n".join(o["text"] for o in cell["outputs"] if o["type"] == "error")


def _streams_while_busy(page, index):
    """Seconds between the first `[rank k]` line on the page and the cell finishing."""
    page.evaluate(JS_RUN_CELL, [PROBE, index])
    seen = _wait(lambda: (lambda c: RANK_LINE.search(c["shown"]) and c)(cells(page, PROBE)[index]),
                 60, f"a [rank k] line from probe cell {index}", poll=0.05)
    seen_at, seen_busy = time.monotonic(), busy(seen)
    done = _wait(lambda: (lambda c: not busy(c) and c)(cells(page, PROBE)[index]), 60,
                 f"probe cell {index} to finish", poll=0.05)
    return seen_busy, time.monotonic() - seen_at, done


@pytest.mark.parametrize("index, what", [(1, "parlib.launch"), (3, "%%ranks")])
def test_rank_lines_stream_before_the_cell_ends(page, probe, index, what):
    if index == 3:
        warm = run_cell(page, PROBE, 2)
        assert "x = 41" in warm["shown"], warm["shown"]
    seen_busy, lead, done = _streams_while_busy(page, index)
    show_cell(page, probe, index)
    assert not _error_text(done), _error_text(done)
    assert seen_busy and lead > 1.5, (
        f"{what}: the first [rank k] line (printed 3 s before the cell ends) appeared "
        f"{lead:.1f} s before the cell finished")


def test_variables_stay_on_the_ranks_after_a_plain_exception(page, probe):
    """Issue 15 item 3 (runtime): a ZeroDivisionError on one rank rebuilt the cluster and
    wiped `x` on every rank."""
    run_cell(page, PROBE, 2)
    failed = run_cell(page, PROBE, 4)
    assert "ZeroDivisionError" in failed["shown"], failed["shown"][-800:]
    after = run_cell(page, PROBE, 5)
    show_cell(page, probe, 5)
    assert "[rank 0] x is still 41" in after["shown"] and "[rank 1] x is still 42" in after[
        "shown"], f"x was lost after a plain exception on rank 1:\n{after['shown'][-800:]}"


def test_ranks_error_names_the_cell_by_its_execution_count(page, probe):
    """Issue 15 item 1 (runtime): a %%ranks error named the cell `<%%ranks cell 2>` while the
    page shows In [5]; the failing line (`1 / 0`) is line 3 of the cell as the editor numbers
    it, the %%ranks line being line 1."""
    failed = run_cell(page, PROBE, 4)
    show_cell(page, probe, 4)
    count = re.search(r"\d+", failed["prompt"]).group()
    shown = failed["shown"]
    assert "<%%ranks cell" not in shown and re.search(rf"In ?\[{count}\], line 3", shown), (
        f"the error does not name the failing line as In [{count}], line 3:\n{shown[:1500]}")


# Times the interrupt inside the page: from the pointer going down on the toolbar's stop
# button to the cell's prompt leaving [*], so the test's own polling adds nothing.
JS_ARM_INTERRUPT_TIMER = """([id, index]) => {
  const cell = document.getElementById(id).querySelectorAll('.jp-Cell')[index];
  window.__interruptTook = null;
  let t0 = null;
  document.addEventListener('pointerdown', () => { t0 = performance.now(); },
                            {capture: true, once: true});
  const obs = new MutationObserver(() => {
    const prompt = cell.querySelector('.jp-InputPrompt');
    if (t0 !== null && prompt && !prompt.textContent.includes('*')) {
      window.__interruptTook = (performance.now() - t0) / 1000;
      obs.disconnect();
    }
  });
  obs.observe(cell, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def test_interrupt_stops_ranks_within_2_seconds(page, probe):
    run_cell(page, PROBE, 2)  # warm ranks
    page.evaluate(JS_RUN_CELL, [PROBE, 6])
    _wait(lambda: "sleeping" in cells(page, PROBE)[6]["shown"], 60, "the ranks to start sleeping")
    page.evaluate(JS_ARM_INTERRUPT_TIMER, [probe.widget_id, 6])
    page.locator(f"#{probe.widget_id} [data-jp-item-name='interrupt']").first.click()
    try:
        took = _wait(lambda: page.evaluate("() => window.__interruptTook"), 30,
                     "the interrupted cell to stop")
    finally:
        if busy(cells(page, PROBE)[6]):  # leave the kernel usable for the next checks
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:interrupt-kernel')")
            _wait(lambda: not busy(cells(page, PROBE)[6]), 60, "a second interrupt")
    show_cell(page, probe, 6)
    print(f"interrupt took {took:.2f} s")
    assert took <= 2.0, f"the interrupt took {took:.1f} s"


def test_interrupt_says_what_happened_in_a_few_lines(page, probe):
    """Issue 15 item 2 (runtime): an interrupt printed about 45 lines of parlib and standard
    library frames and never said what happened."""
    cell = cells(page, PROBE)[6]
    if "sleeping" not in cell["shown"]:
        test_interrupt_stops_ranks_within_2_seconds(page, probe)
        cell = cells(page, PROBE)[6]
    show_cell(page, probe, 6)
    lines = [ln for ln in cell["shown"].splitlines() if ln.strip()]
    after = [ln for ln in lines if "sleeping" not in ln]
    assert any("interrupt" in ln.lower() for ln in after), "\n".join(after[:50])
    assert len(after) <= 8, f"the interrupt printed {len(after)} lines:\n" + "\n".join(after[:60])
    assert not any("multiprocessing" in ln or "selectors" in ln for ln in after)


def test_rank_error_shows_the_learners_frame_first(page, probe):
    """Issue 15 item 1 (runtime): a failing rank showed three parlib-internal frames with
    source excerpts before the rank's error and the learner's own line."""
    failed = run_cell(page, PROBE, 7)
    show_cell(page, probe, 7)
    print(failed["shown"])
    lines = failed["shown"].splitlines()
    assert "RankError" in failed["shown"], failed["shown"][-800:]
    # The rank's own frame: `File "...", line 3, in picky` (not the excerpt of the cell that
    # IPython shows around the launch call, which quotes the same source).
    mine = next((i for i, ln in enumerate(lines) if re.search(r"line 3, in picky", ln)), None)
    assert mine is not None, "the learner's frame (picky) is not shown:\n" + failed["shown"]
    before = lines[:mine]
    internal = [ln for ln in before if re.search(r"parlib[/\\]", ln)]
    # First the learner's own cell (IPython's frame of the launch call), then the rank's
    # error and the rank's frame: a few lines each, and none of parlib's.
    cell = next((i for i, ln in enumerate(lines) if re.search(r"Cell In ?\[\d+\]", ln)), None)
    assert cell is not None and cell <= 4 and mine <= 15 and not internal, (
        f"{mine} lines ({len(internal)} naming parlib's files) before the learner's frame:\n"
        + "\n".join(before))

