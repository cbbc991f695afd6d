"""The course as a learner meets it: JupyterLab in a real (headless) browser.

nbval and papermill run notebooks headless; they cannot see whether the live dashboard renders
and updates in JupyterLab, or whether an exercise's check shows its feedback there. These tests
do what a person does and look at the page, in JupyterLab started as `make lab` starts it (see
browser_lab.py). Screenshots land in build/browser-artifacts/ (and, with MOE_TUTORIAL_UPDATE_DOCS=1,
as tools/screenshots.py runs them, the pictures in docs/)."""

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from browser_lab import ACTIVE, CHROMIUM, CHROMIUM_FLAGS, ROOT, Notebook, jupyter_lab

from moe_tutorial.course.widgets import (
    SKEW_EXPLORER_CLASS,
    SKEW_OUTPUT_CLASS,
    SKEW_SLIDER_CLASS,
)
from moe_tutorial.precision import hardware

pytestmark = pytest.mark.browser
# Seconds a notebook's Run All may take in small mode: generous, because on 2 cores shared with
# other work it takes several times as long as on 2 cores of its own.
NOTEBOOK_TIMEOUT_S = 900
# CI sets MOE_TUTORIAL_REQUIRE_BROWSER=1: there a missing browser fails the suite instead of
# skipping it, so a green CI run means these tests ran.
_REQUIRED = os.environ.get("MOE_TUTORIAL_REQUIRE_BROWSER") == "1"
try:
    from playwright import sync_api
except ImportError:
    if _REQUIRED:
        raise
    pytest.skip("pip install playwright (the test extra)", allow_module_level=True)
if not os.path.exists(CHROMIUM):
    message = f"no Chromium at {CHROMIUM}: apt-get install chromium (.ci/run does)"
    if _REQUIRED:
        raise RuntimeError(message + "; MOE_TUTORIAL_REQUIRE_BROWSER=1 forbids skipping")
    pytest.skip(message, allow_module_level=True)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with jupyter_lab(tmp_path_factory.mktemp("lab")) as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


def _open(browser, lab, path):
    base, token, _ = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{base}/lab/tree/{path}?reset&token={token}")  # reset: a fresh workspace
    notebook = Notebook(page, path)
    notebook.wait_until_ready()
    return notebook


def _keep_for_docs(shot, name):
    if os.environ.get("MOE_TUTORIAL_UPDATE_DOCS") == "1":
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copy(shot, ROOT / "docs" / name)


@pytest.fixture(scope="module")
def grouped_linear(lab, browser):
    """Notebook 02 run top to bottom with Run All, watched while it runs: (the notebook, the
    point counts its first live dashboard figure was seen with while the kernel was busy, a
    screenshot of it a few measurements in)."""
    nb = _open(browser, lab, "notebooks/02_grouped_linear.ipynb")
    nb.run_all()
    counts, mid_shot, replaced = [], None, False

    def observe():  # called while the kernel is busy, until it is idle
        nonlocal mid_shot, replaced
        live = nb.live_figure_points()
        if replaced or not live:  # the first dashboard's figure, until finish() replaces it
            replaced = bool(counts)
            return
        if live[0] and (not counts or live[0] != counts[-1]):
            counts.append(live[0])
            if mid_shot is None and live[0] >= 4:  # a few measurements in
                mid_shot = nb.screenshot_live_figure("dashboard-mid-run")

    time.sleep(1)
    nb.wait_for_idle(NOTEBOOK_TIMEOUT_S, poll=observe)
    nb.screenshot("page-end")
    errors = nb.error_outputs()
    if errors:
        nb.fail(f"error output in the notebook: {errors[0][:500]}")
    yield nb, counts, mid_shot
    nb.page.close()


def test_live_dashboard_redraws_while_the_cells_run_in_jupyterlab(grouped_linear):
    """The live figure itself gains points while the kernel is busy (the static figure that
    replaces it at the end does not count), then gives way to that static figure."""
    nb, counts, mid_shot = grouped_linear
    final = nb.screenshot_plot("dashboard-end", "experts forward+backward")
    if len(counts) < 3 or counts != sorted(counts):
        nb.fail(f"the live dashboard did not redraw while the cells ran (points in its live "
                f"figure, each time they changed: {counts})")
    if nb.live_figure_points():
        nb.fail("a live dashboard figure is left after the run: finish() should replace it")
    if not {"naive", "grouped_torch"} <= nb.trace_names():
        nb.fail(f"expected the naive and grouped_torch traces, found {sorted(nb.trace_names())}")
    unlabelled = [name for name in nb.trace_names() if name.startswith("te_") and "stand-in" not in name]
    if not hardware.capabilities().has_te and unlabelled:
        nb.fail(f"without TE a TE backend's trace must say it is the stand-in (as in {STAND_IN!r}); "
                f"found {unlabelled}")
    if "02 · loop vs grouped" not in nb.text():
        nb.fail("the closing table is not visible")
    assert mid_shot is not None and final is not None
    _keep_for_docs(mid_shot, "dashboard-live.png")
    _keep_for_docs(final, "dashboard-end.png")


