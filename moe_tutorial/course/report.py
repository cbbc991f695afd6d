"""The pages of a course run: each executed notebook as a web page (`notebook_page`,
`write_html`: nbconvert's HTML exporter, its plotly figures drawn, its links pointed from where it
is written) and `report.html` (`write_report`: one self-contained page with this machine's
capability table, every notebook's closing outputs, run times against the mode's budget, the CPU
each notebook had, and the versions that ran). The runner (`runner.py`) calls them; `make site`
(tools/site.py) renders its chapters with `notebook_page` too.
"""

from __future__ import annotations

import html
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from ..locations import checkout_root
from ..precision.hardware import capabilities
from ..safe_io import write_text
from .links import retarget_links

# The functions below take the runner's records (runner.NotebookRun, runner.CourseRun) as they
# come, unannotated: the runner imports this module, never the other way round.

CLOSING_TAG = "closing"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
BUDGET_S = {"small": 120, "full": 300}  # per notebook: 2 CPU cores / one H200
PLOTLY_JS = "plotly.min.js"  # next to the HTML renderings, which load it (report.html inlines it)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def plotly_html(spec: dict, div: str) -> str:
    """A plotly figure's JSON (PLOTLY_MIME) as a div and the script that draws it (plotly.js must
    be loaded before it)."""
    payload = json.dumps([spec.get("data", []), spec.get("layout", {}),
                          {"displaylogo": False, "responsive": True}]).replace("</", "<\\/")
    return (f'<div id="{div}" class="plot"></div><script>'
            f'Plotly.newPlot("{div}", ...{payload});</script>')


def run_page_link(path: str, source_dir: Path, out_dir: Path, in_run: set[str]) -> str | None:
    """Where a link of a notebook in `source_dir` points from its page in `out_dir`: a chapter of
    this run to its page here, anything else to the file in the checkout; None where the target
    does not exist (left as written, and reported by `links.broken_links`)."""
    target = (source_dir / path).resolve()
    if target.suffix == ".ipynb" and target.parent == source_dir.resolve() and \
            target.name in in_run:
        return target.with_suffix(".html").name
    if not target.exists():
        return None
    return os.path.relpath(target, out_dir.resolve())


def notebook_page(notebook: Path, name: str, source_dir: Path) -> tuple[str, int]:
    """An executed notebook as one HTML page by nbconvert's HTML exporter, and its number of
    plotly figures. nbconvert has no renderer for plotly's JSON, so each figure is given an HTML
    form that draws it with PLOTLY_JS, which the page loads from its own folder; images the
    markdown links to (the notebook's `figures/`, under `source_dir`) are embedded."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(notebook, as_version=4)
    figures = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            spec = output.get("data", {}).get(PLOTLY_MIME)
            if spec is not None:
                figures += 1
                output["data"]["text/html"] = plotly_html(spec, f"figure-{figures}")
    exporter = HTMLExporter(embed_images=True)
    page, _ = exporter.from_notebook_node(
        nb, resources={"metadata": {"name": name, "path": str(source_dir)}})
    if figures:
        page = page.replace("</head>", f'<script src="{PLOTLY_JS}"></script>\n</head>', 1)
    return page, figures


def write_html(run, in_run: set[str] = frozenset()) -> Path:
    """Write `run.html`, the executed notebook's page (`notebook_page`), atomically, its relative
    links (glossary, notes, exercises, results) pointed from the page's folder, and those to a
    chapter of this run (`in_run`: their file names) to its page."""
    page, _ = notebook_page(run.output, run.name, run.source.parent)
    page = retarget_links(page, lambda path: run_page_link(path, run.source.parent,
                                                           run.html.parent, set(in_run)))
    write_text(run.html, page, replace=True)
    return run.html


def write_plotly_js(out_dir: Path) -> str:
    """Write PLOTLY_JS into `out_dir` for the HTML renderings; "" or why it could not be."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        return "plotly is not installed: the HTML renderings show their figures as text"
    write_text(out_dir / PLOTLY_JS, get_plotlyjs(), replace=True)
    return ""


REPORT_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1150px;
 padding:0 1em;color:#1f2328;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em} h2{margin-top:2em;border-bottom:1px solid #d0d7de;padding-bottom:.2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em} caption{text-align:left;font-weight:600;padding:.3em 0}
