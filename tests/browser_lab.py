"""JupyterLab + headless Chromium for the browser tests: start, drive, observe, shut down.

JupyterLab starts as `make lab` starts it (`python -m moe_tutorial lab`): the learner's working
copy is prepared by `workspace.prepare_workspace` (here in a temporary folder, so running cells,
which saves outputs, leaves the repository alone) and the server is started by
`workspace.lab_argv`, with only the port, the token and "no browser" added, and small mode in its
environment. Chromium is Debian's (`apt-get install chromium`), driven by Playwright for Python
through `executable_path` — Playwright's own browser download is not used.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from moe_tutorial.course.dashboard import DASHBOARD_CLASS
from moe_tutorial.course.workspace import lab_argv, prepare_workspace

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"]
ARTIFACTS = ROOT / "build" / "browser-artifacts"  # screenshots of every run (git-ignored)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyter_lab(tmp: Path):
    """JupyterLab as `make lab` runs it, on a working copy in `tmp/work`; yields
    (base_url, token, workspace). Always stopped."""
    workspace = prepare_workspace(ROOT, tmp / "work")
    settings = tmp / "lab-settings" / "@jupyterlab"
    for extension, name, values in [
            # No "get notified about Jupyter news?" toast over the notebook.
            ("apputils-extension", "notification", {"fetchNews": "false"}),
            # Render every cell, on screen or not, so the tests can read any cell's output.
            ("notebook-extension", "tracker", {"windowingMode": "none"})]:
        (settings / extension).mkdir(parents=True)
        (settings / extension / f"{name}.jupyterlab-settings").write_text(json.dumps(values))
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "MOE_TUTORIAL_MODE": "small", "MOE_TUTORIAL_LIVE": "1",
           "JUPYTERLAB_SETTINGS_DIR": str(tmp / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "lab-workspaces")}
    log = open(tmp / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        lab_argv(workspace, ["--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
                             f"--ServerApp.token={token}"]),
        env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"JupyterLab did not start; see {tmp / 'jupyterlab.log'}:\n"
                                       + (tmp / "jupyterlab.log").read_text()[-2000:])
                time.sleep(0.5)
        yield base, token, workspace
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


# The notebook in the visible tab (a restored workspace may keep others open behind it).
ACTIVE = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"
# A live dashboard's figure: the plotly FigureWidget in the dashboard's widget box (the static
# figure that replaces it at the end is plotly's mime renderer's output, outside any widget).
LIVE_FIGURE = f".{DASHBOARD_CLASS} .js-plotly-plot"


class Notebook:
    """One notebook open in JupyterLab, with the few actions and observations the tests need."""

    def __init__(self, page, name: str):
        self.page, self.name = page, name
        ARTIFACTS.mkdir(parents=True, exist_ok=True)

    def screenshot(self, label: str) -> Path:
        path = ARTIFACTS / f"{Path(self.name).stem}-{label}.png"
        self.page.screenshot(path=str(path), full_page=False)
        return path

    def screenshot_live_figure(self, label: str) -> Path | None:
        """A picture of the newest live dashboard figure on the page (the one being drawn)."""
        plots = self.page.locator(f"{ACTIVE} {LIVE_FIGURE}")
        if plots.count() == 0:
            return None
        return self.screenshot_element(plots.last, label)

    def screenshot_plot(self, label: str, title: str) -> Path | None:
        """A picture of the plotly figure whose title contains `title`, or None."""
        plots = self.page.locator(f"{ACTIVE} .js-plotly-plot:has(.gtitle:has-text({title!r}))")
        if plots.count() == 0:
            return None
        return self.screenshot_element(plots.last, label)

    def screenshot_element(self, element, label: str) -> Path:
        element.scroll_into_view_if_needed()
        path = ARTIFACTS / f"{Path(self.name).stem}-{label}.png"
        element.screenshot(path=str(path))
        return path

    def fail(self, message: str):
        raise AssertionError(f"{message} (screenshot: {self.screenshot('failure')})")

    def wait_until_ready(self, timeout_s: float = 90) -> None:
        self.page.wait_for_selector(ACTIVE, timeout=timeout_s * 1e3)
        self.wait_for_idle(timeout_s)

    def kernel_idle(self) -> bool:
        """No cell queued or running, and the status bar says the kernel is idle."""
        return self.page.evaluate(
            """() => { const bar = document.querySelector('#jp-main-statusbar');
                       const busy = [...document.querySelectorAll('.jp-InputPrompt')]
                         .some(p => p.textContent.includes('[*]'));
                       return !busy && !!bar && bar.innerText.includes('Idle'); }""")

    def wait_for_idle(self, timeout_s: float, *, poll=None) -> None:
        deadline = time.time() + timeout_s
        while not self.kernel_idle():
            if poll is not None:
                poll()
            if time.time() > deadline:
                self.fail(f"{self.name}: kernel still busy after {timeout_s:.0f} s")
            time.sleep(0.5)

    def run_all(self) -> None:
        """Run ▸ Run All Cells, as a learner would."""
        self.page.click(".lm-MenuBar-itemLabel:text-is('Run')")
        self.page.click("li[data-command='runmenu:run-all']")

    def cell(self, index: int):
        cell = self.page.locator(f"{ACTIVE} .jp-Cell").nth(index)
        cell.scroll_into_view_if_needed()
        return cell

    def replace_cell_source(self, index: int, source: str) -> None:
        """Click into a code cell, select everything and type `source` over it (inserted as
        text, so the editor's auto-indent and bracket-closing do not alter it)."""
        editor = self.cell(index).locator(".cm-content")
        editor.scroll_into_view_if_needed()
        editor.click()
        self.page.keyboard.press("Control+a")
        self.page.keyboard.insert_text(source)

    def run_cell(self, index: int, timeout_s: float = 60) -> str:
        """Run one cell (Shift+Enter in it) and return its output text once the kernel is idle."""
        self.cell(index).locator(".cm-content").click()
        self.page.keyboard.press("Shift+Enter")
        time.sleep(0.5)
        self.wait_for_idle(timeout_s)
        return self.cell(index).locator(".jp-OutputArea").inner_text()

    def error_outputs(self) -> list[str]:
        """Texts of error outputs (a traceback), ignoring harmless stderr such as warnings."""
        return self.page.evaluate(
            """() => [...document.querySelectorAll(
                 '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
                 .map(e => e.innerText)
                 .filter(t => t.includes('Traceback') || t.includes('Cell In[') || /^\\w+Error: /m.test(t))""")

    def live_figure_points(self) -> list[int]:
        """For each live dashboard figure on the page (a plotly FigureWidget inside the
        dashboard's widget box, not the static figure that replaces it at the end), how many
        points its traces hold now, read from the figure's own data."""
        return self.page.evaluate(
            f"""() => [...document.querySelectorAll('{ACTIVE} {LIVE_FIGURE}')]
                 .map(gd => (gd.data || []).reduce((n, t) => n + (t.x ? t.x.length : 0), 0))""")

    def follow_link(self, target: str) -> None:
        """Click the first link in the notebook whose address holds `target`, as a learner
        does; JupyterLab opens a notebook it points to in a tab of its own."""
        link = self.page.locator(f"{ACTIVE} a[href*={target!r}]").first
        if link.count() == 0:
            self.fail(f"{self.name} has no link to {target}")
        link.scroll_into_view_if_needed()
        link.click()

    def file_browser_listing(self, folder: str) -> list[str]:
        """Go to `folder` (under the server's root) in the file browser; the names it lists."""
        exactly = re.compile(f"^{re.escape(folder)}$")
        self.page.click(".jp-BreadCrumbs-home")
        self.page.locator(".jp-DirListing-itemText").filter(has_text=exactly).dblclick()
        self.page.locator(".jp-BreadCrumbs-item").filter(has_text=exactly).wait_for(timeout=15_000)
        time.sleep(0.5)  # the listing follows the breadcrumbs
        return self.page.evaluate(
            "() => [...document.querySelectorAll('.jp-DirListing-itemText')].map(e => e.textContent)")

    def trace_names(self) -> set[str]:
        return set(self.page.evaluate(
            "() => [...document.querySelectorAll('.js-plotly-plot .legendtext')].map(e => e.textContent)"))

    def text(self) -> str:
        return self.page.inner_text(ACTIVE)