def test_a_figure_of_the_idea_renders_in_jupyterlab(grouped_linear):
    nb, _, _ = grouped_linear
    figure = nb.page.locator(f"{ACTIVE} img[src*='grouped_gemm.svg']").first
    figure.scroll_into_view_if_needed()
    width = figure.evaluate("img => img.complete ? img.naturalWidth : 0")
    if width == 0:
        nb.fail("figures/grouped_gemm.svg did not load in the notebook")
    _keep_for_docs(nb.screenshot_element(figure, "figure-grouped-gemm"), "figure-grouped-gemm.png")


def test_a_prediction_is_answered_and_regraded_in_jupyterlab(grouped_linear):
    """Click another answer of the first predict cell after its measurement: its one-sentence
    grade follows the new answer (as it does for a learner who changes their mind)."""
    nb, _, _ = grouped_linear
    choices = nb.page.locator(f"{ACTIVE} .widget-toggle-buttons").first
    other = choices.locator("button:not(.mod-active)").first
    answer = other.inner_text().strip()
    other.click()
    grade = nb.page.locator(f"{ACTIVE} .widget-html:has-text('you predicted')").first
    try:
        sync_api.expect(grade).to_contain_text(f"you predicted '{answer}'", timeout=15_000)
    except AssertionError:
        nb.fail(f"clicking {answer!r} did not regrade the prediction: {grade.inner_text()!r}")
    text = grade.inner_text()
    assert ("✓ Right" in text or "✗ Not this time" in text) and "the measurement says" in text, text
    cell = grade.locator("xpath=ancestor::div[contains(@class, 'jp-Cell ')]").first
    _keep_for_docs(nb.screenshot_element(cell, "predict-graded"), "predict-graded.png")


def _run_all(browser, lab, path: str) -> Notebook:
    """The notebook at `path` run top to bottom with Run All, until the kernel is idle, with no
    error output."""
    nb = _open(browser, lab, path)
    nb.run_all()
    time.sleep(1)
    nb.wait_for_idle(NOTEBOOK_TIMEOUT_S)
    errors = nb.error_outputs()
    if errors:
        nb.fail(f"error output in the notebook: {errors[0][:500]}")
    return nb


@pytest.fixture(scope="module")
def expert_parallel(lab, browser):
    """Notebook 07 run top to bottom with Run All."""
    nb = _run_all(browser, lab, "notebooks/07_expert_parallel.ipynb")
    yield nb
    nb.page.close()


def test_the_skew_slider_remeasures_in_jupyterlab(expert_parallel):
    """Move the routing-skew explorer's slider to one hot expert: the explorer measures that skew
    live and redraws its table and figure."""
    nb = expert_parallel
    explorer = nb.page.locator(f"{ACTIVE} .{SKEW_EXPLORER_CLASS}").first
    explorer.scroll_into_view_if_needed()
    caption = explorer.locator(f".{SKEW_OUTPUT_CLASS} table caption").first
    if "routing skew 0.50" not in caption.inner_text():
        nb.fail(f"the explorer should start at the notebook's default skew: {caption.inner_text()!r}")
    readout = explorer.locator(f".{SKEW_SLIDER_CLASS} .widget-readout").first
    readout.click()
    nb.page.keyboard.press("Control+a")
    nb.page.keyboard.type("1")
    nb.page.keyboard.press("Enter")
    try:  # the redraw replaces the table: wait on the locator, not on the old element
        sync_api.expect(caption).to_contain_text("routing skew 1.00", timeout=60_000)
    except AssertionError:
        nb.fail(f"moving the slider to 1 did not redraw the explorer: {caption.inner_text()!r}")
    table = explorer.locator(f".{SKEW_OUTPUT_CLASS} table").first.inner_text()
    assert re.search(r"\b([\d,]+) of \1 tokens", table), table  # every token has a copy on expert 0
    assert explorer.locator(".js-plotly-plot").count() >= 1
    _keep_for_docs(nb.screenshot_element(explorer, "skew-explorer"), "skew-explorer.png")