th,td{border:1px solid #d0d7de;padding:.25em .6em;vertical-align:top} th{background:#f6f8fa}
pre{background:#f6f8fa;padding:.6em;overflow-x:auto;font-size:.85em;white-space:pre-wrap}
pre.error{background:#fff0f0;border-left:4px solid #d1242f}
.ok{color:#1a7f37;font-weight:600} .failed{color:#d1242f;font-weight:600} .notrun{color:#6e7781}
.native{color:#1a7f37} .fallback{color:#9a6700} .unavailable{color:#d1242f}
.muted{color:#6e7781;font-size:.9em} .moe-table-note{color:#6e7781;font-size:.85em;margin-top:0}
"""


def closing_outputs(nb) -> list[dict]:
    """The outputs of the cells tagged `closing`, in order."""
    outputs = []
    for cell in nb.cells:
        if cell.cell_type == "code" and CLOSING_TAG in cell.get("metadata", {}).get("tags", []):
            outputs.extend(cell.get("outputs", []))
    return outputs


def source_text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


class _FigureCounter:
    def __init__(self):
        self.count = 0


def render_output(output: dict, figures: _FigureCounter) -> str:
    """One notebook output as HTML for the report (plotly JSON becomes a live plot)."""
    kind = output.get("output_type")
    if kind == "stream":
        return f'<pre class="stream">{html.escape(strip_ansi(source_text(output.get("text", ""))))}</pre>'
    if kind == "error":
        trace = strip_ansi("\n".join(output.get("traceback", [])))
        return f'<pre class="error">{html.escape(trace)}</pre>'
    data = output.get("data", {})
    if PLOTLY_MIME in data:
        figures.count += 1
        return plotly_html(data[PLOTLY_MIME], f"figure-{figures.count}")
    if "text/html" in data:
        return source_text(data["text/html"])
    for image in ("image/png", "image/jpeg"):
        if image in data:
            b64 = source_text(data[image]).replace("\n", "")
            return f'<img alt="figure" src="data:{image};base64,{b64}">'
    if "image/svg+xml" in data:
        return source_text(data["image/svg+xml"])
    if WIDGET_MIME in data:
        return ""  # a live widget: its final state is the static output that follows it
    if "text/plain" in data:
        return f"<pre>{html.escape(strip_ansi(source_text(data['text/plain'])))}</pre>"
    return ""


def _versions() -> list[tuple[str, str]]:
    rows = [("python", f"{platform.python_version()} ({sys.executable})"),
            ("platform", f"{platform.platform()}, {os.cpu_count()} CPU cores")]
    for dist in ("moe_tutorial", "torch", "transformers", "transformer_engine", "papermill",
                 "nbclient", "nbformat", "ipykernel", "plotly", "ipywidgets", "anywidget",
                 "jupyterlab"):
        version = None
        for name in (dist, dist.replace("_", "-")):
            try:
                version = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        rows.append((dist, version or "not installed"))
    root = checkout_root()
    if root is None:  # an installed package run outside a clone has no commit to name
        return rows
    try:
        commit = subprocess.run(["git", "-C", str(root), "describe", "--always",
                                 "--dirty"], capture_output=True, text=True, timeout=10)
        if commit.returncode == 0 and commit.stdout.strip():
            rows.append(("course commit", commit.stdout.strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    return rows


def _capability_html() -> str:
    caps = capabilities()
    rows = "".join(
        f'<tr><td>{html.escape(f.title)}</td><td class="{f.status}">{f.status}</td>'
        f"<td>{html.escape(f.runs)}</td><td>{html.escape(f.reason)}</td></tr>"
        for f in caps.features.values())
    return (f"<pre>{html.escape(caps.describe_machine())}</pre>"
            '<table class="capabilities"><thead><tr><th>feature</th><th>status</th>'
            f"<th>what runs</th><th>why</th></tr></thead><tbody>{rows}</tbody></table>")


def _cell_times(nb, top: int = 3) -> list[tuple[float, int, str]]:
    times = []
    for cell in nb.cells:
        duration = cell.get("metadata", {}).get("papermill", {}).get("duration")
        if cell.cell_type == "code" and duration:
            first = next((line for line in cell.source.splitlines() if line.strip()), "")
            times.append((float(duration), cell.get("execution_count") or 0, first[:80]))
    return sorted(times, reverse=True)[:top]


def _notebook_section(run, status_class: str, figures: _FigureCounter) -> str:
    """The report's section of one notebook that ran: its status, error, slowest cells and
    closing outputs."""
    import nbformat

    body = [f"<h2 id='{html.escape(run.name)}'>{html.escape(run.name)} "
            f"<span class='{status_class}'>{run.status}</span> "
            f"<span class='muted'>{run.seconds:.1f} s</span></h2>"]
    if run.error:
        cell = f" in cell [{run.failed_cell}]" if run.failed_cell else ""
        body.append(f"<p class='failed'>Failed{cell}:</p>"
                    f"<pre class='error'>{html.escape(run.error)}</pre>")
    if run.output.exists():
        nb = nbformat.read(run.output, as_version=4)
        slow = _cell_times(nb)
        if slow:
            body.append("<p class='muted'>slowest cells: " + "; ".join(
                f"[{count}] {seconds:.1f} s <code>{html.escape(first)}</code>"
                for seconds, count, first in slow) + "</p>")
        outputs = closing_outputs(nb)
        if outputs:
            body.extend(render_output(o, figures) for o in outputs)
        elif run.status == "ok":
            body.append(f"<p class='muted'>(no cell tagged '{CLOSING_TAG}')</p>")
    return "\n".join(body)


def write_report(course) -> Path:
    """Write `report.html` for a course run (also for a failed or empty one)."""
    figures = _FigureCounter()
    budget = BUDGET_S[course.mode]
    summary, sections = [], []
    for run in course.runs:
        status_class = {"ok": "ok", "failed": "failed"}.get(run.status, "notrun")
        within = ("" if run.status == "not run"
                  else ("yes" if run.seconds <= budget else f"no (> {budget} s)"))
        link = (f'<a href="{html.escape(run.html.name)}">{html.escape(run.html.name)}</a>'
                if run.html.exists() else
                f"not rendered ({html.escape(run.html_error)}): {html.escape(run.output.name)}"
                if run.html_error else "")
        cpu = html.escape(run.cpu.describe()) if run.cpu else ""
        summary.append(f"<tr><td>{html.escape(run.name)}</td><td class='{status_class}'>"
                       f"{run.status}</td><td style='text-align:right'>"
                       f"{run.seconds:.1f}</td><td>{within}</td><td>{cpu}</td><td>{link}</td></tr>")
        if run.status != "not run":
            sections.append(_notebook_section(run, status_class, figures))

    plotly_js = ""
    if figures.count:
        try:
            from plotly.offline import get_plotlyjs

            plotly_js = f"<script>{get_plotlyjs()}</script>"
        except ImportError:
            plotly_js = ("<p class='failed'>plotly is not installed where the report was written:"
                         " figures cannot be drawn.</p>")
    n_ok = sum(r.status == "ok" for r in course.runs)
    verdict = ("<span class='ok'>all notebooks ran</span>" if course.runs and course.ok
               else f"<span class='failed'>{n_ok} of {len(course.runs)} notebooks ran</span>"
               if course.runs else "<span class='notrun'>no notebooks</span>")
    params = ", ".join(f"{k}={v!r}" for k, v in course.parameters.items())
    versions = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
                       for k, v in _versions())
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>MoE course run {html.escape(course.started)} ({course.mode})</title>
<style>{REPORT_CSS}</style>{plotly_js}</head><body>
<h1>Training MoE models fast with Transformer Engine — course run</h1>
<p>{html.escape(course.started)} · mode <b>{course.mode}</b> · {verdict} · {course.seconds:.0f} s in total
 · kernel <code>{html.escape(course.kernel)}</code> · parameters <code>{html.escape(params)}</code></p>
{f"<p>{html.escape(course.note)}</p>" if course.note else ""}
<h2>What this machine can run</h2>
{_capability_html()}
<h2>Notebooks</h2>
<table><thead><tr><th>notebook</th><th>status</th><th>seconds</th>
<th>within the {course.mode}-mode budget ({budget} s)?</th><th>CPU at its start</th>
<th>the executed notebook</th></tr></thead>
<tbody>{"".join(summary)}</tbody></table>
<p class="muted">Seconds include starting the notebook's kernel. Each notebook's torch had the
threads shown: the cores other processes left free as it started (OMP_NUM_THREADS), so a busy
machine runs it slower, and says so here. Each link opens the executed
notebook as a web page (its <code>.ipynb</code>, next to it, opens in Jupyter). Every number below was
computed in this run, on this machine; figures quoted from elsewhere name their source in the notebooks.</p>
{"".join(sections)}
<h2>Versions</h2>
<table><tbody>{versions}</tbody></table>
<p class="muted">Written by <code>python -m moe_tutorial run</code>.</p>
</body></html>
"""
    write_text(course.report, page, replace=True)  # whole or not at all: a stopped run leaves no half page
    return course.report
