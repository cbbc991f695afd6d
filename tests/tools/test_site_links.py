"""Every link of the course's HTML leads somewhere: the static site `make site` builds
(tools/site.py) and the pages `make course` writes next to each executed notebook (the runner).

With $MOE_TUTORIAL_EXECUTED_RUN naming a `make course` run (CI's), the site is built from it and
its own pages are checked as they are; elsewhere the site is built from the chapters as they are
in the checkout (the same links, no outputs), and the runner's link rule is checked directly."""

import os
import shutil
from pathlib import Path

import pytest
from checkout_copy import ROOT
from notebook_conventions import EXECUTED_RUN_ENV

from moe_tutorial.course.links import broken_links, relative_links, retarget_links
from moe_tutorial.course.report import run_page_link
from moe_tutorial.course.runner import NOTEBOOK_GLOB
from tools import site

CHAPTERS = sorted(p.name for p in (ROOT / "notebooks").glob(NOTEBOOK_GLOB))


def executed_run() -> Path | None:
    run = os.environ.get(EXECUTED_RUN_ENV)
    return (ROOT / run) if run else None


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    run = executed_run()
    if run is None:  # the chapters as committed stand in for their executed copies
        run = tmp_path_factory.mktemp("run")
        for name in CHAPTERS:
            shutil.copy2(ROOT / "notebooks" / name, run / name)
        (run / site.PLOTLY_JS).write_text("/* plotly.js */")
    out = tmp_path_factory.mktemp("site") / "site"
    assert site.main(["--run", str(run), "--out", str(out)]) == 0
    return out


def test_the_site_has_every_chapter_the_glossary_and_no_broken_link(built_site):
    assert site.site_broken_links(built_site) == {}
    index = (built_site / "index.html").read_text()
    for name in CHAPTERS:
        assert f'href="notebooks/{Path(name).stem}.html"' in index
        assert (built_site / "notebooks" / name).with_suffix(".html").is_file()
    glossary = (built_site / "docs" / "glossary.html").read_text()
    assert 'id="router"' in glossary and 'id="top-k"' in glossary
    chapter = (built_site / "notebooks" / "01_naive_moe.html").read_text()
    assert "../docs/glossary.html#router" in chapter  # a chapter's first term, linked
    assert not [link for link in relative_links(chapter) if link.split("#")[0].endswith(
        (".md", ".ipynb"))]  # every page link leads to a page of the site
    assert (built_site / "docs" / "notes" / "index.html").is_file()  # README's docs/notes/


GPU_LABEL = "[committed GPU run: NVIDIA"  # gpu_replay.label's start, on a CPU run


def first_chapter_with_gpu_output() -> str:
    """The first chapter whose executed copy shows a `%%needs_gpu` cell's committed output
    (tests/course/test_gpu_replay.py checks that every such cell has one)."""
    run = executed_run()
    if run is None:
        pytest.skip(f"needs an executed small-mode run: set ${EXECUTED_RUN_ENV} to a "
                    f"`make course` folder (CI does)")
    shown = [Path(n).stem for n in CHAPTERS if GPU_LABEL in (run / n).read_text()]
    assert shown, f"no chapter of {run} shows a committed GPU output"
    return shown[0]


def test_the_site_of_a_cpu_run_shows_the_committed_gpu_outputs(built_site):
    chapter = first_chapter_with_gpu_output()
    assert GPU_LABEL in (built_site / "notebooks" / f"{chapter}.html").read_text()


def test_a_run_with_a_missing_chapter_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    shutil.copy2(ROOT / "notebooks" / CHAPTERS[0], tmp_path / "run" / CHAPTERS[0])
    with pytest.raises(SystemExit) as stop:
        site.main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "site")])
    message = str(stop.value)
    assert "\n" not in message and CHAPTERS[1] in message and "SITE_RUN" in message
    assert not (tmp_path / "site").exists()


def test_headings_answer_to_githubs_anchors():
    page = '<h2 id="Without-the-network">Without the network<a class="anchor-link">x</a></h2>'
    assert site.add_heading_anchors(page + page).count('id="without-the-network') == 2
    assert 'id="without-the-network-1"' in site.add_heading_anchors(page + page)
    assert site.github_slug("What runs where: `make gpu`!") == "what-runs-where-make-gpu"


def test_the_runners_pages_point_their_links_from_the_run_folder(tmp_path):
    """A chapter of the run links its sibling's page; the glossary, an exercise and a results
    file are reached in the checkout from wherever the run folder is."""
    out = tmp_path / "runs" / "today"
    out.mkdir(parents=True)
    page = ('<a href="../docs/glossary.md#router">r</a> <a href="02_grouped_linear.ipynb">n</a> '
            '<a href="../exercises/01_router_and_loop.ipynb">e</a> '
            '<a href="https://example.org/x.md">web</a> <a href="#top">top</a> '
            '<a href="../no/such/file.md">gone</a>')
    in_run = {"01_naive_moe.ipynb", "02_grouped_linear.ipynb"}
    pointed = retarget_links(page, lambda p: run_page_link(p, ROOT / "notebooks", out, in_run))
    (out / "01_naive_moe.html").write_text(pointed)
    (out / "02_grouped_linear.html").write_text("")
    glossary = os.path.relpath(ROOT / "docs" / "glossary.md", out)
    assert f'href="{glossary}#router"' in pointed and 'href="02_grouped_linear.html"' in pointed
    assert 'href="https://example.org/x.md"' in pointed and 'href="#top"' in pointed
    assert broken_links(out / "01_naive_moe.html") == ["../no/such/file.md"]


def test_every_page_of_the_executed_run_has_working_links():
    run = executed_run()
    if run is None:
        pytest.skip(f"needs an executed run: set ${EXECUTED_RUN_ENV} to a `make course` folder")
    pages = sorted(run.glob("*.html"))
    assert {p.name for p in pages} >= {"report.html"} | {Path(n).with_suffix(".html").name
                                                          for n in CHAPTERS}
    cache: dict = {}
    assert {p.name: b for p in pages if (b := broken_links(p, cache))} == {}


def test_a_browser_follows_the_site_from_its_entry_page_to_a_gpu_output(built_site):
    """In Chromium: the entry page's chapter table leads to the first chapter with a GPU cell,
    which shows the committed GPU run's output; its bar leads to the glossary."""
    chapter = first_chapter_with_gpu_output()
    required = os.environ.get("MOE_TUTORIAL_REQUIRE_BROWSER") == "1"
    try:
        from browser_lab import CHROMIUM, CHROMIUM_FLAGS
        from playwright import sync_api
    except ImportError:
        if required:
            raise
        pytest.skip("pip install playwright (the test extra)")
    if not os.path.exists(CHROMIUM) and not required:
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.goto((built_site / "index.html").as_uri())
            page.click(f"a[href='notebooks/{chapter}.html']")
            page.wait_for_load_state()
            assert page.url.endswith(f"/notebooks/{chapter}.html")
            assert page.get_by_text(GPU_LABEL).first.is_visible()
            page.click("nav.site >> text=Glossary")
            page.wait_for_load_state()
            assert page.url.endswith("/docs/glossary.html")
            assert page.locator("#router").count() == 1
        finally:
            browser.close()