def test_where_the_time_goes_bars_render_in_jupyterlab(lab, browser):
    """Notebook 06's stacked bars of step time by part, for every chapter's step so far."""
    nb = _run_all(browser, lab, "notebooks/06_end_to_end.ipynb")
    shot = nb.screenshot_plot("where-the-time-goes", "06 · where the time goes")
    if shot is None:
        nb.fail("no 'where the time goes' figure in notebook 06")
    if not {"GEMMs", "optimizer", "launch gaps / idle"} <= nb.trace_names():
        nb.fail(f"the bars should have one trace per part; found {sorted(nb.trace_names())}")
    _keep_for_docs(shot, "where-the-time-goes.png")
    nb.page.close()


STAND_IN = "te_grouped_linear: pure-PyTorch stand-in of te.GroupedLinear"
EXERCISE = Path("exercises/01_router_and_loop.ipynb")


def _cell_index(path: Path, text: str) -> int:
    """The index of the first cell of the notebook at `path` whose source contains `text`."""
    cells = json.loads((ROOT / path).read_text(encoding="utf-8"))["cells"]
    return next(i for i, cell in enumerate(cells) if text in "".join(cell["source"]))


# The solution cell of exercise 01's router, its check cell, and a plausible wrong answer.
ROUTER_CELL = _cell_index(EXERCISE, "def route(")
ROUTER_CHECK_CELL = _cell_index(EXERCISE, "checks.check_route(")
CORRECT_ROUTER = '''def route(logits, top_k):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, indices = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), indices
'''
UNNORMALISED_ROUTER = '''def route(logits, top_k):
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.topk(probs, top_k, dim=-1)
'''


def _exercise_from_its_chapter(browser, lab) -> Notebook:
    """Open chapter 01 and follow its link to exercise 01, as a learner does: the exercise must
    open (the link resolves inside the server's root: no "could not open" dialog, no 404)."""
    chapter = _open(browser, lab, "notebooks/01_naive_moe.ipynb")
    chapter.follow_link(EXERCISE.name)
    page = chapter.page
    tab = f".lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel:text-is({EXERCISE.name!r})"
    try:
        page.wait_for_selector(tab, timeout=30_000)
    except sync_api.TimeoutError:
        dialog = page.locator(".jp-Dialog")
        chapter.fail(f"the chapter's link did not open {EXERCISE}"
                     + (f": {dialog.first.inner_text()!r}" if dialog.count() else ""))
    nb = Notebook(page, str(EXERCISE))
    nb.wait_until_ready()
    if page.locator(".jp-Dialog").count():
        nb.fail(f"a dialog opened with the exercise: {page.locator('.jp-Dialog').first.inner_text()!r}")
    return nb


def test_an_exercise_gives_feedback_in_jupyterlab(lab, browser):
    """Reached from its chapter, exercise 01 runs, diagnoses a wrong router and passes a right
    one; the file browser lists every exercise next to the chapters."""
    nb = _exercise_from_its_chapter(browser, lab)
    listed = nb.file_browser_listing("exercises")
    expected = sorted(p.name for p in (ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))
    if sorted(n for n in listed if n.endswith(".ipynb")) != expected:
        nb.fail(f"the file browser's exercises/ lists {listed}, expected {expected}")
    if "def route(" not in nb.cell(ROUTER_CELL).inner_text():
        nb.fail(f"cell {ROUTER_CELL} of exercise 01 is not the router's solution cell")
    nb.run_all()  # the stubs run too: every check says "not implemented yet", nothing raises
    nb.wait_for_idle(NOTEBOOK_TIMEOUT_S)
    if nb.error_outputs():
        nb.fail(f"error output in the exercise: {nb.error_outputs()[0][:500]}")
    first = nb.cell(ROUTER_CHECK_CELL).locator(".jp-OutputArea").inner_text()
    assert "not implemented yet" in first, first

    nb.replace_cell_source(ROUTER_CELL, UNNORMALISED_ROUTER)
    nb.run_cell(ROUTER_CELL)
    wrong = nb.run_cell(ROUTER_CHECK_CELL)
    wrong_shot = nb.screenshot("exercise-wrong")
    if "✗" not in wrong or "renormalis" not in wrong:
        nb.fail(f"expected a diagnosis about renormalising the top-k weights, got: {wrong!r}")

    nb.replace_cell_source(ROUTER_CELL, CORRECT_ROUTER)
    nb.run_cell(ROUTER_CELL)
    right = nb.run_cell(ROUTER_CHECK_CELL)
    right_shot = nb.screenshot("exercise-pass")
    if "✓" not in right or not ("passed" in right or "agree" in right):
        nb.fail(f"expected the check to pass, got: {right!r}")
    _keep_for_docs(wrong_shot, "exercise-diagnosis.png")
    _keep_for_docs(right_shot, "exercise-pass.png")
    nb.page.close()
